"""When a node whose lease lapsed counts as lost: not while the control plane itself was away.

A node is alive while its etcd lease is, and only a control plane that reaches etcd can
refresh it, on the node's heartbeat. When no control plane could hear heartbeats (every
replica down or stopped, or etcd out of their reach) for longer than the lease, every
node's lease lapses at once although the nodes are fine and their workers train on. A
leader that acted on that at once would stop every job (Kubernetes' node controller had
the same problem and answers it the same way: after an outage of its own it gives the
nodes a grace period before it evicts anything).

So the scheduler loop notes its last contact with etcd and, when it starts or finds that
the last contact is older than half a lease (a heartbeating node's lease cannot lapse in
less), it gives members whose node record is gone `outage_grace` seconds, from then, to
come back: their agents get 404 on their next heartbeat and register again, saying which
attempt they still run (`members.decide_registered` keeps such a member). A node that
does not come back within the grace is lost as usual. Planning with a grace is
`scheduling.plan(..., grace_until=...)`.

A replica that has been in contact all along and becomes leader gives no grace: it served
heartbeats the whole time, so a lapsed lease there is a node's own silence.
"""

from __future__ import annotations

from dataclasses import dataclass

# Beyond the lease: an agent's heartbeat interval (a quarter of the lease), a request stuck
# in a stopped control plane's backlog (the agent's timeout, 5 s + the interval), and its
# registration.
MIN_MARGIN_S = 8.0


@dataclass(frozen=True)
class Grace:
    """Members whose node is gone count as lost only after `seconds` from now; `reason` says why."""

    seconds: float
    reason: str


def outage_grace(since_contact_s: float | None, node_ttl_s: float) -> Grace | None:
    """The grace lapsed nodes get, given how long ago this control plane last reached etcd
    (None: it never has, it just started); None: no grace, a lapsed lease means a lost node."""
    seconds = node_ttl_s + max(MIN_MARGIN_S, node_ttl_s / 2)
    if since_contact_s is None:
        return Grace(seconds, "this control plane has just started and cannot know whether one "
                              "heard the nodes' heartbeats before")
    if since_contact_s > node_ttl_s / 2:
        return Grace(seconds, f"this control plane had no contact with etcd for {since_contact_s:.0f} s, "
                              "so nodes' heartbeats may have gone unheard")
    return None
