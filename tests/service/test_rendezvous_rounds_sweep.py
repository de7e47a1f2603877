"""The store keys of an attempt's earlier rendezvous rounds are deleted once a later round
formed (`service.rendezvous.delete_rounds_before`), on the in-memory store."""

from __future__ import annotations

import asyncio

import pytest

from service.keys import Keys
from service.rendezvous import Rendezvous, _decode_key, delete_rounds_before, round_of_store_key
from service.store.memory import MemoryStore
from worker.protocol import Timeouts

RDZV = "long-abc123-a3"
LONG_POLL_S = Timeouts().long_poll_s  # the control plane's default hold of a long poll


@pytest.mark.parametrize("key,expected", [
    (f"torch.rendezvous.{RDZV}.0/MASTER_ADDR", 0),
    (f"torch.rendezvous.{RDZV}.12/torchelastic/role_info/1", 12),
    ("torch.rendezvous.other-abc123-a3.4/MASTER_ADDR", None),  # another attempt's
    (f"torch.rendezvous.{RDZV}/MASTER_ADDR", None),  # no round
    ("MASTER_ADDR", None),
])
def test_a_store_key_names_its_round_as_torchs_handler_prefixes_it(key, expected):
    assert round_of_store_key(RDZV, key) == expected


def test_the_store_keys_of_earlier_rounds_go_and_the_rest_stay():
    async def run():
        kv, keys = MemoryStore(), Keys()
        rdzv = Rendezvous(kv, keys, RDZV, long_poll_s=LONG_POLL_S)
        other = Rendezvous(kv, keys, "other-abc123-a0", long_poll_s=LONG_POLL_S)
        for r in range(4):  # a worker restart in each: rounds 0..3 of one attempt
            await rdzv.set([(f"torch.rendezvous.{RDZV}.{r}/MASTER_ADDR", b"h"),
                            (f"torch.rendezvous.{RDZV}.{r}/MASTER_PORT", b"1")])
        await rdzv.set([("plain", b"x")])
        await other.set([("torch.rendezvous.other-abc123-a0.0/MASTER_ADDR", b"h")])
        assert await delete_rounds_before(kv, keys, RDZV, 3) == 6
        prefix = keys.rdzv_store(RDZV)
        left = [_decode_key(e.key[len(prefix):]) async for e in kv.scan_prefix(prefix, keys_only=True)]
        assert sorted(left) == ["plain", f"torch.rendezvous.{RDZV}.3/MASTER_ADDR",
                                f"torch.rendezvous.{RDZV}.3/MASTER_PORT"]
        assert await other.num_keys() == 1

    asyncio.run(run())
