"""Submissions written several to one etcd transaction (group commit).

A submit is one transaction: the job record, its first event and its Idempotency-Key
(if any), each compared absent, the record read back for its revision (read-your-writes).
Under a burst of submissions every one of them was its own gRPC call and etcd
round trip, on the event loop that also answers the requests. `GroupCommit` writes them
together: a transaction that finds nothing waiting goes out at once, as before (no wait
added when submissions are few); those that come while MAX_IN_FLIGHT transactions are in
flight wait for one of them to end and then go out together, in one transaction of as
many as fit (MAX_TXN_OPS operations, MAX_BATCH_BYTES, no key twice). Each submitter is
answered once the transaction that holds its writes was committed, with what it would
have had alone: whether it was written and its record as read back (every key of one
transaction has that transaction's revision). If any compare of a group fails (a
repeated Idempotency-Key, a job id taken), nothing of it was written and each of its
transactions is sent again alone, so each gets its own answer; an error (etcd away) is
each one's error, as it would have been.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from service.store.api import MAX_TXN_OPS, Delete, Entry, KeyValue, Put

MAX_IN_FLIGHT = 2  # transactions of submissions in flight at once
MAX_BATCH_BYTES = 512 * 1024  # of values in one transaction (etcd refuses over 1.5 MiB)


@dataclass
class _Pending:
    expect: dict[str, int]
    ops: Sequence[Put | Delete]
    read: str
    answer: asyncio.Future = field(repr=False)

    @property
    def keys(self) -> set[str]:
        return {*self.expect, *(op.key for op in self.ops), self.read}

    @property
    def size(self) -> int:
        return sum(len(op.value) for op in self.ops if isinstance(op, Put))


class GroupCommit:
    """`commit_read` of transactions that only create keys (each compares its keys absent,
    or at a revision, and reads one of the keys it puts), grouped (module doc)."""

    def __init__(self, kv: KeyValue):
        self.kv = kv
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self.transactions = 0  # sent to the store (for tests and the bench)
        self.grouped = 0  # of them, those that held more than one submitter's

    async def commit_read(self, expect: dict[str, int], ops: Sequence[Put | Delete],
                          read: str) -> tuple[bool, Entry | None]:
        pending = _Pending(expect, ops, read, asyncio.get_running_loop().create_future())
        self._waiting.append(pending)
        if self._in_flight < MAX_IN_FLIGHT:
            self._in_flight += 1
            task = asyncio.create_task(self._send())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await pending.answer

    async def _send(self) -> None:
        try:
            while self._waiting:
                if group := self._take():
                    await self._commit(group)
        finally:
            self._in_flight -= 1

    def _take(self) -> list[_Pending]:
        """The waiting transactions, oldest first, as many as fit in one."""
        group: list[_Pending] = []
        keys: set[str] = set()
        n_ops = n_compares = size = 0
        while self._waiting:
            p = self._waiting[0]
            if p.answer.done():  # its submitter is gone (cancelled) before it was sent: not sent
                self._waiting.popleft()
                continue
            if group and (n_ops + len(p.ops) + 1 > MAX_TXN_OPS
                          or n_compares + len(p.expect) > MAX_TXN_OPS
                          or size + p.size > MAX_BATCH_BYTES or not keys.isdisjoint(p.keys)):
                break
            self._waiting.popleft()
            group.append(p)
            keys |= p.keys
            n_ops, n_compares, size = n_ops + len(p.ops), n_compares + len(p.expect), size + p.size
        return group

    async def _commit(self, group: list[_Pending]) -> None:
        if len(group) == 1:
            await self._alone(group[0])
            return
        expect = {k: v for p in group for k, v in p.expect.items()}
        self.transactions += 1
        self.grouped += 1
        try:
            ok, entry = await self.kv.commit_read(expect, [op for p in group for op in p.ops],
                                                  group[-1].read)
        except asyncio.CancelledError:
            for p in group:
                p.answer.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each submitter's error, as if alone
            for p in group:
                _settle(p, exc=exc)
            return
        if not ok or entry is None:  # a compare failed: nothing was written; each alone
            await asyncio.gather(*(self._alone(p) for p in group))
            return
        for p in group:
            put = next(op for op in p.ops if isinstance(op, Put) and op.key == p.read)
            _settle(p, (True, Entry(p.read, put.value, entry.mod_revision, entry.mod_revision, 0)))

    async def _alone(self, p: _Pending) -> None:
        self.transactions += 1
        try:
            _settle(p, await self.kv.commit_read(p.expect, p.ops, p.read))
        except asyncio.CancelledError:
            p.answer.cancel()
            raise
        except Exception as exc:  # noqa: BLE001
            _settle(p, exc=exc)


def _settle(p: _Pending, result: tuple[bool, Entry | None] | None = None,
            exc: BaseException | None = None) -> None:
    if p.answer.done():  # its submitter is gone (cancelled): nobody waits for the answer
        return
    if exc is not None:
        p.answer.set_exception(exc)
    else:
        p.answer.set_result(result)

