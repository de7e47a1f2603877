"""Which of etcd's keys there are, by kind and by whose they are: the soak's key census.

`etcd_keys(endpoint, prefix)` lists every key under the control plane's prefix through etcd's
v3 HTTP gateway (keys only, a page at a time); `census(keys, ...)` counts them under labels
made of the key's kind (its first component after the prefix: jobs, events, rdzv, memory,
...) and, for a key of a job, whose job it is, so that growth can be put down to one thing:

    long     the soak's long job (it lives for the whole run)
    open     a stream job not yet seen finished
    ended    a job seen finished less than `stale_s` ago (retention has yet to delete it)
    expired  a job seen finished `stale_s` or more ago: retention should have deleted it
    gone     a job the soak does not track (or one whose id does not parse)

A rendezvous key also names its part (state, store, ops) and whether its attempt is the job's
latest one seen in the listing (`cur`) or an earlier one (`old`). Keys of nodes (nodes/,
presence/, suspects/, drains/) are counted by kind.
"""

from __future__ import annotations

import base64
import re
from collections import Counter

import httpx

_RDZV = re.compile(r"^(?P<job>[a-z0-9][-a-z0-9]*)-a(?P<attempt>[0-9]{1,9})$")
PAGE = 1000


def etcd_keys(endpoint: str, prefix: str = "/ftrain", timeout_s: float = 10.0) -> list[str]:
    """Every key under `prefix` (keys only), read in pages of PAGE through etcd's gateway."""
    root = prefix.rstrip("/") + "/"
    end = root[:-1] + chr(ord("/") + 1)
    key, out = root, []
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    while True:
        body = httpx.post(f"{endpoint}/v3/kv/range", timeout=timeout_s,
                          json={"key": b64(key), "range_end": b64(end), "keys_only": True,
                                "limit": PAGE}).json()
        kvs = body.get("kvs") or []
        out += [base64.b64decode(kv["key"]).decode() for kv in kvs]
        if not body.get("more") or not kvs:
            return out
        key = out[-1] + "\0"


def job_class(job_id: str, long_id: str | None, ended_at: dict[str, float | None], now: float,
              stale_s: float) -> str:
    """long, open, ended, expired or gone (the module's docstring)."""
    if job_id == long_id:
        return "long"
    if job_id not in ended_at:
        return "gone"
    t = ended_at[job_id]
    if t is None:
        return "open"
    return "expired" if now - t >= stale_s else "ended"


def census(keys: list[str], prefix: str, long_id: str | None, ended_at: dict[str, float | None],
           now: float, stale_s: float) -> dict[str, int]:
    """Count `keys` by label (the module's docstring); labels sorted."""
    root = prefix.rstrip("/") + "/"
    latest: dict[str, int] = {}  # a job's highest rendezvous attempt among the keys
    for k in keys:
        parts = k[len(root):].split("/")
        if parts[0] == "rdzv" and len(parts) > 1 and (m := _RDZV.match(parts[1])):
            latest[m["job"]] = max(latest.get(m["job"], 0), int(m["attempt"]))
    counts: Counter[str] = Counter()
    for k in keys:
        parts = k[len(root):].split("/") if k.startswith(root) else ["?"]
        kind = parts[0]
        if kind == "rdzv" and len(parts) > 1:
            m = _RDZV.match(parts[1])
            if m is None:
                counts["rdzv/?"] += 1
                continue
            who = job_class(m["job"], long_id, ended_at, now, stale_s)
            age = "cur" if int(m["attempt"]) == latest[m["job"]] else "old"
            part = parts[2] if len(parts) > 2 else "?"
            counts[f"rdzv/{who}/{age}/{part}"] += 1
        elif kind in ("jobs", "progress", "events", "metrics", "snapshots", "memory") and len(parts) > 1:
            counts[f"{kind}/{job_class(parts[1], long_id, ended_at, now, stale_s)}"] += 1
        else:
            counts[kind] += 1
    return dict(sorted(counts.items()))
