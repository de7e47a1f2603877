"""The scheduler loop: read, plan (`service.decide.scheduling`), write by compare-and-set.

The loop (`run`) runs only on the elected leader among control-plane replicas (the lead is
kept by a task of its own, `keep_lead`, so that a long pass cannot let it lapse). On
every change under the job and node prefixes (an etcd watch) and at least every
`scheduler_interval_s`, it reads the nodes and the unfinished jobs and applies `plan`
to each job through `JobStore.update`, which re-reads the job and re-decides on a lost
compare-and-set, so a decision is never written over a change it did not see. Then it
watches the running jobs for hangs (`service.decide.hangs`; the clocks it keeps for that
live in this loop's memory, `watches`, kept for one term: a replica that leads again, even
in a new term of its own, starts them afresh; and a gap in the loop's own passes, a stall in
which it could hear no progress, is not counted, `STALL_MARGIN_S`).

Every replica's loop also keeps `service.contact`: the leader notes in etcd that it hears
the nodes, and a replica that starts or comes back from a gap reads that note; after an
outage in which no control plane could hear them, member nodes whose lease lapsed in it
get a grace before they count as lost (`service.decide.liveness`). A node that dies while
a control plane is there to hear it is lost as soon as its lease lapses.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import operator
import os
import socket
import time
from collections.abc import Callable, Collection, Iterable, Sequence

from service.contact import Contact
from service.decide import hangs, keep, preempt, quotas
from service.decide.change import Change
from service.decide.order import queue_key
from service.decide.scheduling import (
    Plan,
    SchedulerConfig,
    Settled,
    free_again,
    holders,
    live_members,
    plan,
    schedule_queue,
    lent,
    with_mark,
    withdrawn,
)
from service.errors import FtrainError, StaleLeader, StoreUnavailable
from service.job_index import JobIndex
from service.jobs import JobStore
from service.models import Borrow, JobRecord, JobState, NodeRecord, Preemption
from service.nodes import NodeStore, departures
from service.rendezvous import delete_rendezvous
from service.store.api import Fence, KeyValue, Put
from service.tenancy import Tenancy
from worker.protocol import MemorySnapshot

log = logging.getLogger(__name__)

PASS_WINDOW = 1000  # the passes whose quantiles /metrics gives
# Passes are coalesced: after a pass, the next one waits this long (or as long as the pass
# took, if longer), so a burst of submissions, each of which wakes the scheduler, makes one
# pass, and passes take at most about half of the event loop that answers the requests.
MIN_PASS_GAP_S = 0.02
# A gap between two passes longer than the interval plus this is a stall of this control
# plane's own (stopped, its loop held up, etcd away): the hang clocks do not count it
# (`hangs.unheard`). Passes come round at least every interval, plus the pass itself.
STALL_MARGIN_S = 1.0
# At most this many jobs start in one pass (its planning is one step of the event loop; two
# transactions of `JobStore.write_many`); the rest start in the next pass, 20 ms later.
MAX_STARTS_PER_PASS = 128
PREEMPTED = operator.attrgetter("preempt")  # a job giving nodes to one of higher priority (or None)


class PassTimes:
    """The durations of this replica's scheduler passes: a count and a sum since start (as
    Prometheus counts them), and the last PASS_WINDOW passes for quantiles. O(1) a pass."""

    def __init__(self) -> None:
        self.count = 0
        self.sum_s = 0.0
        self.recent: collections.deque[float] = collections.deque(maxlen=PASS_WINDOW)

    def record(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self.recent.append(seconds)

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) of the last PASS_WINDOW passes; None before the first."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# The leader stops acting on its own clock this share of its lease's TTL before the lease
# can lapse in etcd (`Leadership`), and renews it every RENEW_EVERY of the TTL: it stays
# leader while etcd confirms a renewal within 1 - STOP_MARGIN - RENEW_EVERY of a TTL (1.17 s
# of the default 2 s; it was 1.5 s with no margin and a renewal every quarter).
STOP_MARGIN = 1 / 4
RENEW_EVERY = 1 / 6

# How long a replica that has just taken the lead waits for its job index to have the last
# writes of the one that led before (`JobIndex.catch_up`) before it plans without them.
CATCH_UP_S = 5.0


async def active_jobs(jobs: JobStore, index: JobIndex) -> list[JobRecord]:
    """The unfinished jobs, oldest first, as the watch-fed index has them (`queue`, in one
    list)."""
    pending, others = await queue(jobs, index)
    return sorted([*pending, *others], key=lambda j: (j.created_at, j.id))


async def queue(jobs: JobStore, index: JobIndex) -> tuple[Iterable[JobRecord], list[JobRecord]]:
    """The unfinished jobs as the watch-fed index has them, apart: the PENDING ones in queue
    order (`decide.order`; lazily: to be read before the next await, and only as far as
    needed) and the others (those that hold nodes), oldest first.

    The index has this control plane's own writes at once (`JobIndex.note_written`), so a
    tick sees its last writes; another replica's (a report, a cancel) a watch event later,
    which wakes the scheduler again. Every change a pass makes is a compare-and-set that
    re-reads the job and decides again on what is stored, so a record a moment old costs
    nothing but that re-read. (Reading every unfinished record from etcd on every pass cost
    a pass 190 reads and 3,000 parses with 3,000 jobs waiting: bench/api.py's submissions.)
    A new leader plans on the index once it has the last leader's writes (`run`,
    `JobIndex.catch_up`). Until the index is ready: every unfinished job as etcd has it now.
    """
    pending, others = await _unfinished(jobs, index)
    return pending, list(others.values())


async def _unfinished(jobs: JobStore, index: JobIndex) -> tuple[Iterable[JobRecord], dict[str, JobRecord]]:
    """`queue`, with the others by id (a dict of the caller's own, oldest first)."""
    if not index.ready.is_set():
        found = sorted([j async for j in jobs.scan() if not j.state.is_terminal()],
                       key=lambda j: (j.created_at, j.id))
        return (sorted((j for j in found if j.state is JobState.PENDING), key=queue_key),
                {j.id: j for j in found if j.state is not JobState.PENDING})
    pending = (j for j in map(index.get, index.pending_ids())
               if j is not None and j.state is JobState.PENDING)
    return pending, index.running()


async def tick(jobs: JobStore, nodes: NodeStore, index: JobIndex, cfg: SchedulerConfig,
               last_reason: dict[str, str], watches: dict[str, hangs.Watch] | None = None,
               contact: Contact | None = None, missing_since: dict[str, float] | None = None,
               fence: dict[str, int] | None = None, settled: Settled | None = None,
               stall_after_s: float | None = None, tenancy: Tenancy | None = None) -> bool:
    """One pass: read, plan, and apply each plan by compare-and-set; then look for hangs.
    Returns whether jobs are left to start that this pass did not (MAX_STARTS_PER_PASS).

    `missing_since` (kept across passes): since when each member node whose record is gone
    has been seen gone; with `contact`, those whose lease lapsed in an outage of the
    control plane's own are waited for, not counted as lost (`Contact.graced`). `fence`
    (`Leadership.fence`): every write compares the leader's key, so a replica that lost the
    lead (its lease lapsed, e.g. cut off from etcd) writes nothing once another may lead.
    `settled` (kept across passes): the jobs whose plan is known to be None still
    (`decide.scheduling.Settled`). `tenancy`: the teams and quotas (`decide.quotas`; None:
    none are set).

    The memory reports of a job that may fall below its `min` in this pass are read first
    (`decide.keep`: its survivors that hold a copy are held for it), and a free node held for
    a waiting job is found in the index's map of them (`JobIndex.claims`)."""
    tenants = None if tenancy is None else await tenancy.current()
    live_nodes = await nodes.live()
    if settled is not None:
        # (of the view `live` just copied: no await between)
        settled.advance(nodes.version, nodes.changed_since(settled.view))
    from_index = index.ready.is_set()  # (then `queue` reads the index, without an await)
    pending, active = await _unfinished(jobs, index)
    others = list(active.values())
    # What the index counts of them, read with them (no await between): the nodes they hold,
    # those with a hang timeout (its spec is fixed), and their live members' nodes.
    holding, hang_ids = (index.held_nodes(), index.hang_watched()) if from_index else (None, None)
    graced: frozenset[str] = frozenset()
    missing = index.member_nodes() - live_nodes.keys() if from_index else \
        {n for j in others for n in live_members(j) if n not in live_nodes}
    if missing_since is not None:
        now = jobs.clock()
        for name in missing_since.keys() - missing:
            del missing_since[name]
        for name in missing:
            missing_since.setdefault(name, now)
        if contact is not None:
            graced = contact.graced(missing_since, now)
    copies: dict[str, list[MemorySnapshot]] = {}
    # (a job falls short when it loses a node, or is suspended by a preemption)
    for job in others if missing else (index.yielding() if from_index else filter(PREEMPTED, others)):
        if keep.may_fall_short(job, live_nodes, graced):
            copies[job.id] = await memory_copies(jobs, job.id)
    # Why each missing member went, where a control plane noted it (service.nodes.departures).
    gone = await departures(nodes.kv, nodes.keys, sorted(missing - graced)) if missing - graced else {}
    if copies and from_index:  # the index may have moved meanwhile: the queue as it is now
        pending, active = await _unfinished(jobs, index)
        others = list(active.values())
        holding, hang_ids = index.held_nodes(), index.hang_watched()
    if from_index:
        claims = index.claims()
    else:
        pending = list(pending)
        claims = keep.claims(pending)
    # (`active`: the jobs that hold nodes; a PENDING job holds none, so none of it is missing)
    if settled is not None:
        settled.keep_only(active)
    # (kept by the index as jobs change: a pass need not look through every running job for them)
    running = (index.lowest_running_priority(), index.yielding()) if from_index else None
    # The shares of the cluster, as the index counts them (GPUs are not: counted by the pass)
    used = index.shares(tenants or quotas.Tenants()) \
        if from_index and not (tenants and quotas.counts_gpus(tenants)) else None
    # (a victim's mark for a job that no longer waits is withdrawn: `decide.preempt.withdraw`)
    waits = functools.partial(is_waiting, index) if from_index else {j.id for j in pending}.__contains__
    more = await _schedule(jobs, live_nodes, pending, active, cfg, last_reason, graced, fence,
                           settled, index.revision_of if from_index else None, claims, copies, gone,
                           running, tenants, used, index.waiting_owners() if from_index else None,
                           waits, holding)
    if watches is not None:
        await watch_hangs(jobs, active, watches, fence, stall_after_s, hang_ids)
    return more


async def _schedule(jobs: JobStore, live_nodes: dict[str, NodeRecord], pending: Iterable[JobRecord],
                    active: dict[str, JobRecord], cfg: SchedulerConfig, last_reason: dict[str, str],
                    graced: frozenset[str], fence: dict[str, int] | None = None,
                    settled: Settled | None = None,
                    revision_of: Callable[[str], int] | None = None,
                    claims: dict[str, JobRecord] | None = None,
                    copies: dict[str, list[MemorySnapshot]] | None = None,
                    gone: dict[str, str] | None = None,
                    running: tuple[int | None, list[JobRecord]] | None = None,
                    tenants: quotas.Tenants | None = None, used: quotas.Usage | None = None,
                    waiting_owners: list[str] | None = None,
                    waits: Callable[[str], bool] | None = None,
                    holding: Collection[str] | None = None) -> bool:
    """Plan (on the queue as read: `pending` is consumed here, before any await) and apply
    each plan; `active` (the jobs that hold nodes, by id) takes in the changes made. Returns
    whether it started as many jobs as a pass may (more may wait).

    Plans made on records the index has at a known revision (`revision_of`) are written
    together first (`JobStore.write_many`: a transaction per few dozen jobs, comparing each
    one's revision), so that a pass that starts a thousand jobs does not make three thousand
    round trips; a plan whose transaction lost, or made on a record read otherwise, goes
    through `JobStore.update`, which re-reads the job and decides again. (`revision_of` is
    asked before any await: the records and their revisions are the index's of one moment.)
    `holding`: the nodes the jobs of `active` hold, as the index counts them
    (`JobIndex.held_nodes`; None: found from their members)."""
    originals: dict[str, JobRecord] = dict(active)
    for j in (claims or {}).values():  # a job held for is planned on this record (`keep.holding`)
        originals[j.id] = j
    queue = (j for j in pending if _note(originals, j))
    plans = schedule_queue(queue, list(active.values()), live_nodes, jobs.clock(), cfg, graced,
                           settled, MAX_STARTS_PER_PASS, claims, copies, gone, running=running,
                           tenants=tenants, shares=used, waiting_owners=waiting_owners, waits=waits,
                           holding=holding)
    reserved: dict[str, str] | None = None  # node -> the waiting job it is held for (`decide.keep`)
    starts = sum(1 for p in plans if originals[p.job.id].state is JobState.PENDING)
    held = holders(active.values()) if plans else {}
    batch = [(p, originals[p.job.id], revision_of(p.job.id)) for p in plans
             if revision_of is not None and p.job.id in originals]
    batch = [(p, job, rev) for p, job, rev in batch if rev]
    written: dict[str, JobRecord] = {}
    if batch:
        got = await jobs.write_many([(job, rev, Change(p.job, p.events)) for p, job, rev in batch],
                                    fence)
        written = {p.job.id: new for (p, _, _), new in zip(batch, got, strict=True) if new is not None}
    for p in plans:
        job_id = p.job.id
        new = written.get(job_id)
        if new is None:
            if reserved is None:
                reserved = keep.reserved(live_nodes, claims or {}, live_nodes, jobs.clock())

            def decide(current: JobRecord, reserved: dict[str, str] = reserved,
                       mark: Preemption | None = _new_mark(p, originals[job_id]),
                       offered: Sequence[str] = p.offered, loan: Borrow | None = p.loan) -> Change | None:
                # Re-decide on what is stored now, on the free nodes the pass offered it (its
                # limits: backfill's too) that others do not hold now (as members, or held for a
                # waiting job) and its quotas leave it (`free_again`). A victim marked in this
                # pass is marked again on it, if the mark still holds there, and one whose
                # preemptor no longer waits has its mark withdrawn (`decide.preempt`).
                now = jobs.clock()
                marked = preempt.remark(current, mark, now) \
                    if mark is not None and preempt.still_applies(current, mark) \
                    else withdrawn(current, waits, now, lambda n: bool(held.get(n, set()) - {current.id}))
                free = free_again(current, offered, held, live_nodes, reserved, active.values(), tenants)
                again = plan(current if marked is None else marked[0], live_nodes, free, now, cfg, graced,
                             (copies or {}).get(current.id, ()), gone)
                if marked is not None:
                    again = with_mark(marked, again)
                if loan is not None:  # (it is marked borrower of the kept nodes it takes: `decide.backfill`)
                    again = lent(again, current, loan, now)
                return None if again is None else Change(again.job, again.events)

            try:
                new = await jobs.update(job_id, decide, fence)
            except StaleLeader:
                raise
            except FtrainError as exc:
                log.warning("scheduling job %s failed: %s", job_id, exc)
                continue
        old = active.pop(job_id, None)
        for n in [] if old is None else old.members:
            held.get(n, set()).discard(job_id)
        if new.state.is_active():
            active[job_id] = new
            for n, m in new.members.items():
                if m.holds_node():
                    held.setdefault(n, set()).add(job_id)
        if new.state.is_terminal():
            await _cleanup(jobs, job_id, fence)
        if last_reason.get(job_id) != p.reason:
            log.info("job %s: %s", job_id, p.reason)
            last_reason[job_id] = p.reason
    for job_id in last_reason.keys() - active.keys():  # finished (and in time deleted)
        del last_reason[job_id]
    return starts >= MAX_STARTS_PER_PASS


def is_waiting(index: JobIndex, job_id: str) -> bool:
    """The job is PENDING, as the index has it."""
    job = index.get(job_id)
    return job is not None and job.state is JobState.PENDING


def _new_mark(p: Plan, original: JobRecord) -> Preemption | None:
    """The preemption `p` marks its job with in this pass (None: none new)."""
    return p.job.preempt if p.job.preempt is not None and original.preempt is None else None


async def memory_copies(jobs: JobStore, job_id: str) -> list[MemorySnapshot]:
    """What each node's memory tier holds of the job, as its worker last reported (one range read)."""
    return [MemorySnapshot.model_validate_json(e.value)
            async for e in jobs.kv.scan_prefix(jobs.keys.memory_copies(job_id))]


def _note(seen: dict[str, JobRecord], job: JobRecord) -> bool:
    """Keep `job` as read (the record its plan is made on); always True (a filter's step)."""
    seen[job.id] = job
    return True


async def progress_steps(jobs: JobStore, watched: list[JobRecord]) -> list[int | None]:
    """Rank 0's last reported step of each job: the one place the hang watch reads progress."""
    return [None if p is None else p.step for p in await jobs.progress(watched)]


async def watch_hangs(jobs: JobStore, active: dict[str, JobRecord],
                      watches: dict[str, hangs.Watch], fence: dict[str, int] | None = None,
                      stall_after_s: float | None = None, hang_ids: Collection[str] | None = None) -> None:
    """Advance the hang clock of each job that has one; restart (or fail) the jobs that hang.
    `stall_after_s`: a gap between two passes longer than this is this control plane's own
    stall, which the clocks do not count (`hangs.unheard`). `hang_ids`: the jobs of `active`
    with a hang timeout (`JobIndex.hang_watched`; None: found from every job)."""
    # (oldest first, as `active` has them)
    jobs_with = active.values() if hang_ids is None else \
        sorted((active[i] for i in hang_ids if i in active), key=lambda j: (j.created_at, j.id))
    # (A PENDING job is never watched: its clock starts afresh when it runs, `hangs.observe`.)
    watched = [j for j in jobs_with if j.spec.hang_timeout_s is not None
               and not j.state.is_terminal() and j.state is not JobState.PENDING]
    for job_id in watches.keys() - {j.id for j in watched}:
        del watches[job_id]
    if not watched:
        return
    now = jobs.clock()
    for job, step in zip(watched, await progress_steps(jobs, watched), strict=True):
        seen = watches[job.id] = hangs.observe(watches.get(job.id), job, step, now, stall_after_s)
        if hangs.decide_hang(job, seen.step, seen.since, now) is None:
            continue

        def decide(current: JobRecord, seen: hangs.Watch = seen) -> Change | None:
            # A job that moved on since it was read (a new group, a planned change) is no hang.
            again = hangs.observe(seen, current, seen.step, now)
            return hangs.decide_hang(current, again.step, again.since, now)

        try:
            new = await jobs.update(job.id, decide, fence)
        except StaleLeader:
            raise
        except FtrainError as exc:
            log.warning("restarting hung job %s failed: %s", job.id, exc)
            continue
        log.info("job %s: %s", job.id, new.reason)
        active[job.id] = new
        watches[job.id] = hangs.observe(None, new, step, now)
        if new.state.is_terminal():
            await _cleanup(jobs, job.id, fence)


async def _cleanup(jobs: JobStore, job_id: str, fence: dict[str, int] | None = None) -> None:
    """A finished job's rendezvous keys are of no further use. Fenced like every scheduler
    write: a replica that lost the lead deletes nothing (StaleLeader stops its loop)."""
    with contextlib.suppress(StoreUnavailable):
        await delete_rendezvous(jobs.kv, jobs.keys, job_id, fence)


class Leadership:
    """Leader election over one etcd key bound to a lease (one scheduler at a time) of
    `ttl_s`, the control plane's `Settings.leader_ttl_s`.

    `keep_lead` calls `hold` every RENEW_EVERY of the TTL (a replica that does not lead: at
    least every second), in a task of its own beside the scheduler's passes; the scheduler
    and the other leader-only loops read `fence()`: the leader key at the revision this
    replica wrote it (its term), to compare in their transactions, so that a replica that
    lost the lead without noticing writes nothing (`service.retention`,
    `service.compaction`).

    The lead also ends here before it can end in etcd: a replica counts itself leader only
    until `ttl_s` less STOP_MARGIN of it after it *sent* the last grant or keep-alive that
    etcd confirmed (etcd starts the lease's TTL when it receives that, later), so a replica
    cut off from etcd stops acting (`fence()` is None, the scheduler passes stop) at least
    STOP_MARGIN of a TTL before its lease can lapse and another replica take the lead, even
    when its etcd calls hang for longer than that. (Without the margin the two moments
    could meet: etcd received the last keep-alive at once, the next replica asked just as
    the lease lapsed; tests/faults/test_leader_cut.py measured 0.19 s between them once.)

    The election's calls go on a connection of their own (`KeyValue.own_connection`), so
    that the nodes' keep-alives, a thousand at a time on the shared keep-alive stream
    (`service.heartbeats`), and the request load cannot hold the leader's keep-alive back
    past its lease (it lapsed three times in one loaded bench/api.py run when it shared
    that stream).
    """

    def __init__(self, kv: KeyValue, key: str, ttl_s: int,
                 clock: Callable[[], float] = time.monotonic, own_connection: bool = True):
        self._shared_kv = kv
        self.kv = kv.own_connection() if own_connection else kv
        self.key = key
        self.ttl_s = ttl_s
        self.clock = clock
        self.lease_id: int | None = None
        # Who leads, for people and tests reading the key: host, PID, then what makes it unique.
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}-{time.time_ns()}"
        self.leading = False
        self._fence: Fence | None = None
        self._until = 0.0  # clock() after which this replica no longer counts itself leader
        self._timer: asyncio.TimerHandle | None = None  # notes that moment when it comes

    def _lapsed(self) -> bool:
        return self.clock() >= self._until

    def fence(self) -> Fence | None:
        """{leader key: its mod_revision} (with this replica's identity and term) while this
        replica knows itself leader, else None."""
        if self._fence is not None and self._lapsed():
            self.lost(f"its lease was not confirmed within {self.ttl_s * (1 - STOP_MARGIN):g} s "
                      f"(its TTL {self.ttl_s} s less the stop margin)")
        return self._fence

    def _lead(self, revision: int, sent: float) -> None:
        if self._fence is None or self._fence.term != revision:
            log.info("leading (term %d) as %s", revision, self.identity)
        self.leading, self._until = True, sent + self.ttl_s * (1 - STOP_MARGIN)
        self._fence = Fence(self.key, revision, self.identity, self._lapsed)
        # Stop at that moment even while this replica's etcd calls hang (the lapse is said
        # in the log when it happens, not when a call times out).
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, self._until - self.clock()) + 0.001
        self._timer = asyncio.get_running_loop().call_later(delay, self.fence)

    async def hold(self) -> bool:
        """Try to be (or stay) leader; True while this replica leads."""
        sent = self.clock()
        if self.lease_id is not None and await self.kv.refresh_lease(self.lease_id):
            entry = await self.kv.get(self.key)
            if entry is not None and entry.value.decode() == self.identity:
                self._lead(entry.mod_revision, sent)
                return self.fence() is not None
        self.lost("its lease lapsed")
        sent = self.clock()
        self.lease_id = await self.kv.grant_lease(self.ttl_s)
        won, entry = await self.kv.commit_read(
            {self.key: 0}, [Put(self.key, self.identity.encode(), self.lease_id)], self.key)
        if won and entry is not None:
            self._lead(entry.mod_revision, sent)
        return self.fence() is not None

    def lost(self, why: str = "etcd did not answer") -> None:
        """This replica does not lead, or cannot tell (etcd did not answer)."""
        if self._fence is not None:
            log.warning("stopped leading (term %d): %s", self._fence.term, why)
        self.leading, self._fence = False, None

    async def release(self) -> None:
        """Give up the lead (the next replica need not wait for the lease to lapse)."""
        self.lost("stopping")
        if self._timer is not None:
            self._timer.cancel()
        if self.lease_id is not None:
            with contextlib.suppress(StoreUnavailable):
                await self.kv.revoke_lease(self.lease_id)
        if self.kv is not self._shared_kv:
            await self.kv.close()


