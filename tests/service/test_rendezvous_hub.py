"""The control plane's side of merged rendezvous writes and shared long polls
(`service.rendezvous.StateHub`), on the in-memory store."""

from __future__ import annotations

import asyncio

from service.keys import Keys
from service.rendezvous import Rendezvous, StateHub
from service.store.memory import MemoryStore
from worker.protocol import Timeouts, open_state, seal_state
from worker.rdzv_state import ENDED_LAST_CALL_US, MergeSpec, Op, RdzvDoc

RDZV = "job-abc123-a0"
LONG_POLL_S = Timeouts().long_poll_s  # the control plane's default hold of a long poll


class CountingStore(MemoryStore):
    """Counts the etcd-like calls the hub makes."""

    def __init__(self):
        super().__init__()
        self.watches = 0
        self.commits = 0

    def watch_prefix(self, prefix, start_revision, max_session_s=60.0):
        self.watches += 1
        return super().watch_prefix(prefix, start_revision, max_session_s)

    async def commit_read(self, expect, ops, read):
        self.commits += 1
        return await super().commit_read(expect, ops, read)


def join(i: int, n: int) -> tuple[bytes, MergeSpec]:
    node = ("127.0.0.1", 100 + i, 0)
    doc = RdzvDoc(participants={node: 0}, last_heartbeats={node: 1})
    spec = MergeSpec(ops=[Op(kind="join", node=node, at_us=1, deadline_us=9)], min_nodes=n, max_nodes=n)
    return seal_state(doc.to_json(), version=2), spec


def test_many_waiters_share_one_watch_and_all_see_the_write():
    async def scenario():
        kv, hub = CountingStore(), StateHub()
        rdzv = Rendezvous(kv, Keys(), RDZV, hub, long_poll_s=LONG_POLL_S)
        waits = [asyncio.create_task(rdzv.wait_for_state_change("0", 5)) for _ in range(20)]
        await asyncio.sleep(0.05)  # let them start waiting
        entry, written = await rdzv.set_state(seal_state(b"x"), None)
        results = await asyncio.gather(*waits)
        return kv.watches, entry, written, results

    watches, entry, written, results = asyncio.run(scenario())
    assert written and watches == 1
    assert all(changed and got.mod_revision == entry.mod_revision for got, changed in results)


def test_concurrent_joins_go_to_etcd_in_fewer_writes_than_joins_and_all_land():
    n = 16

    async def scenario():
        kv = CountingStore()
        rdzv = Rendezvous(kv, Keys(), RDZV, StateHub(), long_poll_s=LONG_POLL_S)
        writes = [join(i, n) for i in range(n)]
        answers = await asyncio.gather(*(rdzv.set_state(state, None, spec) for state, spec in writes))
        return kv.commits, answers, await rdzv.get_state()

    commits, answers, final = asyncio.run(scenario())
    assert all(written for _, written in answers)
    assert commits < n
    doc = RdzvDoc.from_json(open_state(final.value))
    assert doc.complete and sorted(doc.participants.values()) == list(range(n))


def test_a_waiter_that_gives_its_shape_sleeps_through_keep_alives_but_not_a_join():
    a, b = ("h", 1, 0), ("h", 2, 0)
    base = RdzvDoc(participants={a: 0}, last_heartbeats={a: 1})

    async def scenario():
        loop = asyncio.get_running_loop()
        rdzv = Rendezvous(MemoryStore(), Keys(), RDZV, StateHub(), long_poll_s=LONG_POLL_S)
        first, _ = await rdzv.set_state(seal_state(base.to_json(), version=2), None)
        after = str(first.mod_revision)
        spec = MergeSpec(ops=[Op(kind="keep_alive", node=a, at_us=5)], min_nodes=2, max_nodes=2)
        waiting = asyncio.create_task(rdzv.wait_for_state_change(after, 0.5, base.shape()))
        await asyncio.sleep(0.05)
        beat, written = await rdzv.set_state(seal_state(base.to_json(), version=2), after, spec)
        start = loop.time()
        _, changed = await waiting  # the keep-alive alone did not end the wait
        slept = loop.time() - start
        joined = asyncio.create_task(rdzv.wait_for_state_change(str(beat.mod_revision), 5, base.shape()))
        await asyncio.sleep(0.05)
        state, spec = join(1, 2)
        spec = MergeSpec(ops=[spec.ops[0].model_copy(update={"node": b})], min_nodes=2, max_nodes=2)
        await rdzv.set_state(state, after, spec)  # a stale token: merged into the current state
        woke = await asyncio.wait_for(joined, 2)
        return written, changed, slept, woke

    written, changed, slept, (entry, woke) = asyncio.run(scenario())
    assert written and changed and slept > 0.3
    assert woke and RdzvDoc.from_json(open_state(entry.value)).complete


