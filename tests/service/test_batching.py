"""`service.batching`: the one write batcher's contract (requests queue while N sends are in
flight, go out together, each caller answered with its own result) and what fits in one
etcd transaction (`TxnRoom`, `pack`). Pure logic, a fake send; the writers built on it
(submissions, rendezvous joins, a scheduler pass's plans) are tested with their stores."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from service.batching import MAX_BATCH_BYTES, Batcher, Failed, TxnRoom, pack
from service.store.api import MAX_TXN_OPS, Delete, Put


class FakeSend:
    """A send that records its groups and how many ran at once, each taking one loop turn
    per `turns` (a round trip), answering `item * 10`, or `Failed` for negative items."""

    def __init__(self, turns: int = 3):
        self.groups: list[list[int]] = []
        self.running = self.most_running = 0
        self.turns = turns
        self.error: Exception | None = None

    async def __call__(self, group: list[int]) -> list[int | Failed]:
        self.groups.append(group)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            for _ in range(self.turns):
                await asyncio.sleep(0)
            if self.error is not None:
                raise self.error
            return [Failed(ValueError(f"bad {i}")) if i < 0 else i * 10 for i in group]
        finally:
            self.running -= 1


@dataclass
class Part:
    expect: dict[str, int] = field(default_factory=dict)
    ops: list[Put | Delete] = field(default_factory=list)


def test_a_lone_request_goes_out_at_once_and_later_ones_wait_for_a_free_send_then_go_together():
    async def main():
        send = FakeSend(turns=8)
        batcher = Batcher(send, max_in_flight=2)
        assert await batcher.submit(1) == 10 and send.groups == [[1]]
        send.groups.clear()
        calls = []
        for i in range(2, 32):  # a stream: one request a loop turn, a send takes eight
            calls.append(asyncio.ensure_future(batcher.submit(i)))
            await asyncio.sleep(0)
        got = await asyncio.gather(*calls)
        assert got == [i * 10 for i in range(2, 32)]  # each its own result, in its place
        assert send.most_running == 2  # never more in flight than allowed
        assert sorted(i for g in send.groups for i in g) == list(range(2, 32))  # each sent once
        assert len(send.groups) <= 10 and max(map(len, send.groups)) > 1, send.groups
        assert batcher.grouped >= 1 and batcher.sends == 1 + len(send.groups)

    asyncio.run(main())


def test_with_one_send_in_flight_everything_that_came_meanwhile_is_the_next_group():
    async def main():
        send = FakeSend()
        batcher = Batcher(send)  # max_in_flight 1, no room: a group takes all that wait
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first is in flight now
        rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(2, 7)]
        assert await asyncio.gather(first, *rest) == [10, 20, 30, 40, 50, 60]
        assert send.groups == [[1], [2, 3, 4, 5, 6]] and send.most_running == 1

    asyncio.run(main())


def test_a_failed_result_is_its_callers_error_only_and_a_raising_send_is_its_whole_groups():
    async def main():
        send = FakeSend()
        batcher = Batcher(send)
        got = await asyncio.gather(*(batcher.submit(i) for i in (1, -2, 3)), return_exceptions=True)
        assert got[0] == 10 and got[2] == 30 and isinstance(got[1], ValueError)
        send.error = ConnectionError("etcd away (the test)")
        got = await asyncio.gather(*(batcher.submit(i) for i in (4, 5)), return_exceptions=True)
        assert all(isinstance(e, ConnectionError) for e in got), got
        send.error = None
        assert await batcher.submit(6) == 60  # the batcher goes on after an error

    asyncio.run(main())


def test_a_caller_gone_before_its_group_is_taken_is_not_sent_and_idle_is_told():
    async def main():
        send = FakeSend()
        idle: list[int] = []
        batcher = Batcher(send, on_idle=lambda: idle.append(len(send.groups)))
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        gone = asyncio.ensure_future(batcher.submit(2))
        kept = asyncio.ensure_future(batcher.submit(3))
        await asyncio.sleep(0)
        gone.cancel()
        assert await first == 10 and await kept == 30
        assert send.groups == [[1], [3]] and idle == [2]  # idle once, after the last send

    asyncio.run(main())


def test_a_room_cuts_the_waiting_requests_into_groups_in_order():
    class Three:
        def __init__(self):
            self.n = 0

        def take(self, item):
            self.n += 1
            return self.n <= 3

    async def main():
        send = FakeSend()
        batcher = Batcher(send, room=Three)
        assert await asyncio.gather(*(batcher.submit(i) for i in range(8))) == [i * 10 for i in range(8)]
        assert send.groups == [[0, 1, 2], [3, 4, 5], [6, 7]]  # (all eight came at once)

    asyncio.run(main())


def put(key: str, size: int = 1) -> Put:
    return Put(key, b"x" * size)


def filled(room: TxnRoom, *parts: Part) -> TxnRoom:
    for part in parts:
        assert room.take(part)
    return room


def test_a_transaction_takes_max_txn_ops_with_its_read_back_and_shared_compares_counted_once():
    room = filled(TxnRoom(), *(Part({f"k{i}": 0}, [put(f"k{i}")]) for i in range(MAX_TXN_OPS - 1)))
    assert not room.take(Part({"a": 0}, [put("a")]))  # (+ 1: the read back)
    assert filled(TxnRoom(reads=0), Part({}, [put("b")] * (MAX_TXN_OPS - 1))).take(Part({}, [put("c")]))
    assert filled(TxnRoom(shared=MAX_TXN_OPS - 2), Part({"a": 1}, [])).take(Part({"b": 1}, []))
    assert not filled(TxnRoom(shared=MAX_TXN_OPS - 2), Part({"a": 1}, [])).take(Part({"b": 1, "c": 1}, []))
    assert TxnRoom().take(Part({}, [put("big")] * 500))  # the first part of a group always fits


def test_a_transaction_holds_no_key_twice_and_at_most_max_batch_bytes():
    def room() -> TxnRoom:
        return filled(TxnRoom(), Part({"job/a": 0}, [put("job/a", MAX_BATCH_BYTES - 10)]))

    assert not room().take(Part({"job/b": 0}, [put("job/b", 11)]))
    assert room().take(Part({"job/b": 0}, [put("job/b", 10)]))
    assert not room().take(Part({"job/c": 0}, [put("job/a", 1)]))  # a key the group puts
    assert not room().take(Part({"job/a": 3}, []))  # ... or compares
    assert filled(TxnRoom(distinct=False), Part({}, [put("job/x")])).take(Part({}, [put("job/x")]))


def test_pack_keeps_order_puts_a_too_large_part_alone_and_takes_parts_only_as_it_needs_them():
    parts = [Part({f"k{i}": 0}, [put(f"k{i}")] * 50) for i in range(5)] + [Part({}, [put("big")] * 500)]
    groups = list(pack(parts, TxnRoom))
    assert [len(g) for g in groups] == [2, 2, 1, 1] and [p for g in groups for p in g] == parts
    taken: list[int] = []

    def lazily():
        for i, part in enumerate(parts):
            taken.append(i)
            yield part

    first = next(pack(lazily(), TxnRoom))
    assert len(first) == 2 and taken == [0, 1, 2]  # the third only to see the group is full
    with pytest.raises(StopIteration):
        next(pack([], TxnRoom))
