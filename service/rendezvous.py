"""torch rendezvous state and c10d store keys of one job attempt, in etcd.

The control plane is the rendezvous: torch's `DynamicRendezvousHandler` on every node agent
keeps its state through `worker.rendezvous.FtrainRendezvousBackend` and its small c10d store
through `worker.rendezvous.HttpStore`, both HTTP clients of the routes in
`service.routes.rendezvous`, which are thin wrappers around `Rendezvous` here.

State. The pickled `_RendezvousState` is kept at `keys.rdzv_state(id)`, sealed by the client
(`worker.protocol.seal_state`: a header and the pickle's SHA-256; a write that is not sealed
is refused with 422, and a client that reads a state whose seal does not open raises torch's
`RendezvousStateError`); the pickle itself is never unpickled here. Its fencing token is
that key's `mod_revision`. `set_state` is one transaction that compares the
revision (0: only if absent) and reads the key back in the same transaction, so the caller
gets the token it wrote, or the state and token that won the race, atomically.

Store. Each c10d key is stored at `keys.rdzv_store(id) + base64url(key)`, so any key torch
uses (with `/`, spaces, anything) is a valid, unambiguous etcd key. Read-modify-writes
(`add`, `append`, `compare_set`, `delete`) go through `service.store.cas.update`. `add` and `append` are
not idempotent, yet a client retries a request whose answer it lost (the control plane was
restarted mid-request); such requests carry an `op_id`, and the result is recorded at
`keys.rdzv(id) + "ops/<op_id>"` in the same transaction, so a retry returns the first
result instead of adding twice (a barrier that counts one agent twice would release early).

Blocking reads (`get`, `multi_get`, `wait`) are long polls: a request waits at most
`long_poll_s` on the server (`worker.protocol.Timeouts`, which every node is given when it
registers and hands to its torchrun) and answers "not yet"; the client asks again until its
own store timeout. A short wait per request keeps a control-plane restart or a lost connection cheap
(the client just asks again) and no request outlives uvicorn's graceful shutdown for long.
While keys are missing the server waits on an etcd watch of the store's prefix, one per
store and control plane shared by all its waiting reads (`StateHub.key_waits`), started
after a revision read before the waiter's own read of its keys, so no write in between is
lost. A watch (rather than polling etcd every few ms) wakes the waiter within a millisecond
of the write and costs etcd nothing while nothing changes: agents sit in the exit barrier for
up to `exit_barrier_timeout` (300 s by default), and N agents polling for minutes would be N
steady reads a tick for nothing; and one watch, not one a waiting read: a round's N nodes
all ask for the master's address at once.

Merged writes. A `set_state` does not go to etcd by itself: the writes to one state that reach
this control plane while its previous write is in flight wait, and go together as one batch
(`StateHub`, a `service.batching.Batcher` per state): one etcd read, then every write
applied in order, then one compare-and-set.
A plain write (a token and a whole state) applies iff its token is the state's and nothing
before it in the batch changed the state: torch's compare-and-set, unchanged. A write that
carries its change as ops (`merge`, a version-2 state: `worker.rdzv_state`) applies to the
state as the batch found it or left it, stale token or not, wherever torch would have decided
the same action; each is answered with the batch's result and whether it was applied. So N
nodes joining at once cost a few batches, not N^2/2 lost compare-and-sets; the waiters see
a few changes, not N. With several replicas each batches its own requests; a batch whose
compare-and-set loses to another replica's is applied again to what won.

The state has a long poll too (`wait_for_state_change`): an agent waiting for other nodes
asks "answer when the token is no longer the one I saw", and a watch of the state key answers
it within a millisecond of another node's write instead of at torch's next one-second poll
(see `worker.rendezvous`). All the long polls on one state share one watch per control plane
(`StateHub.wait`): it reads the state once per change and hands that to every waiter, and a
batch written here is handed to them at once; so N waiting nodes cost etcd one watch and one
read a change, not N of each. A waiter that says what the state it holds looks like apart
from heartbeats (`shape`, `worker.rdzv_state.RdzvDoc.shape`) sleeps through changes that
are only other nodes' keep-alives: N joined nodes beat N/5 times a second, and waking every
waiter at each beat was N^2/5 answers a second; torch looks at heartbeats only against the
clock, and the wait still ends within torch's one-second poll.

Keep-alives of waiting nodes. A node that has joined an open round has nothing to do but wait
for the round to complete, yet torch makes it write a keep-alive every `keep_alive_interval`
(5 s), each a read and a write of the whole state by that node: in a round of N nodes that
takes longer than the interval, N/5 writes and 2N/5 decodes of an N-node state a second, which
on a 1,024-node round outgrew the machine. So a long poll may name its node (`alive`) and its
interval: while it is held (or was, within `ALIVE_GRACE_S`) this control plane writes that
node's keep-alive itself when torch would (the heartbeat `beat_s` old), the held polls'
keep-alives batched into one write a tick (`KEEP_ALIVE_TICK_S`), and answers "kept alive"; a
poll that ends with nothing changed then comes back without the state, and the node polls again
(`worker.rendezvous.backend`) instead of decoding the state and writing its own keep-alive. A
node whose process dies or stops holds no poll, is kept alive no longer, and expires by
torch's rules, as before. A node that is not in the state is not kept alive (the answer says so).

Keep-alives of a formed round. Once a round is complete, every node's torch handler writes a
keep-alive into the state every `keep_alive_interval` for as long as the group trains: N/5 writes
a second for N nodes at torch's 5 s, each a read and a compare-and-set of the whole N-node state
(~86 KB at 1,024), which batches of writes in flight merged only as far as the machine was slow
(measured: 18 batches a second at 256 nodes on 2 cores, 0.3 MB/s into etcd and 15% of a core on
the control plane; about 1.5-17 MB/s into etcd at 1,024). So a write that is only its node's
keep-alive (one `keep_alive` op), of a node of a round this control plane knows is complete (its
watch of the state, kept `BEATS_WATCH_S` after the last such write), waits for the other nodes'
(`StateHub.keep_alive`): they go together as one batch (`submit`), the batches started
`BEATS_GAP_PER_NODE_S` (1 ms) a node of the state apart, at most `BEATS_GAP_S` (0.5 s). A
write of the state is ~70 bytes a node, so a job's keep-alives write at most ~70 KB a second to
etcd below 500 nodes and two states a second above (~170 KB/s at 1,024; before: up to N/5
states a second), while a job of a few nodes waits a few milliseconds. Each is answered after
the write that carries it commits, with that write's state, as before (a gap later at most, on a
machine that keeps up: a node's
keep-alive waits 3 s for an answer and retries for 3 s, `worker.rendezvous.outage`, and torch
drops a node only after interval x attempts, 15 s). A keep-alive in an open round, or with other ops (a
dropped node), goes at once. Nothing is written for a node that sends none: a dead node expires
by torch's rules. A batch whose compare-and-set loses to another replica's is applied again.
While this control plane follows a state (that watch, or the long polls'), a plain read (torch's
`get_state`: each keep-alive reads before it writes, and torchrun's monitor once a second) is
answered from it (`Rendezvous.read_state`), not with an etcd read of the N-node state each; as
the long polls are, so a write through another replica shows a watch event later (torch's
compare-and-set and the merges hold on a stale token), and a write here at once. Not while
this control plane hears nothing from etcd (`KeyValue.check_contact`): then it answers 503 and
the node asks another replica, as for every answer from memory.

Fencing of attempts. Every rendezvous id names its job attempt (`<job id>-a<attempt>`) and
the routes refuse (410) any id whose attempt is not the job's current one. The check and the
write are two etcd requests, not one transaction (comparing the job key's revision would make
every progress report of the job abort rendezvous writes); this is safe because each attempt
has its own keys: a stale agent that slips through the window writes only into its own,
dead, attempt's keys, never into the current one's. The check takes the job from the watch-fed
job index where that answers (`service.routes.rendezvous._cached_job`), which widens the
window by a watch event's delay and changes nothing else: a refusal (410) rests only on an
attempt newer than the caller's, which the index never shows early. The keys of a job's earlier
attempts are dead once a request of a newer one passes that check: the first such request a
control plane sees deletes them in the background (`StateHub.attempt_seen`); the job's end
deletes the rest.

Rounds of one attempt. Within an attempt torch re-forms the group after a worker failure
(torchrun's `--max-restarts`) in a new rendezvous round, and its handler keeps each round's
store keys under their own prefix (`torch.rendezvous.<run id>.<round>/`: the master's address
and port, ...); those of earlier rounds are never read again, yet they stayed until the attempt
ended: a job that runs for months in one attempt kept two or more keys a restart. So when group
rank 0 reports the round it formed (`POST /v1/jobs/{id}/rounds`, 'joined'), the store keys of
the attempt's earlier rounds are deleted in the background (`StateHub.round_seen`). A key not
named like a round's is left to the attempt's end.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from service.batching import Batcher
from service.errors import FtrainError, StaleLeader
from service.keys import Keys
from service.store import cas
from service.store.api import MAX_TXN_OPS, PAGE_SIZE, Delete, Entry, KeyValue, Put
from worker.protocol import StateNotSealed, open_state, seal_state, state_version
from worker.rdzv_state import MergeSpec, Node, NotAState, Op, RdzvDoc, apply_ops, end_last_call

log = logging.getLogger(__name__)

WATCH_LINGER_S = 2.0  # a state's watch outlives its last long poll by this much
KEEP_ALIVE_TICK_S = 1.0  # how often the held polls' nodes are looked at (keep-alives of waiters)
ALIVE_GRACE_S = 2.0  # a node between two polls (it re-polls at once) counts as holding one
MAX_ENCODED = 64  # states kept encoded (`StateHub.encoded`): a few revisions of a few rounds
BATCH_ATTEMPTS = 20  # a batch's compare-and-sets lost to other replicas before it gives up
# Keep-alives of a formed round's nodes (`StateHub.keep_alive`): the writes that carry them
# start BEATS_GAP_PER_NODE_S a node of the state apart, at most BEATS_GAP_S (a write of the
# state is ~70 B a node: at most ~70 KB/s into etcd below 500 nodes, 2 writes a second above);
# the state's watch is kept BEATS_WATCH_S after the last one (their interval is 5 s by default).
BEATS_GAP_PER_NODE_S = 0.001
BEATS_GAP_S = 0.5
BEATS_WATCH_S = 30.0

_RDZV_ID = re.compile(r"^(?P<job>[a-z0-9][-a-z0-9]*)-a(?P<attempt>[0-9]{1,9})$")
_OP_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class RendezvousGone(FtrainError):
    """The rendezvous belongs to an attempt that is over (a newer one started, or the job ended)."""

    status_code = 410


class InvalidRendezvousId(FtrainError):
    status_code = 404

    def __init__(self, rdzv_id: str):
        super().__init__(f"{rdzv_id!r} is not a rendezvous id; expected '<job id>-a<attempt>', "
                         "as in the job's FTRAIN_RDZV_ID")


class StoreValueError(FtrainError):
    """A store operation does not fit the value stored (e.g. `add` to a non-integer)."""

    status_code = 409


def parse_rdzv_id(rdzv_id: str) -> tuple[str, int]:
    """'train-x1y2z3-a4' -> ('train-x1y2z3', 4)."""
    match = _RDZV_ID.match(rdzv_id)
    if match is None:
        raise InvalidRendezvousId(rdzv_id)
    return match["job"], int(match["attempt"])


def _encode_key(key: str) -> str:
    return base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")


def _decode_key(encoded: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


_ROUND_KEY = re.compile(r"^torch\.rendezvous\.(?P<run>.+)\.(?P<round>[0-9]{1,9})/")


def round_of_store_key(rdzv_id: str, key: str) -> int | None:
    """The rendezvous round of a c10d store key of `rdzv_id` as torch's handler names it
    (`torch.rendezvous.<run id>.<round>/<key>`: its PrefixStore), or None."""
    match = _ROUND_KEY.match(key)
    return int(match["round"]) if match is not None and match["run"] == rdzv_id else None


async def delete_rounds_before(kv: KeyValue, keys: Keys, rdzv_id: str, round_: int) -> int:
    """Delete the store keys of `rdzv_id`'s rounds before `round_` (the module's docstring,
    "Rounds of one attempt"); returns how many went."""
    prefix = keys.rdzv_store(rdzv_id)
    doomed = []
    async for entry in kv.scan_prefix(prefix, page_size=PAGE_SIZE, keys_only=True):
        key = _decode_key(entry.key[len(prefix):])
        if key is not None and (r := round_of_store_key(rdzv_id, key)) is not None and r < round_:
            doomed.append(entry.key)
    for start in range(0, len(doomed), MAX_TXN_OPS):
        await kv.commit({}, [Delete(k) for k in doomed[start:start + MAX_TXN_OPS]])
    return len(doomed)


@dataclass
class _Write:
    state: bytes | None  # sealed; None for a merge
    token: str | None
    merge: MergeSpec | None
    expected_nodes: int = 0  # the job's live members as the writer's request saw them (0: unknown)


@dataclass
class _Watched:
    """One state key's long polls on this control plane: the latest state seen, and an event
    set (and replaced) at each change."""

    entry: Entry | None = None
    shape: str | None = None  # `RdzvDoc.shape` of `entry`, if a version-2 state
    progress: str | None = None  # `RdzvDoc.progress` of it, ditto
    known: bool = False
    # Set (and replaced) at each change of the state; of its shape (`RdzvDoc.shape`); of its
    # progress (`RdzvDoc.progress`). A poll waits on the one its condition needs, so a joined
    # node's poll (progress) sleeps through the other nodes' joins and keep-alives, and a
    # shape poll through keep-alives: N waiters woken at every write of a round were N^2 wakes.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    reshaped: asyncio.Event = field(default_factory=asyncio.Event)
    progressed: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0
    task: asyncio.Task | None = None
    doc: RdzvDoc | None = None  # `entry` as data, if a version-2 state
    # The nodes of held polls that asked to be kept alive: node -> [polls held now, when the
    # last one ended (loop time), its keep-alive interval s]; and the task that keeps them.
    alive: dict[Node, list] = field(default_factory=dict)
    keeper: asyncio.Task | None = None
    # Keep-alives of a formed round's nodes waiting for the next write that carries them
    # (`StateHub.keep_alive`), the task that sends them, its writes' allowance (a token bucket:
    # writes it may send now, and when it was last topped up, loop time), and until when
    # (loop time) the watch is kept for them with no poll held.
    beats: list[tuple[_Write, asyncio.Future]] = field(default_factory=list)  # and their answers
    beats_sender: asyncio.Task | None = None
    beats_sent: float = float("-inf")  # when the last write of them started (loop time)
    beats_until: float = 0.0
    rechecking: bool = False  # a look at dropping the watch is due then (one, however many ended)

    def publish(self, entry: Entry | None) -> None:
        if self.known and self.entry is not None and entry is not None \
                and entry.mod_revision <= self.entry.mod_revision:
            return  # not newer (the watch and a batch of this replica both tell of a write)
        if self.known and self.entry is None and entry is None:
            return
        doc = None if entry is None else _doc(entry.value)
        was_known, shape, progress = self.known, self.shape, self.progress
        self.entry, self.shape, self.known, self.doc = entry, None if doc is None else doc.shape(), True, doc
        self.progress = None if doc is None else doc.progress()
        self.changed.set()
        self.changed = asyncio.Event()
        if not was_known or self.shape != shape or self.shape is None:
            self.reshaped.set()
            self.reshaped = asyncio.Event()
        if not was_known or self.progress != progress or self.progress is None:
            self.progressed.set()
            self.progressed = asyncio.Event()


@dataclass
class _KeyWaits:
    """The blocking store reads of one rendezvous on this control plane that wait for keys,
    and the one etcd watch of its store's prefix that wakes them (`StateHub.key_waits`)."""

    start: asyncio.Future  # the revision the watch starts after (read once, by the first)
    waiters: dict[asyncio.Future, frozenset[str]] = field(default_factory=dict)
    task: asyncio.Task | None = None
    ended: bool = False

    def wake(self, key: str | None) -> None:
        """Wake the waiters for `key` (None: all of them: the watch ended, they read again)."""
        for done, keys in self.waiters.items():
            if not done.done() and (key is None or key in keys):
                done.set_result(None)


