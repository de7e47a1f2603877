"""The one compare-and-set loop of the control plane.

Every write that depends on what was read goes through `update`: read, decide, and write
only if what was read is still what is stored, comparing each key's mod_revision (the
fencing token; 0: the key must be absent). A lost race is not an error: the loop reads
again and decides again on what is stored now, so a decision is never written over a
change it did not see. Only a key that keeps changing under the request, MAX_CAS_ATTEMPTS
times in a row, ends it with ContentionError (503: the client may retry).

`decide` is a pure function of what `read` returned: it answers `Done(result)` when
nothing is to be written (the change is already there, or the request is refused by
raising), or `Write(expect, ops, result)`: the fence, the operations, and what to answer
once they applied.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from service.errors import ContentionError
from service.store.api import Entry, KeyValue, Op

# Concurrent writers of one key (N agents `add`ing to one barrier counter): each round one
# of them wins, so this bounds how many may contend, not how often one may lose.
MAX_CAS_ATTEMPTS = 64

R = TypeVar("R")  # what `read` returns
T = TypeVar("T")  # what the caller is answered


@dataclass(frozen=True)
class Done(Generic[T]):
    """Nothing to write; answer `result`."""

    result: T


@dataclass(frozen=True)
class Write(Generic[T]):
    """Apply `ops` iff every key of `expect` is at that mod_revision (0: absent); answer `result`."""

    expect: dict[str, int]
    ops: Sequence[Op]
    result: T


async def update(kv: KeyValue, read: Callable[[], Awaitable[R]],
                 decide: Callable[[R], Done[T] | Write[T]], what: str,
                 written: Callable[[Entry], None] | None = None) -> T:
    """Read, decide and write by compare-and-set, re-reading and re-deciding on a lost race.

    `what` names the contended thing in the error ("job train-x1y2z3"). `written`: told of
    the first key a write compared, as that write left it (read back in its transaction:
    its mod_revision is the write's revision), e.g. to show a cache its own writes at once.
    """
    for _ in range(MAX_CAS_ATTEMPTS):
        outcome = decide(await read())
        if isinstance(outcome, Done):
            return outcome.result
        if written is None:
            if await kv.commit(outcome.expect, outcome.ops):
                return outcome.result
            continue
        key = next(iter(outcome.expect))
        ok, entry = await kv.commit_read(outcome.expect, outcome.ops, key)
        if ok:
            if entry is not None:
                written(entry)
            return outcome.result
    raise ContentionError(f"{what} changed {MAX_CAS_ATTEMPTS} times while this request tried to "
                          "change it; retry the request")
