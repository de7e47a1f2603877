"""Months of use at high speed: many short jobs, logs in volume, one long job, short retention.

    python bench/soak.py --quick          # ~600 jobs, ~200 MB of log lines, a few minutes
    python bench/soak.py                  # 50,000 jobs, 5 GB of log lines (hours on 2 cores)
    python bench/soak.py --jobs 5000 --log-mb 1000 --retention 20
    python bench/soak.py --minutes 60 --faults --retention 120 --compaction 30
                                          # an hour of real jobs, faults on a schedule
                                          # (bench/soak_faults.py has its own account)

Starts a real etcd and a real control plane (`ftrain serve`, uvicorn) with a short
retention (`--retention`, seconds), a short compaction interval and a small per-job log cap,
then drives it as a busy team would, from this process (asyncio + httpx):

* one long job, `examples/train.py` with many steps, on a real node agent (`soak-a-long`),
  training and reporting progress through the runtime for the whole run;
* a second real node agent (`soak-a-real`) that runs whatever short job the scheduler hands
  it, through torchrun, as any node would (the scheduler hands out free nodes by name, so
  it gets the next job whenever it is free): the real path, a few seconds a job;
* `--fake-nodes` fake nodes that speak the node API as an agent does (register, long-poll
  heartbeats with the lease id, report running, ship the job's lines in shipments of at
  most 48 KiB of JSON with lines cut at 4,000 characters, report succeeded): the volume.
  Nothing inside the control plane is faked; the fake nodes are HTTP clients;
* a submitter that keeps as many jobs in flight as there are nodes for them (so an
  idle node is there for each submission), and `--readers` clients reading the status of
  recent jobs.

Each job's command prints `SOAK_LINES` lines of `SOAK_CHARS` characters (a fake node ships
the same lines). Most jobs print a share of `--log-mb`; every `--burst-every`-th job prints a
burst of `--burst-mb` (past the per-job cap, `--log-cap-mb`, so the cap cuts); the one after
half of them prints 6,000-character lines (cut to 4,000 by the shipper). Once a job has
SUCCEEDED its log is read back through `GET /logs` pages and its lines counted: a log that
the cap did not cut (`cut_bytes == 0`) must hold every line; one it cut must end with the
last line and hold a contiguous run of the newest; a cut below the cap counts as lines lost.
`--checkers` clients read logs back; one that retention deleted before it was read (the job
answers 404) is counted as gone, not checked. A real agent's log that was not complete when
its job was SUCCEEDED is read again for 15 s and counted as late (a follower, which stops at
the job's end, would miss those lines). The last row is taken when the last job is done; the
last logs are read back after it and its line counts brought up to date.

Printed every 10% of the jobs: etcd's db size in use (`etcd_mvcc_db_total_size_in_use_in_bytes`
from etcd's /metrics: pages freed by the leader's compaction are no longer in use; the file
itself only shrinks on defrag) and its key count; the scheduler's pass time from the control
plane's GET /metrics (`ftrain_scheduler_pass_seconds`: the mean of the passes since the last
row, how many, and the p99 of the last 1,000); the submit-to-assignment time (submit
acknowledged to the fake node's long-poll heartbeat returning the job, for submissions made
while a fake node waited idle: a scheduler pass on the watch event plus the long poll's
wake-up); API p50/p99 of status reads and
submits measured here; 5xx answers seen by any client here; lines shipped vs lines read back;
jobs deleted by retention (the oldest job's GET answers 404; the job list's length); the long
job's step. At the end, the issue's targets, checked against a baseline row (the first 10%,
or the first row after `--retention` + two compactions if that is later: the state at steady
state, not still filling): db size in use at the end within 2x of the baseline's; the
pass time (mean and p99), submit-to-assignment p50 and the API p99s of the last 10% within
2x of the baseline's (a ratio
under a 5 ms floor on both sides is not held against the run: a 2x of sub-millisecond noise
says nothing); 0 5xx; 0 lines lost; 0 jobs failed; retention deleted jobs.
Exits 1 if a target is missed. Writes bench/results/soak.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness import etcd_metrics  # noqa: E402
from worker.log_shipper import json_size  # noqa: E402
from worker.protocol import MAX_SHIPMENT_BYTES, MAX_SHIPMENT_LINES, LogLineIn, cut_line  # noqa: E402

# What each job runs. A fake node prints the same lines itself (`job_lines`).
JOB_SCRIPT = ("import os\n"
              "env = os.environ\n"
              "n, w, tag = int(env['SOAK_LINES']), int(env['SOAK_CHARS']), env['SOAK_TAG']\n"
              "for i in range(n):\n"
              "    head = f'soak-line {tag} {i:08d} '\n"
              "    print(head + 'x' * max(0, w - len(head)))\n")
LINE = re.compile(r"soak-line (\S+) (\d{8}) ")
RATIO_FLOOR_MS = 5.0


def job_lines(tag: str, n: int, width: int):
    for i in range(n):
        head = f"soak-line {tag} {i:08d} "
        yield head + "x" * max(0, width - len(head))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


@dataclass
class Job:
    tag: str
    lines: int
    chars: int
    submitted_at: float = 0.0
    idle_at_submit: bool = False
    id: str | None = None
    ran_on: str | None = None  # a fake node's name; None: a real agent ran it
    finished: bool = False


@dataclass
class Window:
    """What one tenth of the run measured."""

    status_ms: list[float] = field(default_factory=list)
    submit_ms: list[float] = field(default_factory=list)
    assign_ms: list[float] = field(default_factory=list)


@dataclass
class Totals:
    requests: int = 0
    http_5xx: int = 0
    errors: list[str] = field(default_factory=list)
    lines_shipped: int = 0
    bytes_shipped: int = 0
    lines_expected: int = 0  # lines of finished, checked jobs that the cap did not cut
    lines_readable: int = 0
    lines_lost: int = 0
    logs_checked: int = 0
    logs_cut: int = 0
    logs_gone: int = 0  # deleted by retention before they were checked
    logs_late: int = 0  # a real agent's logs that were not complete when the job was SUCCEEDED
    jobs_failed: int = 0
    real_jobs: int = 0
    fake_jobs: int = 0


class Soak:
    def __init__(self, args, cp_url: str, user_token: str, node_token: str):
        self.args = args
        self.cp_url = cp_url
        self.user_h = {"Authorization": f"Bearer {user_token}"}
        self.node_h = {"Authorization": f"Bearer {node_token}"}
        self.jobs: dict[str, Job] = {}  # by job id
        self.order: list[str] = []
        self.window = Window()
        self.totals = Totals()
        self.idle_fakes = 0
        self.in_flight = 0
        self.done = 0
        self.stop = asyncio.Event()
        self.slot_free = asyncio.Event()
        self.to_check: asyncio.Queue[Job] = asyncio.Queue()
        self.checking = 0  # checkers reading a log now
        self.rng = random.Random(args.seed)
        self.passes_before = (0.0, 0.0)  # the scheduler's pass count and sum at the last row

    # ------------------------------------------------------------------ HTTP, counted

    async def call(self, client: httpx.AsyncClient, method: str, url: str, kind: str | None = None,
                   **kw) -> httpx.Response | None:
        started = time.perf_counter()
        try:
            resp = await client.request(method, url, **kw)
        except httpx.HTTPError as exc:
            self.totals.errors.append(f"{method} {url}: {exc!r}"[:300])
            return None
        took = 1000 * (time.perf_counter() - started)
        self.totals.requests += 1
        if resp.status_code >= 500:
            self.totals.http_5xx += 1
            self.totals.errors.append(f"{method} {url}: {resp.status_code} {resp.text[:200]}")
        elif kind is not None:
            getattr(self.window, kind).append(took)
        return resp

    # ------------------------------------------------------------------ the job mix

    def next_job(self, i: int) -> Job:
        a = self.args
        if a.burst_every and i % a.burst_every == a.burst_every - 1:
            return Job(f"b{i}", int(a.burst_mb * 1e6 / 200), 200)
        if a.burst_every and i % a.burst_every == a.burst_every // 2:
            return Job(f"l{i}", 150, 6000)
        bursts = a.jobs // a.burst_every if a.burst_every else 0
        per_job = max(0.0, a.log_mb * 1e6 - bursts * a.burst_mb * 1e6) / max(1, a.jobs - bursts)
        chars = self.rng.choice((80, 160, 300))
        return Job(f"n{i}", max(1, int(per_job / chars * self.rng.uniform(0.5, 1.5))), chars)

    async def submitter(self, slots: int) -> None:
        async with httpx.AsyncClient(base_url=self.cp_url, headers=self.user_h, timeout=30) as api:
            for i in range(self.args.jobs):
                while self.in_flight >= slots:
                    self.slot_free.clear()
                    await self.slot_free.wait()
                job = self.next_job(i)
                body = {"name": f"soak-{i % 1000}", "command": [sys.executable, "-c", JOB_SCRIPT],
                        "env": {"SOAK_LINES": str(job.lines), "SOAK_CHARS": str(job.chars),
                                "SOAK_TAG": job.tag}, "max_restarts": 0}
                job.idle_at_submit = self.idle_fakes > 0
                resp = await self.call(api, "POST", "/v1/jobs", "submit_ms", json=body)
                if resp is None or resp.status_code != 201:
                    self.totals.errors.append(f"submit: {resp and resp.status_code}")
                    continue
                job.submitted_at = time.monotonic()
                job.id = resp.json()["id"]
                # A fake node may have run it before this answer came (and counted it done).
                self.jobs.setdefault(job.id, job)
                self.order.append(job.id)
                self.in_flight += 1

    def finish(self, job: Job) -> None:
        if not job.finished:
            job.finished = True
            self.in_flight -= 1
            self.done += 1
            self.slot_free.set()
            self.to_check.put_nowait(job)

    # ------------------------------------------------------------------ fake nodes

    async def fake_node(self, name: str) -> None:
        limits = httpx.Limits(max_connections=2)
        async with httpx.AsyncClient(base_url=self.cp_url, headers=self.node_h, timeout=30,
                                     limits=limits) as http:
            assignments: asyncio.Queue[dict] = asyncio.Queue()
            beat = asyncio.create_task(self._heartbeats(http, name, assignments))
            try:
                while not self.stop.is_set():
                    self.idle_fakes += 1
                    try:
                        a = await assignments.get()
                    finally:
                        self.idle_fakes -= 1
                    await self._run_assignment(http, name, a)
            finally:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat

    async def _register(self, http: httpx.AsyncClient, name: str) -> tuple[int, float]:
        """Enrol with the node token; the node's own credential then goes with every other call."""
        while True:
            r = await self.call(http, "POST", "/v1/nodes/register", json={"name": name},
                                headers=self.node_h)
            if r is not None and r.status_code == 200:
                body = r.json()
                if body.get("credential"):
                    http.headers["Authorization"] = f"Bearer {body['credential']}"
                return body["lease_id"], body["heartbeat_interval_s"]
            await asyncio.sleep(0.5)

    async def _heartbeats(self, http: httpx.AsyncClient, name: str, out: asyncio.Queue) -> None:
        """Long-poll heartbeats; hand each new assignment to the node's worker loop."""
        lease, interval = await self._register(http, name)
        known = None
        while True:
            started = time.monotonic()
            r = await self.call(http, "POST", f"/v1/nodes/{name}/heartbeat",
                                json={"lease_id": lease, "known": known, "wait_s": interval})
            if r is None or r.status_code >= 500:
                await asyncio.sleep(0.2)
                continue
            if r.status_code in (401, 404):  # lease lapsed (its credential is then outdated)
                self.totals.errors.append(f"node {name}: lease lapsed, registering again")
                lease, interval = await self._register(http, name)
                known = None
                continue
            a = r.json()["assignment"]
            now_known = None if a is None else {k: a[k] for k in ("job_id", "attempt", "action")}
            if now_known != known and a is not None:
                job = self.jobs.get(a["job_id"])
                if job is not None and a["action"] == "run" and job.idle_at_submit \
                        and job.ran_on is None and job.submitted_at:
                    self.window.assign_ms.append(1000 * (time.monotonic() - job.submitted_at))
                out.put_nowait(a)
            known = now_known
            if time.monotonic() - started < 0.05 and now_known is not None:
                await asyncio.sleep(min(interval, 0.5))  # held for a job: no long poll to wait on

    async def _run_assignment(self, http: httpx.AsyncClient, name: str, a: dict) -> None:
        job_id, attempt = a["job_id"], a["attempt"]
        report = {"job_id": job_id, "attempt": attempt}
        if a["action"] == "stop":
            await self.call(http, "POST", f"/v1/nodes/{name}/report", json={**report, "state": "stopped"})
            return
        job = self.jobs.get(job_id)
        env = a["env"]
        if job is None:  # submitted, but its POST has not answered yet
            for _ in range(100):
                await asyncio.sleep(0.01)
                if (job := self.jobs.get(job_id)) is not None:
                    break
        if job is None:
            job = self.jobs.setdefault(job_id, Job(env["SOAK_TAG"], int(env["SOAK_LINES"]),
                                                   int(env["SOAK_CHARS"]), id=job_id))
        job.ran_on = name
        self.totals.fake_jobs += 1
        await self.call(http, "POST", f"/v1/nodes/{name}/report", json={**report, "state": "running"})
        await self.ship(http, name, job_id, attempt, job_lines(job.tag, job.lines, job.chars))
        await self.call(http, "POST", f"/v1/nodes/{name}/report",
                        json={**report, "state": "succeeded", "exit_code": 0})
        self.finish(job)

    async def ship(self, http: httpx.AsyncClient, name: str, job_id: str, attempt: int, lines) -> None:
        """Ship lines as the agent does: cut at 4,000 characters, at most 48 KiB of JSON each."""
        batch: list[dict] = []
        size = 200

        async def send() -> None:
            for _ in range(50):
                r = await self.call(http, "POST", f"/v1/jobs/{job_id}/logs",
                                    json={"node": name, "attempt": attempt, "lines": batch})
                if r is not None and r.status_code == 204:
                    self.totals.lines_shipped += len(batch)
                    self.totals.bytes_shipped += size
                    return
                if r is not None and r.status_code < 500:
                    self.totals.errors.append(f"shipment refused: {r.status_code} {r.text[:200]}")
                    return
                await asyncio.sleep(0.2)  # the agent keeps lines on a 5xx and sends them again

        for text in lines:
            line = LogLineIn(rank=0, line=cut_line(text), time=time.time())
            n = json_size(line)
            if batch and (size + n > MAX_SHIPMENT_BYTES or len(batch) >= MAX_SHIPMENT_LINES):
                await send()
                batch, size = [], 200
            batch.append(line.model_dump(mode="json"))
            size += n
        if batch:
            await send()

    # ------------------------------------------------------------------ real agents' jobs

    async def watch_unclaimed(self) -> None:
        """Jobs no fake node took ran on a real agent: wait for them to end."""
        async with httpx.AsyncClient(base_url=self.cp_url, headers=self.user_h, timeout=30) as api:
            while not self.stop.is_set():
                now = time.monotonic()
                for job in [j for j in self.jobs.values()
                            if not j.finished and j.ran_on is None and now - j.submitted_at > 1.0]:
                    r = await self.call(api, "GET", f"/v1/jobs/{job.id}")
                    if r is not None and r.status_code == 200 and r.json()["state"] in (
                            "SUCCEEDED", "FAILED", "CANCELLED"):
                        if r.json()["state"] != "SUCCEEDED":
                            self.totals.jobs_failed += 1
                            self.totals.errors.append(f"job {job.id}: {r.json()['state']} "
                                                      f"{r.json()['reason'][:200]}")
                        self.totals.real_jobs += 1
                        self.finish(job)
                await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ checks and readers

    async def checker(self) -> None:
        """Read each finished job's log back through GET /logs pages and count its lines."""
        async with httpx.AsyncClient(base_url=self.cp_url, headers=self.user_h, timeout=60) as api:
            while True:
                job = await self.to_check.get()
                self.checking += 1
                try:
                    await self.check_log(api, job)
                finally:
                    self.checking -= 1

    async def check_log(self, api: httpx.AsyncClient, job: Job) -> None:
        t = self.totals
        deadline = time.monotonic() + 60
        while True:  # the member's report is in; the scheduler's next pass ends the job
            r = await self.call(api, "GET", f"/v1/jobs/{job.id}")
            if r is not None and r.status_code == 404:
                t.logs_gone += 1
                return
            state = r.json()["state"] if r is not None and r.status_code == 200 else None
            if state in ("SUCCEEDED", "FAILED", "CANCELLED") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        if state != "SUCCEEDED" and job.ran_on is not None:  # a fake node reported success
            t.jobs_failed += 1
            t.errors.append(f"job {job.id} ran on {job.ran_on}: {state} after its success report")
        # A real agent ships what its workers printed every half second, also after the job
        # ended: its last lines may come after SUCCEEDED. Read again for a while before
        # counting any line of its jobs as lost.
        # (Counted apart, as logs_late: a follower, which stops at the job's end, misses them.)
        settle = time.monotonic() + (15 if job.ran_on is None else 0)
        first = True
        while True:
            page, seen = await self.read_log(api, job)
            if page is None:
                return
            if page["cut_bytes"] or len(set(seen)) >= job.lines or time.monotonic() > settle:
                break
            if first and job.ran_on is None:
                t.logs_late += 1
                t.errors.append(f"log of {job.id} (a real agent's): {len(set(seen))} of {job.lines} "
                                "lines when the job was SUCCEEDED")
            first = False
            await asyncio.sleep(0.5)
        self.count_lines(job, page, seen)

    async def read_log(self, api: httpx.AsyncClient, job: Job) -> tuple[dict | None, list[int]]:
        """The job's log, page by page: its last page and the line numbers of its lines."""
        t = self.totals
        seen: list[int] = []
        since, page = 0, None
        while True:
            r = await self.call(api, "GET", f"/v1/jobs/{job.id}/logs", params={"since": since, "limit": 5000})
            if r is None or r.status_code == 404:
                t.logs_gone += 1
                return None, seen
            if r.status_code != 200:
                t.errors.append(f"logs of {job.id}: {r.status_code}")
                return None, seen
            page = r.json()
            for item in page["items"]:
                m = LINE.search(item["line"])
                if m and m.group(1) == job.tag:
                    seen.append(int(m.group(2)))
            if page["next_seq"] >= page["end_seq"]:
                break
            since = page["next_seq"]
        return page, seen

    def count_lines(self, job: Job, page: dict, seen: list[int]) -> None:
        t = self.totals
        t.logs_checked += 1
        t.lines_readable += len(seen)
        if page["cut_bytes"] == 0:
            t.lines_expected += job.lines
            lost = job.lines - len(set(seen))
        else:
            t.logs_cut += 1
            # Cut by the cap: the newest lines, contiguous, up to the last one.
            newest = sorted(set(seen))
            contiguous = bool(newest) and newest[-1] == job.lines - 1 \
                and newest == list(range(newest[0], job.lines))
            lost = 0 if contiguous and page["end_seq"] > page["cap_bytes"] else job.lines - len(newest)
            if lost:
                t.errors.append(f"log of {job.id} cut below its cap or not contiguous: "
                                f"end_seq {page['end_seq']}, cap {page['cap_bytes']}")
        if lost:
            t.lines_lost += lost
            t.errors.append(f"log of {job.id} ({job.tag}, ran on {job.ran_on or 'a real agent'}): "
                            f"{lost} of {job.lines} lines missing; page {page}"[:600])

    async def reader(self) -> None:
        """A user polling the status of recent jobs."""
        async with httpx.AsyncClient(base_url=self.cp_url, headers=self.user_h, timeout=30) as api:
            while not self.stop.is_set():
                if self.order:
                    job_id = self.order[-1 - self.rng.randrange(min(len(self.order), 100))]
                    await self.call(api, "GET", f"/v1/jobs/{job_id}", "status_ms")
                await asyncio.sleep(self.args.read_pause)