class StateHub:
    """The rendezvous state writes of this control plane waiting for the batch in flight, and
    its long polls waiting for a change, per state key (module docstring); one per control
    plane (`Context.rdzv_states`)."""

    def __init__(self) -> None:
        self._watched: dict[str, _Watched] = {}
        # state key -> its writes waiting for the batch in flight (`submit`)
        self._batchers: dict[str, Batcher[_Write, tuple[Entry | None, bool]]] = {}
        self._encoded: dict[tuple[str, int], str] = {}  # (key, mod_revision) -> base64 of the value
        self._live_members: dict[str, tuple[object, int]] = {}  # job id -> (its record, live members)
        self._key_waits: dict[str, _KeyWaits] = {}  # store prefix -> its waiting reads
        self._attempts: dict[str, int] = {}  # job id -> the newest attempt seen here (`attempt_seen`)
        self._sweeps: set[asyncio.Task] = set()
        self.store_watches = 0  # etcd watches of store prefixes started (for the tests)
        # Written batches and the writes they carried; waits of long polls (one per poll and
        # per wake-up that did not answer it): GET /metrics, for the bench.
        self.batches = 0
        self.writes = 0
        self.wakes = 0

    def attempt_seen(self, kv: KeyValue, keys: Keys, job_id: str, attempt: int) -> None:
        """A request of `attempt` of `job_id` passed the attempt check: the first time this
        control plane sees an attempt newer than its first, delete the keys of the job's
        earlier attempts in the background. They are dead (every request of an older attempt
        is refused 410) and were kept until the job ended: a job that runs for months and
        restarts often kept about five keys a restart."""
        known = self._attempts.get(job_id)
        if known is not None and known >= attempt:
            return
        if len(self._attempts) >= MAX_ENCODED * 16:
            self._attempts.clear()
        self._attempts[job_id] = attempt
        if attempt == 0:  # (a job's first attempt is 0)
            return
        self._background(self._sweep(kv, keys, job_id, attempt))

    def _background(self, work) -> None:
        """Run a sweep beside the request, keeping it referenced until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self._sweeps.add(task)
        task.add_done_callback(self._sweeps.discard)

    @staticmethod
    async def _sweep(kv: KeyValue, keys: Keys, job_id: str, attempt: int) -> None:
        try:
            await delete_rendezvous(kv, keys, job_id, below=attempt)
        except FtrainError as exc:  # etcd away: the job's end deletes them, as before
            log.info("earlier attempts' rendezvous keys of %s left: %s", job_id, exc)

    def round_seen(self, kv: KeyValue, keys: Keys, rdzv_id: str, round_: int) -> None:
        """Group rank 0 of `rdzv_id` formed round `round_`: delete the store keys of its
        earlier rounds in the background (module docstring, "Rounds of one attempt")."""
        if round_ <= 0:
            return
        self._background(self._sweep_rounds(kv, keys, rdzv_id, round_))

    @staticmethod
    async def _sweep_rounds(kv: KeyValue, keys: Keys, rdzv_id: str, round_: int) -> None:
        try:
            if n := await delete_rounds_before(kv, keys, rdzv_id, round_):
                log.debug("deleted %d store key(s) of %s's rounds before %d", n, rdzv_id, round_)
        except FtrainError as exc:  # etcd away: the attempt's end deletes them
            log.info("store keys of %s's rounds before %d left: %s", rdzv_id, round_, exc)

    def live_members(self, job) -> int:
        """How many of `job`'s members are live (`Rendezvous.expected_nodes`), counted once per
        record: the index hands every request of a round the same record object."""
        known = self._live_members.get(job.id)
        if known is not None and known[0] is job:
            return known[1]
        if len(self._live_members) >= MAX_ENCODED:
            self._live_members.clear()
        count = sum(1 for m in job.members.values() if m.is_live())
        self._live_members[job.id] = (job, count)
        return count

    def encoded(self, entry: Entry) -> str:
        """The state `entry` as it travels (base64), made once per revision: a round's N nodes
        read the same few revisions (the last one by all N at once), each up to N nodes' size."""
        known = (entry.key, entry.mod_revision)
        text = self._encoded.get(known)
        if text is None:
            if len(self._encoded) >= MAX_ENCODED:
                del self._encoded[next(iter(self._encoded))]  # the oldest
            text = self._encoded[known] = base64.b64encode(entry.value).decode()
        return text

    async def submit(self, key: str, apply: Callable[[list[_Write]], Awaitable[list]],
                     write: _Write) -> tuple[Entry | None, bool]:
        """`write`'s result, once the batch that holds it was written: one batch of a state in
        flight here, and every write to it that came meanwhile in the next
        (`service.batching.Batcher`; `apply` merges a batch into one compare-and-set)."""
        batcher = self._batchers.get(key)
        if batcher is None:
            def idle() -> None:
                if self._batchers.get(key) is batcher:
                    del self._batchers[key]

            batcher = self._batchers[key] = Batcher(lambda batch: self._write(key, apply, batch),
                                                    on_idle=idle)
        return await batcher.submit(write)

    async def _write(self, key: str, apply: Callable[[list[_Write]], Awaitable[list]],
                     batch: list[_Write]) -> list[tuple[Entry | None, bool]]:
        results = await apply(batch)
        self.batches += 1
        self.writes += len(batch)
        if key in self._watched and any(applied for _, applied in results):
            self._watched[key].publish(results[0][0])  # waiters here learn it at once
        return results

    async def wait(self, kv: KeyValue, key: str, after: str, wait_s: float,
                   shape: str | None = None, progress: str | None = None,
                   alive: tuple[Node, float, Callable[[list[_Write]], Awaitable[list]]] | None = None,
                   ) -> tuple[Entry | None, bool]:
        """The state at `key` once its token is no longer `after` (and, given the `shape` of
        the state at `after`, once it differs in more than heartbeats), waiting up to
        `wait_s`; and whether its token changed. Given the `progress` of the state at `after`
        (a node that joined an open round), only once that differs. Every wait on one key
        shares one etcd watch (`_follow`). `alive`: (node, its keep-alive interval s, the
        batch writer): the node is kept alive while it waits (module docstring)."""
        watched = self._watch(kv, key)
        watched.waiters += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        if alive is not None:
            node, beat_s, apply = alive
            held = watched.alive.setdefault(node, [0, 0.0, beat_s])
            held[0], held[2] = held[0] + 1, beat_s
            if watched.keeper is None:
                watched.keeper = loop.create_task(self._keep_alive(key, watched, apply))
        try:
            while True:
                if watched.known and state_token(watched.entry) != after \
                        and (shape is None or watched.shape != shape) \
                        and (progress is None or watched.progress != progress):
                    return watched.entry, True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                event = watched.changed if not watched.known else \
                    watched.progressed if progress is not None else \
                    watched.reshaped if shape is not None else watched.changed
                self.wakes += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(event.wait(), remaining)
        finally:
            if alive is not None:
                held = watched.alive[alive[0]]
                held[0], held[1] = held[0] - 1, loop.time()
            watched.waiters -= 1
            if watched.waiters == 0:  # kept a moment: the waiters it just answered ask again
                loop.call_later(WATCH_LINGER_S, self._drop_unwatched, key, watched)
        entry = watched.entry if watched.known else await kv.get(key)
        # A kept-alive node's poll that timed out: nothing it waits for changed (its answer
        # then comes without the state, `service.routes.rendezvous`).
        return entry, alive is None and state_token(entry) != after

    def latest(self, key: str) -> tuple[bool, Entry | None]:
        """Whether this control plane follows the state at `key` (a watch under way that has read
        it), and the state as the watch last saw it (or a batch here wrote it)."""
        watched = self._watched.get(key)
        return (False, None) if watched is None or not watched.known else (True, watched.entry)

    def _watch(self, kv: KeyValue, key: str) -> _Watched:
        """The long polls' view of the state at `key`, fed by one etcd watch (`_follow`)."""
        watched = self._watched.get(key)
        if watched is None:
            watched = self._watched[key] = _Watched()
            watched.task = asyncio.get_running_loop().create_task(self._follow(kv, key, watched))
        return watched

    async def keep_alive(self, kv: KeyValue, key: str, apply: Callable[[list[_Write]], Awaitable[list]],
                         write: _Write) -> tuple[Entry | None, bool]:
        """`write`, a state write (`submit`); if it is only its node's keep-alive in a round that
        is complete, it waits to go with the other nodes' keep-alives (module docstring): the
        writes that carry them start a millisecond a node apart, at most BEATS_GAP_S."""
        node = _keep_alive_of(write.merge)
        if node is None:
            return await self.submit(key, apply, write)
        loop = asyncio.get_running_loop()
        known = key in self._watched
        watched = self._watch(kv, key)
        watched.beats_until = loop.time() + BEATS_WATCH_S
        if not known:  # kept while keep-alives come (`_drop_unwatched`); the next one knows the round
            self._drop_unwatched(key, watched)
        doc = watched.doc
        if doc is None or not doc.complete or doc.closed or node not in doc.participants:
            return await self.submit(key, apply, write)  # a round under way: at once, as before
        answer = loop.create_future()
        watched.beats.append((write, answer))
        if watched.beats_sender is None:
            watched.beats_sender = loop.create_task(self._send_beats(key, watched, apply))
        return await answer

    async def _send_beats(self, key: str, watched: _Watched,
                          apply: Callable[[list[_Write]], Awaitable[list]]) -> None:
        """Send the keep-alives queued on `watched`, all that are there at each write, the writes
        started BEATS_GAP_PER_NODE_S a node apart (at most BEATS_GAP_S): a job of two nodes waits
        2 ms at most, and the bytes a second that a job's keep-alives write to etcd stay
        bounded whatever its size (one of a thousand nodes: two writes a second, not two hundred)."""
        loop = asyncio.get_running_loop()
        try:
            while watched.beats:
                nodes = 0 if watched.doc is None else len(watched.doc.last_heartbeats)
                wait = watched.beats_sent + min(BEATS_GAP_S, nodes * BEATS_GAP_PER_NODE_S) - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                watched.beats_sent = loop.time()
                beats, watched.beats = watched.beats, []
                await asyncio.gather(*(self._answer(key, apply, *beat) for beat in beats))
        finally:
            watched.beats_sender = None
            if watched.beats:  # cancelled (the watch dropped) with some queued: they go at once
                beats, watched.beats = watched.beats, []
                for beat in beats:
                    loop.create_task(self._answer(key, apply, *beat))

    async def _answer(self, key: str, apply: Callable[[list[_Write]], Awaitable[list]],
                      write: _Write, answer: asyncio.Future) -> None:
        """Submit a queued keep-alive and hand its result (or error) to its caller's `answer`."""
        try:
            result = await self.submit(key, apply, write)
        except asyncio.CancelledError:  # the sender was cancelled: so is its caller's wait
            answer.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - its caller's error (a 503 when etcd is away)
            if not answer.done():
                answer.set_exception(exc)
        else:
            if not answer.done():
                answer.set_result(result)

    @contextlib.asynccontextmanager
    async def key_waits(self, kv: KeyValue, prefix: str, keys: frozenset[str]):
        """Wait for a write of one of `keys` (etcd keys under `prefix`): yields a future that is
        done once one of them is written after the block's start (or the watch ended: read
        again). Every wait on one prefix shares one etcd watch per control plane, started
        after a revision read before the first waiter's; a waiter reads its keys inside the
        block, so any write after that read wakes it. A round's N nodes all wait for the
        master's address at once: N watches of etcd before, one now."""
        waits = self._key_waits.get(prefix)
        if waits is None or waits.ended:
            waits = self._key_waits[prefix] = _KeyWaits(asyncio.get_running_loop().create_future())
            waits.task = asyncio.get_running_loop().create_task(self._follow_keys(kv, prefix, waits))
        done = asyncio.get_running_loop().create_future()
        waits.waiters[done] = keys
        try:
            await asyncio.shield(waits.start)  # the watch starts after this revision
            yield done
        finally:
            del waits.waiters[done]
            if not waits.waiters:
                asyncio.get_running_loop().call_later(WATCH_LINGER_S, self._drop_key_waits, prefix, waits)

    def _drop_key_waits(self, prefix: str, waits: _KeyWaits) -> None:
        if not waits.waiters and self._key_waits.get(prefix) is waits:
            del self._key_waits[prefix]
            waits.ended = True
            assert waits.task is not None
            waits.task.cancel()

    async def _follow_keys(self, kv: KeyValue, prefix: str, waits: _KeyWaits) -> None:
        """The watch of `prefix`: wakes the waiters of each key written; when it ends (etcd
        away, history compacted, its session over), every waiter reads again and the next
        wait starts another."""
        try:
            revision = await kv.revision()
            waits.start.set_result(revision)
            self.store_watches += 1
            events = kv.watch_prefix(prefix, revision + 1)
            async with contextlib.aclosing(events):
                async for event in events:
                    if event.value is not None:
                        waits.wake(event.key)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the waiters read again (and raise, if etcd is away)
            if not waits.start.done():
                waits.start.set_exception(exc)
        finally:
            waits.ended = True
            if self._key_waits.get(prefix) is waits:
                del self._key_waits[prefix]
            waits.wake(None)

    def kept_alive(self, key: str, node: Node) -> bool:
        """Whether `node` is kept alive by this control plane's polls (it is in the state)."""
        watched = self._watched.get(key)
        return watched is not None and watched.doc is not None and node in watched.doc.last_heartbeats

    def _drop_unwatched(self, key: str, watched: _Watched, recheck: bool = False) -> None:
        if recheck:
            watched.rechecking = False
        if watched.waiters == 0 and self._watched.get(key) is watched:
            left = watched.beats_until - asyncio.get_running_loop().time()
            if left > 0 or watched.beats:  # keep-alives still come (`keep_alive`): look again then
                if not watched.rechecking:
                    watched.rechecking = True
                    asyncio.get_running_loop().call_later(max(left, WATCH_LINGER_S), self._drop_unwatched,
                                                          key, watched, True)
                return
            del self._watched[key]
            assert watched.task is not None
            watched.task.cancel()
            if watched.keeper is not None:
                watched.keeper.cancel()
            if watched.beats_sender is not None:
                watched.beats_sender.cancel()

    async def _keep_alive(self, key: str, watched: _Watched,
                          apply: Callable[[list[_Write]], Awaitable[list]]) -> None:
        """Each tick, write the keep-alives torch would have the nodes of held polls write
        (their heartbeats `beat_s` old), as one batch (module docstring)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(KEEP_ALIVE_TICK_S)
            now, doc = loop.time(), watched.doc
            for node in [n for n, (held, ended, _) in watched.alive.items()
                         if not held and now - ended > ALIVE_GRACE_S]:
                del watched.alive[node]
            if doc is None:
                continue
            now_us = time.time_ns() // 1000
            due = [node for node, (_, _, beat_s) in watched.alive.items()
                   if node in doc.last_heartbeats and doc.last_heartbeats[node] <= now_us - beat_s * 1e6]
            if not due:
                continue
            # min/max nodes matter only to joins and drops; a keep-alive applies iff the node
            # still has a heartbeat (one dropped meanwhile is left dropped).
            writes = [_Write(None, None, MergeSpec(ops=[Op(kind="keep_alive", node=node, at_us=now_us)],
                                                   min_nodes=1, max_nodes=1))
                      for node in due]
            await asyncio.gather(*(self.submit(key, apply, w) for w in writes), return_exceptions=True)

    @staticmethod
    async def _follow(kv: KeyValue, key: str, watched: _Watched) -> None:
        """Keep `watched` up to date: read the key, then watch it from just after that read
        (a write in between is seen by one or the other); again after the watch ends."""
        while True:
            try:
                revision = await kv.revision()
                watched.publish(await kv.get(key))
                events = kv.watch_prefix(key, revision + 1)
                async with contextlib.aclosing(events):
                    async for event in events:
                        if event.key == key:
                            watched.publish(await kv.get(key))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - etcd away, history compacted: read again shortly
                await asyncio.sleep(0.2)


class Rendezvous:
    """The rendezvous state and c10d store of one job attempt, over etcd compare-and-set."""

    def __init__(self, kv: KeyValue, keys: Keys, rdzv_id: str, states: StateHub | None = None,
                 expected_nodes: int = 0, *, long_poll_s: float):
        self.kv = kv
        self.rdzv_id = rdzv_id
        self.long_poll_s = long_poll_s  # the longest a long poll is held (`Timeouts.long_poll_s`)
        # The nodes the job's attempt counts on (its live members): once all of them joined an
        # open round, its last call ends (`worker.rdzv_state.end_last_call`); 0: never.
        self.expected_nodes = expected_nodes
        self._states = states or StateHub()
        self._state_key = keys.rdzv_state(rdzv_id)
        self._store_prefix = keys.rdzv_store(rdzv_id)
        self._ops_prefix = keys.rdzv(rdzv_id) + "ops/"

    # -- torch's RendezvousBackend -------------------------------------------------------

    async def get_state(self) -> Entry | None:
        return await self.kv.get(self._state_key)

    async def read_state(self) -> Entry | None:
        """The state for torch's `get_state`: as this control plane's watch of it has it, where one
        is under way (the long polls of a round, a formed round's keep-alives keep one), else
        read from etcd (module docstring). Not from memory while etcd does not answer."""
        known, entry = self._states.latest(self._state_key)
        if not known:
            return await self.get_state()
        self.kv.check_contact()
        return entry

    async def set_state(self, state: bytes | None, token: str | None,
                        merge: MergeSpec | None = None) -> tuple[Entry | None, bool]:
        """Write `state` iff `token` is the current one (None: iff there is no state yet), or,
        with `merge`, apply its ops to the state as it is now (module docstring; `state` is
        then not needed: the ops on the state at `token` rebuild it).

        Returns what is stored after the attempt and whether this call's change is in it. A
        token that is not one of ours (not a revision) can never match.
        """
        if _revision(token) is None and merge is None:
            return await self.get_state(), False
        write = _Write(state, token, merge, self.expected_nodes)
        if merge is not None:  # a keep-alive of a formed round's node waits for the others'
            return await self._states.keep_alive(self.kv, self._state_key, self._apply_batch, write)
        return await self._states.submit(self._state_key, self._apply_batch, write)

    async def _apply_batch(self, batch: list[_Write]) -> list[tuple[Entry | None, bool]]:
        """Apply `batch` to the stored state with one compare-and-set (again if it loses)."""
        for _ in range(BATCH_ATTEMPTS):
            entry = await self.get_state()
            revision = 0 if entry is None else entry.mod_revision
            value = None if entry is None else entry.value
            doc: RdzvDoc | None = None  # the state as data, once a merge needs it
            changed = False
            applied = [False] * len(batch)
            # Plain writes first: at most one wins (on an unchanged state), merges go on top.
            order = sorted(range(len(batch)), key=lambda i: batch[i].merge is not None)
            for i in order:
                write = batch[i]
                if write.merge is None and not changed and _revision(write.token) == revision:
                    value, changed, applied[i] = write.state, True, True
                    doc = None  # read from `value` if a merge comes after
                    continue
                if write.merge is None:
                    continue
                if doc is None:
                    doc = _doc(value)
                    if doc is None:
                        continue  # not a state this control plane reads: compare-and-set only
                merged = apply_ops(doc, write.merge, in_place=True)
                if merged is not None:
                    doc, value, changed, applied[i] = merged, None, True, True
            if not changed:
                return [(entry, False)] * len(batch)
            if value is None:
                assert doc is not None
                merged_specs = [w.merge for w, was in zip(batch, applied) if was and w.merge is not None]
                if merged_specs:
                    end_last_call(doc, max(w.expected_nodes for w in batch),
                                  max(m.min_nodes for m in merged_specs))
                value = seal_state(doc.to_json(), version=2)
            written, after = await self.kv.commit_read({self._state_key: revision},
                                                       [Put(self._state_key, value)], self._state_key)
            if written:
                return [(after, was) for was in applied]
        return [(await self.get_state(), False)] * len(batch)

    async def wait_for_state_change(self, after: str, wait_s: float, shape: str | None = None,
                                    progress: str | None = None, alive: tuple[Node, float] | None = None,
                                    ) -> tuple[Entry | None, bool]:
        """The state once its token is no longer `after` ("0": no state), waiting up to
        `wait_s` (at most `long_poll_s`); and whether it changed. At the timeout: the state as is.
        `alive`: (node, its keep-alive interval s) to keep alive while it waits (`StateHub`).
        """
        keep = None if alive is None else (*alive, self._apply_batch)
        return await self._states.wait(self.kv, self._state_key, after, min(wait_s, self.long_poll_s), shape,
                                      progress, keep)

    def kept_alive(self, node: Node) -> bool:
        """Whether this control plane keeps `node` alive while it polls (`StateHub.kept_alive`)."""
        return self._states.kept_alive(self._state_key, node)

    # -- the c10d store ------------------------------------------------------------------

    def store_key(self, key: str) -> str:
        return self._store_prefix + _encode_key(key)

    async def get(self, keys: Sequence[str], wait_s: float) -> list[bytes] | None:
        """The values of `keys` once all exist, waiting up to `wait_s`; None if they do not."""
        etcd_keys = [self.store_key(k) for k in keys]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, self.long_poll_s)
        while True:
            values = await self._read(etcd_keys)
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            # Read again once the shared watch of the store is under way: a key written
            # after this read wakes the wait (`StateHub.key_waits`).
            async with self._states.key_waits(self.kv, self._store_prefix, frozenset(etcd_keys)) as written:
                values = await self._read(etcd_keys)
                if all(v is not None for v in values):
                    return values  # type: ignore[return-value]
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(written), max(0.0, deadline - loop.time()))
            if deadline - loop.time() <= 0:
                # One last read: the write that ended the wait may have landed at the deadline.
                values = await self._read(etcd_keys)
                return values if all(v is not None for v in values) else None  # type: ignore[return-value]

    async def check(self, keys: Sequence[str]) -> bool:
        return all(v is not None for v in await self._read([self.store_key(k) for k in keys]))

    async def set(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Set every (key, value); atomically when there are at most MAX_TXN_OPS of them. A key
        given twice takes its last value, as setting them one by one would (etcd refuses a
        transaction that names a key twice)."""
        puts = [Put(self.store_key(k), v) for k, v in dict(items).items()]
        for start in range(0, len(puts), MAX_TXN_OPS):
            await self.kv.commit({}, puts[start:start + MAX_TXN_OPS])

    async def add(self, key: str, amount: int, op_id: str | None) -> int:
        """Add `amount` to the integer at `key` (absent: 0); returns the new value."""

        def combine(current: bytes | None) -> bytes:
            try:
                base = int(current) if current is not None else 0
            except ValueError:
                raise StoreValueError(f"store key {key!r} holds {current[:40]!r}, not an integer; "
                                      "add() needs an integer value") from None
            return str(base + amount).encode()

        return int(await self._update(key, combine, op_id))

    async def append(self, key: str, value: bytes, op_id: str | None) -> None:
        await self._update(key, lambda current: (current or b"") + value, op_id)

    async def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d (TCPStore) semantics: write `desired` iff the value is `expected` (absent
        counts as b""); returns the value stored afterwards, except that for an absent key
        and a non-empty `expected` it returns `expected` and writes nothing, as TCPStore does."""
        etcd_key = self.store_key(key)

        def decide(entry: Entry | None) -> cas.Done[bytes] | cas.Write[bytes]:
            if entry is None and expected != b"":
                return cas.Done(expected)
            current = b"" if entry is None else entry.value
            if current != expected:
                return cas.Done(current)
            revision = 0 if entry is None else entry.mod_revision
            return cas.Write({etcd_key: revision}, [Put(etcd_key, desired)], desired)

        return await cas.update(self.kv, lambda: self.kv.get(etcd_key), decide, self._what(key))

    async def delete(self, key: str) -> bool:
        """Delete `key`; False if it did not exist."""
        etcd_key = self.store_key(key)

        def decide(entry: Entry | None) -> cas.Done[bool] | cas.Write[bool]:
            if entry is None:
                return cas.Done(False)
            return cas.Write({etcd_key: entry.mod_revision}, [Delete(etcd_key)], True)

        return await cas.update(self.kv, lambda: self.kv.get(etcd_key), decide, self._what(key))

    async def num_keys(self) -> int:
        return await self.kv.count_prefix(self._store_prefix)

    # -- helpers -------------------------------------------------------------------------

    async def _read(self, etcd_keys: Sequence[str]) -> list[bytes | None]:
        entries = await asyncio.gather(*(self.kv.get(k) for k in etcd_keys))
        return [None if e is None else e.value for e in entries]

    async def _update(self, key: str, combine, op_id: str | None) -> bytes:
        """Read-modify-write `key` by CAS; with `op_id`, at most once across retries."""
        etcd_key = self.store_key(key)
        op_key = None
        if op_id is not None:
            if not _OP_ID.match(op_id):
                raise StoreValueError("op_id must be 1 to 64 characters of [A-Za-z0-9_-]")
            op_key = self._ops_prefix + op_id

        async def read() -> tuple[Entry | None, Entry | None]:
            done = await self.kv.get(op_key) if op_key is not None else None
            return done, (None if done is not None else await self.kv.get(etcd_key))

        def decide(read: tuple[Entry | None, Entry | None]) -> cas.Done[bytes] | cas.Write[bytes]:
            done, entry = read
            if done is not None:
                return cas.Done(done.value)  # a retry of a request that already applied
            value = combine(None if entry is None else entry.value)
            expect = {etcd_key: 0 if entry is None else entry.mod_revision}
            ops = [Put(etcd_key, value)]
            if op_key is not None:
                expect[op_key] = 0
                ops.append(Put(op_key, value))
            return cas.Write(expect, ops, value)

        return await cas.update(self.kv, read, decide, self._what(key))

    def _what(self, key: str) -> str:
        return f"store key {key!r} of rendezvous {self.rdzv_id}"


def _doc(value: bytes | None) -> RdzvDoc | None:
    """The stored state as data: empty if none, None if it is not a version-2 state."""
    if value is None:
        return RdzvDoc()
    if state_version(value) != 2:
        return None
    try:
        return RdzvDoc.from_json(open_state(value))
    except (StateNotSealed, NotAState):
        return None


def _keep_alive_of(merge: MergeSpec | None) -> Node | None:
    """The node of a write that is only its node's keep-alive (torch's keep-alive timer, no
    expired node dropped with it); else None."""
    if merge is None or len(merge.ops) != 1 or merge.ops[0].kind != "keep_alive":
        return None
    return tuple(merge.ops[0].node)  # type: ignore[return-value]


def state_token(entry: Entry | None) -> str:
    """The fencing token of a state as the client sees it: its mod_revision, "0" for none."""
    return "0" if entry is None else str(entry.mod_revision)


def _revision(token: str | None) -> int | None:
    """A client's fencing token as an etcd mod_revision (None: no token given = 0)."""
    if token is None:
        return 0
    if not token.isdigit() or len(token) > 19:
        return None
    revision = int(token)
    return revision if revision > 0 else None


