"""Snapshot files (atomic, checksummed, crash-safe) and their commits on the control plane."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from service.decide.snapshots import plan_prune
from service.jobs import Change, JobStore
from service.keys import Keys
from service.models import Control, ControlAction, JobRecord
from service.store.etcd import EtcdStore
from tests.helpers.processes import REPO, wait_for
from worker import snapshot as snap
from worker.links import LocalLink
from worker.protocol import SnapshotRecord

SPEC = {"name": "snap", "command": ["python", "train.py"], "snapshot": {"every_steps": 10, "keep": 3}}


# ------------------------------------------------------------------ files

def test_write_atomic_leaves_one_verified_file_and_no_temporaries(tmp_path):
    state = {"w": torch.randn(100, 100), "step": 7}
    written = snap.write_atomic(state, tmp_path, 7)
    assert Path(written.path) == tmp_path / "step-000000000007.pt"
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000000007.pt"]
    assert written.size == os.path.getsize(written.path)
    assert written.checksum == snap.file_checksum(written.path)
    snap.verify(written.path, written.checksum, written.size)
    assert torch.equal(snap.load(written.path)["w"], state["w"])


def test_verify_rejects_a_flipped_byte_and_a_truncated_file(tmp_path):
    written = snap.write_atomic({"w": torch.randn(1000)}, tmp_path, 1)
    data = bytearray(Path(written.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(written.path).write_bytes(bytes(data))
    with pytest.raises(snap.SnapshotCorrupt, match="checksum"):
        snap.verify(written.path, written.checksum, written.size)
    Path(written.path).write_bytes(bytes(data[:100]))
    with pytest.raises(snap.SnapshotCorrupt, match="bytes"):
        snap.verify(written.path, written.checksum, written.size)


def test_to_host_copies_so_later_training_does_not_change_the_snapshot():
    w = torch.zeros(3)
    copy = snap.to_host({"opt": [{"w": w}]})
    w.add_(1)
    assert torch.equal(copy["opt"][0]["w"], torch.zeros(3))


def test_host_staging_reuses_its_buffers_and_copies_the_current_values():
    staging = snap.HostStaging()
    w = torch.zeros(3)
    first = staging.copy({"w": w, "n": 1})
    buffer = first["w"]
    w.add_(2)
    assert torch.equal(buffer, torch.zeros(3))  # a copy, not a view
    second = staging.copy({"w": w, "n": 2})
    assert second["w"] is buffer and torch.equal(second["w"], torch.full((3,), 2.0)) and second["n"] == 2
    assert staging.copy({"w": torch.ones(5)})["w"].shape == (5,)  # a new shape gets a new buffer


_CHILD = """
import sys, torch
from worker import snapshot as snap
snap.write_atomic({"big": [torch.ones(8 << 20) for _ in range(12)]}, sys.argv[1], 20)
"""


@pytest.mark.integration
def test_a_crash_mid_write_leaves_the_latest_committed_snapshot_loadable(tmp_path):
    link = LocalLink(tmp_path, keep=3)
    committed = snap.write_atomic({"w": torch.arange(10.0)}, tmp_path, 10)
    link.commit(committed, 0.0, None)

    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], cwd=REPO)
    try:
        def temp_growing():
            temps = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
            return temps and temps[0].stat().st_size > (16 << 20)

        wait_for(temp_growing, 30, "the child to be half-way through its write", interval_s=0.005)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert not (tmp_path / snap.snapshot_name(20)).exists(), "the write finished before the kill"

    items, latest = link.snapshots()
    assert latest == 10
    snap.verify(committed.path, committed.checksum, committed.size)
    assert torch.equal(snap.load(committed.path)["w"], torch.arange(10.0))
    assert len(snap.cleanup_temporaries(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshots.json", snap.snapshot_name(10)]


# ------------------------------------------------------------------ pure pruning

def _rec(step: int, bad: bool = False) -> SnapshotRecord:
    return SnapshotRecord(step=step, path=f"/s/{step}", size=1, checksum="x", bad=bad)


@pytest.mark.parametrize("steps,bad,latest,keep,pruned", [
    ([10, 20, 30, 40], [], 40, 3, [10]),
    ([10, 20, 30, 40], [], 40, 1, [10, 20, 30]),
    ([10, 20, 30, 40], [40], 30, 2, [10, 40]),       # a bad one is never kept
    ([10, 20, 30], [], 10, 1, [20, 30]),             # the latest survives whatever its age
    ([10, 20], [], 20, 5, []),
])
def test_plan_prune_keeps_keep_and_never_the_latest(steps, bad, latest, keep, pruned):
    records = {s: _rec(s, s in bad) for s in steps}
    assert plan_prune(records, latest, keep) == pruned


# ------------------------------------------------------------------ against the control plane

def edit_job(etcd_endpoint: str, job_id: str, **update) -> JobRecord:
    """Change a stored job as the scheduler would (by CAS), e.g. its attempt or control."""

    async def run() -> JobRecord:
        etcd = EtcdStore(etcd_endpoint)
        try:
            store = JobStore(etcd, Keys())
            return await store.update(job_id, lambda job: Change(job.model_copy(update=update)))
        finally:
            await etcd.close()

    return asyncio.run(run())


def read_job(etcd_endpoint: str, job_id: str) -> JobRecord:
    async def run() -> JobRecord:
        etcd = EtcdStore(etcd_endpoint)
        try:
            return await JobStore(etcd, Keys()).get(job_id)
        finally:
            await etcd.close()

    return asyncio.run(run())


@pytest.fixture
def job(api):
    resp = api.post("/v1/jobs", json=SPEC)
    assert resp.status_code == 201, resp.text
    return resp.json()


@pytest.fixture
def worker(control_plane, job, etcd):
    """A client with the job's own token (derived as the control plane does for its workers)."""
    token = control_plane.job_token(read_job(etcd.endpoint, job["id"]))
    with control_plane.client(token) as client:
        yield client


