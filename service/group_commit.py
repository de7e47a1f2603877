"""Submissions written several to one etcd transaction (group commit).

A submit is one transaction: the job record, its first event and its Idempotency-Key
(if any), each compared absent, the record read back for its revision (read-your-writes).
Under a burst of submissions every one of them was its own gRPC call and etcd
round trip, on the event loop that also answers the requests. `GroupCommit` writes them
together through the control plane's one write batcher (`service.batching.Batcher`): a
transaction that finds nothing waiting goes out at once, as before (no wait added when
submissions are few); those that come while MAX_IN_FLIGHT transactions are in flight wait
for one of them to end and then go out together, in one transaction of as many as fit
(`service.batching.TxnRoom`: MAX_TXN_OPS operations, MAX_BATCH_BYTES, no key twice). Each
submitter is answered once the transaction that holds its writes was committed, with what it
would have had alone: whether it was written and its record as read back (every key of one
transaction has that transaction's revision). If any compare of a group fails (a repeated
Idempotency-Key, a job id taken), nothing of it was written and each of its transactions is
sent again alone, so each gets its own answer; an error (etcd away) is each one's error, as
it would have been.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from service.batching import Batcher, Failed, TxnRoom
from service.store.api import Delete, Entry, KeyValue, Put

MAX_IN_FLIGHT = 2  # transactions of submissions in flight at once

Answer = tuple[bool, Entry | None]


@dataclass(slots=True)
class _Create:
    expect: dict[str, int]
    ops: Sequence[Put | Delete]
    read: str


class GroupCommit:
    """`commit_read` of transactions that only create keys (each compares its keys absent,
    or at a revision, and reads one of the keys it puts), grouped (module doc)."""

    def __init__(self, kv: KeyValue):
        self.kv = kv
        self._batcher: Batcher[_Create, Answer] = Batcher(self._commit, max_in_flight=MAX_IN_FLIGHT,
                                                          room=TxnRoom)
        self.transactions = 0  # sent to the store (for tests and the bench)

    @property
    def grouped(self) -> int:
        """Transactions that held more than one submitter's writes."""
        return self._batcher.grouped

    async def commit_read(self, expect: dict[str, int], ops: Sequence[Put | Delete],
                          read: str) -> Answer:
        return await self._batcher.submit(_Create(expect, ops, read))

    async def _commit(self, group: list[_Create]) -> Sequence[Answer | Failed]:
        if len(group) == 1:
            return [await self._alone(group[0])]
        self.transactions += 1
        expect = {k: v for c in group for k, v in c.expect.items()}
        ok, entry = await self.kv.commit_read(expect, [op for c in group for op in c.ops], group[-1].read)
        if not ok or entry is None:  # a compare failed: nothing was written; each alone
            return await asyncio.gather(*(self._alone(c) for c in group))
        return [(True, Entry(c.read, _put_of(c).value, entry.mod_revision, entry.mod_revision, 0))
                for c in group]

    async def _alone(self, create: _Create) -> Answer | Failed:
        self.transactions += 1
        try:
            return await self.kv.commit_read(create.expect, create.ops, create.read)
        except Exception as exc:  # noqa: BLE001 - this submitter's error, as if alone
            return Failed(exc)


def _put_of(create: _Create) -> Put:
    return next(op for op in create.ops if isinstance(op, Put) and op.key == create.read)