def test_a_joined_waiter_that_gives_its_progress_sleeps_through_joins_but_not_the_round_completing():
    """A node already in an open round waits for the round's progress only: another node's
    join that leaves the round open does not end its wait; the join that completes it does."""
    a, b, c = ("h", 1, 0), ("h", 2, 0), ("h", 3, 0)
    base = RdzvDoc(participants={a: 0}, last_heartbeats={a: 1})

    def join_of(node) -> MergeSpec:
        return MergeSpec(ops=[Op(kind="join", node=node, at_us=5)], min_nodes=3, max_nodes=3)

    async def scenario():
        loop = asyncio.get_running_loop()
        rdzv = Rendezvous(MemoryStore(), Keys(), RDZV, StateHub(), long_poll_s=LONG_POLL_S)
        first, _ = await rdzv.set_state(seal_state(base.to_json(), version=2), None)
        after = str(first.mod_revision)
        waiting = asyncio.create_task(rdzv.wait_for_state_change(after, 0.5, progress=base.progress()))
        await asyncio.sleep(0.05)
        second, _ = await rdzv.set_state(None, after, join_of(b))
        start = loop.time()
        _, changed = await waiting  # b's join alone did not end the wait
        slept = loop.time() - start
        completing = asyncio.create_task(
            rdzv.wait_for_state_change(str(second.mod_revision), 5, progress=base.progress()))
        await asyncio.sleep(0.05)
        await rdzv.set_state(None, after, join_of(c))
        return changed, slept, await asyncio.wait_for(completing, 2)

    changed, slept, (entry, woke) = asyncio.run(scenario())
    assert changed and slept > 0.3
    assert woke and RdzvDoc.from_json(open_state(entry.value)).complete


def test_a_node_is_kept_alive_while_it_polls_and_not_after(monkeypatch):
    """A joined node's long poll that names it keeps its heartbeat fresh (the control plane
    writes its keep-alive when torch would: the heartbeat `beat_s` old), without waking the
    other waiters; once it stops polling (its process died or stopped), its heartbeat ages as
    torch's rules expect, and a node that is not in the state is not kept alive."""
    import service.rendezvous as hub_module

    monkeypatch.setattr(hub_module, "KEEP_ALIVE_TICK_S", 0.05)
    monkeypatch.setattr(hub_module, "ALIVE_GRACE_S", 0.05)
    a, b, stranger = ("h", 1, 0), ("h", 2, 0), ("h", 9, 0)
    base = RdzvDoc(participants={a: 0, b: 0}, last_heartbeats={a: 1, b: 1})

    def beats(entry) -> dict:
        return RdzvDoc.from_json(open_state(entry.value)).last_heartbeats

    async def scenario():
        rdzv = Rendezvous(MemoryStore(), Keys(), RDZV, StateHub(), long_poll_s=LONG_POLL_S)
        first, _ = await rdzv.set_state(seal_state(base.to_json(), version=2), None)
        after = str(first.mod_revision)
        other = asyncio.create_task(rdzv.wait_for_state_change(after, 0.5, progress=base.progress()))
        _, changed = await rdzv.wait_for_state_change(after, 0.3, progress=base.progress(), alive=(a, 0.1))
        kept = rdzv.kept_alive(a), rdzv.kept_alive(stranger)
        during = beats(await rdzv.get_state())
        _, other_woke = await other
        await asyncio.sleep(0.4)  # a no longer polls
        stopped = beats(await rdzv.get_state())
        await asyncio.sleep(0.3)
        return changed, kept, during, other_woke, stopped, beats(await rdzv.get_state())

    changed, kept, during, other_woke, stopped, later = asyncio.run(scenario())
    assert not changed and kept == (True, False)
    assert during[a] > 1 and during[b] == 1  # only the polling node is kept alive
    assert other_woke  # its token changed, but its wait ran to the end (progress unchanged)
    assert later[a] == stopped[a]  # not kept alive once it stopped polling


