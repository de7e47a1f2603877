"""The one compare-and-set loop (`service.store.cas.update`), on the in-memory store."""

from __future__ import annotations

import asyncio

import pytest

from service.errors import ContentionError
from service.store import cas
from service.store.api import Entry, Put
from service.store.memory import MemoryStore


def increment(key: str):
    def decide(entry: Entry | None) -> cas.Write[int]:
        value = int(entry.value) + 1 if entry else 1
        return cas.Write({key: entry.mod_revision if entry else 0}, [Put(key, b"%d" % value)], value)

    return decide


def test_update_writes_what_decide_returns_and_answers_its_result():
    async def main():
        kv = MemoryStore()
        assert await cas.update(kv, lambda: kv.get("/n"), increment("/n"), "n") == 1
        assert await cas.update(kv, lambda: kv.get("/n"), increment("/n"), "n") == 2
        assert (await kv.get("/n")).value == b"2"

    asyncio.run(main())


def test_done_writes_nothing():
    async def main():
        kv = MemoryStore()
        await kv.put("/n", b"7")
        revision = await kv.revision()
        got = await cas.update(kv, lambda: kv.get("/n"), lambda e: cas.Done(int(e.value)), "n")
        assert got == 7 and await kv.revision() == revision

    asyncio.run(main())


def test_a_lost_race_re_reads_and_re_decides_on_what_is_stored_now():
    async def main():
        kv = MemoryStore()
        await kv.put("/n", b"10")
        seen: list[bytes] = []

        async def read() -> Entry | None:
            entry = await kv.get("/n")
            seen.append(entry.value)
            if len(seen) == 1:  # another writer lands between this read and the write
                await kv.put("/n", b"20")
            return entry

        assert await cas.update(kv, read, increment("/n"), "n") == 21
        assert seen == [b"10", b"20"]
        assert (await kv.get("/n")).value == b"21"

    asyncio.run(main())


def test_a_key_that_changes_on_every_attempt_ends_in_contention_error():
    async def main():
        kv = MemoryStore()
        reads = 0

        async def read() -> Entry | None:
            nonlocal reads
            reads += 1
            entry = await kv.get("/n")
            await kv.put("/n", b"%d" % reads)  # always one step ahead
            return entry

        with pytest.raises(ContentionError, match="node n1 changed 64 times"):
            await cas.update(kv, read, increment("/n"), "node n1")
        assert reads == cas.MAX_CAS_ATTEMPTS

    asyncio.run(main())


def test_a_refusal_raised_by_decide_writes_nothing():
    async def main():
        kv = MemoryStore()

        def refuse(entry):
            raise ValueError("no")

        with pytest.raises(ValueError):
            await cas.update(kv, lambda: kv.get("/n"), refuse, "n")
        assert await kv.get("/n") is None

    asyncio.run(main())


def test_concurrent_increments_lose_none():
    async def main():
        kv = MemoryStore()
        await asyncio.gather(*(cas.update(kv, lambda: kv.get("/n"), increment("/n"), "n")
                               for _ in range(40)))
        assert (await kv.get("/n")).value == b"40"

    asyncio.run(main())
