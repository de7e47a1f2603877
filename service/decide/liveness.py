"""When a node whose lease lapsed counts as lost: not when no control plane could hear it.

A node is alive while its etcd lease is, and only a control plane that reaches etcd can
refresh it, on the node's heartbeat. When no control plane could hear heartbeats (every
replica down or stopped, or etcd out of their reach) for longer than the lease, every
node's lease lapses at once although the nodes are fine and their workers train on. A
leader that acted on that at once would stop every job (Kubernetes' node controller had
the same problem and answers it the same way: after an outage of its own it gives the
nodes a grace period before it evicts anything).

Whether there was such an outage is a fact about the cluster, not about one replica: the
leading control plane notes in etcd when it last heard (`Keys.contact`, every
`HEARD_EVERY_S`). A replica that starts, or comes back from a gap of its own, reads that
note: older than half a lease (plus the note's own period) is an outage (`outage_since`);
fresh (another replica was in touch all along, or the gap was too short for a heartbeating
node's lease to lapse) or absent (a fresh etcd: nobody's lease can have lapsed unheard) is
none. A control plane's start is no outage by itself.

After an outage, the grace is per node (`graced`): a member whose node record is gone is
waited for (`outage_grace` seconds from the outage's end; its agent gets 404 on its next
heartbeat and registers again, saying which attempt it still runs, and
`members.decide_registered` keeps it) only if its lease lapsed before a heartbeat could
have landed after the outage, that is, if it went missing less than a lease after the
outage ended. A node that was heard after the outage and then went silent for a lease (its
agent SIGKILLed, its machine gone) is lost at once, as without any outage: the grace never
delays the recovery from a real fault that the control plane was there to see.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Beyond the lease: an agent's heartbeat interval (a quarter of the lease), a request stuck
# in a stopped control plane's backlog (the agent's timeout, 5 s + the interval), and its
# registration.
MIN_MARGIN_S = 8.0
HEARD_EVERY_S = 2.0  # how often the leader notes in etcd that it hears the nodes
NOTICE_S = 1.0  # how late a scheduler pass may notice a node record's deletion


@dataclass(frozen=True)
class Outage:
    """A time (wall clock, s) in which no control plane could hear the nodes."""

    started: float
    ended: float


def outage_since(last_heard: float | None, now: float, node_ttl_s: float) -> Outage | None:
    """The outage that ends `now`, given when a control plane last noted that it heard the
    nodes (`last_heard`; None: never, a fresh etcd); None: there was none."""
    if last_heard is None or now - last_heard <= node_ttl_s / 2 + HEARD_EVERY_S:
        return None
    return Outage(started=last_heard, ended=now)


def outage_grace(node_ttl_s: float) -> float:
    """How long after an outage a node whose lease lapsed in it may take to come back."""
    return node_ttl_s + max(MIN_MARGIN_S, node_ttl_s / 2)


def graced(missing_since: Mapping[str, float], outage: Outage | None, node_ttl_s: float,
           now: float) -> frozenset[str]:
    """The nodes (of `missing_since`: member nodes whose record is gone, and since when the
    scheduler has seen them gone) that are not lost yet: their lease lapsed because of
    `outage`, and its grace lasts."""
    if outage is None or now >= outage.ended + outage_grace(node_ttl_s):
        return frozenset()
    # A heartbeat that landed after the outage ended keeps a lease until at least a lease later.
    unheard_until = outage.ended + node_ttl_s + NOTICE_S
    return frozenset(n for n, since in missing_since.items() if since < unheard_until)


def broken_peer_suspects(members: Mapping[str, object], reporter: str, attempt: int,
                         job_attempt: int, finished: bool) -> list[str]:
    """The nodes a survivor's broken-peer report makes suspect: the other members of the
    attempt it runs (its process group broke; it cannot tell which peer). None from a stale
    attempt or a finished job (a report of a group that is gone says nothing now), nor from
    a node that is not a member. A suspect is lost only if its agent's connection dropped
    too (`service.presence`)."""
    if finished or attempt != job_attempt or reporter not in members:
        return []
    return sorted(n for n in members if n != reporter)