@pytest.fixture
def job_dir(control_plane, job) -> Path:
    """The job's snapshot directory (`<snapshot root>/<job id>`): what its commits name."""
    return control_plane.snapshot_root / job["id"]


def commit(client, job_dir: Path, step: int, attempt: int = 0, **extra):
    """Commit step `step` of the job whose snapshot directory is `job_dir`."""
    body = {"step": step, "path": str(job_dir / f"{step}.pt"), "size": 10, "checksum": f"sha256:{step}",
            "attempt": attempt, **extra}
    return client.post(f"/v1/jobs/{job_dir.name}/snapshots", json=body)


def test_commit_is_fenced_to_the_current_attempt_and_latest_only_moves_forward(
        worker, api, job, job_dir, etcd):
    job_id = job["id"]
    assert commit(worker, job_dir, 20).json()["latest"] == 20
    resp = commit(worker, job_dir, 10)
    assert resp.status_code == 200 and resp.json()["latest"] == 20  # recorded, latest stays
    listed = api.get(f"/v1/jobs/{job_id}/snapshots").json()
    assert [i["step"] for i in listed["items"]] == [10, 20] and listed["latest"] == 20

    edit_job(etcd.endpoint, job_id, attempt=1)
    stale = commit(worker, job_dir, 30, attempt=0)
    assert stale.status_code == 409 and "attempt 0" in stale.json()["detail"]
    assert api.get(f"/v1/jobs/{job_id}").json()["latest_snapshot"]["step"] == 20
    assert commit(worker, job_dir, 30, attempt=1).json()["latest"] == 30
    assert api.get(f"/v1/jobs/{job_id}").json()["latest_snapshot"]["step"] == 30

    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202  # PENDING -> CANCELLED
    assert commit(worker, job_dir, 40, attempt=1).status_code == 409
    assert api.get(f"/v1/jobs/{job_id}/snapshots").json()["latest"] == 30


def test_commits_prune_beyond_keep_and_the_writer_deletes_the_files(worker, api, job, job_dir):
    job_id = job["id"]
    files = job_dir
    for step in range(10, 70, 10):
        written = snap.write_atomic({"step": step}, files, step)
        body = {"step": step, "path": written.path, "size": written.size, "checksum": written.checksum,
                "attempt": 0}
        resp = worker.post(f"/v1/jobs/{job_id}/snapshots", json=body)
        assert resp.status_code == 200, resp.text
        assert written.path not in resp.json()["prune"]
        snap.delete_files(resp.json()["prune"])
    listed = api.get(f"/v1/jobs/{job_id}/snapshots").json()
    assert [i["step"] for i in listed["items"]] == [40, 50, 60] and listed["latest"] == 60
    assert sorted(p.name for p in files.iterdir()) == [snap.snapshot_name(s) for s in (40, 50, 60)]