async def delete_rendezvous(kv: KeyValue, keys: Keys, job_id: str,
                            fence: dict[str, int] | None = None, below: int | None = None) -> int:
    """Delete the rendezvous keys of every attempt of `job_id` (the scheduler calls this when a
    job ends), or of its attempts before `below` (`StateHub.attempt_seen`); returns how many
    keys went.

    `fence` (`Leadership.fence`, from the leader-only loops): every deletion compares the
    leader's key, and a replica that lost the lead deletes nothing (StaleLeader).

    `keys.rdzv_of_job` is a string prefix, and a job named like another job's id plus
    '-a<digits>' would share it; only keys whose rendezvous id parses back to `job_id` go.
    """
    prefix = keys.rdzv_of_job(job_id)
    rdzv_root = keys.rdzv("")  # "<prefix>/rdzv//" -> "<prefix>/rdzv/"
    rdzv_root = rdzv_root[:-1]
    attempts: dict[str, int] = {}
    async for entry in kv.scan_prefix(prefix, page_size=PAGE_SIZE * 8, keys_only=True):
        rdzv_id = entry.key[len(rdzv_root):].split("/", 1)[0]
        with contextlib.suppress(InvalidRendezvousId):
            owner, attempt = parse_rdzv_id(rdzv_id)
            if owner == job_id and (below is None or attempt < below):
                attempts[rdzv_id] = attempts.get(rdzv_id, 0) + 1
    ops = [Delete(keys.rdzv(rdzv_id), prefix=True) for rdzv_id in sorted(attempts)]
    for start in range(0, len(ops), MAX_TXN_OPS):
        if not await kv.commit(fence or {}, ops[start:start + MAX_TXN_OPS]):
            raise StaleLeader("this control plane no longer leads; rendezvous keys are left")
    return sum(attempts.values())
