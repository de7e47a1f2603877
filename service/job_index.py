"""A read cache of the jobs, fed by an etcd watch (the Kubernetes API server's pattern).

Node heartbeats ask "which job is mine?" every second; answering that from etcd would
cost a range read of every job per heartbeat. The scheduler asks it which jobs are not
finished (and then reads those from etcd), so finished jobs, which pile up until retention
deletes them, are not read on every tick. The API lists jobs in the index's order (oldest
first) and reads the records of one page from etcd.

The index is loaded once, a page at a time, then kept current by a watch from the revision
read before that load (a change during the load is replayed by the watch). When a watch
session ends quietly the index watches again from the last revision it applied; only a
broken or compacted watch makes it load again. It is only used where a slightly stale answer is harmless
(assignments are re-sent on the next heartbeat, records are read fresh); every write still
goes to etcd as a compare-and-set. A watch whose history was compacted away
(HistoryCompacted) loads again at once, serving what it has meanwhile.

A job's status (`GET /v1/jobs/{id}`) is answered from the index, with its progress (a second
watch, on the progress keys) and its JSON made once per change (`view_json`), with
read-your-writes: `revision` is the etcd revision up to which the index has applied every
change of a job record. A write returns the revision it made (the `X-Ftrain-Revision`
header); a client sends back the highest it saw, and a read waits until the index has
reached it (`wait_for_revision`), or reads through to etcd if it does not within a second.
A write's revision is that of a job record, which the watch brings to every replica, so a
read after a write through another replica is never older than the write.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, KeysView

from service.decide import keep, ledger, quotas
from service.decide.order import QueueKey, queue_key
from service.errors import StoreUnavailable
from service.follow import follow_prefix
from service.jobs import JOB_PAGE_SIZE
from service.keys import Keys
from service.models import JobRecord, JobState
from service.store.api import Entry, KeyValue, WatchEvent
from worker.protocol import Progress

log = logging.getLogger(__name__)

SortKey = tuple[float, str]  # (created_at, id): the listing order, oldest first
# Deleted jobs whose place in the listing order is remembered, so that a listing whose
# cursor (`after`) names a job that retention deleted meanwhile goes on where it was.
REMEMBERED_DELETIONS = 10_000


def _place(queue_is_pending: bool, job: JobRecord, fifo: bool) -> QueueKey | SortKey:
    """`job`'s entry in the pending queue (`queue_key`) or among the others (its age)."""
    return queue_key(job, fifo) if queue_is_pending else (job.created_at, job.id)


