"""Faults of the snapshot store: the disk fills up during a save, the latest snapshot is
damaged on disk. Neither may cost a committed snapshot or commit a broken one, and a full
disk must not stop the training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.elastic import job, log_items, submit, wait_nodes, wait_state
from tests.helpers.faults import (
    SnapshotWatch,
    check_steps,
    events_of,
    fill_disk,
    is_mountpoint,
    tmpfs,
    train_spec,
    wait_latest,
    workers,
)
from tests.helpers.processes import wait_for
from worker import snapshot as snap

pytestmark = pytest.mark.integration


@pytest.fixture
def small_snapshot_disk(control_plane):
    """A 4 MiB tmpfs as the control plane's snapshot root (set up before the agents, so it
    is unmounted after they stop)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(control_plane.snapshot_root, "4m") as root:
        yield root


def _temporaries(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".pt.tmp-" in p.name] if directory.is_dir() else []


def test_snapshot_dir_full_during_a_save_commits_nothing_broken_and_keeps_the_latest(
        control_plane, api, small_snapshot_disk, agents):
    root = small_snapshot_disk
    assert is_mountpoint(root)
    agents(1, nproc=2)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("diskfull", 80, nproc=2, max_restarts=6))
    with SnapshotWatch(control_plane, job_id) as watch:
        before = wait_latest(api, job_id, 10)
        filler = fill_disk(root / job_id)
        assert os.statvfs(root).f_bavail == 0, "the tmpfs is not full"

        def enospc() -> bool:
            lines = log_items(api, job_id, rank=0)
            return any("No space left on device" in i["line"] for i in lines)
        wait_for(enospc, 60, "a snapshot save to fail with ENOSPC")
        listed = api.get(f"/v1/jobs/{job_id}/snapshots").json()
        assert listed["latest"] >= before and before in {i["step"] for i in listed["items"]}
        for item in listed["items"]:  # whatever got committed while full is whole
            snap.verify(item["path"], item["checksum"], item["size"])
        filler.unlink()

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        # The failed save cost that snapshot, not the training: no restart, no step redone.
        assert done["restarts"] == 0, events_of(api, job_id)
        trace = check_steps(api, job_id, watch=watch)
        assert trace.steps[-1] == 80 and not trace.resumes
        assert watch.check(api)["latest"] == 80  # saves went through again once there was room
        assert _temporaries(root / job_id) == []


def test_corrupt_latest_snapshot_is_skipped_for_the_previous_one_and_said_in_the_events(
        control_plane, api, agents):
    (a,) = agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("corrupt", 60))
    with SnapshotWatch(control_plane, job_id) as watch:
        wait_latest(api, job_id, 15)
        # Stop the only node (gracefully): the job waits in PENDING, nothing writes snapshots.
        a.stop()
        waiting = wait_state(api, job_id, "PENDING", timeout_s=30)
        assert not workers(a)
        listed = api.get(f"/v1/jobs/{job_id}/snapshots").json()
        latest = next(i for i in listed["items"] if i["step"] == listed["latest"])
        previous = max(i["step"] for i in listed["items"] if i["step"] < latest["step"])
        path = Path(latest["path"])
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        assert snap.file_checksum(path) != latest["checksum"], "the snapshot was not corrupted"
        watch.mark_bad(latest["step"], latest["checksum"])

        agents(1)
        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        reasons = [e["reason"] for e in events_of(api, job_id)]
        assert any(f"snapshot at step {latest['step']} is corrupt" in r
                   and f"resuming from step {previous}" in r for r in reasons), "\n".join(reasons)
        trace = check_steps(api, job_id, watch=watch)
        assert trace.steps[-1] == 60
        assert [r[1] for r in trace.resumes] == [previous], trace.resumes
        assert watch.check(api)["latest"] == 60
        assert job(api, job_id)["attempt"] == waiting["attempt"] + 1  # one start since it waited


@pytest.mark.slow  # about a minute (900 steps, a join held up by the full disk): out of the default run
def test_a_join_while_the_disk_is_full_goes_ahead_from_the_latest_snapshot(
        control_plane, api, small_snapshot_disk, agents):
    """A planned change asks rank 0 for a snapshot first; if the disk refuses it, every rank
    keeps training (none pauses), the change goes ahead after the control plane's timeout,
    and the bigger group resumes from the latest committed snapshot or, newer, the memory
    tier's copy (which the first node sends the joining one)."""
    root = small_snapshot_disk
    agents(1, nproc=2)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("joinfull", 900, nproc=2, mx=2, delay_s=0.04))
    with SnapshotWatch(control_plane, job_id) as watch:
        before = wait_latest(api, job_id, 10)
        filler = fill_disk(root / job_id)
        assert os.statvfs(root).f_bavail == 0, "the tmpfs is not full"
        agents(1, nproc=2)

        def refused() -> bool:
            lines = log_items(api, job_id, rank=0)
            return any("could not be saved for the planned change" in i["line"] for i in lines)
        wait_for(refused, 60, "rank 0 to say the planned change's snapshot failed")
        wait_for(lambda: job(api, job_id)["world_size"] == 4, 90, "the job to go on at world size 4")
        filler.unlink()

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=180)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        assert done["restarts"] == 0  # a membership change, not a failure
        trace = check_steps(api, job_id, watch=watch)  # resumed only from committed snapshots or memory
        assert trace.steps[-1] == 900 and trace.resumes and all(r[1] >= before for r in trace.resumes)
