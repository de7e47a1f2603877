"""The scheduler leader's lease against a real etcd, beside many nodes' leases.

Every node lease this replica keeps is refreshed on one keep-alive stream (`EtcdStore.
refresh_lease`; `service.heartbeats` sends a thousand at a flush), and etcd answers a stream's
keep-alives in the order they came. The leader's lease used to go on that stream too, behind
them: under bench/api.py's load it lapsed three times in one run. `Leadership` now makes its
calls on a connection of its own (`KeyValue.own_connection`).
"""

from __future__ import annotations

import asyncio
import time

from service import scheduler
from service.store.etcd import EtcdStore

NODES = 500
ROUNDS = 10  # keep-alives of each node lease in the flood


def test_the_leaders_keep_alive_is_answered_before_the_node_keep_alives_queued_ahead_of_it(etcd):
    async def main() -> None:
        kv = EtcdStore(etcd.endpoint, timeout_s=30)
        lead = scheduler.Leadership(kv, "/t/leader", ttl_s=2)
        try:
            leases: list[int] = []
            for i in range(0, NODES, 200):
                leases += await asyncio.gather(*(kv.grant_lease(60) for _ in range(min(200, NODES - i))))
            assert await lead.hold()
            answered = 0

            async def node_keep_alive(lease: int) -> None:
                nonlocal answered
                assert await kv.refresh_lease(lease)
                answered += 1

            # Half a flush of node keep-alives, ten times over, queued on the shared stream
            # first; then the leader renews its lead, as keep_lead does meanwhile.
            flood = [asyncio.create_task(node_keep_alive(lease)) for lease in leases * ROUNDS]
            await asyncio.sleep(0)  # every one of them has started and waits to be written
            sent = time.perf_counter()
            assert await lead.hold()
            took, answered_then = time.perf_counter() - sent, answered
            fence = lead.fence()  # read now: the flood may outlast the 2 s TTL on a loaded machine
            await asyncio.gather(*flood)
            flood_s = time.perf_counter() - sent
            print(f"leader renewed in {took * 1e3:.0f} ms with {answered_then} of {len(flood)} node "
                  f"keep-alives answered; the flood took {flood_s * 1e3:.0f} ms")
            # It did not wait for the node keep-alives ahead of it (sharing their stream, it
            # was answered after every one of them), and kept its lead well inside its TTL.
            assert answered_then < len(flood) // 2, (answered_then, len(flood))
            assert fence is not None
        finally:
            await lead.release()
            await kv.close()

    asyncio.run(main())
