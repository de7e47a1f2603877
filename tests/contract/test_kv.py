"""The `KeyValue` contract, run against every implementation: a real etcd and MemoryStore.

What ftrain relies on is asserted here once, so the in-memory store that tests of the
stores use cannot drift from etcd: revisions, compare-and-set on mod_revision (0: absent),
transactions that apply whole or not at all, leases whose lapse deletes their keys,
watches that replay from a past revision, and compaction, after which a watch from before
it raises HistoryCompacted (and the store serves everything else as before).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from service.errors import HistoryCompacted, ReplyTooLarge, StoreUnavailable
from service.store.api import MAX_TXN_OPS, Delete, Entry, KeyValue, Put, WatchEvent
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait

LEASE_TTL_S = 2  # etcd rounds shorter TTLs up to its minimum


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Backend:
    """One implementation under test: clients of one store, and a way to let time pass."""

    def __init__(self, name: str, new_client: Callable[[], KeyValue],
                 elapse: Callable[[float], Awaitable[None]]):
        self.name = name
        self.new_client = new_client
        self.elapse = elapse

    def run(self, test: Callable[[KeyValue], Awaitable[object]]) -> object:
        async def main():
            store = self.new_client()
            try:
                return await test(store)
            finally:
                await store.close()

        return asyncio.run(main())

    async def eventually(self, check: Callable[[], Awaitable[bool]], within_s: float) -> None:
        """Let time pass, a little at a time, until `check` holds (fail after `within_s`)."""
        waited = 0.0
        while not await check():
            if waited > within_s:
                raise AssertionError(f"{self.name}: not true after {within_s} s")
            await self.elapse(0.1)
            waited += 0.1


@pytest.fixture(params=[pytest.param("etcd", marks=pytest.mark.integration), "memory"])
def backend(request) -> Backend:
    if request.param == "etcd":
        from service.store.etcd import EtcdStore

        endpoint = request.getfixturevalue("etcd").endpoint
        return Backend("etcd", lambda: EtcdStore(endpoint), asyncio.sleep)
    clock = ManualClock()
    store = MemoryStore(clock=clock)

    async def elapse(seconds: float) -> None:
        clock.now += seconds
        await asyncio.sleep(0)

    return Backend("memory", lambda: store, elapse)


async def scan(kv: KeyValue, prefix: str, **kw) -> list[Entry]:
    return [e async for e in kv.scan_prefix(prefix, **kw)]


async def next_events(events, n: int, timeout_s: float = 10) -> list[WatchEvent]:
    return [await asyncio.wait_for(anext(events), timeout_s) for _ in range(n)]


# ------------------------------------------------------------------ reads and plain writes

def test_get_returns_none_for_an_absent_key(backend):
    async def test(kv: KeyValue):
        assert await kv.get("/c/absent") is None

    backend.run(test)


def test_put_then_get_returns_the_value_with_its_revisions(backend):
    async def test(kv: KeyValue):
        before = await kv.revision()
        await kv.put("/c/a", b"1")
        entry = await kv.get("/c/a")
        assert (entry.key, entry.value, entry.lease) == ("/c/a", b"1", 0)
        assert entry.mod_revision == entry.create_revision == before + 1 == await kv.revision()

    backend.run(test)


def test_overwriting_moves_mod_revision_and_keeps_create_revision(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/a", b"1")
        first = await kv.get("/c/a")
        await kv.put("/c/a", b"2")
        second = await kv.get("/c/a")
        assert second.value == b"2"
        assert second.mod_revision == first.mod_revision + 1
        assert second.create_revision == first.create_revision

    backend.run(test)


def test_delete_removes_a_key_and_a_new_put_creates_it_anew(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/a", b"1")
        created = (await kv.get("/c/a")).create_revision
        await kv.delete("/c/a")
        assert await kv.get("/c/a") is None
        await kv.put("/c/a", b"2")
        assert (await kv.get("/c/a")).create_revision > created

    backend.run(test)


def test_deleting_an_absent_key_changes_nothing_not_even_the_revision(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/a", b"1")
        revision = await kv.revision()
        await kv.delete("/c/absent")
        assert await kv.revision() == revision

    backend.run(test)


def test_scan_prefix_returns_only_keys_under_the_prefix_in_key_order(backend):
    async def test(kv: KeyValue):
        for key in ("/c/p/b", "/c/p/a", "/c/p2/x", "/c/q", "/c/p/c/d"):
            await kv.put(key, key.encode())
        assert [e.key for e in await scan(kv, "/c/p/")] == ["/c/p/a", "/c/p/b", "/c/p/c/d"]
        assert [e.value for e in await scan(kv, "/c/p/")] == [b"/c/p/a", b"/c/p/b", b"/c/p/c/d"]
        assert await scan(kv, "/c/none/") == []
        assert await kv.count_prefix("/c/p/") == 3 and await kv.count_prefix("/c/none/") == 0

    backend.run(test)


def test_latest_revision_is_that_of_the_key_under_the_prefix_changed_last(backend):
    async def test(kv: KeyValue):
        assert await kv.latest_revision("/c/p/") == 0
        for key in ("/c/p/b", "/c/p/a", "/c/p/c"):
            await kv.put(key, b"1")
        await kv.put("/c/p/a", b"2")  # not the last key, nor the first: changed last
        latest = (await kv.get("/c/p/a")).mod_revision
        await kv.put("/c/q", b"1")  # not under the prefix
        assert await kv.latest_revision("/c/p/") == latest

    backend.run(test)


def test_get_range_reads_at_most_limit_entries_after_a_key(backend):
    async def test(kv: KeyValue):
        keys = [f"/c/r/{i:03d}" for i in range(7)]
        for key in [*keys, "/c/r0", "/c/q"]:
            await kv.put(key, key.encode())
        first = await kv.get_range("/c/r/", limit=3)
        assert [e.key for e in first] == keys[:3] and first[0].value == keys[0].encode()
        rest = await kv.get_range("/c/r/", limit=3, start_after=first[-1].key)
        assert [e.key for e in rest] == keys[3:6]
        assert [e.key for e in await kv.get_range("/c/r/", limit=3, start_after=keys[5])] == keys[6:]
        assert await kv.get_range("/c/r/", limit=3, start_after=keys[6]) == []
        # A start before the prefix reads from the prefix's first key, never outside it.
        assert [e.key for e in await kv.get_range("/c/r/", limit=1, start_after="/c/a")] == keys[:1]
        only_keys = await kv.get_range("/c/r/", limit=2, keys_only=True)
        assert [(e.key, e.value) for e in only_keys] == [(keys[0], b""), (keys[1], b"")]
        assert only_keys[0].mod_revision > 0

    backend.run(test)


def test_scan_prefix_pages_through_more_keys_than_one_page(backend):
    async def test(kv: KeyValue):
        keys = [f"/c/s/{i:04d}" for i in range(25)]
        for start in range(0, len(keys), MAX_TXN_OPS):
            await kv.commit({}, [Put(k, b"v") for k in keys[start:start + MAX_TXN_OPS]])
        reads: list[int] = []
        get_range = kv.get_range

        async def counting(prefix, **kw):
            page = await get_range(prefix, **kw)
            reads.append(len(page))
            return page

        kv.get_range = counting  # type: ignore[method-assign]
        try:
            assert [e.key for e in await scan(kv, "/c/s/", page_size=10)] == keys
            assert reads == [10, 10, 5]  # no read of more than a page
            assert [e.key for e in await scan(kv, "/c/s/", page_size=5, keys_only=True)] == keys
        finally:
            del kv.get_range

    backend.run(test)


def test_a_page_too_large_for_one_reply_is_read_again_in_halves(backend):
    """Four values of 1.2 MiB: one reply of all four would pass gRPC's 4 MiB cap."""
    big = 1200 * 1024

    async def test(kv: KeyValue):
        keys = [f"/c/big/{i}" for i in range(4)]
        for i, key in enumerate(keys):
            await kv.put(key, bytes([i]) * big)
        with pytest.raises(ReplyTooLarge):
            await kv.get_range("/c/big/", limit=4)
        got = await scan(kv, "/c/big/", page_size=4)
        assert [(e.key, len(e.value), e.value[:1]) for e in got] == \
            [(k, big, bytes([i])) for i, k in enumerate(keys)]
        many = await kv.get_many([keys[0], "/c/big/none", *keys[1:]])
        assert [None if e is None else e.key for e in many] == [keys[0], None, *keys[1:]]
        assert [e.key for e in await scan(kv, "/c/big/", keys_only=True)] == keys  # keys are small

    backend.run(test)


