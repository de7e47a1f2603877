"""Scheduling decisions: which nodes a job gets, and what becomes of it as nodes come and go.

`plan(job, nodes, free, now, cfg)` looks at one job, the live nodes and the nodes no
job holds, and returns the job as it should be next (with the events that explain the
change), or None when nothing is to be done. It does no I/O and reads no clock, so it
is tested with a table of cases and a fixed `now`. `schedule` plans every job, pending
ones first; the loop that applies the plans is `service.scheduler`.

Gang scheduling: a PENDING job starts only when `nodes.min` nodes are free and takes up
to `nodes.max`; waiting jobs are offered nodes in priority order, then oldest first
(`decide.order`), and one of higher priority that cannot start takes nodes from running jobs
of lower priority (`decide.preempt`: they shrink or are suspended, `_yield_nodes`). A running
job below `max` is given free nodes (scale-up) once no pending job can use them. Only nodes
with what the job asks of each (`gpus_per_node`: `placement.fits`) are taken. A lost node (its lease lapsed) leaves the job; if fewer than
`min` remain, the job goes back to PENDING, keeping its snapshots, and the survivors are
released; those that hold its memory copy are held for it a while (`keep`: it is offered
them first, and no other job is). Not a member in `graced`, though: after an outage in
which no control plane could hear the nodes, one whose lease lapsed in it is waited for, as
if present (`liveness.graced`).
Planned changes (a join, a drain, a cancel) first ask rank 0 for a snapshot at a step
boundary (`job.control`), when the job runs the ftrain runtime, so no step is lost.
A lost node that stops the group is a fault (RECOVERING until the new group's first step);
a join, a drain or a change called off is not: the job stays RUNNING with the change as its
reason until then (`recovery.regroup`).
A member whose torchrun died by itself (SIGKILLed, crashed) is a fault too: one restart of
the job's workers under a new attempt, the job FAILED only once `max_restarts` are spent.
When the members' reports end the job is `outcome.by_members`. A member that finished
(its workers exited 0) keeps its node until the job ends and counts towards `min`; once
one has, the job is ending and none of the above changes its membership any more
(`outcome` has the rules and why).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from service.decide import backfill, giveback, keep, outcome, preempt, quotas
from service.decide.backfill import ends_by
from service.decide.order import queue_key
from service.decide.placement import fits
from service.decide.recovery import is_regrouping, regroup
from service.decide.shares import served
from service.decide.state import note, transition, uses_runtime
from service.models import (
    Borrow,
    Control,
    EventView,
    JobRecord,
    JobState,
    MemberStatus,
    NodeRecord,
    NodeState,
)
from worker.protocol import ControlAction, MemorySnapshot, Timeouts

S = JobState


@dataclass(frozen=True)
class SchedulerConfig:
    # How long rank 0 gets to snapshot before a planned change goes ahead without it: the
    # control plane's `Timeouts.control_ack_timeout_s`, which a leaving agent waits out too.
    control_ack_timeout_s: float = Timeouts.model_fields["control_ack_timeout_s"].default
    # A cancel waits this long for rank 0's final snapshot before workers are stopped.
    cancel_ack_timeout_s: float = 4.0
    # A job that went back to PENDING holds the survivors that keep its memory copy this long
    # (no other job is given them); shorter than the agent's MEMORY_KEEP_S. `decide.keep` says why.
    memory_hold_s: float = 120.0
    # The queue policy (`Settings.queue_policy`): "fifo" serves the queue in submission order
    # (no priority, fair share or preemption), "priority" as `decide.order` says.
    fifo: bool = False
    # A running job gives nodes back by fair share only once it has run this long (`decide.giveback`).
    fair_share_settle_s: float = giveback.SETTLE_S


@dataclass
class Plan:
    job: JobRecord
    events: list[EventView]
    reason: str
    # The free nodes the pass offered the job, its limits applied (its quotas, backfill for the
    # queue's head, the nodes held for other jobs): made again on a re-read record, the plan
    # takes none but these (`free_again`).
    offered: Sequence[str] = ()
    # The free nodes kept for the queue's head that the pass lets the job borrow (`decide.backfill`):
    # the plan marks it borrower of those it takes (`lent`), on a re-read record too.
    loan: Borrow | None = None


class _Draft:
    """A job being changed by `plan`: collects the new fields and the events."""

    def __init__(self, job: JobRecord, now: float):
        self.job = job
        self.now = now
        self.events: list[EventView] = []
        self.reasons: list[str] = []

    def update(self, **fields) -> None:
        self.job = self.job.model_copy(update={**fields, "updated_at": self.now})

    def move(self, target: JobState, reason: str, **fields) -> None:
        self.job, event = transition(self.job, target, reason, self.now)
        if fields:
            self.update(**fields)
        self.events.append(event)
        self.reasons.append(reason)

    def note(self, reason: str, as_reason: bool = False) -> None:
        self.job, event = note(self.job, reason, self.now, as_reason=as_reason)
        self.events.append(event)
        self.reasons.append(reason)

    def regroup(self, reason: str, planned: bool, **fields) -> None:
        """The group stops for `reason`: a fault (RECOVERING) or a planned change (`recovery`)."""
        self.job, event = regroup(self.job, reason, self.now, planned=planned, **fields)
        self.job = self.job.model_copy(update={"updated_at": self.now})
        self.events.append(event)
        self.reasons.append(reason)

    def result(self, original: JobRecord) -> Plan | None:
        if self.job == original:
            return None
        return Plan(self.job, self.events, "; ".join(self.reasons) or "bookkeeping")


def live_members(job: JobRecord) -> list[str]:
    """Members whose workers run or are about to (not finished, failed or stopped)."""
    return sorted(n for n, m in job.members.items() if m.is_live())


def _control_done(job: JobRecord, now: float, timeout_s: float) -> bool:
    """The pending planned change may go ahead: rank 0 acked it, or cannot/did not in time."""
    c = job.control
    if c is None:
        return True
    return job.control_acked >= c.id or now - c.requested_at > timeout_s


def _request_control(d: _Draft, action: ControlAction, reason: str) -> None:
    c = d.job.control
    if c is not None and c.action == action:
        return
    next_id = max(d.job.control_acked, c.id if c else 0) + 1
    d.update(control=Control(id=next_id, action=action, reason=reason, requested_at=d.now))


# At most this many waiting jobs look for victims in one pass (`schedule_queue`): the queue is
# in priority order, so these are the ones of highest priority that cannot start.
MAX_PREEMPTORS = 8

_PRIORITY = operator.attrgetter("spec.priority")
_PREEMPTED = operator.attrgetter("preempt")  # (a Preemption is truthy, None is not)

LAPSED = "its lease lapsed"  # why a node went, when no other reason was noted (`plan`'s `gone`)


def plan(job: JobRecord, nodes: dict[str, NodeRecord], free: list[str], now: float,
         cfg: SchedulerConfig = SchedulerConfig(), graced: frozenset[str] = frozenset(),
         copies: Sequence[MemorySnapshot] = (), gone: Mapping[str, str] | None = None) -> Plan | None:
    """The next state of `job`, given the live `nodes` and the `free` ones (in preference order).

    Returns None when nothing changes. The plan only ever takes nodes from `free`. A live
    member whose node is not in `nodes` but is in `graced` is not lost yet. `copies`: its
    members' memory reports, read where it may fall below its `min` (`keep.may_fall_short`):
    the survivors that hold a copy are kept for it (`keep.kept_for`). `gone`: why a node
    went, where that is known (its agent stopped, its connection closed); else its lease lapsed.
    """
    if job.state.is_terminal():
        return None
    d = _Draft(job, now)

    if job.state is S.PENDING:
        # (the first `max` that fit, not all of them: a pass may start a job for each free node)
        chosen = list(itertools.islice((n for n in free if nodes[n].state is NodeState.READY
                                        and fits(job.spec, nodes[n])), job.spec.nodes.max))
        if len(chosen) >= job.spec.nodes.min:
            # STARTING until its first step: RUNNING means steps are being made (`decide.recovery`)
            d.move(S.STARTING, f"started on {len(chosen)} node(s): {', '.join(chosen)}",
                   attempt=job.attempt + 1, world_size=0, round_nodes=0, rounds=0,
                   members={n: MemberStatus(nproc=nodes[n].nproc_per_node) for n in chosen},
                   control=None, stopping=False, group=None, group_round=None, regrouping=True,
                   stopped_group=None, kept=None, started_at=now)
        return d.result(job)

    # Active: STARTING, RUNNING, RECOVERING or CANCELLING. First, forget members whose node is gone
    # (a finished member is not lost: nothing of the job runs there any more; nor yet one
    # whose lease lapsed while no control plane could hear it: `graced`).
    members = dict(job.members)
    lost_any = False
    for name in sorted(members):
        if members[name].is_live() and name not in nodes and name not in graced:
            lost_any = True
            why = (gone or {}).get(name, LAPSED)
            stopped = members[name].model_copy(update={"state": "stopped", "reason": "node lost"})
            if d.job.state is not S.CANCELLING:
                stopped = outcome.vanished(members, name, f"node lost ({why})") or stopped
            members[name] = stopped
            d.update(members=dict(members))
            # while re-forming, the loss is what the job now waits on: its reason says so
            d.note(f"node {name} lost ({why})", as_reason=is_regrouping(d.job))
    if lost_any and d.job.state is not S.CANCELLING:  # one restart of the group, however many went
        d.update(restarts_by_cause=d.job.restarts_by_cause.plus("lost_node"))

    states = {m.state for m in d.job.members.values()}

    if d.job.state is S.CANCELLING:
        if not live_members(d.job):
            d.move(S.CANCELLED, "cancelled; every worker has stopped", control=None)
        elif not d.job.stopping:
            if uses_runtime(d.job) and "running" in states:
                _request_control(d, ControlAction.CHECKPOINT_STOP, "cancel requested")
            if not uses_runtime(d.job) or _control_done(d.job, now, cfg.cancel_ack_timeout_s):
                d.update(stopping=True)
        return d.result(job)

    if _past_max_duration(d):
        return d.result(job)
    if _restart_after_a_crash(d, nodes):
        return d.result(job)
    ended = outcome.by_members(d.job.members)
    if ended is not None:
        stop = {"stopping": True} if ended.stops_workers else {}
        d.move(ended.state, ended.reason, control=None, **stop)
        return d.result(job)
    if outcome.finished_members(d.job.members):
        # Ending: the others are finishing; nothing of the job is restarted, moved or added.
        return d.result(job)
    if d.job.preempt is not None:
        _yield_nodes(d, nodes, cfg, copies)
        return d.result(job)

    # Drains: a member on a draining node leaves at a step boundary.
    draining = [n for n in live_members(d.job) if n in nodes and nodes[n].state.takes_no_work()]
    if draining:
        if uses_runtime(d.job) and d.job.control is None:
            _request_control(d, ControlAction.CHECKPOINT_PAUSE, f"draining {', '.join(draining)}")
        if not uses_runtime(d.job) or _control_done(d.job, now, cfg.control_ack_timeout_s):
            # The others restart under a new attempt: a paused rank 0 would not notice a
            # peer leaving (it is in no collective), and a fresh rendezvous forms at once.
            members = {n: MemberStatus(nproc=m.nproc) for n, m in d.job.members.items()
                       if m.is_live() and n not in draining}
            gone = ("quarantined" if all(nodes[n].state is NodeState.QUARANTINED for n in draining)
                    else "drained")
            d.regroup(f"node(s) {', '.join(draining)} {gone}; the others go on from the last snapshot",
                      planned=True, members=members, control=None, attempt=d.job.attempt + 1, rounds=0,
                      round_nodes=0, world_size=0, restarts_by_cause=d.job.restarts_by_cause.plus("resize"))

    swap = None if draining else straggler_swap(d.job, nodes, free)
    if swap is not None:
        slow, fresh = swap
        _request_control(d, ControlAction.CHECKPOINT_PAUSE, f"replacing straggler node {slow} with {fresh}")
        if _control_done(d.job, now, cfg.control_ack_timeout_s):
            members = {n: MemberStatus(nproc=m.nproc) for n, m in d.job.members.items()
                       if m.is_live() and n != slow}
            members[fresh] = MemberStatus(nproc=nodes[fresh].nproc_per_node)
            d.regroup(f"straggler node {slow} replaced by {fresh}; the group goes on from the step it "
                      "paused at", planned=True, members=members, control=None, attempt=d.job.attempt + 1,
                      rounds=0, round_nodes=0, world_size=0, stragglers=[],
                      replaced=[*d.job.replaced, slow][-REPLACED_KEPT:])

    live = live_members(d.job)
    lost = [n for n in job.members if job.members[n].is_live() and n not in nodes and n not in graced]
    if lost and len(live) >= d.job.spec.nodes.min and d.job.round_nodes > len(live):
        # The survivors have not re-formed without the lost node (NCCL blocks in a collective
        # with a dead peer instead of failing): restart them under a fresh rendezvous.
        d.regroup(f"node(s) {', '.join(sorted(lost))} lost: restarting the {len(live)} remaining "
                  "node(s) under a new rendezvous", planned=False,
                  attempt=d.job.attempt + 1, rounds=0, round_nodes=0, world_size=0, control=None,
                  members={n: MemberStatus(nproc=d.job.members[n].nproc) for n in live})
    if len(live) < d.job.spec.nodes.min:
        kept = keep.kept_for(live, copies, nodes, now, cfg.memory_hold_s)
        held = "" if kept is None else f"; {keep.describe(kept)}"
        d.move(S.PENDING, f"only {len(live)} of the {d.job.spec.nodes.min} nodes it needs are left; "
               f"waiting for nodes (snapshots are kept){held}",
               members={}, world_size=0, round_nodes=0, control=None, group=None, group_round=None,
               regrouping=False, kept=kept)
        return d.result(job)

    # Scale-up: free ready nodes join a job below its max.
    room = max(d.job.spec.nodes.max - len(live), 0)
    # (the first `room` of them, not all: a full job would list every free node on every pass)
    joining = list(itertools.islice((n for n in free if nodes[n].state is NodeState.READY
                                     and fits(job.spec, nodes[n]) and n not in d.job.replaced), room))
    if joining and not draining and swap is None:
        if uses_runtime(d.job) and "running" in states:
            _request_control(d, ControlAction.CHECKPOINT_PAUSE, f"node(s) {', '.join(joining)} joining")
        if not uses_runtime(d.job) or _control_done(d.job, now, cfg.control_ack_timeout_s):
            members = dict(d.job.members)
            for name in joining:
                members[name] = MemberStatus(nproc=nodes[name].nproc_per_node)
            d.regroup(f"node(s) {', '.join(joining)} joined; scaling up", planned=True,
                      members=members, control=None, restarts_by_cause=d.job.restarts_by_cause.plus("resize"))
    elif d.job.control is not None and d.job.control.action is ControlAction.CHECKPOINT_PAUSE \
            and not draining and swap is None and _control_done(d.job, now, cfg.control_ack_timeout_s):
        # The nodes it paused for went elsewhere: restart the group from the snapshot it took.
        d.regroup("the planned change was called off; restarting from the committed snapshot",
                  planned=True, control=None, attempt=d.job.attempt + 1, rounds=0, round_nodes=0,
                  restarts_by_cause=d.job.restarts_by_cause.plus("resize"),
                  members={n: MemberStatus(nproc=m.nproc) for n, m in d.job.members.items()
                           if m.is_live()})
    return d.result(job)


def _yield_nodes(d: _Draft, nodes: Mapping[str, NodeRecord], cfg: SchedulerConfig,
                 copies: Sequence[MemorySnapshot]) -> None:
    """Give the nodes of `d.job.preempt` to the job of higher priority that takes them
    (`decide.preempt`): a runtime job at a step boundary (rank 0 snapshots first), a plain
    script once its workers stopped (SIGTERM, then `spec.preempt_grace_s`); then go on on the
    others under a new attempt (a shrink), or back to PENDING with the state kept (a suspension)."""
    job, pre = d.job, d.job.preempt
    assert pre is not None
    live = live_members(job)
    if uses_runtime(job):
        if job.control is None and any(job.members[n].state == "running" for n in live):
            _request_control(d, ControlAction.CHECKPOINT_PAUSE, f"preempted by {pre.describe()}")
        if not _control_done(d.job, d.now, cfg.control_ack_timeout_s):
            return
        staying = [n for n in live if n not in pre.leave and n in nodes]
    else:
        if live:  # SIGTERM and the grace (`Assignment.cancel_grace_s` is the spec's preempt_grace_s)
            if not job.stopping:
                d.update(stopping=True)
            return
        staying = sorted(n for n, m in job.members.items() if m.state == "stopped"
                         and n not in pre.leave and n in nodes)
    counts = d.job.restarts_by_cause.plus("resize" if pre.fair_share else "preemption")
    back = "back (it borrowed them)" if preempt.gives_back(job, pre) else ""
    if pre.suspend or len(staying) < job.spec.nodes.min:
        kept = keep.kept_for(live, copies, nodes, d.now, cfg.memory_hold_s)
        went = f"gave its nodes {back} to" if back else "its nodes went to"
        d.move(S.PENDING, f"suspended: {went} {pre.describe()}; waiting for nodes "
               "(its snapshots are kept; it resumes from where it stopped)",
               members={}, world_size=0, round_nodes=0, control=None, group=None, group_round=None,
               regrouping=False, stopping=False, preempt=None, restarts_by_cause=counts,
               # its copy is preferred when it resumes, but not held from the job that took the nodes
               kept=None if kept is None else kept.model_copy(update={"until": d.now}))
        return
    gave = (f"gave node(s) {', '.join(pre.leave)} {back + ' ' if back else ''}to {pre.describe()}; the others "
            "go on from the last snapshot") if pre.leave else f"{pre.describe()} took none of its nodes; it goes on on all of them"
    d.regroup(gave, planned=True, control=None, attempt=d.job.attempt + 1, rounds=0,
              round_nodes=0, world_size=0, stopping=False, preempt=None, restarts_by_cause=counts,
              borrowed=_still_borrowed(job, staying),
              members={n: MemberStatus(nproc=d.job.members[n].nproc) for n in staying})


def _still_borrowed(job: JobRecord, staying: Collection[str]) -> Borrow | None:
    """What `job` still borrows once it goes on on `staying` alone (None: nothing)."""
    b = job.borrowed
    rest = [] if b is None else [n for n in b.nodes if n in staying]
    return b.model_copy(update={"nodes": rest}) if rest else None


REPLACED_KEPT = 16  # straggler nodes a job remembers not to take back


def straggler_swap(job: JobRecord, nodes: Mapping[str, NodeRecord], free: list[str]) -> tuple[str, str] | None:
    """(a straggler's node, a free node to take its place) for a job that asks for it
    (`straggler_action: replace`, docs/stragglers.md); None while there is none, or no free
    node that fits. The first flagged rank's node, if it is a live member."""
    if job.spec.straggler_action != "replace" or job.state is not S.RUNNING:
        return None
    live = set(live_members(job))
    slow = next((s.node for s in job.stragglers if s.node in live), None)
    fresh = next((n for n in free if n in nodes and nodes[n].state is NodeState.READY
                  and fits(job.spec, nodes[n]) and n not in job.replaced and n != slow), None)
    return None if slow is None or fresh is None else (slow, fresh)


def _past_max_duration(d: _Draft) -> bool:
    """A job still running past its `max_duration_s` is stopped and FAILED (True: it ended)."""
    end = ends_by(d.job)
    if end is None or d.now < end:
        return False
    limit = d.job.spec.max_duration_s
    d.move(S.FAILED, f"ran past its max_duration_s={limit:g} (started {d.now - d.job.started_at:.0f} s "
           "ago); its workers are stopped", control=None, stopping=True)
    return True


def _restart_after_a_crash(d: _Draft, nodes: Mapping[str, NodeRecord]) -> bool:
    """A member's torchrun died by itself (`outcome.crashed`): a fault of that node's process
    tree, not of the job. One restart of the job's workers, under a new attempt on the live
    members and the crashed ones whose node is still here (their agents start torchrun
    again); once `max_restarts` are spent, the job fails with the crash as its reason (True:
    it ended)."""
    crashes = outcome.crashed(d.job.members)
    if not crashes:
        return False
    # The first by name, as `outcome.by_members`; its report's first line (the headline),
    # what is done about it, then the lines it quoted (the event's detail).
    name, report = crashes[0]
    headline, _, quoted = report.partition("\n")

    def why(what: str) -> str:
        return f"node {name}: {headline}; {what}" + (f"\n{quoted}" if quoted else "")

    spent = outcome.by_restarts(d.job.restarts, d.job.spec.max_restarts)
    if spent is not None:
        d.move(spent.state, why(spent.reason), control=None, stopping=spent.stops_workers)
        return True
    restarts = d.job.restarts + 1
    crashed_here = {n for n, _ in crashes if n in nodes}
    again = [n for n, m in d.job.members.items() if m.is_live() or n in crashed_here]
    d.regroup(why(f"restarting the workers ({restarts} of {d.job.spec.max_restarts})"),
              planned=False, attempt=d.job.attempt + 1, rounds=0, round_nodes=0,
              restarts_by_cause=d.job.restarts_by_cause.plus("failure"),
              world_size=0, control=None,
              members={n: MemberStatus(nproc=d.job.members[n].nproc) for n in sorted(again)})
    return False


def free_nodes(jobs: Iterable[JobRecord], nodes: dict[str, NodeRecord]) -> list[str]:
    """Live nodes that no active job holds (a finished member holds its node), by name."""
    held = {n for j in jobs if j.state.is_active() for n, m in j.members.items() if m.holds_node()}
    return sorted(n for n in nodes if n not in held)


def holders(jobs: Iterable[JobRecord]) -> dict[str, set[str]]:
    """node -> the ids of the active jobs that hold it (one, unless records disagree)."""
    held: dict[str, set[str]] = {}
    for j in jobs:
        if j.state.is_active():
            for n, m in j.members.items():
                if m.holds_node():
                    held.setdefault(n, set()).add(j.id)
    return held


def free_for(job: JobRecord, held: dict[str, set[str]], nodes: dict[str, NodeRecord]) -> list[str]:
    """`free_nodes` of `job` as it is now and the other jobs of `held` (`holders`): what a
    decision on a re-read record may take, without going through every job again."""
    own = {n for n, m in job.members.items() if m.holds_node()} if job.state.is_active() else set()
    return sorted(n for n in nodes if n not in own and not held.get(n, set()) - {job.id})


def offer_to(job: JobRecord, free: Sequence[str], held: Mapping[str, str]) -> list[str]:
    """`free` as offered to `job`: without the nodes held for another waiting job (`held`:
    node -> that job's id, `keep.reserved`), the ones that hold its own copy first."""
    return keep.prefer(job, [n for n in free if held.get(n, job.id) == job.id])


def within_quotas(job: JobRecord, free: Sequence[str], active: Iterable[JobRecord],
                  nodes: Mapping[str, NodeRecord], tenants: quotas.Tenants | None) -> Sequence[str]:
    """`free` as far as `job`'s owner's quotas let it take them, the `active` jobs holding
    what they hold: a decision on a re-read record (`offer_to`)."""
    if tenants is None or not (tenants.users or tenants.teams):
        return free
    holding = itertools.chain((j for j in active if j.id != job.id), [job])
    return quotas.trim(job, free, nodes, quotas.limits(job.owner, quotas.usage(holding, nodes, tenants)))


def free_again(job: JobRecord, offered: Collection[str], held: dict[str, set[str]],
               nodes: dict[str, NodeRecord], reserved: Mapping[str, str], active: Iterable[JobRecord],
               tenants: quotas.Tenants | None) -> Sequence[str]:
    """The free nodes for a plan of `job` made again on its re-read record (its write lost a
    race): those the pass `offered` it (`Plan.offered`: the pass's limits on it, backfill's
    included) that no other job holds now (`free_for`: `held`, `holders`), not held for another
    waiting job (`offer_to`: `reserved`), as far as its quotas let it now (`within_quotas`)."""
    offered = set(offered)
    free = [n for n in free_for(job, held, nodes) if n in offered]
    return within_quotas(job, offer_to(job, free, reserved), active, nodes, tenants)


def schedule(jobs: list[JobRecord], nodes: dict[str, NodeRecord], now: float,
             cfg: SchedulerConfig = SchedulerConfig(), graced: frozenset[str] = frozenset(),
             copies: Mapping[str, Sequence[MemorySnapshot]] | None = None,
             tenants: quotas.Tenants | None = None) -> list[Plan]:
    """Plans for every job, pending jobs (by priority, fair share and age) served before scale-ups."""
    order = sorted(jobs, key=lambda j: (j.created_at, j.id))
    return schedule_queue(sorted((j for j in order if j.state is S.PENDING), key=lambda j: queue_key(j, cfg.fifo)),
                          [j for j in order if j.state is not S.PENDING], nodes, now, cfg, graced,
                          claims=keep.claims(order), copies=copies, tenants=tenants)


def schedule_queue(pending: Iterable[JobRecord], others: Sequence[JobRecord],
                   nodes: dict[str, NodeRecord], now: float, cfg: SchedulerConfig = SchedulerConfig(),
                   graced: frozenset[str] = frozenset(), settled: Settled | None = None,
                   max_starts: int | None = None, claims: Mapping[str, JobRecord] | None = None,
                   copies: Mapping[str, Sequence[MemorySnapshot]] | None = None,
                   gone: Mapping[str, str] | None = None,
                   running: tuple[int | None, Iterable[JobRecord]] | None = None,
                   tenants: quotas.Tenants | None = None, shares: quotas.Usage | None = None,
                   waiting_owners: Collection[str] | None = None,
                   waits: Callable[[str], bool] | None = None,
                   holding: Collection[str] | None = None) -> list[Plan]:
    """`schedule`, with the queue given apart: `pending` (PENDING jobs, in queue order:
    `decide.order.queue_key`) and `others` (the other unfinished jobs, oldest first). While a
    node is free the queue is served in `shares.fair_queue`'s order (priority, the owner's
    share of the cluster now, age), and each job is offered only the nodes its owner's and
    team's quotas leave it (`quotas.trim`; `tenants`: who is in which team and the quotas;
    None: no quotas, fair share by user). `shares`: what `others` hold (the caller's own
    count, taken over by the pass; None: counted here when needed).

    `pending` is read only while some free node is READY, or while the waiting jobs read may
    preempt (their priority is above the lowest of the running jobs that may give nodes, at
    most MAX_PREEMPTORS of them: `decide.preempt`): past that no pending job can start (`plan`
    would return None for each), so a pass costs the jobs that hold nodes and the pending ones
    that might start, not the whole queue (bench/scheduler_pass.py). `settled`
    (kept across passes by the caller) skips the others whose plan is known to be None
    still (`Settled`). With `max_starts`, at most that many pending jobs start (a pass is
    one step of the event loop that answers the requests: a thousand starts at once kept
    it for hundreds of ms); when that stops the queue, no running job scales up onto the
    nodes left free (the queue comes first, in the next pass).

    `claims`: node -> the PENDING job whose memory copy the node last kept (`keep`); a free
    node held for a waiting job is offered to that job only, first, and counts as ready for
    no other (so it does not make the pass read the queue), and a job that holds free nodes
    is planned before the rest of the queue (`keep.holding`). `copies`: job id -> its members'
    memory reports, for the jobs that may fall below their `min` (`plan`). `running`: the lowest
    priority among `others` and those of them giving nodes up (`JobRecord.preempt`), as the job
    index keeps them (`JobIndex.lowest_running_priority`, `yielding`); None: found from `others`.
    `waiting_owners`: the users with a PENDING job (`JobIndex.waiting_owners`), for the fair-share
    give-back (`decide.giveback`); None: found from `pending` where it is a list, else none.
    `waits`: whether the job of an id is PENDING (`withdrawn`: a victim's mark for a job that no
    longer waits is withdrawn); None: found from `pending` where it is a list, else not known.
    `holding`: the nodes `others` hold (`JobIndex.held_nodes`); None: found from their members.

    While the queue's head waits for nodes that no preemption gives it, a job behind it takes
    (and a running job grows onto) free nodes that fit the head only if it cannot delay its
    start, or as a borrower that gives them back when the head can start with them
    (`decide.backfill`).
    """
    # Preemption (`decide.preempt`): the lowest priority that runs (of all: a bound that needs no
    # look at their members) and the jobs giving nodes up.
    floor, yielding = running if running is not None else \
        (min(map(_PRIORITY, others), default=None), filter(_PREEMPTED, others))
    yielding = list(yielding)
    free = free_nodes(others, nodes) if holding is None else sorted(nodes.keys() - holding)
    unheld = set(free)  # (less the nodes the pass's plans take: `take`) what no job holds
    if kept_by_victims := preempt.staying(yielding):
        free = [n for n in free if n not in kept_by_victims]
    held = keep.reserved(set(free), claims, nodes, now) if claims else {}
    offered = [n for n in free if n not in held] if held else free  # to a job that holds none of them
    ready = {n for n in offered if nodes[n].state is NodeState.READY}
    plans = []
    copies = copies or {}
    tenants = tenants or quotas.Tenants()
    limited = bool(tenants.users or tenants.teams)
    used = shares  # (else counted once a job may start or grow: `usage`)

    def usage() -> quotas.Usage:
        nonlocal used
        if used is None:
            used = quotas.usage(others, nodes, tenants, gpus=quotas.counts_gpus(tenants))
        return used

    limits: dict[str, list[quotas.Limit]] = {}  # owner -> its quotas, until the usage changes
    allowed: dict[tuple[str, int], bool] = {}  # (owner, min) -> `quota_allows`, as long

    def within(job: JobRecord, free: Sequence[str]) -> Sequence[str]:
        """`free` as far as `job`'s owner's quotas let it take them."""
        if not limited:
            return free
        if (applying := limits.get(job.owner)) is None:
            applying = limits[job.owner] = quotas.limits(job.owner, usage())
        return quotas.trim(job, free, nodes, applying)

    free_set = set(free) if claims else set()  # (to find a kept node past its hold: still first)

    def offer(job: JobRecord) -> list[str]:
        """`offered`, with the free nodes that hold `job`'s copy first (`keep.prefer`, without
        sorting every free node for each job that kept some)."""
        if job.kept is None:
            return offered
        steps = job.kept.steps
        mine = sorted((n for n in steps if held.get(n) == job.id or (n not in held and n in free_set)),
                      key=lambda n: (-steps[n], n))
        if all(held.get(n) == job.id for n in mine):
            return mine + offered if mine else offered  # (a held node is not in `offered`)
        return mine + [n for n in offered if n not in steps]

    loans: dict[str, Borrow] = {}  # job id -> the kept nodes it may borrow (`backfilled`)

    def take(p: Plan, job: JobRecord) -> None:
        nonlocal offered
        if (offer := loans.get(job.id)) is not None:
            p = lent(p, job, offer, now)
        plans.append(p)
        before, after = set(quotas.held_nodes(job)), set(quotas.held_nodes(p.job))
        if before != after:  # (the shares and quotas of the jobs planned after it see the change)
            limits.clear()
            allowed.clear()
            usage().add(job.owner, len(after) - len(before),
                        sum(nodes[n].gpus for n in after - before if n in nodes)
                        - sum(nodes[n].gpus for n in before - after if n in nodes), job.spec.priority)
        taken = set(live_members(p.job)) - set(live_members(job))
        if taken:
            unheld.difference_update(taken)
            offered = [n for n in offered if n not in taken]
            for n in taken:
                held.pop(n, None)
            ready.difference_update(taken)
            free_set.difference_update(taken)

    # The nodes leaving for each waiting job, and the jobs that may give nodes (found only when
    # a waiting job looks for victims).
    if cfg.fifo:  # nothing preempts
        floor, yielding = None, ()
    leaving = preempt.coming(yielding)
    victims: preempt.Victims | None = None  # made at the first waiting job that looks for victims
    marked: dict[str, tuple[JobRecord, EventView]] = {}  # victim id -> its record marked, the event
    claims_left = MAX_PREEMPTORS
    # Fair-share give-back (`decide.giveback`): the owners with a job waiting and no node, while
    # some running job could give nodes back (looked for only while such an owner waits).
    if waiting_owners is None and isinstance(pending, Sequence):  # (a lazy queue is not read for it)
        waiting_owners = {j.owner for j in pending}
    if waits is None and isinstance(pending, Sequence):
        waits = {j.id for j in pending}.__contains__
    starving = giveback.starved(waiting_owners, usage()) if waiting_owners and not cfg.fifo else set()
    donors = giveback.donors(others) if starving else []
    if not donors:
        starving = set()

    def claim(job: JobRecord) -> bool:
        """`job` cannot start on the free nodes: take nodes from jobs of lower priority, and keep
        the free ones that fit it from those jobs meanwhile (none, if it cannot be started so:
        False)."""
        nonlocal offered, victims
        usable = [n for n in offer(job) if nodes[n].state is NodeState.READY and fits(job.spec, nodes[n])]
        need = preempt.shortfall(job, len(usable), len(leaving.get(job.id, ())))
        if need > 0 and (victims is None or job.spec.priority > (victims.below or 0)):
            # (in queue order the first to ask has the highest priority, but for a job held for)
            victims = preempt.Victims(others, now, below=job.spec.priority,
                                      taken=set(marked) if victims is None else victims.taken)
        takes = victims.choose(job, need, nodes) if need > 0 and victims is not None else []
        fair = need > 0 and not takes and job.owner in starving
        if fair:  # (its owner's first job in queue order: the one the give-back is for)
            starving.discard(job.owner)
            takes = giveback.choose(job, need, donors, usage(), nodes, now, taken=marked,
                                    settle_s=cfg.fair_share_settle_s)
        if need > 0 and not takes:
            return False
        for t in takes:
            marked[t.victim.id] = preempt.mark(t, job, now, fair_share=fair)
            leaving.setdefault(job.id, []).extend(t.leave)
            if victims is not None:
                victims.taken.add(t.victim.id)
        if takes:
            waiter, event = preempt.noted_on_waiter(job, takes, now, fair_share=fair)
            plans.append(Plan(waiter, [event], event.reason))
        kept_back = set(usable[:job.spec.nodes.min])
        offered = [n for n in offered if n not in kept_back]
        ready.difference_update(kept_back)
        return True

    # A waiting job that holds free nodes (its memory copy) comes first: it ran until it lost
    # a node, and its held nodes stay idle for every other job until it starts or the hold ends.
    first = keep.holding(held, claims) if held else []
    first_ids = {j.id for j in first}

    def may_start(job: JobRecord) -> bool:
        """Enough READY nodes are free for its `min`, or it holds some of its own (`keep`)."""
        return job.kept is not None or job.spec.nodes.min <= len(ready)

    lenders: list[JobRecord] | None = None  # (found once asked) the borrowers that may give back

    def may_preempt(job: JobRecord) -> bool:
        """It outranks a running job, nodes are already leaving for it, its owner is starved, or
        a job it may take back from borrowed nodes (`decide.backfill`, `preempt.may_take_back`)."""
        nonlocal lenders
        if (floor is not None and job.spec.priority > floor) or job.id in leaving or job.owner in starving:
            return True
        if lenders is None:
            lenders = [j for j in others if j.borrowed is not None and preempt.is_candidate(j)]
        return any(preempt.may_take_back(job, b) for b in lenders)

    def quota_allows(job: JobRecord) -> bool:
        """Its owner's node quotas leave room for its `min` (preempting for a job its quota
        would then hold back frees nodes for nobody)."""
        if not limited:
            return True
        key = (job.owner, job.spec.nodes.min)
        if (room := allowed.get(key)) is None:  # (asked of every job a full quota holds back)
            if (applying := limits.get(job.owner)) is None:
                applying = limits[job.owner] = quotas.limits(job.owner, usage())
            room = allowed[key] = quotas.leaves_room_for_min(job, applying)
        return room

    # Backfill (`decide.backfill`): the first job, in queue order, that waits for nodes no
    # preemption gives it, and when it could start; a job behind it starts on free nodes that
    # fit it only if it cannot delay that start.
    head: JobRecord | None = None
    start: list[float | None] = []  # (found once a job may backfill: `planned_start`)

    def waits_for_nodes(job: JobRecord) -> None:
        """`job` cannot start on the free nodes nor preempt for them: the head, if it is first."""
        nonlocal head
        if cfg.fifo or (head is not None and queue_key(head) <= queue_key(job)) or not quota_allows(job):
            return
        head = job

    def backfilled(job: JobRecord, free: Sequence[str]) -> Sequence[str]:
        """`free` as far as `job` may take it while the head waits (all of it, with no head)."""
        if head is None or head is job or not free:
            return free
        if not start:
            running = {j.id: j for j in others} | {q.job.id: q.job for q in plans}
            start.append(backfill.planned_start(head, ready, running.values(), nodes, now))
        allowed = backfill.may_take(job, free, head, start[0], nodes, now)
        # Only a waiting job borrows: a running one growing onto a kept node would take back
        # each node fair share gives a starved job of its priority, over and over.
        if job.state is not JobState.PENDING or (offer := backfill.loan(job, free, allowed, head, now)) is None:
            return allowed
        loans[job.id] = offer
        return free

    def offer_others(job: JobRecord) -> Sequence[str]:
        """`offered` as a running job may grow onto it (`plan`'s free nodes for it)."""
        free = within(job, offered) if ready else offered
        if len(live_members(job)) >= job.spec.nodes.max:  # (no growth: a scale-up is all it limits)
            return free
        return backfilled(job, free)

    def waiting() -> Iterator[JobRecord]:  # (read only once the loop asks: a generator)
        held_for = set(held.values())
        rest = (j for j in pending if j.id not in held_for)
        if not ready:  # only preemption can start one: in queue order, read only as far as needed
            yield from rest
            return

        def offered_to(j: JobRecord) -> bool:
            if may_start(j) or may_preempt(j):
                return True
            if head is None:  # (in queue order: the first such is the head)
                waits_for_nodes(j)
            return False
        yield from served(filter(offered_to, rest), usage(), cfg.fifo)

    queue = itertools.chain(first, waiting())
    while max_starts is None or len(plans) < max_starts:
        if not ready and not (claims_left and (floor is not None or leaving)):
            break
        if (job := next(queue, None)) is None:
            break
        p, held_back = None, False
        if ready and may_start(job):
            mine = within(job, offer(job))
            free = backfilled(job, mine)
            held_back = len(free) < len(mine)  # (then it waits behind the head: it preempts nobody)
            if job.state is not S.PENDING or len(free) >= job.spec.nodes.min:
                p = plan(job, nodes, free, now, cfg, graced)
                if p is not None:
                    p.offered = free
        if p is not None:
            take(p, job)
        elif held_back:
            continue
        elif claims_left and may_preempt(job) and quota_allows(job):
            claims_left -= 1
            if not claim(job) and ready:
                waits_for_nodes(job)
        elif not ready and job.id not in first_ids and not may_preempt(job) and not starving:
            break  # (in priority order: no later job may preempt; a starved owner's may be further on)
        elif ready and job.state is S.PENDING:  # (too few of the free nodes fit it)
            waits_for_nodes(job)
    if ready and max_starts is not None and len(plans) >= max_starts:
        offered, ready = [], set()  # the rest of the queue first: no scale-up takes its nodes
    for job in others if settled is None else settled.unknown(others, graced, marked):
        mark = marked.get(job.id) or withdrawn(job, waits, now, lambda n: n not in unheld)
        if mark is None and settled is not None and settled.known(job, graced, ready, nodes):
            continue
        free = offer_others(job)
        p = plan(job if mark is None else mark[0], nodes, free, now, cfg, graced, copies.get(job.id, ()), gone)
        if mark is not None:
            p = with_mark(mark, p)
        if p is not None:
            p.offered = free
        if settled is not None:
            settled.note(job, graced, p is None)
        if p is not None:
            take(p, job)
    if settled is not None:
        settled.ready_left = bool(ready)
    return plans


def withdrawn(job: JobRecord, waits: Callable[[str], bool] | None, now: float,
              elsewhere: Callable[[str], bool]) -> tuple[JobRecord, EventView] | None:
    """`job` with its preemption withdrawn, and the event, where the job it gives nodes to no
    longer waits (`waits`: whether a job of that id is PENDING; None: not known, nothing is
    withdrawn) (`preempt.withdraw`; `elsewhere`: whether another job holds a node now); else with its borrowed nodes its own, where the job it
    borrowed them in front of no longer waits (`backfill.released`); None: nothing to withdraw."""
    if waits is None:
        return None
    if job.preempt is not None and not waits(job.preempt.by):
        return preempt.withdraw(job, now, elsewhere)
    if job.borrowed is not None and not waits(job.borrowed.head):
        return backfill.released(job, now)
    return None


def lent(p: Plan | None, before: JobRecord, offer: Borrow, now: float) -> Plan | None:
    """`p` (the plan of `before`) with the job marked borrower of the nodes of `offer` it takes
    (`backfill.lend`), and the loan kept on the plan for a plan made again on a re-read record."""
    if p is None:
        return None
    p.loan = offer
    marked = backfill.lend(before, p.job, offer, now)
    if marked is None:
        return p
    return Plan(marked[0], [*p.events, marked[1]], p.reason, p.offered, offer)


def with_mark(mark: tuple[JobRecord, EventView], p: Plan | None) -> Plan:
    """The plan of a job marked as a preemption's victim in this pass, or whose mark is withdrawn
    (`mark`: its record so changed, and the event), made on that record (`p`, None if it changes
    nothing more)."""
    record, event = mark
    if p is None:
        return Plan(record, [event], event.reason)
    return Plan(p.job, [event, *p.events], f"{event.reason}; {p.reason}", p.offered)


class Settled:
    """The unfinished jobs (not PENDING) whose last plan was None, and on what it was made.

    `plan` of a RUNNING or RECOVERING job with no planned change pending (`control` None)
    reads no clock (unless it has a `max_duration_s`): it depends on the record, the live nodes,
    `graced`, and the free nodes
    only where one that is READY and fits could join (below `max`). So while the record is
    the same object, the node view the same version (`nodes_version`, set by the caller for
    each pass; None: unknown, nothing is skipped) and no such node free, its plan is None
    again and is not made (a pass over a thousand running jobs costs milliseconds each time
    a submission wakes it). Of the node view it reads only its members' records (but for a
    free node that could join it, or replace a straggler): a new view in which other nodes
    changed keeps it known (`advance`)."""

    def __init__(self) -> None:
        self.nodes_version: int | None = None
        self.view: int | None = None  # the node view of the last pass (`advance`)
        # job id -> the record, node view version and `graced` its plan was None on, and how
        # many more nodes it could take (`max` less its live members: <= 0, none could join)
        self._seen: dict[str, tuple[JobRecord, int, frozenset[str], int]] = {}
        self._on: dict[str, set[str]] = {}  # node -> the jobs of `_seen` it is a member of
        self._on_any: set[str] = set()  # those that may replace a straggler with any free node
        self.ready_left = True  # a READY node was left free by the last pass (unknown: True)

    def advance(self, version: int | None, changed: Collection[str] | None) -> None:
        """This pass plans on the node view of `version` (`NodeStore.version`); `changed`: the
        nodes whose records changed since the last pass's view (`NodeStore.changed_since`;
        None: not known, and nothing is known of this view). Known, only the jobs with a
        member among them (or a straggler to replace) are forgotten: the others' plans read
        none of their records, and stay known on this view."""
        if version is None or changed is None or self.nodes_version is None:
            self.nodes_version = version
        elif changed:
            for job_id in {*self._on_any, *(j for n in changed for j in self._on.get(n, ()))}:
                self._forget(job_id)
        self.view = version

    def known(self, job: JobRecord, graced: frozenset[str], ready: set[str],
              nodes: dict[str, NodeRecord]) -> bool:
        seen = self._seen.get(job.id)
        if seen is None or seen[0] is not job or seen[1] != self.nodes_version or seen[2] != graced:
            return False
        return seen[3] <= 0 or not any(fits(job.spec, nodes[n]) for n in ready)

    def unknown(self, jobs: Iterable[JobRecord], graced: frozenset[str],
                keep: Collection[str] = ()) -> list[JobRecord]:
        """`jobs` (in their order) but those `known` whatever nodes are free: at their `max`
        (their room is none), unless in `keep` or a preemption's victim (its mark may be
        withdrawn: `withdrawn`) or a borrower (its loan may end, as well). One look at each, no look at its members."""
        seen, version = self._seen, self.nodes_version
        return [j for j in jobs if (s := seen.get(j.id)) is None or s[0] is not j or s[1] != version
                or s[3] > 0 or s[2] != graced or j.id in keep or j.preempt is not None
                or j.borrowed is not None]

    def note(self, job: JobRecord, graced: frozenset[str], settled: bool) -> None:
        """What the plan of `job` was made on, if it was None (`settled`) and reads no clock."""
        if settled and self.nodes_version is not None and job.control is None \
                and job.spec.max_duration_s is None and job.state in (S.STARTING, S.RUNNING, S.RECOVERING):
            room = job.spec.nodes.max - sum(1 for m in job.members.values() if m.is_live())
            self._forget(job.id)
            self._seen[job.id] = (job, self.nodes_version, graced, room)
            for n in job.members:
                self._on.setdefault(n, set()).add(job.id)
            if job.spec.straggler_action == "replace":
                self._on_any.add(job.id)
        else:
            self._forget(job.id)

    def keep_only(self, job_ids: Iterable[str]) -> None:
        """Forget every job but these (the unfinished ones; a dict's keys are not copied)."""
        keep = job_ids.keys() if isinstance(job_ids, Mapping) else set(job_ids)
        for job_id in self._seen.keys() - keep:
            self._forget(job_id)

    def _forget(self, job_id: str) -> None:
        seen = self._seen.pop(job_id, None)
        if seen is None:
            return
        for n in seen[0].members:
            jobs = self._on.get(n)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._on[n]
        self._on_any.discard(job_id)
