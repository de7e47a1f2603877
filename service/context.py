"""Everything a request handler or a background loop of one control plane needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.cache import JobIndex
from service.jobs import JobStore
from service.keys import Keys
from service.settings import Settings
from service.store.api import KeyValue


@dataclass
class Context:
    settings: Settings
    etcd: KeyValue
    keys: Keys
    jobs: JobStore
    index: JobIndex
    # Filled by the lifespan: background tasks (scheduler, node reaper) to stop on shutdown.
    tasks: list = field(default_factory=list)

    @classmethod
    def build(cls, settings: Settings) -> Context:
        from service.store.etcd import EtcdStore  # needs aetcd and gRPC: only when used

        etcd = EtcdStore(settings.etcd_endpoints, settings.etcd_timeout_s)
        keys = Keys(settings.etcd_prefix.rstrip("/"))
        return cls(settings=settings, etcd=etcd, keys=keys, jobs=JobStore(etcd, keys),
                   index=JobIndex(etcd, keys))