async def keep_lead(leadership: Leadership, every_s: float, wake: asyncio.Event | None = None) -> None:
    """Hold the lead (every RENEW_EVERY of its TTL), or try to take it (every `every_s`), apart
    from the scheduler's passes:
    a pass that starts a thousand jobs takes seconds, and the lead must not lapse meanwhile.
    (Kept between passes, it lapsed under bench/api.py's submissions, and each new term's
    first passes read every unfinished job from etcd, which stalled the API for seconds.)
    `wake` is set when the lead is taken or comes back (the scheduler plans at once)."""
    leading = False
    while True:
        try:
            if await leadership.hold() and not leading and wake is not None:
                wake.set()
            leading = leadership.fence() is not None
        except StoreUnavailable as exc:
            leading = False
            leadership.lost(exc.message)  # compaction and retention stop too, until hold() answers
            log.warning("scheduler paused: %s", exc.message)
        # The leader renews every RENEW_EVERY of its TTL; a replica that does not lead tries
        # at least every second, so that it takes over soon after a lead lapses.
        await asyncio.sleep(leadership.ttl_s * RENEW_EVERY if leading else every_s)


async def run(jobs: JobStore, nodes: NodeStore, index: JobIndex, leadership: Leadership,
              interval_s: float, cfg: SchedulerConfig | None = None,
              passes: PassTimes | None = None, contact: Contact | None = None,
              tenancy: Tenancy | None = None) -> None:
    """Schedule while this replica leads (`keep_lead`): on every change (of a job, a node, a
    quota) and at least every `interval_s`; in a new term, once the job index has the writes
    of the term before."""
    cfg = cfg or SchedulerConfig()
    passes = passes if passes is not None else PassTimes()
    wake = asyncio.Event()
    index.wake_on_change(wake)
    if tenancy is not None:
        tenancy.wake_on_change(wake)
    every_s = min(1.0, leadership.ttl_s / 4)
    # Node changes wake the scheduler once the node view has them (NodeStore.follow).
    helpers = [asyncio.create_task(nodes.follow(wake)),
               asyncio.create_task(keep_lead(leadership, every_s, wake))]
    last_reason: dict[str, str] = {}
    watches: dict[str, hangs.Watch] = {}
    watches_term: int | None = None  # the term whose passes keep `watches`
    last_settle = 0.0
    contact = contact or Contact(jobs.kv, jobs.keys.contact, node_ttl_s=nodes.ttl_s)
    missing_since: dict[str, float] = {}
    settled = Settled()
    caught_up: int | None = None  # the term in which the index was found to have every write
    pass_s = 0.0  # how long the last pass took
    last_pass = float("-inf")  # monotonic: when the last pass started
    woken = False  # by a change (not by the interval)
    last: tuple | None = None  # what the last pass saw, when it left nothing to do meanwhile
    try:
        while True:
            wake.clear()  # before the pass: a change it does not see wakes the next one
            fence = leadership.fence()  # None: not leading (or the lead lapsed here)
            # (`view_changes`, not `version`: the version is the count of the view the last
            # pass copied, which a skipped pass never updates, so a node registering after
            # skipped passes looked like no change at all and waited for the interval.)
            seen = (fence and fence.term, index.changes, nodes.view_changes,
                    tenancy and tenancy.changes)
            # Until the interval's pass is due (it runs for the clocks of planned changes and
            # hangs, however many wake-ups come meanwhile): nothing to plan when woken by new
            # PENDING jobs only while no node was free (each submission woke a pass over
            # every running job), or when woken by the contact's clock alone.
            idle = fence is not None and fence.term == caught_up and \
                time.monotonic() - last_pass < interval_s and (not woken or seen == last)
            try:
                contact.observe()
                if time.monotonic() - last_settle > every_s:
                    await contact.settle(fence)
                    last_settle = time.monotonic()
                if fence is not None and fence.term != caught_up:
                    # The last writes of the replica that led before may still be on their
                    # way to this index: plan once it has them.
                    if await index.catch_up(CATCH_UP_S):
                        caught_up = fence.term
                    elif index.ready.is_set():
                        log.warning("the job index did not catch up with etcd within %g s; "
                                    "not scheduling yet", CATCH_UP_S)
                        fence = None
                    # (not ready: the pass reads etcd itself, `queue`)
                if fence is not None and not idle:
                    started = time.perf_counter()
                    last_pass = time.monotonic()
                    last = None
                    if fence.term != watches_term:  # led again (its lease lapsed, say, while stopped)
                        watches.clear()
                        watches_term = fence.term
                    if await tick(jobs, nodes, index, cfg, last_reason, watches, contact,
                                  missing_since, fence, settled=settled,
                                  stall_after_s=interval_s + STALL_MARGIN_S, tenancy=tenancy):
                        wake.set()  # jobs left to start: another pass after the gap
                    elif not settled.ready_left:
                        last = seen  # as it was before the pass: a change during it runs the next
                    pass_s = time.perf_counter() - started
                    passes.record(pass_s)
                    contact.reached()
                elif fence is None:
                    watches.clear()  # another replica keeps the clocks while it leads
                    missing_since.clear()
                    settled = Settled()
                    pass_s = 0.0
            except StoreUnavailable as exc:
                fence = None
                leadership.lost(exc.message)  # compaction and retention stop too, until hold() answers
                log.warning("scheduler paused: %s", exc.message)
            except StaleLeader as exc:
                fence = None
                leadership.lost(exc.message)
                log.warning("scheduler stopped: %s", exc.message)
            except Exception:
                log.exception("scheduler tick failed; retrying")
            if fence is not None and not idle:  # coalesce: what wakes it meanwhile is planned next
                await asyncio.sleep(max(MIN_PASS_GAP_S, pass_s))
            # Wait for a change, or the interval's pass; the contact note (`every_s`) is
            # kept meanwhile without a pass.
            due = max(0.0, last_pass + interval_s - time.monotonic()) if fence is not None else every_s
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), max(0.001, min(due, every_s)))
            woken = wake.is_set()
    finally:
        for helper in helpers:
            helper.cancel()
        for helper in helpers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await helper
        await leadership.release()