class JobIndex:
    """Which jobs exist and in what order, which are unfinished, and which job each node
    works for; kept current by a watch."""

    def __init__(self, kv: KeyValue, keys: Keys, fifo: bool = False,
                 clock: Callable[[], float] = time.time, half_life_s: float = ledger.HALF_LIFE_S):
        self._kv = kv
        self._keys = keys
        self.fifo = fifo  # the queue in submission order (`Settings.queue_policy`)
        self.clock = clock
        # The node-seconds each (user, priority) has held, fed every change (`decide.ledger`).
        self.ledger = ledger.Ledger(half_life_s)
        self._jobs: dict[str, JobRecord] = {}
        self._by_node: dict[str, str] = {}
        # node -> the other active jobs that list it as a live member too (records that
        # disagree: the scheduler never assigns a node twice, but should it, the job whose
        # entry `_by_node` lost gets the node back once the other lets it go: `_hold`, `_let_go`)
        self._shadowed: dict[str, set[str]] = {}
        # node -> the PENDING job whose memory copy it last kept (`keeper`): at most one a node
        self._kept: dict[str, str] = {}
        self._order: list[SortKey] = []  # every job in self._jobs, sorted
        # The unfinished jobs, apart: PENDING ones in queue order (`decide.order.queue_key`), and
        # the others (which hold nodes), oldest first.
        self._pending: list[QueueKey] = []
        self._held: Counter[str] = Counter()  # user -> nodes held (`held`)
        self._waiting: Counter[str] = Counter()  # user -> its PENDING jobs (`waiting_owners`)
        self._running: list[SortKey] = []
        # Their records by id, oldest first (`running`), remade only when a job starts or
        # leaves them (None: to be remade); and the nodes they hold and those their live
        # members are on, counted per node (`held_nodes`, `member_nodes`): kept as jobs
        # change, so a scheduler pass reads them without a look at every running job's members.
        self._running_jobs: dict[str, JobRecord] | None = {}
        self._holding: Counter[str] = Counter()
        self._live: Counter[str] = Counter()
        # Of those others: how many run at each priority, and the ones giving nodes up to a
        # preemption (`decide.preempt`), so a scheduler pass need not look through them all.
        self._priorities: Counter[int] = Counter()
        self._yielding: set[str] = set()
        self._hang_watched: set[str] = set()  # those with a hang timeout (`hang_watched`)
        self._gone: OrderedDict[str, SortKey] = OrderedDict()
        self._revs: dict[str, int] = {}  # job id -> the mod_revision of its record here
        self._progress: dict[str, bytes] = {}  # job id -> its progress key's value
        self._progress_revs: dict[str, int] = {}
        self._views: dict[str, bytes] = {}  # job id -> its JobView's JSON, made on first read
        self.revision = 0  # every change of a job record up to this revision is applied
        # Changes applied other than a new PENDING job's: while it stands still and no node is
        # free, a scheduler pass has nothing to do (`scheduler.run` skips it).
        self.changes = 0
        self.progress_ready = asyncio.Event()
        self.ready = asyncio.Event()
        # Set and replaced at every change (`_notify`): a waiter awaits the one it read. (No
        # asyncio.Condition: a wait on one that was cancelled just as its timeout ended
        # could exit without its lock while its inner wait took the lock for good, and every
        # later notification and heartbeat long poll then waited on that lock for ever.)
        self._changed = asyncio.Event()
        self._wakes: list[asyncio.Event] = []
        self._observers: list[Callable[[JobRecord | None, JobRecord | None], None]] = []

    def wake_on_change(self, event: asyncio.Event) -> None:
        """Set `event` whenever the index has applied a change (so whoever waits on it reads
        an index that already has that change)."""
        self._wakes.append(event)

    def observe(self, fn: Callable[[JobRecord | None, JobRecord | None], None]) -> None:
        """Call `fn(old, new)` for every change of a job (the watch's, or this replica's own
        write shown at once; None: not known / deleted);
        the metrics of `service.telemetry` are fed this way."""
        self._observers.append(fn)

    def jobs(self) -> list[JobRecord]:
        """Every job as the index has it now."""
        return list(self._jobs.values())

    def active_ids(self) -> list[str]:
        """The jobs not yet finished, oldest first (submission order)."""
        by_age = sorted((created_at, job_id) for _, created_at, job_id in self._pending)
        return [job_id for _, job_id in heapq.merge(by_age, self._running)]

    def pending_ids(self) -> Iterator[str]:
        """The PENDING jobs in the order they are offered nodes (`decide.order.queue_key`: higher
        priority first, then the oldest): kept in order as they change, so a scheduler pass reads
        the queue only as far as it can start jobs (`decide.scheduling.schedule_queue`). To be
        consumed before the next await (the index may change at any await)."""
        return (key[-1] for key in self._pending)

    def running_ids(self) -> list[str]:
        """The unfinished jobs that are not PENDING (they hold nodes), oldest first."""
        return [job_id for _, job_id in self._running]

    def running(self) -> dict[str, JobRecord]:
        """The unfinished jobs that are not PENDING, by id, oldest first (`running_ids`'
        records): a copy, the caller's to change."""
        if self._running_jobs is None:
            jobs = self._jobs
            self._running_jobs = {job_id: jobs[job_id] for _, job_id in self._running}
        return dict(self._running_jobs)

    def held_nodes(self) -> set[str]:
        """The nodes those jobs hold (`quotas.held_nodes`: live or finished members), as a set
        of its own (`decide.scheduling.free_nodes` of `running` without reading their members)."""
        return set(self._holding)

    def member_nodes(self) -> KeysView[str]:
        """The nodes of those jobs' live members (`decide.scheduling.live_members`): a view,
        to be read before the next await."""
        return self._live.keys()

    def hang_watched(self) -> set[str]:
        """The ids of those jobs with a hang timeout (`spec.hang_timeout_s`), as a set of its own."""
        return set(self._hang_watched)

    def lowest_running_priority(self) -> int | None:
        """The lowest priority among the unfinished jobs that are not PENDING (None: none)."""
        return min(self._priorities) if self._priorities else None

    def yielding(self) -> list[JobRecord]:
        """The unfinished jobs giving nodes up to a job of higher priority (`JobRecord.preempt`)."""
        return [self._jobs[j] for j in sorted(self._yielding) if j in self._jobs]

    def finished(self) -> list[tuple[str, float]]:
        """(id, finished_at) of every finished job, as the index has them (for retention)."""
        return [(j.id, j.finished_at if j.finished_at is not None else j.updated_at)
                for j in self._jobs.values() if j.state.is_terminal()]

    def job_of_node(self, node: str) -> JobRecord | None:
        """The active job in which `node` is a live member, if any."""
        job_id = self._by_node.get(node)
        return self._jobs.get(job_id) if job_id else None

    def claims(self) -> dict[str, JobRecord]:
        """node -> the PENDING job whose memory copy it last kept (`service.decide.keep.claims`
        of the jobs here), one entry per kept node."""
        return {n: self._jobs[j] for n, j in self._kept.items() if j in self._jobs}

    def keeper(self, node: str) -> JobRecord | None:
        """The PENDING job whose memory copy `node` last kept (`JobRecord.kept`), if any; whether
        the node is held for it now is `service.decide.keep.holds`."""
        job_id = self._kept.get(node)
        return self._jobs.get(job_id) if job_id else None

    def _note_kept(self, old: JobRecord | None, job: JobRecord | None, job_id: str) -> None:
        """Keep `_kept` with the change of one job: a node is the latest keeper's (the copy of
        the job it ran last)."""
        if old is not None and old.kept is not None:
            for n in old.kept.steps:
                if self._kept.get(n) == job_id:
                    del self._kept[n]
        if job is not None and job.state is JobState.PENDING and job.kept is not None:
            for n in job.kept.steps:
                other = self._jobs.get(self._kept.get(n, ""))
                if other is None or other.kept is None or other.kept.since <= job.kept.since:
                    self._kept[n] = job_id

    def get(self, job_id: str) -> JobRecord | None:
        """The job as the index last saw it (it may lag etcd by a watch event)."""
        return self._jobs.get(job_id)

    def revision_of(self, job_id: str) -> int:
        """The mod_revision of the job's record as the index has it (0: not known): what a
        change decided on that record compares (`JobStore.write_many`)."""
        return self._revs.get(job_id, 0) if job_id in self._jobs else 0

    def view_json(self, job_id: str) -> bytes | None:
        """The job's view (record and progress) as JSON, as the index has them; None if the
        index has no such job. Made once per change of either: records were validated when
        the watch brought them, and are not validated again to answer."""
        view = self._views.get(job_id)
        if view is None:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            raw = self._progress.get(job_id)
            view = job.view(None if raw is None else Progress.model_validate_json(raw)
                            ).model_dump_json().encode()
            self._views[job_id] = view
        return view

    async def wait_for_revision(self, revision: int, timeout_s: float) -> bool:
        """Wait until the index has applied every job change up to `revision` (at most
        `timeout_s`); returns whether it has."""
        if self.revision >= revision:
            return True
        return await self.wait_until(lambda: self.revision >= revision, timeout_s)

    async def catch_up(self, timeout_s: float) -> bool:
        """Wait until the index has every job record as etcd has it now: the latest change
        under the jobs prefix applied (at most `timeout_s`; one read of etcd); returns
        whether it has. A replica that has just taken the lead plans on the index only then:
        the last writes of the one that led before may still be on their way here."""
        if not self.ready.is_set():
            return False
        latest = await self._kv.latest_revision(self._keys.jobs)
        return await self.wait_for_revision(latest, timeout_s)

    def __len__(self) -> int:
        return len(self._jobs)

    def place_of(self, job_id: str) -> SortKey | None:
        """Where `job_id` is (or was, if deleted lately) in the listing order; None if unknown."""
        job = self._jobs.get(job_id)
        return (job.created_at, job_id) if job is not None else self._gone.get(job_id)

    def ids_after(self, place: SortKey | None,
                  states: Collection[JobState] | None = None) -> Iterator[str]:
        """Job ids oldest first (by created_at, then id) after `place`, of jobs in `states`
        as the index has them (any state if none).

        Lazy, and safe to consume across awaits: each step looks up the next place anew, so
        jobs added or deleted meanwhile neither stop it nor make it repeat one.
        """
        while True:
            i = 0 if place is None else bisect.bisect_right(self._order, place)
            if i >= len(self._order):
                return
            place = self._order[i]
            job = self._jobs.get(place[1])
            if job is not None and (not states or job.state in states):
                yield place[1]

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `predicate` holds on the index (checked after every change it applies),
        at most `timeout_s`; returns whether it holds."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not predicate():
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return predicate()
        return True

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once the index is loaded; StoreUnavailable after `timeout_s`."""
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except TimeoutError:
            raise StoreUnavailable(f"the job index (the control plane's view of the jobs) was not "
                                   f"loaded within {timeout_s:g} s; etcd may be away. Retry.") from None

    def note_created(self, job: JobRecord) -> None:
        """A job this control plane has just created: list it now, not a watch event later.

        Only a job the index does not know yet is added (the watch may already have brought
        it, or a newer version of it); its watch event applies it again, harmlessly.
        """
        if self.ready.is_set() and job.id not in self._jobs:
            self._apply(job, job.id)

    def note_written(self, entry: Entry, record: JobRecord | None = None) -> None:
        """A job record or progress that this control plane has just written (as its
        transaction read it back; `record`: the job record it holds, if the writer has it,
        so it is not parsed again): shown at once, not a watch event later. What the watch
        brings later of an older revision does not replace it."""
        if entry.key.startswith(self._keys.jobs):
            job_id = entry.key[len(self._keys.jobs):]
            if self.ready.is_set() and entry.mod_revision > self._revs.get(job_id, 0):
                if record is None or record.id != job_id:
                    record = JobRecord.model_validate_json(entry.value)
                self._apply(record, job_id, entry.mod_revision)
        elif entry.key.startswith(self._progress_prefix):
            job_id = entry.key[len(self._progress_prefix):]
            if self.progress_ready.is_set() and entry.mod_revision > self._progress_revs.get(job_id, 0):
                self._set_progress(job_id, entry.value, entry.mod_revision)

    def _set_progress(self, job_id: str, value: bytes | None, revision: int) -> None:
        if value is None:
            self._progress.pop(job_id, None)
            self._progress_revs.pop(job_id, None)
        else:
            self._progress[job_id] = value
            self._progress_revs[job_id] = revision
        self._views.pop(job_id, None)

    @property
    def _progress_prefix(self) -> str:
        return self._keys.progress("")

    def _apply(self, job: JobRecord | None, job_id: str, revision: int = 0) -> None:
        # The watch's echo of a write this replica already showed (note_written) changes
        # nothing: the observers were told of it then.
        echo = bool(revision) and job is not None and self._revs.get(job_id) == revision
        if job is None or job.state is not JobState.PENDING or job_id in self._jobs:
            self.changes += 1  # (a new PENDING job's is not counted: `changes`)
        if revision:  # a deleted job's too: a late note of an older write brings nothing back
            self._revs[job_id] = revision
        self._views.pop(job_id, None)
        old = self._jobs.pop(job_id, None)
        self._queue(job_id, old, job)
        self._count_held(old, job)
        self._count_waiting(old, -1)
        self._count_waiting(job, 1)
        self.ledger.change(old, job, self.clock())
        self._note_kept(old, job, job_id)
        if old is not None:
            for n in old.members:
                self._let_go(n, job_id)
            if job is None or job.created_at != old.created_at:
                place = (old.created_at, job_id)
                i = bisect.bisect_left(self._order, place)
                if i < len(self._order) and self._order[i] == place:
                    del self._order[i]
                if job is None:
                    self._remember_deleted(job_id, place)
        if job is not None:
            if old is None or job.created_at != old.created_at:
                bisect.insort(self._order, (job.created_at, job_id))
            self._jobs[job_id] = job
            if job.state.is_active():
                for n, m in job.members.items():
                    if m.is_live():
                        self._hold(n, job_id)
        if not echo:
            for observe in self._observers:
                observe(old, job)

    def _hold(self, node: str, job_id: str) -> None:
        """`node` is a live member of `job_id` (the job its heartbeats are answered with)."""
        other = self._by_node.get(node)
        if other is not None and other != job_id:
            log.error("node %s is a live member of two jobs, %s and %s; it runs %s, then %s once %s lets "
                      "it go", node, other, job_id, job_id, other, job_id)
            self._shadowed.setdefault(node, set()).add(other)
        self._by_node[node] = job_id

    def _let_go(self, node: str, job_id: str) -> None:
        """`job_id`'s record no longer lists `node` as it did: the node is the job's that
        `_hold` shadowed there and still lists it live, if any, else no job's."""
        shadowed = self._shadowed.get(node)
        if shadowed is not None:
            shadowed.discard(job_id)
        if self._by_node.get(node) == job_id:
            del self._by_node[node]
            while shadowed:
                other = self._jobs.get(shadowed.pop())
                if other is not None and other.state.is_active() and (m := other.members.get(node)) is not None \
                        and m.is_live():
                    self._by_node[node] = other.id
                    break
        if shadowed is not None and not shadowed:
            del self._shadowed[node]

    def _count_held(self, old: JobRecord | None, new: JobRecord | None) -> None:
        if (was := len(quotas.held_nodes(old))):
            self._held[old.owner] -= was
            if not self._held[old.owner]:
                del self._held[old.owner]
        if (now := len(quotas.held_nodes(new))):
            self._held[new.owner] += now

    def _count_waiting(self, job: JobRecord | None, by: int) -> None:
        if job is not None and job.state is JobState.PENDING:
            self._waiting[job.owner] += by
            if not self._waiting[job.owner]:
                del self._waiting[job.owner]

    def waiting_owners(self) -> list[str]:
        """The users with a PENDING job (kept as jobs change: a pass finds the starved users,
        `decide.giveback`, without reading the queue)."""
        return list(self._waiting)

    def held(self) -> dict[str, int]:
        """user -> the nodes its unfinished jobs hold (kept as jobs change: a scheduler pass
        reads the shares of the cluster without going over every running job)."""
        return dict(self._held)

    def shares(self, tenants: quotas.Tenants) -> quotas.Usage:
        """What the unfinished jobs hold by user and team (`held`), and the node-seconds each
        user has had at each priority (`ledger`): the shares fair share orders the queue by."""
        return quotas.usage_of(self._held, tenants, held_at=self.ledger.held(),
                               past=self.ledger.used(self.clock()))

    def _queue(self, job_id: str, old: JobRecord | None, new: JobRecord | None) -> None:
        """Move the job between the sorted lists of unfinished jobs (`_pending`, `_running`)."""
        was, now = self._queue_of(old), self._queue_of(new)
        self._count_running(old, -1 if was is self._running else 0)
        self._count_running(new, 1 if now is self._running else 0)
        old_place = None if was is None else _place(was is self._pending, old, self.fifo)
        new_place = None if now is None else _place(now is self._pending, new, self.fifo)
        if was is not None and (was is not now or new_place != old_place):
            i = bisect.bisect_left(was, old_place)
            if i < len(was) and was[i] == old_place:
                del was[i]
        if now is not None and (was is not now or new_place != old_place):
            bisect.insort(now, new_place)
        if was is self._running and now is self._running and new_place == old_place:
            if self._running_jobs is not None:
                self._running_jobs[job_id] = new  # (in its place: the order is the same)
        elif self._running in (was, now):
            self._running_jobs = None  # (a job started or left them: remade when next read)

    def _count_running(self, job: JobRecord | None, by: int) -> None:
        """Add (1) or take (-1) `job` to the aggregates of the others (`_priorities`, `_yielding`)."""
        if job is None or not by:
            return
        _count(self._holding, quotas.held_nodes(job), by)
        _count(self._live, [n for n, m in job.members.items() if m.is_live()], by)
        prio = job.spec.priority
        self._priorities[prio] += by
        if self._priorities[prio] <= 0:
            del self._priorities[prio]
        if by > 0 and job.preempt is not None:
            self._yielding.add(job.id)
        elif by < 0:
            self._yielding.discard(job.id)
        if by > 0 and job.spec.hang_timeout_s is not None:
            self._hang_watched.add(job.id)
        elif by < 0:
            self._hang_watched.discard(job.id)

    def _queue_of(self, job: JobRecord | None) -> list | None:
        if job is None or job.state.is_terminal():
            return None
        return self._pending if job.state is JobState.PENDING else self._running

    def _remember_deleted(self, job_id: str, place: SortKey) -> None:
        self._gone[job_id] = place
        while len(self._gone) > REMEMBERED_DELETIONS:
            forgotten, _ = self._gone.popitem(last=False)
            if forgotten not in self._jobs:
                self._revs.pop(forgotten, None)

    async def _notify(self) -> None:
        """Tell the scheduler and every waiter that the index changed (a re-read after a
        broken or compacted watch included: what it missed may be what they wait for)."""
        for event in self._wakes:
            event.set()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _load(self) -> int:
        """Read every job, a page at a time; returns the revision to watch from."""
        prefix = self._keys.jobs
        revision = await self._kv.revision()
        jobs: dict[str, JobRecord] = {}
        revs: dict[str, int] = {}
        async for e in self._kv.scan_prefix(prefix, page_size=JOB_PAGE_SIZE):
            jobs[e.key[len(prefix):]] = JobRecord.model_validate_json(e.value)
            revs[e.key[len(prefix):]] = e.mod_revision
        self.changes += 1
        for job_id in self._jobs.keys() - jobs.keys():
            old = self._jobs[job_id]
            self._remember_deleted(job_id, (old.created_at, job_id))
        self._jobs.clear()
        self._revs = revs
        self._views.clear()
        self._by_node.clear()
        self._shadowed.clear()
        self._held.clear()
        self._waiting.clear()
        self.ledger.recount(jobs.values(), self.clock())
        self._kept = {n: j.id for n, j in keep.claims(jobs.values()).items()}
        self._order = sorted((job.created_at, job_id) for job_id, job in jobs.items())
        self._pending = sorted(queue_key(j, self.fifo) for j in jobs.values() if j.state is JobState.PENDING)
        self._running = [p for p in self._order
                         if jobs[p[1]].state is not JobState.PENDING and not jobs[p[1]].state.is_terminal()]
        self._priorities, self._yielding, self._hang_watched = Counter(), set(), set()
        self._running_jobs, self._holding, self._live = None, Counter(), Counter()
        for _, job_id in self._running:
            self._count_running(jobs[job_id], 1)
        for job_id, job in jobs.items():
            self._jobs[job_id] = job
            self._count_held(None, job)
            self._count_waiting(job, 1)
            if job.state.is_active():
                for n, m in job.members.items():
                    if m.is_live():
                        self._hold(n, job_id)
        return revision

    async def run(self) -> None:
        """Load every job, then follow the watch; load again after a broken watch. Runs
        until cancelled."""
        await follow_prefix(self._kv, self._keys.jobs, self._load_jobs, self._job_event, self.ready,
                            "job index", self._notify)

    async def run_progress(self) -> None:
        """Keep the jobs' progress (for `view_json`): load it, then follow its watch; load
        again after a broken watch. Runs until cancelled."""
        await follow_prefix(self._kv, self._progress_prefix, self._load_progress,
                            self._progress_event, self.progress_ready, "progress index")

    async def _load_jobs(self) -> int:
        revision = await self._load()
        self.revision = max(self.revision, revision)
        return revision

    def _job_event(self, ev: WatchEvent, job_id: str) -> None:
        if ev.value is None or ev.mod_revision > self._revs.get(job_id, 0):
            # (older than what this replica wrote and showed already, or that very write,
            # which the index has: skipped, not parsed again)
            job = None if ev.value is None else JobRecord.model_validate_json(ev.value)
            self._apply(job, job_id, ev.mod_revision)
        self.revision = max(self.revision, ev.mod_revision)

    async def _load_progress(self) -> int:
        prefix = self._progress_prefix
        revision = await self._kv.revision()
        entries = [e async for e in self._kv.scan_prefix(prefix)]
        self._progress = {e.key[len(prefix):]: e.value for e in entries}
        self._progress_revs = {e.key[len(prefix):]: e.mod_revision for e in entries}
        self._views.clear()
        return revision

    def _progress_event(self, ev: WatchEvent, job_id: str) -> None:
        if ev.value is None or ev.mod_revision >= self._progress_revs.get(job_id, 0):
            self._set_progress(job_id, ev.value, ev.mod_revision)


def _count(counts: Counter[str], keys: Iterable[str], by: int) -> None:
    """Add `by` to the count of each of `keys`; a count that falls to 0 goes."""
    for key in keys:
        counts[key] += by
        if counts[key] <= 0:
            del counts[key]