def test_delete_prefix_deletes_only_keys_under_the_prefix(backend):
    async def test(kv: KeyValue):
        for key in ("/c/p/a", "/c/p/b", "/c/p2/x"):
            await kv.put(key, b"1")
        await kv.delete_prefix("/c/p/")
        assert [e.key for e in await scan(kv, "/c/")] == ["/c/p2/x"]

    backend.run(test)


def test_get_many_returns_entries_in_order_with_none_for_absent_keys(backend):
    async def test(kv: KeyValue):
        keys = [f"/c/many/{i:04d}" for i in range(MAX_TXN_OPS * 2 + 5)]  # more than one txn
        for key in keys[::3]:
            await kv.put(key, key.encode())
        got = await kv.get_many(keys)
        assert [None if e is None else e.value.decode() for e in got] == \
            [k if i % 3 == 0 else None for i, k in enumerate(keys)]
        assert await kv.get_many([]) == []

    backend.run(test)


# ------------------------------------------------------------------ compare-and-set

def test_commit_with_revision_zero_creates_only_if_absent(backend):
    async def test(kv: KeyValue):
        assert await kv.commit({"/c/a": 0}, [Put("/c/a", b"1")])
        assert not await kv.commit({"/c/a": 0}, [Put("/c/a", b"2")])
        assert (await kv.get("/c/a")).value == b"1"

    backend.run(test)