def test_the_join_of_the_last_expected_member_ends_the_last_call_and_no_other_does():
    def joined_deadline(expected: int) -> int | None:
        async def scenario():
            rdzv = Rendezvous(MemoryStore(), Keys(), RDZV, StateHub(), expected_nodes=expected,
                              long_poll_s=LONG_POLL_S)
            node = ("127.0.0.1", 100, 0)
            doc = RdzvDoc(participants={node: 0}, last_heartbeats={node: 1}, deadline_us=9)
            spec = MergeSpec(ops=[Op(kind="join", node=node, at_us=1, deadline_us=9)], min_nodes=1,
                             max_nodes=2)
            entry, written = await rdzv.set_state(seal_state(doc.to_json(), version=2), None, spec)
            assert written
            return RdzvDoc.from_json(open_state(entry.value)).deadline_us
        return asyncio.run(scenario())

    assert joined_deadline(1) == ENDED_LAST_CALL_US  # the one member left is in: complete now
    assert joined_deadline(2) == 9  # one more member to come: torch's last call
    assert joined_deadline(0) == 9  # members unknown: torch's last call


def test_joined_waiters_are_not_woken_by_joins_that_leave_the_round_open():
    """A poll waiting for the round's progress waits on its own event: the other nodes' joins
    (each a change of the state) do not wake it to find nothing it waits for: 14 joins, no
    wake-up of the 10 polls (before: each woke at every join, 140 wake-ups)."""
    n, waiting_n = 16, 10
    first = ("h", 0, 0)
    base = RdzvDoc(participants={first: 0}, last_heartbeats={first: 1})

    async def scenario():
        hub = StateHub()
        rdzv = Rendezvous(MemoryStore(), Keys(), RDZV, hub, long_poll_s=LONG_POLL_S)
        start, _ = await rdzv.set_state(seal_state(base.to_json(), version=2), None)
        polls = [asyncio.create_task(rdzv.wait_for_state_change(str(start.mod_revision), 5,
                                                                progress=base.progress()))
                 for _ in range(waiting_n)]
        await asyncio.sleep(0.05)
        waits_before = hub.wakes
        for i in range(1, n - 1):  # 14 joins one by one; the round (of 16) stays open
            spec = MergeSpec(ops=[Op(kind="join", node=("h", i, 0), at_us=5)], min_nodes=n, max_nodes=n)
            _, written = await rdzv.set_state(None, str(start.mod_revision), spec)
            assert written
        await asyncio.sleep(0.05)
        woken_meanwhile = hub.wakes - waits_before
        spec = MergeSpec(ops=[Op(kind="join", node=("h", n - 1, 0), at_us=5)], min_nodes=n, max_nodes=n)
        await rdzv.set_state(None, str(start.mod_revision), spec)  # completes the round
        answers = await asyncio.wait_for(asyncio.gather(*polls), 2)
        return waits_before, woken_meanwhile, answers

    waits_before, woken_meanwhile, answers = asyncio.run(scenario())
    assert waits_before >= waiting_n and woken_meanwhile == 0
    assert all(changed and RdzvDoc.from_json(open_state(e.value)).complete for e, changed in answers)


