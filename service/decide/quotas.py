"""Quotas: the most nodes (and GPUs) the running jobs of a user, or of a team, may hold at once.

A job holds a node while a member of it holds that node (`MemberStatus.holds_node`: a finished
member too, until the job ends), and with it every GPU the node has. A user's jobs count
against the user's quota and, if the user is in a team, against the team's. A job starts only
if its `min` nodes fit in what every quota that applies leaves (else it waits, and its reason
names the quota), and an elastic job takes, or grows to, no more than what they leave: its
`max` is capped, never its `min` lowered.

Pure: the caller gives the tenants (who is in which team, and the quotas, as etcd has them:
`service.tenancy`) and the jobs that hold nodes; `trim` narrows the nodes offered to a job
to those it may take, so `scheduling.plan` needs no change to honour a quota.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from service.decide.placement import fits
from service.models import HOLDING_STATES, JobRecord, NodeRecord, NodeState


@dataclass(frozen=True)
class Quota:
    max_nodes: int | None = None
    max_gpus: int | None = None


@dataclass(frozen=True)
class Tenants:
    """Who belongs to which team, and the quotas set: user -> team, user -> Quota, team -> Quota."""

    team_of: Mapping[str, str] = field(default_factory=dict)
    users: Mapping[str, Quota] = field(default_factory=dict)
    teams: Mapping[str, Quota] = field(default_factory=dict)

    def team(self, owner: str) -> str | None:
        return self.team_of.get(owner)


@dataclass
class Usage:
    """What the unfinished jobs hold now: nodes and GPUs by user and by team; and, for fair
    share (`decide.shares`), the nodes by (user, priority) and the node-seconds each (user,
    priority) has held (`decide.ledger`; empty where no ledger is kept)."""

    tenants: Tenants
    user_nodes: Counter = field(default_factory=Counter)
    user_gpus: Counter = field(default_factory=Counter)
    team_nodes: Counter = field(default_factory=Counter)
    team_gpus: Counter = field(default_factory=Counter)
    held_at: Counter = field(default_factory=Counter)
    past: Mapping[tuple[str, int], float] = field(default_factory=dict)

    def add(self, owner: str, nodes: int, gpus: int, priority: int | None = None) -> None:
        """`owner`'s jobs (of `priority`) took `nodes` more nodes with `gpus` GPUs (negative:
        gave them back)."""
        self.user_nodes[owner] += nodes
        self.user_gpus[owner] += gpus
        if priority is not None:
            self.held_at[owner, priority] += nodes
        if (team := self.tenants.team(owner)) is not None:
            self.team_nodes[team] += nodes
            self.team_gpus[team] += gpus


def held_nodes(job: JobRecord | None) -> list[str]:
    """The nodes `job` holds (none unless it is active)."""
    if job is None or not job.state.is_active():
        return []
    return [n for n, m in job.members.items() if m.state in HOLDING_STATES]


def usage(jobs: Iterable[JobRecord], nodes: Mapping[str, NodeRecord], tenants: Tenants,
          gpus: bool = True) -> Usage:
    """What `jobs` hold, by user and team (a node no longer registered: no GPUs known).
    Without `gpus`, GPUs are not counted (no GPU quota is set: a pass saves the lookups)."""
    user_nodes: Counter = Counter()
    user_gpus: Counter = Counter()
    held_at: Counter = Counter()
    for job in jobs:  # (kept to plain loops: it goes over every running job)
        if not job.state.is_active():
            continue
        held = held_nodes(job)
        if held:
            user_nodes[job.owner] += len(held)
            held_at[job.owner, job.spec.priority] += len(held)
            if gpus:
                user_gpus[job.owner] += sum(nodes[n].gpus for n in held if n in nodes)
    return usage_of(user_nodes, tenants, user_gpus, held_at)


def usage_of(user_nodes: Mapping[str, int], tenants: Tenants,
             user_gpus: Mapping[str, int] | None = None,
             held_at: Mapping[tuple[str, int], int] | None = None,
             past: Mapping[tuple[str, int], float] | None = None) -> Usage:
    """The `Usage` of these counts by user (the job index keeps the nodes': `JobIndex.held`),
    with the nodes by (user, priority) and their node-seconds (`JobIndex.ledger`)."""
    used = Usage(tenants, Counter(user_nodes), Counter(user_gpus or {}), held_at=Counter(held_at or {}),
                 past=past or {})
    for owner, team in tenants.team_of.items():
        used.team_nodes[team] += used.user_nodes[owner]
        used.team_gpus[team] += used.user_gpus[owner]
    return used


def counts_gpus(tenants: Tenants) -> bool:
    """Some GPU quota is set (so a pass must count the GPUs held)."""
    return any(q.max_gpus is not None for q in (*tenants.users.values(), *tenants.teams.values()))


@dataclass(frozen=True)
class Limit:
    """One quota that applies to a job, and how much of it is in use now."""

    who: str  # "user alice", "team ml"
    what: str  # "nodes", "GPUs"
    used: int
    most: int

    @property
    def left(self) -> int:
        return max(self.most - self.used, 0)

    def words(self) -> str:
        return f"{self.who}'s quota: {self.used} of {self.most} {self.what} in use"


def limits(owner: str, used: Usage) -> list[Limit]:
    """The quotas that apply to `owner`'s jobs (the user's, then its team's), with their use."""
    tenants, found = used.tenants, []
    team = tenants.team(owner)
    for who, quota, nodes, gpus in (
            (f"user {owner}", tenants.users.get(owner), used.user_nodes[owner], used.user_gpus[owner]),
            (f"team {team}", tenants.teams.get(team) if team else None,
             used.team_nodes[team] if team else 0, used.team_gpus[team] if team else 0)):
        if quota is None:
            continue
        if quota.max_nodes is not None:
            found.append(Limit(who, "nodes", nodes, quota.max_nodes))
        if quota.max_gpus is not None:
            found.append(Limit(who, "GPUs", gpus, quota.max_gpus))
    return found


def trim(job: JobRecord, offered: Sequence[str], nodes: Mapping[str, NodeRecord],
         applying: Sequence[Limit]) -> Sequence[str]:
    """The nodes of `offered` (in its order) that `job` may take within `applying` (its
    `limits`): READY ones that fit it, as many as every quota leaves and its `max` needs
    (a node that would break a GPU quota is passed over for one with fewer GPUs)."""
    if not applying:
        return offered
    room = job.spec.nodes.max - len(held_nodes(job))
    nodes_left = min((lim.left for lim in applying if lim.what == "nodes"), default=room)
    gpus_left = min((lim.left for lim in applying if lim.what == "GPUs"), default=None)
    taken: list[str] = []
    for name in offered:
        if len(taken) >= min(room, nodes_left):
            break
        node = nodes[name]
        if node.state is not NodeState.READY or not fits(job.spec, node):
            continue
        if gpus_left is not None:
            if node.gpus > gpus_left:
                continue
            gpus_left -= node.gpus
        taken.append(name)
    return taken


def leaves_room_for_min(job: JobRecord, applying: Sequence[Limit]) -> bool:
    """Its owner's node quotas (`applying`: its `limits`) leave room for its `min` nodes."""
    left = min((lim.left for lim in applying if lim.what == "nodes"), default=None)
    return left is None or left >= job.spec.nodes.min


def blocking(job: JobRecord, fitting: Sequence[NodeRecord], applying: Sequence[Limit]) -> Limit | None:
    """The quota that keeps `job` from starting (its `min` nodes, the ones with fewest GPUs of
    `fitting` for a GPU quota), or None."""
    need = job.spec.nodes.min
    for lim in applying:
        cost = need if lim.what == "nodes" else sum(sorted(n.gpus for n in fitting)[:need])
        if cost > lim.left:
            return lim
    return None