def test_commit_at_the_current_revision_applies(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/a", b"1")
        revision = (await kv.get("/c/a")).mod_revision
        assert await kv.commit({"/c/a": revision}, [Put("/c/a", b"2")])
        assert (await kv.get("/c/a")).value == b"2"

    backend.run(test)


def test_commit_at_a_stale_revision_writes_nothing(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/a", b"1")
        stale = (await kv.get("/c/a")).mod_revision
        await kv.put("/c/a", b"2")
        revision = await kv.revision()
        assert not await kv.commit({"/c/a": stale}, [Put("/c/a", b"3"), Put("/c/b", b"3")])
        assert (await kv.get("/c/a")).value == b"2"
        assert await kv.get("/c/b") is None
        assert await kv.revision() == revision  # a failed transaction is not a write

    backend.run(test)


def test_commit_compares_every_key_and_applies_all_ops_at_one_revision(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/a", b"1")
        await kv.put("/c/gone/x", b"1")
        await kv.put("/c/gone/y", b"1")
        a = (await kv.get("/c/a")).mod_revision
        assert not await kv.commit({"/c/a": a, "/c/b": 1}, [Put("/c/c", b"1")])  # b absent: 0
        assert await kv.commit({"/c/a": a, "/c/b": 0},
                               [Put("/c/a", b"2"), Put("/c/b", b"2"), Delete("/c/gone/", prefix=True)])
        revision = await kv.revision()
        assert [(e.key, e.mod_revision) for e in await scan(kv, "/c/")] == \
            [("/c/a", revision), ("/c/b", revision)]

    backend.run(test)


def test_commit_without_compares_always_applies(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/a", b"1")
        assert await kv.commit({}, [Put("/c/a", b"2"), Delete("/c/none")])
        assert (await kv.get("/c/a")).value == b"2"

    backend.run(test)


def test_commit_read_returns_what_it_wrote_with_the_new_token(backend):
    async def test(kv: KeyValue):
        written, entry = await kv.commit_read({"/c/s": 0}, [Put("/c/s", b"mine")], "/c/s")
        assert written and entry.value == b"mine"
        assert entry.mod_revision == await kv.revision()

    backend.run(test)


def test_commit_read_returns_the_winner_when_it_loses(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/s", b"winner")
        winner = await kv.get("/c/s")
        written, entry = await kv.commit_read({"/c/s": 0}, [Put("/c/s", b"loser")], "/c/s")
        assert not written and entry == winner

    backend.run(test)


def test_commit_read_of_an_absent_key_returns_none(backend):
    async def test(kv: KeyValue):
        written, entry = await kv.commit_read({"/c/x": 0}, [Put("/c/y", b"1")], "/c/x")
        assert written and entry is None

    backend.run(test)


def test_two_clients_racing_on_one_revision_exactly_one_wins(backend):
    async def test(kv: KeyValue):
        other = backend.new_client()
        try:
            for i in range(10):
                key = f"/c/race/{i}"
                await kv.put(key, b"0")
                revision = (await kv.get(key)).mod_revision
                results = await asyncio.gather(kv.commit({key: revision}, [Put(key, b"a")]),
                                               other.commit({key: revision}, [Put(key, b"b")]))
                assert sorted(results) == [False, True]
                assert (await kv.get(key)).value == (b"a" if results[0] else b"b")
        finally:
            if other is not kv:
                await other.close()

    backend.run(test)


def test_a_transaction_over_max_txn_ops_is_refused_whole(backend):
    async def test(kv: KeyValue):
        with pytest.raises(StoreUnavailable):
            await kv.commit({}, [Put(f"/c/big/{i}", b"1") for i in range(MAX_TXN_OPS + 1)])
        assert await scan(kv, "/c/big/") == []
        assert await kv.commit({}, [Put(f"/c/big/{i}", b"1") for i in range(MAX_TXN_OPS)])

    backend.run(test)


@pytest.mark.parametrize("ops", [
    [Put("/c/d/a", b"1"), Put("/c/d/a", b"2")],
    [Put("/c/d/a", b"1"), Delete("/c/d/a")],
    [Delete("/c/d/", prefix=True), Put("/c/d/a", b"1")],
], ids=["put twice", "put and delete", "put under a deleted prefix"])
def test_a_transaction_that_writes_one_key_twice_is_refused_whole(backend, ops):
    async def test(kv: KeyValue):
        await kv.put("/c/d/b", b"0")
        with pytest.raises(StoreUnavailable):
            await kv.commit({}, [Put("/c/d/other", b"1"), *ops])
        assert [e.key for e in await scan(kv, "/c/d/")] == ["/c/d/b"]

    backend.run(test)


def test_a_transaction_may_delete_one_key_twice(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/d/a", b"0")
        assert await kv.commit({}, [Delete("/c/d/a"), Delete("/c/d/", prefix=True)])
        assert await scan(kv, "/c/d/") == []

    backend.run(test)


# ------------------------------------------------------------------ leases

def test_a_key_on_a_lease_records_it_and_goes_when_the_lease_lapses(backend):
    async def test(kv: KeyValue):
        lease = await kv.grant_lease(LEASE_TTL_S)
        await kv.put("/c/l", b"1", lease=lease)
        await kv.put("/c/kept", b"1")
        assert (await kv.get("/c/l")).lease == lease

        async def gone() -> bool:
            return await kv.get("/c/l") is None

        await backend.eventually(gone, within_s=LEASE_TTL_S + 5)
        assert not await kv.refresh_lease(lease)
        assert await kv.get("/c/kept") is not None

    backend.run(test)


def test_refreshing_a_lease_keeps_its_keys_past_the_ttl(backend):
    async def test(kv: KeyValue):
        lease = await kv.grant_lease(LEASE_TTL_S)
        await kv.put("/c/l", b"1", lease=lease)
        for _ in range(LEASE_TTL_S * 3):  # three TTLs, refreshed every half
            await backend.elapse(0.5)
            assert await kv.refresh_lease(lease)
        assert await kv.get("/c/l") is not None

    backend.run(test)


def test_revoking_a_lease_deletes_its_keys_at_once(backend):
    async def test(kv: KeyValue):
        lease = await kv.grant_lease(60)
        await kv.commit({}, [Put("/c/l/a", b"1", lease), Put("/c/l/b", b"1", lease)])
        await kv.revoke_lease(lease)
        assert await scan(kv, "/c/l/") == []
        assert not await kv.refresh_lease(lease)

    backend.run(test)


def test_revoking_or_refreshing_an_unknown_lease_is_harmless(backend):
    async def test(kv: KeyValue):
        lease = await kv.grant_lease(60)
        await kv.revoke_lease(lease)
        await kv.revoke_lease(lease)  # already gone: nothing to do
        assert not await kv.refresh_lease(lease)

    backend.run(test)


def test_a_put_on_a_lease_that_is_gone_is_refused(backend):
    async def test(kv: KeyValue):
        lease = await kv.grant_lease(60)
        await kv.revoke_lease(lease)
        with pytest.raises(StoreUnavailable):
            await kv.put("/c/l", b"1", lease=lease)
        assert await kv.get("/c/l") is None

    backend.run(test)


# ------------------------------------------------------------------ watches

def test_a_watch_from_a_past_revision_replays_puts_and_deletes_then_follows(backend):
    async def test(kv: KeyValue):
        start = await kv.revision() + 1
        await kv.put("/c/w/a", b"1")
        await kv.put("/c/other", b"1")  # not under the prefix
        await kv.delete("/c/w/a")
        events = kv.watch_prefix("/c/w/", start)
        try:
            replayed = await next_events(events, 2)
            assert [(e.key, e.value) for e in replayed] == [("/c/w/a", b"1"), ("/c/w/a", None)]
            assert replayed[0].mod_revision == start
            assert replayed[1].mod_revision == start + 2
            await kv.put("/c/w/b", b"2")
            live = await next_events(events, 1)
            assert [(e.key, e.value, e.mod_revision) for e in live] == \
                [("/c/w/b", b"2", await kv.revision())]
        finally:
            await events.aclose()

    backend.run(test)


def test_a_watch_sees_every_op_of_a_transaction_at_one_revision(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/w/old", b"1")
        events = kv.watch_prefix("/c/w/", await kv.revision() + 1)
        try:
            await kv.commit({}, [Put("/c/w/a", b"1"), Delete("/c/w/old")])
            got = await next_events(events, 2)
            revision = await kv.revision()
            assert sorted((e.key, e.value, e.mod_revision) for e in got) == \
                [("/c/w/a", b"1", revision), ("/c/w/old", None, revision)]
        finally:
            await events.aclose()

    backend.run(test)


def test_a_watch_sees_the_deletes_of_a_lapsed_lease(backend):
    async def test(kv: KeyValue):
        lease = await kv.grant_lease(LEASE_TTL_S)
        await kv.put("/c/w/node", b"1", lease=lease)
        events = kv.watch_prefix("/c/w/", await kv.revision() + 1)
        seen: list[WatchEvent] = []

        async def pump():
            async for event in events:
                seen.append(event)

        task = asyncio.create_task(pump())
        try:
            async def deleted() -> bool:
                # MemoryStore notices a lapse on its next call; etcd on its own.
                return await kv.get("/c/w/node") is None and bool(seen)

            await backend.eventually(deleted, within_s=LEASE_TTL_S + 5)
            assert [(e.key, e.value) for e in seen] == [("/c/w/node", None)]
        finally:
            await cancel_and_wait(task)
            await events.aclose()

    backend.run(test)


def test_a_watch_session_ends_quietly_after_its_longest_time(backend):
    async def test(kv: KeyValue):
        began = time.monotonic()
        async for _ in kv.watch_prefix("/c/quiet/", await kv.revision() + 1, max_session_s=0.5):
            raise AssertionError("nothing was written")
        assert time.monotonic() - began < 10

    backend.run(test)


# ------------------------------------------------------------------ compaction

def test_compaction_keeps_the_data_and_the_history_from_its_revision_on(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/h/a", b"1")
        await kv.put("/c/h/a", b"2")
        kept = await kv.revision()
        await kv.put("/c/h/b", b"3")
        await kv.compact(kept)
        assert (await kv.get("/c/h/a")).value == b"2"
        assert [e.key for e in await scan(kv, "/c/h/")] == ["/c/h/a", "/c/h/b"]
        events = kv.watch_prefix("/c/h/", kept)  # from the compaction's own revision: kept
        try:
            got = await next_events(events, 2)
            assert [(e.key, e.value) for e in got] == [("/c/h/a", b"2"), ("/c/h/b", b"3")]
        finally:
            await events.aclose()

    backend.run(test)


def test_a_watch_from_before_the_compaction_raises_history_compacted(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/h/a", b"1")
        early = await kv.revision()
        await kv.put("/c/h/a", b"2")
        await kv.put("/c/h/a", b"3")
        await kv.compact(await kv.revision())
        with pytest.raises(HistoryCompacted) as raised:
            await next_events(kv.watch_prefix("/c/h/", early), 1)
        assert raised.value.compact_revision == await kv.revision()
        assert isinstance(raised.value, StoreUnavailable)  # callers that re-read on those do here
        # The store goes on serving: reads, writes, and a watch from a kept revision.
        events = kv.watch_prefix("/c/h/", await kv.revision() + 1)
        try:
            await kv.put("/c/h/a", b"4")
            assert [(e.key, e.value) for e in await next_events(events, 1)] == [("/c/h/a", b"4")]
        finally:
            await events.aclose()

    backend.run(test)


def test_compacting_again_at_or_below_an_earlier_compaction_changes_nothing(backend):
    async def test(kv: KeyValue):
        await kv.put("/c/h/a", b"1")
        await kv.put("/c/h/a", b"2")
        revision = await kv.revision()
        await kv.compact(revision)
        await kv.compact(revision)
        await kv.compact(revision - 1)
        assert (await kv.get("/c/h/a")).value == b"2"
        assert await kv.revision() == revision

    backend.run(test)