def test_blocking_store_reads_share_one_watch_and_all_get_the_value():
    """N nodes wait for the master's address at once: one etcd watch of the store (before:
    one a waiting read), and every read answers with the value once it is set."""

    async def scenario():
        kv, hub = CountingStore(), StateHub()
        rdzv = Rendezvous(kv, Keys(), RDZV, hub, long_poll_s=LONG_POLL_S)
        reads = [asyncio.create_task(rdzv.get(["MASTER_ADDR", "MASTER_PORT"], 5)) for _ in range(20)]
        await asyncio.sleep(0.1)  # they all wait
        pending = sum(not r.done() for r in reads)
        await rdzv.set([("MASTER_ADDR", b"10.0.0.1")])
        await asyncio.sleep(0.05)
        still = sum(not r.done() for r in reads)  # only one key of two: all still wait
        await rdzv.set([("MASTER_PORT", b"29500")])
        values = await asyncio.wait_for(asyncio.gather(*reads), 2)
        late = await rdzv.get(["MASTER_ADDR"], 5)  # present: no wait
        return kv.watches, hub.store_watches, pending, still, values, late

    watches, store_watches, pending, still, values, late = asyncio.run(scenario())
    assert pending == 20 and still == 20
    assert watches == 1 and store_watches == 1
    assert all(v == [b"10.0.0.1", b"29500"] for v in values) and late == [b"10.0.0.1"]


def formed(n: int) -> tuple[list, bytes]:
    """A complete round of `n` nodes (heartbeats at 1 us), sealed as it travels."""
    nodes = [("h", i, 0) for i in range(n)]
    doc = RdzvDoc(complete=True, participants={node: i for i, node in enumerate(nodes)},
                  last_heartbeats=dict.fromkeys(nodes, 1))
    return nodes, seal_state(doc.to_json(), version=2)


def beat(node, at_us: int, n: int) -> MergeSpec:
    return MergeSpec(ops=[Op(kind="keep_alive", node=node, at_us=at_us)], min_nodes=n, max_nodes=n)


def test_keep_alives_of_a_formed_round_share_writes_and_each_is_answered_with_its_own(monkeypatch):
    """torch's keep-alive timers of a formed round's nodes write their heartbeats all the time
    (N/5 a second); the control plane sends them together, the writes a gap apart that grows
    with the round (here 10 ms a node: 0.4 s; 39 keep-alives over ~0.8 s: at most 5 writes; one
    each before). Each answer is the write that carries its heartbeat; a node that sends none
    is not kept alive."""
    import service.rendezvous as module

    monkeypatch.setattr(module, "BEATS_GAP_PER_NODE_S", 0.01)
    n, spacing_s = 40, 0.02

    async def scenario():
        kv, hub = CountingStore(), StateHub()
        rdzv = Rendezvous(kv, Keys(), RDZV, hub, long_poll_s=LONG_POLL_S)
        nodes, state = formed(n)
        start, _ = await rdzv.set_state(state, None)
        commits = kv.commits
        began = asyncio.get_running_loop().time()
        beats = []
        for i in range(1, n):  # node 0 is dead: no keep-alive of its own
            beats.append(asyncio.create_task(rdzv.set_state(None, str(start.mod_revision),
                                                            beat(nodes[i], 1000 + i, n))))
            await asyncio.sleep(spacing_s)
        answers = await asyncio.wait_for(asyncio.gather(*beats), 5)
        spent = asyncio.get_running_loop().time() - began
        return kv.commits - commits, spent, nodes, answers, await rdzv.get_state()

    writes, spent, nodes, answers, final = asyncio.run(scenario())
    assert writes <= 1 + spent / 0.4 + 1, (writes, spent)
    for i, (entry, written) in enumerate(answers, start=1):
        assert written and RdzvDoc.from_json(open_state(entry.value)).last_heartbeats[nodes[i]] == 1000 + i
    beats = RdzvDoc.from_json(open_state(final.value)).last_heartbeats
    assert beats == {node: 1 if i == 0 else 1000 + i for i, node in enumerate(nodes)}


