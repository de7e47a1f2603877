"""The control plane's Prometheus metrics (`GET /metrics`), one registry per control plane.

Each replica publishes what it sees itself: the jobs by state and their restarts as its
watch-fed job index has them (every replica's index follows etcd, so any replica answers
for the cluster), and the latencies of the requests it served (heartbeats, snapshot
commits, its etcd calls) and of its scheduler passes (while it leads). Recovery time is
measured on the index too: from the moment a job's record enters RECOVERING to the moment
it is RUNNING again, as each replica's watch delivers them.

The registry belongs to the control plane's `Context` (not prometheus-client's global
one), so two control planes in one process (tests) do not mix their figures.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.decide.quotas import Tenants, held_nodes
from service.models import RESTART_CAUSES, JobRecord, JobState

# A fast worker restart recovers in seconds, a lost node in tens, an outage in minutes.
RECOVERY_BUCKETS_S = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 120, 300, 600)
# Snapshot stall (the training loop's pause) and write: milliseconds to minutes.
SNAPSHOT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# A request the control plane serves, or one of its etcd calls.
REQUEST_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Telemetry:
    """The metrics of one control plane; `observe_job` is fed every job change its index sees."""

    def __init__(self, jobs_now, scheduler_passes, tenants_now=lambda: None) -> None:
        """`jobs_now()`: the jobs as the index has them; `scheduler_passes`: its PassTimes;
        `tenants_now()`: the users' teams (`decide.quotas.Tenants`, None: not known yet)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.recovery_s = Histogram(
            "ftrain_job_recovery_seconds", "From a job entering RECOVERING to RUNNING again.",
            buckets=RECOVERY_BUCKETS_S, registry=r)
        self.restarts = Counter(
            "ftrain_job_restarts", "Restarts of jobs' workers (counted against max_restarts), as "
            "this replica saw them.", registry=r)
        self.snapshot_stall_s = Histogram(
            "ftrain_snapshot_stall_seconds", "How long the training loop stalled for a snapshot "
            "(reported with its commit).", buckets=SNAPSHOT_BUCKETS_S, registry=r)
        self.snapshot_write_s = Histogram(
            "ftrain_snapshot_write_seconds", "The background write and fsync of a snapshot "
            "(reported with its commit).", buckets=SNAPSHOT_BUCKETS_S, registry=r)
        self.snapshot_commit_s = Histogram(
            "ftrain_snapshot_commit_seconds", "A snapshot commit request, as this replica served it.",
            buckets=REQUEST_BUCKETS_S, registry=r)
        self.heartbeat_s = Histogram(
            "ftrain_node_heartbeat_seconds", "A node heartbeat's lease refresh (without its long poll).",
            buckets=REQUEST_BUCKETS_S, registry=r)
        self.etcd_s = Histogram(
            "ftrain_etcd_request_seconds", "One etcd call of this replica (watches excluded), "
            "failures included.", buckets=REQUEST_BUCKETS_S, registry=r)
        r.register(_Jobs(jobs_now))
        r.register(_Tenants(jobs_now, tenants_now))
        r.register(_Passes(scheduler_passes))
        self._recovering_since: dict[str, float] = {}

    def observe_job(self, old: JobRecord | None, new: JobRecord | None) -> None:
        """A change of one job as the index applies it (old None: new to it; new None: deleted)."""
        if new is None or new.state.is_terminal():
            if old is not None:
                self._recovering_since.pop(old.id, None)
            if new is None:
                return
        if old is not None and new.restarts > old.restarts:
            self.restarts.inc(new.restarts - old.restarts)
        if new.state is JobState.RECOVERING:
            if old is not None and old.state is not JobState.RECOVERING:
                self._recovering_since[new.id] = new.updated_at
        elif new.id in self._recovering_since:
            since = self._recovering_since.pop(new.id)
            if new.state is JobState.RUNNING:
                self.recovery_s.observe(max(0.0, new.updated_at - since))

    def count_rendezvous(self, hub) -> None:
        """Publish the counts of `hub` (the replica's `StateHub`)."""
        self.registry.register(_Rendezvous(hub))

    def count_admission(self, limit) -> None:
        """Publish the user requests refused by `limit` (`service.admission.UserLimit`) and
        how many it serves at once now."""
        self.registry.register(_Admission(limit))

    def count_goodput(self, book, clock) -> None:
        """Publish the jobs' seconds by cause and the nodes' by state (`service.goodput`'s
        book, refreshed before each render: `routes.health.metrics`)."""
        self.registry.register(_Goodput(book, clock))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Rendezvous(Collector):
    """The rendezvous hub's counts (`service.rendezvous.StateHub`): state writes and the
    batches that carried them, and long-poll waits (what a round costs this replica)."""

    def __init__(self, hub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[Metric]:
        for name, value, what in (
                ("ftrain_rdzv_state_writes", self._hub.writes, "Rendezvous state writes served."),
                ("ftrain_rdzv_state_batches", self._hub.batches, "etcd writes that carried them."),
                ("ftrain_rdzv_poll_waits", self._hub.wakes, "Waits of state long polls (one a poll, "
                                                            "one more a wake-up that did not answer it).")):
            family = CounterMetricFamily(name, what)
            family.add_metric([], value)
            yield family


class _Admission(Collector):
    """Admission control (`service.admission`): user load shed, node traffic first."""

    def __init__(self, limit) -> None:
        self._limit = limit

    def collect(self) -> Iterator[Metric]:
        refused = CounterMetricFamily("ftrain_user_requests_refused", "User requests answered 429 "
                                      "(more than the control plane serves at once now).")
        refused.add_metric([], self._limit.refused)
        yield refused
        now = GaugeMetricFamily("ftrain_user_requests_limit", "User requests served at once now, "
                                "at most (lowered while the event loop runs late).")
        now.add_metric([], self._limit.limit)
        yield now


class _Goodput(Collector):
    """Where the jobs' wall time went, and the nodes' (`service.goodput.GoodputBook`)."""

    def __init__(self, book, clock) -> None:
        self._book = book
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        jobs = CounterMetricFamily("ftrain_job_seconds", "Jobs' wall time by cause (the goodput "
                                   "ledger), deleted jobs' included.", labels=["cause"])
        for cause, s in self._book.totals(self._clock()).items():
            jobs.add_metric([cause], s)
        yield jobs
        nodes = CounterMetricFamily("ftrain_node_seconds", "Nodes' time by state (busy, idle, "
                                    "draining, drained, quarantined), as this replica sampled it.",
                                    labels=["node", "state"])
        for (node, state), s in sorted(self._book.node_seconds.items()):
            nodes.add_metric([node, state], s)
        yield nodes


class _Jobs(Collector):
    def __init__(self, jobs_now) -> None:
        self._jobs_now = jobs_now

    def collect(self) -> Iterator[Metric]:
        counts = dict.fromkeys(JobState, 0)
        for job in self._jobs_now():
            counts[job.state] += 1
        family = GaugeMetricFamily("ftrain_jobs", "Jobs by state (finished ones until retention "
                                   "deletes them).", labels=["state"])
        for state, n in counts.items():
            family.add_metric([state.value], n)
        yield family
        yield self._restarts_by_cause()
        yield self._stragglers()

    def _restarts_by_cause(self) -> Metric:
        """Each job's restarts by cause (`RestartCounts`), for the jobs that restarted: a
        counter of the job's own record, so any replica gives the same figures."""
        family = CounterMetricFamily("ftrain_job_restarts_by_cause", "A job's restarts by cause "
                                     "(failure, lost_node, preemption, resize; only failures spend "
                                     "max_restarts), for the jobs the index holds that restarted.",
                                     labels=["job", "cause"])
        for job in self._jobs_now():
            counts = job.restarts_by_cause
            if counts.total():
                for cause in RESTART_CAUSES:
                    family.add_metric([job.id, cause], getattr(counts, cause))
        return family

    def _stragglers(self) -> Metric:
        family = GaugeMetricFamily("ftrain_job_straggler_factor", "Ranks flagged as stragglers: each "
                                   "one's compute time per step over the median of its job's other "
                                   "ranks' (docs/stragglers.md).", labels=["job", "node", "rank"])
        for job in self._jobs_now():
            for s in job.stragglers:
                family.add_metric([job.id, s.node or "", str(s.rank)], s.factor)
        return family


class _Tenants(Collector):
    """Per user and per team: the nodes their unfinished jobs hold and the jobs that wait
    (a user in no team counts in no team's figures)."""

    def __init__(self, jobs_now, tenants_now) -> None:
        self._jobs_now = jobs_now
        self._tenants_now = tenants_now

    def collect(self) -> Iterator[Metric]:
        tenants = self._tenants_now() or Tenants()
        figures = {kind: {"user": collections.Counter(), "team": collections.Counter()} for kind in ("nodes", "waiting")}
        for job in self._jobs_now():
            kind, n = ("waiting", 1) if job.state is JobState.PENDING else ("nodes", len(held_nodes(job)))
            if n:
                figures[kind]["user"][job.owner] += n
                if (team := tenants.team(job.owner)) is not None:
                    figures[kind]["team"][team] += n
        for who in ("user", "team"):
            for kind, name, what in (("nodes", "nodes_in_use", "Nodes held by the unfinished jobs"),
                                     ("waiting", "jobs_waiting", "Jobs waiting (PENDING)")):
                family = GaugeMetricFamily(f"ftrain_{who}_{name}", f"{what} of each {who}.",
                                           labels=[who])
                for label, n in sorted(figures[kind][who].items()):
                    family.add_metric([label], n)
                yield family


class _Passes(Collector):
    """The scheduler's pass times (`scheduler.PassTimes`): a summary with the quantiles of
    its last passes, which prometheus-client's own Summary does not compute."""

    def __init__(self, passes) -> None:
        self._passes = passes

    def collect(self) -> Iterator[Metric]:
        p, name = self._passes, "ftrain_scheduler_pass_seconds"
        family = Metric(name, "Duration of one scheduler pass (read, plan, write) on this replica.",
                        "summary")
        for q in (0.5, 0.99):
            if (value := p.quantile(q)) is not None:
                family.add_sample(name, {"quantile": str(q)}, value)
        family.add_sample(f"{name}_sum", {}, p.sum_s)
        family.add_sample(f"{name}_count", {}, p.count)
        yield family
