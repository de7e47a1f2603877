"""Every rank loads the committed snapshot, so what a rank loads is checked first: only a file in
the job's own snapshot directory (`DiskTier.resolve`, worker/tiers/disk.py), and only with torch's weights-only
unpickler (`worker.snapshot.load`): a snapshot that would run code when loaded is refused."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from worker import rng as rngs
from worker import runtime
from worker import snapshot as snap
from worker.links import LocalLink


class _RunsCode:
    """Unpickled, it creates the file `marker` (what a forged snapshot would do, and worse)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _forged(directory, step: int, marker) -> snap.WrittenSnapshot:
    """A snapshot file whose pickle runs code, written as rank 0 writes one (checksum and all)."""
    return snap.write_atomic({"format": 1, "step": step, "world_size": 1, "model": _RunsCode(str(marker))},
                             directory, step)


def _train_from_latest(directory) -> int:
    rt = runtime.init(env={}, snapshot_dir=directory)
    try:
        return rt.restore(model=torch.nn.Linear(2, 1))
    finally:
        rt.finish()


def test_the_runtimes_own_snapshot_loads_weights_only_rng_states_and_optimizer_included(tmp_path):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    state = {"format": 1, "step": 7, "world_size": 1, "rng": [rngs.rng_state()],
             "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    written = snap.write_atomic(state, tmp_path, 7)
    loaded = snap.load(written.path)
    assert loaded["step"] == 7
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    rng, taken = loaded["rng"][0], state["rng"][0]
    assert rng["python"] == taken["python"] and torch.equal(rng["torch"], taken["torch"])
    assert rng["numpy"][0] == taken["numpy"][0] and np.array_equal(rng["numpy"][1], taken["numpy"][1])
    np.random.set_state(rng["numpy"])  # what restore() does with it
    random.setstate(rng["python"])


def test_a_snapshot_whose_pickle_runs_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    written = _forged(tmp_path / "job", 10, marker)
    with pytest.raises(snap.SnapshotUnsafe, match="weights-only") as refused:
        snap.load(written.path)
    assert "add_safe_globals" in str(refused.value)
    assert not marker.exists()


def test_a_committed_path_outside_the_jobs_snapshot_directory_is_never_loaded(tmp_path):
    """A commit naming `/tmp/.../evil.pt` (forged with a leaked job token, checksum right): the
    rank looks for that file name in its own snapshot directory instead, finds none, reports
    it and starts from the snapshot before, or from the start."""
    marker = tmp_path / "ran"
    job = tmp_path / "job"
    evil = _forged(tmp_path / "elsewhere", 10, marker)
    LocalLink(job, keep=3).commit(evil, 0.0, None)
    assert _train_from_latest(job) == 0
    assert not marker.exists()
    items, latest = LocalLink(job, keep=3).snapshots()
    assert [(i.step, i.bad) for i in items] == [(10, True)] and latest is None


def test_in_directory_is_a_file_directly_in_it_links_followed(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (tmp_path / "link").symlink_to(job)
    assert snap.in_directory(job / "step-000000000010.pt", job)
    assert snap.in_directory(tmp_path / "link" / "step-000000000010.pt", job)
    assert snap.in_directory(f"{job}/../job/step-000000000010.pt", job)
    for outside in ("/tmp/evil.pt", job / "sub" / "x.pt", f"{job}/..", tmp_path / "job2" / "x.pt"):
        assert not snap.in_directory(outside, job), outside