def test_keep_alives_through_two_replicas_all_land():
    """Two control planes on one store each send their nodes' keep-alives together; a write
    that loses its compare-and-set to the other replica's is applied again to what won."""
    n = 24

    async def scenario():
        kv = MemoryStore()
        replicas = [Rendezvous(kv, Keys(), RDZV, StateHub(), long_poll_s=LONG_POLL_S) for _ in range(2)]
        nodes, state = formed(n)
        start, _ = await replicas[0].set_state(state, None)
        token = str(start.mod_revision)
        for i in range(2):  # the first keep-alive on each replica starts its watch of the state
            await replicas[i].set_state(None, token, beat(nodes[i], 1000 + i, n))
        await asyncio.sleep(0.1)
        queued = []
        for replica in replicas:  # both now know the round is formed: keep-alives wait for a write
            watched = replica._states._watched[replica._state_key]
            queued.append(watched)
        answers = await asyncio.wait_for(asyncio.gather(*(
            replicas[i % 2].set_state(None, token, beat(node, 1000 + i, n))
            for i, node in enumerate(nodes) if i >= 2)), 5)
        return nodes, answers, await replicas[0].get_state(), [w.doc.complete for w in queued]

    nodes, answers, final, known = asyncio.run(scenario())
    assert known == [True, True]
    assert all(written for _, written in answers)
    assert RdzvDoc.from_json(open_state(final.value)).last_heartbeats == {
        node: 1000 + i for i, node in enumerate(nodes)}


def test_plain_reads_of_a_followed_state_come_from_the_watch_and_show_another_replicas_write():
    """torch reads the state before each keep-alive (and torchrun's monitor once a second): while
    the control plane follows the state (here: for a formed round's keep-alives), those reads
    are answered from its watch, not with an etcd read of the whole state each; a write through
    another replica shows once the watch brings it; cut off from etcd, none is answered."""
    n = 4

    class ReadCounting(CountingStore):
        reads = 0

        async def get(self, key):
            self.reads += 1
            return await super().get(key)

    async def scenario():
        kv = ReadCounting()
        here, there = (Rendezvous(kv, Keys(), RDZV, StateHub(), long_poll_s=LONG_POLL_S) for _ in range(2))
        nodes, state = formed(n)
        start, _ = await here.set_state(state, None)
        await here.set_state(None, str(start.mod_revision), beat(nodes[0], 1000, n))  # followed now
        await asyncio.sleep(0.05)
        before = kv.reads
        entries = [await here.read_state() for _ in range(20)]
        reads = kv.reads - before
        written, _ = await there.set_state(None, str(start.mod_revision), beat(nodes[1], 2000, n))
        for _ in range(100):  # the watch brings the other replica's write
            if (await here.read_state()).mod_revision == written.mod_revision:
                break
            await asyncio.sleep(0.01)
        seen = await here.read_state()

        def cut_off():
            raise StoreUnavailable("no answer from etcd")

        kv.check_contact = cut_off
        try:
            await here.read_state()
            refused = False
        except StoreUnavailable:
            refused = True
        return reads, entries, written, seen, refused

    from service.errors import StoreUnavailable

    reads, entries, written, seen, refused = asyncio.run(scenario())
    assert reads == 0 and all(e.mod_revision == entries[0].mod_revision for e in entries)
    assert seen.mod_revision == written.mod_revision and refused


def test_the_watch_kept_for_keep_alives_ends_once_they_stop(monkeypatch):
    """A state followed only for its keep-alives is followed no longer once they stop (the job
    ended, the nodes died): its watch and its sender go (a control plane runs for months)."""
    import service.rendezvous as module

    monkeypatch.setattr(module, "BEATS_WATCH_S", 0.2)
    monkeypatch.setattr(module, "WATCH_LINGER_S", 0.1)
    n = 3

    async def scenario():
        hub = StateHub()
        rdzv = Rendezvous(MemoryStore(), Keys(), RDZV, hub, long_poll_s=LONG_POLL_S)
        nodes, state = formed(n)
        start, _ = await rdzv.set_state(state, None)
        for i in range(n):
            await rdzv.set_state(None, str(start.mod_revision), beat(nodes[i], 1000 + i, n))
        followed = rdzv._state_key in hub._watched
        for _ in range(100):
            if rdzv._state_key not in hub._watched:
                break
            await asyncio.sleep(0.02)
        return followed, rdzv._state_key in hub._watched, (await rdzv.read_state()).mod_revision

    followed, still, revision = asyncio.run(scenario())
    assert followed and not still and revision > 0