def test_a_corrupt_report_marks_it_bad_moves_latest_back_and_is_an_event(worker, api, job, job_dir):
    job_id = job["id"]
    for step in (10, 20):
        commit(worker, job_dir, step)
    resp = worker.post(f"/v1/jobs/{job_id}/snapshots/20/corrupt", json={"reason": "checksum mismatch"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["latest"] == 10
    assert [i["bad"] for i in resp.json()["items"]] == [False, True]
    assert api.get(f"/v1/jobs/{job_id}").json()["latest_snapshot"]["step"] == 10
    reasons = [e["reason"] for e in api.get(f"/v1/jobs/{job_id}/events").json()["items"]]
    assert any("step 20 is corrupt" in r and "resuming from step 10" in r for r in reasons)
    # reporting it again changes nothing; an unknown step is 404
    worker.post(f"/v1/jobs/{job_id}/snapshots/20/corrupt")
    assert len(api.get(f"/v1/jobs/{job_id}/events").json()["items"]) == len(reasons)
    assert worker.post(f"/v1/jobs/{job_id}/snapshots/99/corrupt").status_code == 404


def test_control_is_shown_until_a_commit_acknowledges_it(worker, job, job_dir, etcd):
    job_id = job["id"]
    assert worker.get(f"/v1/jobs/{job_id}/control").json() == {"id": 0, "action": "none", "reason": ""}
    edit_job(etcd.endpoint, job_id, control=Control(id=3, action=ControlAction.CHECKPOINT_STOP,
                                                      reason="cancel", requested_at=time.time()))
    assert worker.get(f"/v1/jobs/{job_id}/control").json() == {
        "id": 3, "action": "checkpoint_stop", "reason": "cancel"}
    commit(worker, job_dir, 17, control_id=3)
    stored = read_job(etcd.endpoint, job_id)
    assert (stored.control_acked, stored.control_acked_step) == (3, 17)
    assert worker.get(f"/v1/jobs/{job_id}/control").json()["action"] == "none"


def test_progress_is_stored_and_shown_in_the_job_view(worker, api, job):
    resp = worker.post(f"/v1/jobs/{job['id']}/progress", json={"step": 5, "loss": 0.5, "samples_per_s": 100})
    assert resp.status_code == 200
    progress = api.get(f"/v1/jobs/{job['id']}").json()["progress"]
    assert progress["step"] == 5 and progress["loss"] == 0.5 and progress["time"] > 0
    stale = worker.post(f"/v1/jobs/{job['id']}/progress", json={"step": 6, "attempt": 4})
    assert stale.status_code == 409


def writes_of_key(etcd_endpoint: str, key: str, since: int) -> int:
    """How many times etcd wrote `key` after revision `since` (a watch of every key replays
    what happened since, up to a mark written now)."""

    async def run() -> int:
        etcd = EtcdStore(etcd_endpoint)
        try:
            await etcd.put("/test/mark", b"")
            count = 0
            async for event in etcd.watch_prefix("/", since + 1):
                if event.key == "/test/mark":
                    return count
                count += event.key == key
            raise AssertionError("the watch ended before the mark")
        finally:
            await etcd.close()

    return asyncio.run(run())


def etcd_revision(etcd_endpoint: str) -> int:
    """etcd's current revision."""
    async def run() -> int:
        etcd = EtcdStore(etcd_endpoint)
        try:
            return await etcd.revision()
        finally:
            await etcd.close()

    return asyncio.run(run())


def test_twenty_progress_reports_write_the_job_record_once(worker, api, job, etcd):
    """Progress is hot state: its own key, at most one write a second; the job record (spec
    and all, watched by the index and the scheduler) is written by the first report only."""
    job_id = job["id"]
    before = etcd_revision(etcd.endpoint)
    answers = [worker.post(f"/v1/jobs/{job_id}/progress", json={"step": step, "attempt": 0})
               for step in range(20)]
    assert all(a.status_code == 200 for a in answers)
    # Each write is one transaction (one revision): the first report's holds both keys.
    assert etcd_revision(etcd.endpoint) - before <= 3
    assert writes_of_key(etcd.endpoint, f"/ftrain/jobs/{job_id}", before) == 1
    # 20 reports in well under the 1 s interval, unless this machine is very slow
    assert writes_of_key(etcd.endpoint, f"/ftrain/progress/{job_id}", before) <= 3
    shown = api.get(f"/v1/jobs/{job_id}").json()["progress"]
    assert shown == answers[-1].json() and shown["step"] in {a.json()["step"] for a in answers}


def test_runtime_endpoints_refuse_users_and_other_jobs_but_listing_is_open_to_users(
        control_plane, api, job, job_dir, worker):
    other = api.post("/v1/jobs", json={**SPEC, "name": "other"}).json()
    with control_plane.client(None) as anon:
        assert anon.get(f"/v1/jobs/{job['id']}/snapshots").status_code == 401
    assert commit(api, job_dir, 1).status_code == 403  # a user token cannot commit
    assert api.get(f"/v1/jobs/{job['id']}/snapshots").status_code == 200
    with control_plane.client("node") as node:  # the node token is no key to a job
        assert commit(node, job_dir, 1).status_code == 403
    assert commit(worker, job_dir, 1).status_code == 200
    other_dir = control_plane.snapshot_root / other["id"]
    assert commit(worker, other_dir, 1).status_code == 403  # one job's token, another job
    assert worker.get(f"/v1/jobs/{other['id']}/control").status_code == 403


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_costs_that_snapshot_not_the_training(tmp_path):
    """ENOSPC during a background save: nothing committed, no temporary left, no error for
    the training thread; once there is room again the next save goes through."""
    from tests.helpers.faults import tmpfs

    commits: list[int] = []

    def commit(written, stall_s, control_id):
        commits.append(written.step)
        return []

    with tmpfs(tmp_path / "small", "1m") as root:
        writer = snap.AsyncWriter(root / "job", commit)
        writer.submit({"w": torch.zeros(1 << 20)}, step=10, stall_s=0.0)  # 4 MiB into 1 MiB
        writer.wait()  # does not raise
        assert writer.failed_step == 10 and writer.failures == 1 and commits == []
        assert list((root / "job").iterdir()) == []  # the partial file was removed
        writer.submit({"w": torch.zeros(1000)}, step=20, stall_s=0.0, blocking=True)
        assert writer.failed_step is None and commits == [20]
        assert snap.load(root / "job" / snap.snapshot_name(20))["w"].shape == (1000,)


def test_a_refused_commit_still_reaches_the_training_thread(tmp_path):
    def commit(written, stall_s, control_id):
        raise RuntimeError("409: a newer attempt owns this job")

    writer = snap.AsyncWriter(tmp_path, commit)
    writer.submit({"w": torch.zeros(10)}, step=1, stall_s=0.0)
    with pytest.raises(RuntimeError, match="newer attempt"):
        writer.wait()


# ------------------------------------------------------------------ commits while the control plane is away

class FlakyControlPlane:
    """A commit function whose control plane is away until `back` is set (then it commits
    what it is given, in the order given); `refuse` makes the next try final."""

    def __init__(self):
        import threading

        self.back = threading.Event()
        self.tries: list[int] = []
        self.commits: list[int] = []
        self.refuse: Exception | None = None

    def __call__(self, written, stall_s, control_id):
        self.tries.append(written.step)
        if self.refuse is not None:
            raise self.refuse
        if not self.back.is_set():
            raise snap.CommitUnavailable("no answer")
        self.commits.append(written.step)
        return []


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(snap.AsyncWriter, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(snap.AsyncWriter, "RETRY_MAX_S", 0.05)


def test_a_commit_that_gets_no_answer_keeps_its_file_and_lands_when_the_control_plane_is_back(
        tmp_path, fast_retries):
    cp = FlakyControlPlane()
    writer = snap.AsyncWriter(tmp_path, cp, keep=3)
    start = time.monotonic()
    for step in (10, 20):
        writer.submit({"w": torch.zeros(10)}, step=step, stall_s=0.0)
        writer.wait_written()  # what the next snapshot waits for: the write, not the commit
    wait_for(lambda: len(cp.tries) >= 5, 10, "the commit to be tried again")
    assert time.monotonic() - start < 5 and cp.commits == [] and writer.uncommitted() == [10, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == [snap.snapshot_name(10), snap.snapshot_name(20)]
    assert writer.wait(commit_wait_s=0.1) is False  # bounded: the control plane is still away

    cp.back.set()
    assert writer.wait(commit_wait_s=10) is True
    # the newest first: a restart resumes from it, and a planned change's snapshot must not
    # wait behind a backlog left by an outage
    assert cp.commits == [20, 10] and writer.uncommitted() == [] and writer.last.step == 20


def test_a_newer_snapshot_supersedes_the_oldest_waiting_one_as_pruning_would(tmp_path, fast_retries):
    cp = FlakyControlPlane()
    writer = snap.AsyncWriter(tmp_path, cp, keep=2)
    for step in (10, 20, 30, 40):
        writer.submit({"w": torch.zeros(10)}, step=step, stall_s=0.0)
        writer.wait_written()
    assert writer.uncommitted() == [30, 40] and writer.superseded == [10, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == [snap.snapshot_name(30), snap.snapshot_name(40)]
    cp.back.set()
    assert writer.wait() is True and cp.commits == [40, 30]


def test_a_refused_commit_after_an_outage_still_reaches_the_training_thread(tmp_path, fast_retries):
    from worker.links import Fenced

    cp = FlakyControlPlane()
    writer = snap.AsyncWriter(tmp_path, cp)
    writer.submit({"w": torch.zeros(10)}, step=10, stall_s=0.0)
    wait_for(lambda: len(cp.tries) >= 2, 10, "a retry")
    cp.refuse = Fenced("snapshot of step 10 refused: attempt 0 is over")
    wait_for(lambda: writer.uncommitted() == [], 10, "the refusal")  # final: nothing left to try
    with pytest.raises(Fenced, match="attempt 0 is over"):  # at the next snapshot, as before
        writer.submit({"w": torch.zeros(10)}, step=20, stall_s=0.0)
    assert cp.commits == []


def test_finish_hands_the_commits_the_control_plane_did_not_take_to_the_agent_and_commits_no_more(
        tmp_path, fast_retries):
    """The end of training with the control plane away: after `commit_wait_s`, what waits goes
    to `hand_over` (the node agent: worker/handoff.py), newest first, and the writer stops
    trying (the agent makes them; a worker still trying would only race it)."""
    cp = FlakyControlPlane()
    handed: list[list[int]] = []
    writer = snap.AsyncWriter(tmp_path, cp, commit_wait_s=0.05,
                              hand_over=lambda items: handed.append([w.step for w, _s, _c in items]))
    for step in (10, 20):
        writer.submit({"w": torch.zeros(10)}, step=step, stall_s=0.0)
        writer.wait_written()
    assert writer.finish() is False
    assert handed == [[20, 10]] and writer.handed_over == [10, 20] and writer.uncommitted() == []
    tries = len(cp.tries)
    cp.back.set()
    time.sleep(0.2)  # several retry pauses: nothing more is tried
    assert cp.commits == [] and len(cp.tries) <= tries + 1  # (one try may have been in flight)


def test_finish_with_everything_committed_hands_nothing_over_and_a_failed_hand_over_keeps_trying(
        tmp_path, fast_retries):
    cp = FlakyControlPlane()
    cp.back.set()
    handed: list = []
    writer = snap.AsyncWriter(tmp_path, cp, commit_wait_s=5, hand_over=handed.append)
    writer.submit({"w": torch.zeros(10)}, step=10, stall_s=0.0)
    assert writer.finish() is True and handed == [] and cp.commits == [10]

    def cannot(items):
        raise OSError(28, "No space left on device")

    away = FlakyControlPlane()
    writer = snap.AsyncWriter(tmp_path / "b", away, commit_wait_s=0.05, hand_over=cannot)
    writer.submit({"w": torch.zeros(10)}, step=30, stall_s=0.0)
    assert writer.finish() is False and writer.uncommitted() == [30]  # kept: tried while the process lives
    away.back.set()
    assert writer.wait(commit_wait_s=10) is True and away.commits == [30]
