"""Writes that go to etcd together: one queue (`Batcher`) and one rule of what fits in a
transaction (`TxnRoom`), shared by every batched writer of the control plane.

The contract of `Batcher`: a request goes out at once while fewer than `max_in_flight` sends
are in flight (no wait added when requests are few); those that come meanwhile queue, and
the next free sender takes them, oldest first, as many as its room lets into one group
(all of them without a room), and sends them together. Each caller is answered with its
own result (`send` returns one a request, in order; a `Failed` is that caller's error), or
with the send's error if the whole send raised. A request whose caller is gone (cancelled)
before its group is taken is not sent. What a group that loses a compare does is the
sender's: each writer below says it.

Its users:

- submissions (`service.group_commit.GroupCommit`, under `JobStore.create_at`): up to two
  transactions in flight, a group is as many submissions as one transaction holds
  (`TxnRoom`, no key twice); a group that loses a compare is sent again one by one, so each
  submitter gets its own answer;
- rendezvous state writes (`service.rendezvous.StateHub`): one `Batcher` per state key, one
  send in flight (a second compare-and-set of the same key would only lose to the first), a
  group is every write waiting (they merge into one new state: one put, whatever their
  number); a group that loses its compare-and-set to another replica is applied again to
  what won.

`JobStore.write_many` (a scheduler pass's plans) and `JobStore.delete_finished` have all their
writes in hand, from one caller, before the first is sent: there is nothing to queue, so they
take `TxnRoom` only (`pack`), and send the groups one after the other. A group of
`write_many` that loses a compare is left to the caller, which decides on those jobs again
(`update`); `delete_finished` reads its group again and deletes the jobs that did not change.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from service.store.api import MAX_TXN_OPS, Delete, Put

# Bytes of values in one transaction (etcd refuses a request over 1.5 MiB by default; a job
# record may hold a 64 KiB spec).
MAX_BATCH_BYTES = 512 * 1024

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Failed:
    """A request's own error, in the results of a send (its caller raises it)."""

    error: Exception


class Room(Protocol[T]):
    """What one group may still take (a new one for each group)."""

    def take(self, item: T) -> bool:
        """Count `item` in and say True if it fits (the first item of a group always does)."""
        ...


class Batcher(Generic[T, R]):
    """Requests sent in groups by `send`, at most `max_in_flight` sends at once (module doc)."""

    def __init__(self, send: Callable[[list[T]], Awaitable[Sequence[R | Failed]]], *,
                 max_in_flight: int = 1, room: Callable[[], Room[T]] | None = None,
                 on_idle: Callable[[], None] | None = None):
        self._send = send
        self._max_in_flight = max_in_flight
        self._room = room  # a new Room for each group; None: a group takes all that wait
        self._on_idle = on_idle  # called when the last send ends with nothing waiting
        self._waiting: collections.deque[tuple[T, asyncio.Future]] = collections.deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self.sends = 0  # groups sent (the bench, the tests)
        self.grouped = 0  # of them, those of more than one request

    async def submit(self, item: T) -> R:
        """`item`'s result, once the group that holds it was sent."""
        answer = asyncio.get_running_loop().create_future()
        self._waiting.append((item, answer))
        if self._in_flight < self._max_in_flight:
            self._in_flight += 1
            task = asyncio.create_task(self._sender())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await answer

    async def _sender(self) -> None:
        try:
            while self._waiting:
                if group := self._take():
                    await self._deliver(group)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                while self._waiting:  # this sender was cancelled and no other is left
                    self._waiting.popleft()[1].cancel()
                if self._on_idle is not None:
                    self._on_idle()

    def _take(self) -> list[tuple[T, asyncio.Future]]:
        """The waiting requests, oldest first, as many as fit in one group."""
        group: list[tuple[T, asyncio.Future]] = []
        room = self._room() if self._room is not None else None
        while self._waiting:
            item, answer = self._waiting[0]
            if answer.done():  # its caller is gone: not sent
                self._waiting.popleft()
                continue
            if room is not None and not room.take(item):
                break
            group.append(self._waiting.popleft())
        return group

    async def _deliver(self, group: list[tuple[T, asyncio.Future]]) -> None:
        self.sends += 1
        self.grouped += len(group) > 1
        try:
            results = await self._send([item for item, _ in group])
        except asyncio.CancelledError:
            for _, answer in group:
                answer.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every caller of the group gets it (etcd away)
            for _, answer in group:
                if not answer.done():
                    answer.set_exception(exc)
            return
        for (_, answer), result in zip(group, results, strict=True):
            if answer.done():  # its caller is gone: nobody waits for the answer
                continue
            if isinstance(result, Failed):
                answer.set_exception(result.error)
            else:
                answer.set_result(result)


class TxnPart(Protocol):
    """A request's share of a transaction: its compares and its operations."""

    @property
    def expect(self) -> Mapping[str, int]: ...

    @property
    def ops(self) -> Sequence[Put | Delete]: ...


class TxnRoom:
    """What one etcd transaction may still take: MAX_TXN_OPS operations (a read back
    counted) and compares (`shared` compares, e.g. the leader's fence, counted once),
    MAX_BATCH_BYTES of values, and no key twice (etcd refuses a transaction that names
    one key in two operations)."""

    def __init__(self, *, shared: int = 0, reads: int = 1, distinct: bool = True):
        self.ops = reads
        self.compares = shared
        self.size = 0
        self.keys: set[str] | None = set() if distinct else None
        self.empty = True

    def take(self, part: TxnPart) -> bool:
        size = 0
        keys = None if self.keys is None else set(part.expect)
        for op in part.ops:  # (one pass: a scheduler pass takes thousands of parts)
            if isinstance(op, Put):
                size += len(op.value)
            if keys is not None:
                keys.add(op.key)
        if not self.empty and (self.ops + len(part.ops) > MAX_TXN_OPS
                               or self.compares + len(part.expect) > MAX_TXN_OPS
                               or self.size + size > MAX_BATCH_BYTES
                               or (keys is not None and not keys.isdisjoint(self.keys))):
            return False
        self.ops += len(part.ops)
        self.compares += len(part.expect)
        self.size += size
        if keys is not None:
            self.keys |= keys
        self.empty = False
        return True


def pack(parts: Iterable[T], room: Callable[[], Room[T]]) -> Iterator[list[T]]:
    """`parts` in order, in groups that each fit one room (a part alone always makes a group).
    Lazy: a part is taken from `parts` only when the group before it is still open."""
    group: list[T] = []
    current = room()
    for part in parts:
        if not current.take(part):
            yield group
            group, current = [], room()
            current.take(part)
        group.append(part)
    if group:
        yield group
