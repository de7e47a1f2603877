"""Storage: the `KeyValue` seam (`api`), its etcd and in-memory implementations, and the
one compare-and-set loop (`cas`). Import an implementation from its module: the etcd one
needs `aetcd` and gRPC, the in-memory one nothing."""

from service.store.api import MAX_TXN_OPS, Delete, Entry, KeyValue, Op, Put, WatchEvent

__all__ = ["MAX_TXN_OPS", "Delete", "Entry", "KeyValue", "Op", "Put", "WatchEvent"]