# ---------------------------------------------------------------------------- etcd's figures

def pass_metrics(text: str) -> dict[str, float]:
    """The scheduler's pass summary from the control plane's GET /metrics."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("ftrain_scheduler_pass_seconds"):
            out[name] = float(value)
    return out


async def snapshot_row(soak: Soak, etcd_endpoint: str, long_job: str | None, started: float) -> dict:
    w, t = soak.window, soak.totals
    soak.window = Window()
    async with httpx.AsyncClient(base_url=soak.cp_url, headers=soak.user_h, timeout=30) as api:
        r = await soak.call(api, "GET", "/metrics")
        m = pass_metrics(r.text) if r is not None and r.status_code == 200 else {}
        count = m.get("ftrain_scheduler_pass_seconds_count", 0.0)
        total = m.get("ftrain_scheduler_pass_seconds_sum", 0.0)
        (count0, total0), soak.passes_before = soak.passes_before, (count, total)
        q50, q99 = (m.get(f'ftrain_scheduler_pass_seconds{{quantile="{q}"}}') for q in ("0.5", "0.99"))
        passes = {"passes": int(count - count0),  # the mean: of this row's passes; p50/p99: of the last 1,000
                  "pass_mean_ms": 1000 * (total - total0) / (count - count0) if count > count0 else None,
                  "pass_p50_ms": None if q50 is None or q50 != q50 else 1000 * q50,  # NaN: no pass yet
                  "pass_p99_ms": None if q99 is None or q99 != q99 else 1000 * q99}
        first = await soak.call(api, "GET", f"/v1/jobs/{soak.order[0]}") if soak.order else None
        listed, after = 0, None
        while True:
            page = {"limit": 500, **({"after": after} if after else {})}
            r = await soak.call(api, "GET", "/v1/jobs", params=page)
            if r is None or r.status_code != 200:
                break
            listed += len(r.json()["items"])
            after = r.json()["next"]
            if not after:
                break
        step = None
        if long_job:
            r = await soak.call(api, "GET", f"/v1/jobs/{long_job}")
            if r is not None and r.status_code == 200:
                body = r.json()
                step = ((body.get("progress") or {}).get("step"), body["state"])
    return {"s": time.monotonic() - started, "jobs_done": soak.done, **etcd_metrics(etcd_endpoint), **passes,
            "assign_p50_ms": pct(w.assign_ms, 50), "assign_n": len(w.assign_ms),
            "status_p50_ms": pct(w.status_ms, 50), "status_p99_ms": pct(w.status_ms, 99),
            "status_n": len(w.status_ms),
            "submit_p50_ms": pct(w.submit_ms, 50), "submit_p99_ms": pct(w.submit_ms, 99),
            "http_5xx": t.http_5xx, "lines_shipped": t.lines_shipped, "mb_shipped": t.bytes_shipped / 1e6,
            "lines_expected": t.lines_expected, "lines_lost": t.lines_lost, "logs_checked": t.logs_checked,
            "logs_cut": t.logs_cut, "logs_gone": t.logs_gone, "jobs_listed": listed,
            "first_job_deleted": first is not None and first.status_code == 404,
            "long_job": step, "real_jobs": t.real_jobs}


def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_row(row: dict) -> None:
    long_job = row["long_job"] or ("-", "-")
    print(f"{row['s']:6.0f} {row['jobs_done']:7d} {row['db_in_use'] / 1e6:8.2f} {row['db_total'] / 1e6:8.2f} "
          f"{row['keys']:6d} {fmt(row['pass_mean_ms']):>6} {fmt(row['pass_p99_ms']):>6} {row['passes']:6d} "
          f"{fmt(row['assign_p50_ms']):>7} {fmt(row['status_p50_ms']):>6} "
          f"{fmt(row['status_p99_ms']):>6} {fmt(row['submit_p50_ms']):>6} {fmt(row['submit_p99_ms']):>6} "
          f"{row['http_5xx']:4d} {row['mb_shipped']:8.1f} {row['lines_shipped']:9d} "
          f"{row['lines_expected']:9d} "
          f"{row['lines_lost']:5d} {row['jobs_listed']:6d} {row['logs_gone']:5d} {row['real_jobs']:4d} "
          f"{long_job[0]!s:>6}", flush=True)


HEADER = ("     s    done  db_use  db_file   keys pass_m pass99 passes assign  st_50  st_99  sb_50  sb_99 "
          " 5xx   MB_ship lines_ship lines_chk  lost listed  gone real  step")


# ---------------------------------------------------------------------------- the run

def baseline(rows: list[dict], args) -> dict:
    """The row the end is compared with: the first 10%, or if retention had not yet acted by
    then (the state still filling), the first row after retention and a compaction had time
    to (the issue's "first hour-equivalent": a cluster at steady state, not an empty one)."""
    warm_s = args.retention + 2 * args.compaction
    return next((r for r in rows if r["s"] >= warm_s), rows[-1])


def targets(rows: list[dict], soak: Soak) -> list[tuple[str, bool, str]]:
    first, last = baseline(rows, soak.args), rows[-1]
    out = [(f"etcd db in use at the end within 2x of the baseline (at {first['s']:.0f} s)",
            last["db_in_use"] <= 2 * first["db_in_use"],
            f"{first['db_in_use'] / 1e6:.2f} MB -> {last['db_in_use'] / 1e6:.2f} MB "
            f"(file {first['db_total'] / 1e6:.2f} -> {last['db_total'] / 1e6:.2f} MB, "
            f"keys {first['keys']} -> {last['keys']})")]
    for key, what in (("pass_mean_ms", "scheduler pass time (mean of the row's passes)"),
                      ("pass_p99_ms", "scheduler pass time p99 (last 1,000 passes)"),
                      ("assign_p50_ms", "submit-to-assignment p50 (a pass plus the long poll)"),
                      ("status_p99_ms", "status read p99"), ("submit_p99_ms", "submit p99")):
        a, b = first[key], last[key]
        ok = a is None or b is None or b <= 2 * a or max(a, b) < RATIO_FLOOR_MS
        out.append((f"{what} within 2x of the baseline", ok, f"{fmt(a)} ms -> {fmt(b)} ms"))
    t = soak.totals
    out += [("0 5xx", t.http_5xx == 0, f"{t.http_5xx} of {t.requests} requests"),
            ("0 lines lost below the cap", t.lines_lost == 0,
             f"{t.lines_lost} lost; {t.lines_expected} expected in {t.logs_checked - t.logs_cut} uncut logs, "
             f"{t.logs_cut} logs cut by the cap; {t.logs_late} real-agent logs complete only after "
             f"SUCCEEDED; {t.logs_gone} logs deleted by retention before they were read"),
            ("0 jobs failed", t.jobs_failed == 0, f"{t.jobs_failed}"),
            ("retention deleted finished jobs", any(r["first_job_deleted"] for r in rows),
             f"first job 404 from {next((r['jobs_done'] for r in rows if r['first_job_deleted']), '-')} "
             f"jobs done on; "
             f"{last['jobs_listed']} listed at the end of {len(soak.order)} submitted")]
    return out


async def drive(args, cp, etcd, long_job: str | None) -> tuple[list[dict], Soak]:
    soak = Soak(args, cp.url, cp.user_token, cp.node_token)
    started = time.monotonic()
    tasks = [asyncio.create_task(soak.fake_node(f"soak-f-{i:04d}")) for i in range(args.fake_nodes)]
    tasks += [asyncio.create_task(soak.reader()) for _ in range(args.readers)]
    tasks += [asyncio.create_task(soak.watch_unclaimed())]
    tasks += [asyncio.create_task(soak.checker()) for _ in range(args.checkers)]
    submitter = asyncio.create_task(soak.submitter(args.fake_nodes + args.real_nodes))
    rows: list[dict] = []
    print(HEADER, flush=True)
    try:
        for tenth in range(1, 11):
            goal = args.jobs * tenth // 10
            while soak.done < goal:
                if submitter.done() and submitter.exception():
                    raise submitter.exception()
                if time.monotonic() - started > args.max_s:
                    raise TimeoutError(f"the run took over --max-s {args.max_s} s at {soak.done} jobs done")
                await asyncio.sleep(0.2)
            rows.append(await snapshot_row(soak, etcd.endpoint, long_job, started))
            print_row(rows[-1])
        # The last logs are read back after the last row (whose latencies are of the workload,
        # not of this read-back); its line counts are brought up to date.
        drained_at = time.monotonic()
        while not soak.to_check.empty() or soak.checking:
            await asyncio.sleep(0.2)
        t = soak.totals
        rows[-1].update(lines_expected=t.lines_expected, lines_lost=t.lines_lost, logs_checked=t.logs_checked,
                        logs_cut=t.logs_cut, logs_gone=t.logs_gone)
        print(f"the last logs read back in {time.monotonic() - drained_at:.0f} s: {t.lines_expected} lines "
              f"expected in uncut logs, {t.lines_lost} lost, {t.logs_gone} logs deleted before they were "
              "read", flush=True)
    finally:
        soak.stop.set()
        submitter.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(submitter, *tasks, return_exceptions=True)
    return rows, soak


def run_soak(args, root: Path) -> dict:
    """Start the cluster under `root`, drive it, and return the results (targets included)."""
    from bench.harness import ControlPlane, EtcdProcess, NodeAgentProc, wait_for

    etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log").start()
    cp = ControlPlane(etcd.endpoint, root / "cp", env={
        "FTRAIN_RETENTION_S": str(args.retention), "FTRAIN_COMPACTION_INTERVAL_S": str(args.compaction),
        "FTRAIN_LOG_CAP_BYTES": str(int(args.log_cap_mb * 2**20))}).start()
    agents = []
    long_job = None
    try:
        with cp.client("user") as api:
            if args.long_steps:
                agents.append(NodeAgentProc(cp, "soak-a-long", root / "agent-long").start())
                wait_for(lambda: "soak-a-long" in {n["name"] for n in api.get("/v1/nodes").json()["items"]},
                         30, "the long job's node")
                long_job = api.post("/v1/jobs", json={
                    "name": "soak-long", "command": [sys.executable, str(REPO / "examples" / "train.py"),
                                                     "--steps", str(args.long_steps), "--step-delay", "0.05"],
                    "snapshot": {"every_steps": 500}}).json()["id"]
                wait_for(lambda: api.get(f"/v1/jobs/{long_job}").json()["state"] == "RUNNING", 60,
                         "the long job running")
            for i in range(args.real_nodes):
                agents.append(NodeAgentProc(cp, f"soak-a-real{i}", root / f"agent-real{i}").start())
        rows, soak = asyncio.run(drive(args, cp, etcd, long_job))
        result = {"rows": rows, "totals": soak.totals.__dict__ | {"errors": soak.totals.errors[:50]}}
        if long_job:
            with cp.client("user") as api:
                body = api.get(f"/v1/jobs/{long_job}").json()
                result["long_job"] = {"state": body["state"], "restarts": body["restarts"],
                                      "progress": body.get("progress")}
                if body["state"] not in ("RUNNING", "SUCCEEDED"):
                    soak.totals.jobs_failed += 1
                    soak.totals.errors.append(f"long job {long_job}: {body['state']} {body['reason']}")
        result["targets"] = [{"target": n, "met": ok, "figures": f} for n, ok, f in targets(rows, soak)]
        return result
    finally:
        for agent in agents:
            agent.stop()
        cp.stop()
        etcd.kill()


def options(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="600 jobs, 200 MB of lines: a few minutes")
    ap.add_argument("--jobs", type=int, default=None, help="short jobs in all (default 50,000)")
    ap.add_argument("--log-mb", type=float, default=None, help="MB of log lines in all (default 5,000)")
    ap.add_argument("--burst-every", type=int, default=50, help="every Nth job prints a burst")
    ap.add_argument("--burst-mb", type=float, default=None, help="MB of a burst (default 1.5x the cap)")
    ap.add_argument("--log-cap-mb", type=float, default=4.0, help="per-job log cap (MiB)")
    ap.add_argument("--retention", type=float, default=20.0, help="seconds finished jobs are kept")
    ap.add_argument("--compaction", type=float, default=5.0, help="FTRAIN_COMPACTION_INTERVAL_S")
    ap.add_argument("--fake-nodes", type=int, default=8)
    ap.add_argument("--real-nodes", type=int, default=1, help="real agents for short jobs")
    ap.add_argument("--long-steps", type=int, default=10**7,
                    help="steps of the long job (0: none); it trains until the run ends")
    ap.add_argument("--readers", type=int, default=2, help="clients reading job status")
    ap.add_argument("--checkers", type=int, default=2,
                    help="clients reading finished jobs' logs back (a log that retention deleted "
                         "before it was read is counted as gone, not checked)")
    ap.add_argument("--read-pause", type=float, default=0.02, help="seconds between a reader's reads")
    ap.add_argument("--max-s", type=float, default=7 * 86400, help="give up after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    from bench.soak_faults import add_options
    add_options(ap)
    args = ap.parse_args(argv)
    if args.jobs is None:
        args.jobs = 600 if args.quick else 50_000
    if args.log_mb is None:
        args.log_mb = 200.0 if args.quick else 5000.0
    if args.burst_mb is None:
        args.burst_mb = 1.5 * args.log_cap_mb * 2**20 / 1e6
    return args


def main(argv=None) -> int:
    args = options(argv)
    if args.minutes is not None:
        from bench.soak_faults import main_hour
        return main_hour(args)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"soak: {args.jobs} jobs, {args.log_mb:g} MB of lines (a {args.burst_mb:g} MB burst every "
          f"{args.burst_every}), cap {args.log_cap_mb:g} MiB a job, retention {args.retention:g} s, "
          f"compaction every {args.compaction:g} s, {args.fake_nodes} fake + {args.real_nodes} real nodes"
          f"{', a long job' if args.long_steps else ''}; machine {platform.node()}, {os.cpu_count()} cores; "
          f"{uptime}", flush=True)
    root = Path(tempfile.mkdtemp(prefix="ftrain-soak-"))
    try:
        result = run_soak(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result["uptime"] = uptime
    print("\ntargets:")
    for t in result["targets"]:
        print(f"  [{'ok' if t['met'] else 'MISSED'}] {t['target']}: {t['figures']}")
    if result["totals"]["errors"]:
        print("first errors:", *result["totals"]["errors"][:10], sep="\n  ")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(t["met"] for t in result["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
