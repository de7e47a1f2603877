"""Where each piece of state lives in etcd (one place, so the layout can be read at once).

    <prefix>/jobs/<id>                   JobRecord (JSON); every write is a CAS, on real
                                         transitions only (not on progress)
    <prefix>/progress/<id>               rank 0's latest Progress, at most one write per
                                         progress_min_interval_s, fenced on the job record
    <prefix>/metrics/<id>/body           MetricHistory: the job's scalars, bounded and
    <prefix>/metrics/<id>/tail           downsampled; the tail holds the newest few points
                                         (decide.metrics), written with its progress
    <prefix>/events/<id>/<seq>           EventView, written in the same txn as the state
    <prefix>/idempotency/<sha256>        {"job_id", "spec"} for Idempotency-Key; the job record
                                         names it (idempotency_digest): deleted with the job
    <prefix>/nodes/<name>                NodeRecord, attached to the node's lease
    <prefix>/drains/<name>               a drained node's name, with no lease: the drain outlives
                                         the record (re-registration, an etcd pause); undrain
                                         deletes it
    <prefix>/rdzv/<rdzv id>/state        torch rendezvous state (opaque bytes)
    <prefix>/rdzv/<rdzv id>/store/<key>  c10d store keys of one job attempt
    <prefix>/snapshots/<id>/<step>       committed SnapshotMeta
    <prefix>/memory/<id>/<node>          MemorySnapshot: the step a member node's memory tier
                                         holds, as its first worker last reported it (read by
                                         the scheduler for a job losing a node: decide.keep);
                                         all of the job's deleted by the write that removes a
                                         member, starts an attempt or ends it (decide.members)
    <prefix>/logs/                       (no longer used: worker logs are files, service/logs.py;
                                         deleted at start-up where an older version left some)
    <prefix>/leader                      the scheduler leader's lease-bound key
    <prefix>/presence/<name>             the replica holding the node's presence request
                                         (service.presence), bound to the node's lease
    <prefix>/suspects/<name>             the latest broken-peer report naming the node (its
                                         wall-clock time, the replica), bound to the node's
                                         lease: shared by the replicas (service.presence)
    <prefix>/departures/<name>           why a node's record went, when it was not its lease that
                                         lapsed ("its agent stopped", "its agent's connection
                                         closed"), for the job's event; on a lease of its own
                                         that lapses after DEPARTURE_KEEP_S (service.nodes)
    <prefix>/failures/<node>/<job>       the latest failure of the node's workers in the job (wall
                                         clock, and whether the job ran on elsewhere), on a lease
                                         of an hour: bad-node attribution (service.decide.attribution)
    <prefix>/users/<name>                UserRecord: a named user, the SHA-256 of its token,
                                         its team and its quota
    <prefix>/teams/<name>                TeamRecord: a team's quota (service.tenancy)
    <prefix>/user-tokens/<sha256>        the name of the user whose token has this SHA-256
    <prefix>/contact                     when the leader last heard the nodes (wall clock, s;
                                         service.contact), rewritten every 2 s
    <prefix>/compacted                   the revision the leader last compacted etcd to
                                         (service.compaction; written fenced, just before)
    <prefix>/goodput                     the goodput ledgers of the jobs retention deleted, added
                                         up (service.goodput), in the transaction deleting each

Every prefix is read in pages (service.store.api); retention deletes a finished job's
keys under jobs/, events/, progress/, metrics/, idempotency/, snapshots/, memory/, rdzv/ and logs/
(service.retention).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "/ftrain"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}/jobs/{job_id}"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}/jobs/"

    def progress(self, job_id: str) -> str:
        return f"{self.prefix}/progress/{job_id}"

    def metrics(self, job_id: str) -> str:
        """The prefix of the job's metric history (its body and tail keys)."""
        return f"{self.prefix}/metrics/{job_id}/"

    def metrics_body(self, job_id: str) -> str:
        return f"{self.metrics(job_id)}body"

    def metrics_tail(self, job_id: str) -> str:
        return f"{self.metrics(job_id)}tail"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}/events/{job_id}/"

    def event(self, job_id: str, seq: int) -> str:
        return f"{self.prefix}/events/{job_id}/{seq:010d}"

    def idempotency(self, digest: str) -> str:
        return f"{self.prefix}/idempotency/{digest}"

    @property
    def nodes(self) -> str:
        return f"{self.prefix}/nodes/"

    def node(self, name: str) -> str:
        return f"{self.prefix}/nodes/{name}"

    def drain(self, name: str) -> str:
        return f"{self.prefix}/drains/{name}"

    def rdzv(self, rdzv_id: str) -> str:
        return f"{self.prefix}/rdzv/{rdzv_id}/"

    def rdzv_state(self, rdzv_id: str) -> str:
        return f"{self.prefix}/rdzv/{rdzv_id}/state"

    def rdzv_store(self, rdzv_id: str) -> str:
        return f"{self.prefix}/rdzv/{rdzv_id}/store/"

    def rdzv_of_job(self, job_id: str) -> str:
        # rdzv ids are "<job id>-a<attempt>": this prefix covers every attempt of the job.
        return f"{self.prefix}/rdzv/{job_id}-a"

    def snapshots(self, job_id: str) -> str:
        return f"{self.prefix}/snapshots/{job_id}/"

    def snapshot(self, job_id: str, step: int) -> str:
        return f"{self.prefix}/snapshots/{job_id}/{step:012d}"

    def presence(self, name: str) -> str:
        return f"{self.prefix}/presence/{name}"

    def suspect(self, name: str) -> str:
        return f"{self.prefix}/suspects/{name}"

    def failures(self, node: str) -> str:
        return f"{self.prefix}/failures/{node}/"

    def failure(self, node: str, job_id: str) -> str:
        return f"{self.failures(node)}{job_id}"

    def departure(self, name: str) -> str:
        return f"{self.prefix}/departures/{name}"

    def memory_copies(self, job_id: str) -> str:
        return f"{self.prefix}/memory/{job_id}/"

    def memory_copy(self, job_id: str, node: str) -> str:
        return f"{self.prefix}/memory/{job_id}/{node}"

    @property
    def legacy_logs(self) -> str:
        return f"{self.prefix}/logs/"

    def user(self, name: str) -> str:
        return f"{self.prefix}/users/{name}"

    @property
    def users(self) -> str:
        return f"{self.prefix}/users/"

    def team(self, name: str) -> str:
        return f"{self.prefix}/teams/{name}"

    @property
    def teams(self) -> str:
        return f"{self.prefix}/teams/"

    def user_token(self, digest: str) -> str:
        return f"{self.prefix}/user-tokens/{digest}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}/leader"

    @property
    def contact(self) -> str:
        return f"{self.prefix}/contact"

    @property
    def compacted(self) -> str:
        return f"{self.prefix}/compacted"

    @property
    def goodput_retired(self) -> str:
        return f"{self.prefix}/goodput"
