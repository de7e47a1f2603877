"""Everything a request handler or a background loop of one control plane needs.

The stores all stand on one `KeyValue`: `build` makes the etcd one from the settings;
`wire` takes any (a test passes a MemoryStore).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.admission import UserLimit
from service.contact import Contact
from service.goodput import GoodputBook
from service.job_index import JobIndex
from service.jobs import JobStore
from service.keyring import Keyring
from service.keys import Keys
from service.logs import LogStore
from service.models import JobRecord
from service.nodes import NodeStore
from service.presence import Presence
from service.progress import ProgressStore
from service.rendezvous import StateHub
from service.scheduler import PassTimes
from service.settings import Settings
from service.snapshots import SnapshotStore
from service.store.api import KeyValue
from service.telemetry import Telemetry
from service.tenancy import Tenancy
from service.users import UserStore


@dataclass
class Context:
    settings: Settings
    kv: KeyValue
    keys: Keys
    jobs: JobStore
    nodes: NodeStore
    snapshots: SnapshotStore
    progress: ProgressStore
    logs: LogStore
    index: JobIndex
    users: UserStore
    keyring: Keyring
    contact: Contact  # the cluster's outages, as this replica knows them (service.contact)
    presence: Presence  # the agents' held connections: a dropped one is a lost node, fast
    admission: UserLimit  # how many user requests are served at once (service.admission)
    tenancy: Tenancy  # users' teams, users' and teams' quotas, from a watch (service.tenancy)
    # This replica's scheduler passes (while it leads), for GET /metrics.
    scheduler_passes: PassTimes = field(default_factory=PassTimes)
    # GET /metrics (Prometheus): made by `wire`, fed by the index and the routes.
    telemetry: Telemetry = field(init=False)
    # Every job's ledger and every node's seconds by state, for GET /metrics (service.goodput).
    goodput: GoodputBook = field(init=False)
    # Rendezvous state writes waiting for their batch, long polls for a change (service.rendezvous).
    rdzv_states: StateHub = field(default_factory=StateHub)
    # Filled by the lifespan: background tasks (scheduler, node reaper) to stop on shutdown.
    tasks: list = field(default_factory=list)
    # job id -> (the record, a heartbeat's answer for it): made once per change of the record
    # (routes.nodes.heartbeat_answer), not on every beat of its nodes.
    assignments: dict = field(default_factory=dict)

    @classmethod
    def build(cls, settings: Settings) -> Context:
        """The context of a control plane on the etcd that `settings` name."""
        from service.store.etcd import EtcdStore  # needs aetcd and gRPC: only when used

        user, password = settings.etcd_credentials() or (None, None)
        store = EtcdStore(settings.etcd_endpoints, settings.etcd_timeout_s, user=user, password=password,
                          probe_key=settings.etcd_prefix.rstrip("/") + "/")
        ctx = cls.wire(settings, store, Keyring.load(settings.secret_dir))
        store.on_call = ctx.telemetry.etcd_s.observe
        return ctx

    @classmethod
    def wire(cls, settings: Settings, kv: KeyValue, keyring: Keyring | None = None) -> Context:
        """Every store on `kv`, under the settings' key prefix (with a keyring in memory
        unless one is given)."""
        keys = Keys(settings.etcd_prefix.rstrip("/"))
        jobs = JobStore(kv, keys)
        index = JobIndex(kv, keys, fifo=settings.queue_policy == "fifo", clock=jobs.clock,
                         half_life_s=settings.fair_share_half_life_s)
        jobs.written = index.note_written  # a replica reads its own writes at once
        ctx = cls(settings=settings, kv=kv, keys=keys, jobs=jobs,
                  nodes=NodeStore(kv, keys, ttl_s=settings.node_ttl_s),
                  snapshots=SnapshotStore(jobs, settings.snapshot_root),
                  progress=ProgressStore(jobs, settings.progress_min_interval_s, settings.metric_points),
                  logs=LogStore(settings.log_root, settings.log_cap_bytes), index=index,
                  users=UserStore(kv, keys), keyring=keyring or Keyring.ephemeral(),
                  contact=Contact(kv, keys.contact, settings.node_ttl_s),
                  presence=Presence(kv, keys, blip_s=settings.presence_blip_s),
                  admission=UserLimit(settings.user_max_in_flight, settings.admission_lag_s,
                                      settings.admission_wait_s),
                  tenancy=Tenancy(kv, keys))
        ctx.goodput = GoodputBook(jobs)
        ctx.telemetry = Telemetry(ctx.index.jobs, ctx.scheduler_passes, ctx.tenancy.tenants)
        ctx.telemetry.count_goodput(ctx.goodput, jobs.clock)
        ctx.index.observe(ctx.telemetry.observe_job)
        ctx.telemetry.count_rendezvous(ctx.rdzv_states)
        ctx.telemetry.count_admission(ctx.admission)
        ctx.nodes.leases.on_flush = ctx.admission.observe_lateness
        return ctx

    def job_token(self, job: JobRecord) -> str:
        """The token of `job`'s workers: derived, never stored (service.keyring)."""
        return job.legacy_token or self.keyring.job_token(job.id, job.token_nonce)
