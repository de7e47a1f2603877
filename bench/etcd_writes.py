"""What one running job writes to etcd, per kind of key.

    .venv/bin/python bench/etcd_writes.py [--seconds 60] [--step-delay 0.1]

Starts a private etcd, a control plane and one node agent, submits `examples/train.py`
(one node, one worker, a step every `--step-delay` s, a snapshot every `--snapshot-every`
steps), waits until rank 0 has reported progress, then watches every key under the
control plane's prefix for `--seconds` and sums what was written: per kind of key (the
path segment after the prefix: jobs, progress, logs, snapshots, events, rdzv, ...), the
number of writes and the bytes of key + value. It also prints the growth of etcd's own
`etcd_mvcc_db_total_size_in_use_in_bytes` and of its revision over the same time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from service.store.etcd import EtcdStore  # noqa: E402
from bench.harness import ControlPlane, EtcdProcess, NodeAgentProc, wait_for  # noqa: E402

PREFIX = "/ftrain/"


def db_in_use(etcd: EtcdProcess) -> int:
    text = httpx.get(f"{etcd.endpoint}/metrics", timeout=5).text
    found = re.search(r"^etcd_mvcc_db_total_size_in_use_in_bytes (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else -1


async def count_writes(endpoint: str, seconds: float) -> tuple[Counter, Counter, int, int]:
    kv = EtcdStore(endpoint)
    start = await kv.revision()
    writes: Counter = Counter()
    nbytes: Counter = Counter()

    async def follow():
        async for ev in kv.watch_prefix(PREFIX, start + 1, max_session_s=seconds + 30):
            kind = ev.key[len(PREFIX):].split("/", 1)[0]
            writes[kind] += 1
            nbytes[kind] += len(ev.key) + len(ev.value or b"")

    task = asyncio.create_task(follow())
    await asyncio.sleep(seconds)
    end = await kv.revision()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    await kv.close()
    return writes, nbytes, start, end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--step-delay", type=float, default=0.1)
    p.add_argument("--snapshot-every", type=int, default=100)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ftrain-etcd-writes-"))
    etcd = EtcdProcess(work / "etcd-data", log_path=work / "etcd.log").start()
    cp = agent = None
    try:
        cp = ControlPlane(etcd.endpoint, work / "cp").start()
        agent = NodeAgentProc(cp, "n0", work / "nodes").start()
        spec = {"name": "writes", "working_dir": str(REPO),
                "command": ["python", "examples/train.py", "--steps", "1000000",
                            "--step-delay", str(args.step_delay)],
                "snapshot": {"every_steps": args.snapshot_every, "keep": 3}}
        with cp.client("user") as api:
            job = api.post("/v1/jobs", json=spec).json()
            wait_for(lambda: (api.get(f"/v1/jobs/{job['id']}").json().get("progress") or {})
                     .get("step", 0) >= 20, 120, "the job to report progress")
            size0, t0 = db_in_use(etcd), time.monotonic()
            writes, nbytes, rev0, rev1 = asyncio.run(count_writes(etcd.endpoint, args.seconds))
            size1, elapsed = db_in_use(etcd), time.monotonic() - t0
            state = api.get(f"/v1/jobs/{job['id']}").json()
        print(f"job {job['id']}: {state['state']}, step {state['progress']['step']}, "
              f"{args.step_delay:g} s a step, a snapshot every {args.snapshot_every} steps")
        print(f"{'key':<12} {'writes':>7} {'writes/s':>9} {'bytes':>9} {'bytes/s':>9}")
        for kind in sorted(nbytes, key=nbytes.get, reverse=True):
            print(f"{kind:<12} {writes[kind]:>7} {writes[kind] / args.seconds:>9.2f} "
                  f"{nbytes[kind]:>9} {nbytes[kind] / args.seconds:>9.0f}")
        total = sum(nbytes.values())
        print(f"{'all':<12} {sum(writes.values()):>7} {sum(writes.values()) / args.seconds:>9.2f} "
              f"{total:>9} {total / args.seconds:>9.0f}")
        print(f"revisions: {rev1 - rev0} in {args.seconds:g} s; etcd db size in use: "
              f"{size0} -> {size1} bytes over {elapsed:.0f} s")
        print(json.dumps({"bytes_per_s": {k: round(v / args.seconds) for k, v in nbytes.items()},
                          "total_bytes_per_s": round(total / args.seconds)}))
    finally:
        if agent:
            agent.stop()
        if cp:
            cp.stop()
        etcd.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
