"""Worker logs through a real control plane: ship, page back, tail, follow.

    python bench/logs.py                 # 20 MiB into one job, pages of 1000 and 100 lines
    python bench/logs.py --mib 5 --line-chars 200

Starts a real etcd and a real control plane (uvicorn) on loopback, with the default per-job
cap (64 MiB), and then, from this process (httpx, one connection):

* ships `--mib` MiB of lines into one job as an agent would (node token, shipments of at most
  `worker.protocol.MAX_SHIPMENT_BYTES` of JSON) and reports MiB/s and shipments/s;
* reads the whole log back page by page (`?since=next_seq`), with pages of 1000 and 100
  lines, and with a rank filter that matches one line in 100;
* asks for one page at the end of the log (what a follower does each poll) many times;
* prints etcd's key count and value bytes under ftrain's prefix (no log is there).

Writes bench/results/logs.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def ship_all(cp, job_id: str, mib: float, line_chars: int) -> dict:
    from worker.log_shipper import json_size
    from worker.protocol import MAX_SHIPMENT_BYTES, MAX_SHIPMENT_LINES, LogLineIn

    target = int(mib * 1024 * 1024)
    shipped_bytes = lines = shipments = 0
    started = time.perf_counter()
    with cp.client("node") as node_api:
        while shipped_bytes < target:
            batch, size = [], 200
            while size < MAX_SHIPMENT_BYTES - line_chars - 200 and len(batch) < MAX_SHIPMENT_LINES:
                rank = 0 if (lines + len(batch)) % 100 == 0 else 1
                head = f"{lines + len(batch):09d} "
                line = LogLineIn(rank=rank, line=head + "x" * (line_chars - len(head)), time=time.time())
                batch.append(line.model_dump(mode="json"))
                size += json_size(line)
            body = {"node": "bench", "attempt": 1, "lines": batch}
            resp = node_api.post(f"/v1/jobs/{job_id}/logs", json=body)
            resp.raise_for_status()
            shipped_bytes += size
            lines += len(batch)
            shipments += 1
    took = time.perf_counter() - started
    return {"lines": lines, "shipments": shipments, "json_mib": shipped_bytes / 2**20, "s": took,
            "mib_per_s": shipped_bytes / 2**20 / took, "shipments_per_s": shipments / took}


def read_all(api: httpx.Client, job_id: str, **params) -> dict:
    since, pages, items = 0, 0, 0
    started = time.perf_counter()
    while True:
        resp = api.get(f"/v1/jobs/{job_id}/logs", params={"since": since, **params})
        resp.raise_for_status()
        page = resp.json()
        pages += 1
        items += len(page["items"])
        if page["next_seq"] >= page["end_seq"]:
            break
        since = page["next_seq"]
    took = time.perf_counter() - started
    return {"params": params, "pages": pages, "lines": items, "s": took,
            "log_mib": page["end_seq"] / 2**20, "mib_per_s": page["end_seq"] / 2**20 / took,
            "ms_per_page": 1000 * took / pages, "cut_bytes": page["cut_bytes"]}


def end_polls(api: httpx.Client, job_id: str, n: int = 200) -> dict:
    end = api.get(f"/v1/jobs/{job_id}/logs", params={"limit": 1}).json()["end_seq"]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        api.get(f"/v1/jobs/{job_id}/logs", params={"since": end}).raise_for_status()
        times.append(1000 * (time.perf_counter() - t))
    times.sort()
    return {"polls": n, "p50_ms": statistics.median(times), "p99_ms": times[int(n * 0.99) - 1]}


def etcd_bytes(endpoint: str) -> dict:
    from service.store.etcd import EtcdStore

    async def main():
        kv = EtcdStore(endpoint, timeout_s=5)
        try:
            entries = [e async for e in kv.scan_prefix("/ftrain/")]
        finally:
            await kv.close()
        return {"keys": len(entries), "value_bytes": sum(len(e.value) for e in entries),
                "log_keys": sum("/logs/" in e.key for e in entries)}
    return asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=20.0, help="MiB of JSON lines to ship into one job")
    ap.add_argument("--line-chars", type=int, default=500)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "logs.json")
    args = ap.parse_args()

    from bench.harness import ControlPlane, EtcdProcess

    root = Path(tempfile.mkdtemp(prefix="ftrain-bench-logs-"))
    etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log").start()
    cp = ControlPlane(etcd.endpoint, root / "cp").start()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"logs benchmark: {args.mib:g} MiB of {args.line_chars}-character lines into one job; "
          f"machine {platform.node()}, {os.cpu_count()} cores; {uptime}")
    result: dict = {"args": {"mib": args.mib, "line_chars": args.line_chars}, "uptime": uptime}
    try:
        with cp.client("user") as api:
            job_id = api.post("/v1/jobs", json={"name": "bench", "command": ["python", "x.py"]}).json()["id"]
            result["ship"] = s = ship_all(cp, job_id, args.mib, args.line_chars)
            print(f"ship: {s['lines']} lines, {s['shipments']} shipments, {s['json_mib']:.1f} MiB in "
                  f"{s['s']:.2f} s: {s['mib_per_s']:.1f} MiB/s, {s['shipments_per_s']:.0f} shipments/s")
            result["read"] = []
            for params in ({"limit": 1000}, {"limit": 100}, {"rank": 0}):
                r = read_all(api, job_id, **params)
                result["read"].append(r)
                print(f"read {params}: {r['lines']} lines of a {r['log_mib']:.1f} MiB log in "
                      f"{r['pages']} pages, {r['s']:.2f} s ({r['mib_per_s']:.1f} MiB/s, "
                      f"{r['ms_per_page']:.1f} ms a page)")
            result["end_polls"] = p = end_polls(api, job_id)
            print(f"a page at the end (a follower's poll): p50 {p['p50_ms']:.1f} ms, "
                  f"p99 {p['p99_ms']:.1f} ms")
        result["etcd"] = e = etcd_bytes(etcd.endpoint)
        on_disk = sum(f.stat().st_size for f in (cp.log_root / job_id).glob("*.ndjson"))
        result["on_disk_bytes"] = on_disk
        print(f"etcd: {e['keys']} keys, {e['value_bytes']} bytes of values, {e['log_keys']} log keys; "
              f"log on disk {on_disk / 2**20:.1f} MiB")
    finally:
        cp.stop()
        etcd.kill()
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
