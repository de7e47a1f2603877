"""The training runtime: resumable data order, resume and stop against a real control plane,
and failure-transparent training under real torchrun with real SIGKILLs."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from service.models import Control, ControlAction
from tests.helpers.processes import REPO, descendants, pid_alive, wait_for
from tests.worker.test_snapshot import edit_job, read_job
from worker import runtime
from worker.data import ResumableSampler

# ------------------------------------------------------------------ the data order (pure)


def take(sampler: ResumableSampler, n: int) -> list[list[int]]:
    return list(itertools.islice(iter(sampler), n))


def test_sampler_resumes_mid_epoch_exactly():
    straight = take(ResumableSampler(100, 8, seed=3), 30)  # 12 steps per epoch: crosses 2 epochs

    first = ResumableSampler(100, 8, seed=3)
    head = take(first, 17)  # stop in the middle of epoch 1
    assert first.state_dict()["epoch"] == 1 and first.state_dict()["index"] == 5 * 8
    again = ResumableSampler(100, 8, seed=3)
    again.load_state_dict(first.state_dict())
    assert head + take(again, 13) == straight


def test_sampler_is_a_deterministic_epoch_permutation_sharded_over_ranks():
    ranks = [ResumableSampler(64, 4, rank=r, world_size=4, seed=1) for r in range(4)]
    steps = [take(s, 4) for s in ranks]  # one whole epoch: 4 steps of a global batch of 16
    seen = sorted(i for rank in steps for batch in rank for i in batch)
    assert seen == list(range(64))
    global_batches = [sum((steps[r][k] for r in range(4)), []) for k in range(4)]
    assert sum(global_batches, []) == ResumableSampler(64, 4, seed=1).order(0).tolist()
    sampler = ResumableSampler(64, 4, seed=1)
    assert sampler.order(1).tolist() != sampler.order(0).tolist()


def test_global_batch_is_the_same_samples_whatever_the_world_size():
    one = take(ResumableSampler(90, global_batch_size=10, seed=0), 12)
    three = [ResumableSampler(90, global_batch_size=10, rank=r, world_size=3, seed=0) for r in range(3)]
    parts = [take(s, 12) for s in three]
    assert [len(p[0]) for p in parts] == [4, 3, 3]
    assert [sum((parts[r][k] for r in range(3)), []) for k in range(12)] == one
    # DDP averages the ranks' weighted means: with every sample's loss 1, that is the global mean 1
    assert sum(s.loss_weight for s in three) / 3 == pytest.approx(1.0)


# ------------------------------------------------------------------ resume and control in-process

def _job_env(control_plane, job_id: str, every: int = 5) -> dict[str, str]:
    """The environment an agent gives job `job_id`'s workers; its snapshot directory is the
    one its commits must name, `<snapshot root>/<job id>` (`_snapshot_dir`)."""
    return {"FTRAIN_JOB_ID": job_id, "FTRAIN_SERVER": control_plane.url,
            "FTRAIN_JOB_TOKEN": control_plane.job_token_of(job_id), "FTRAIN_ATTEMPT": "0",
            "FTRAIN_SNAPSHOT_DIR": str(_snapshot_dir(control_plane, job_id)),
            "FTRAIN_SNAPSHOT_EVERY": str(every), "FTRAIN_SNAPSHOT_KEEP": "3"}


def _snapshot_dir(control_plane, job_id: str) -> Path:
    return control_plane.snapshot_root / job_id


def _train(rt: runtime.Runtime, steps: int, delay_s: float = 0.0) -> int:
    torch.manual_seed(0)
    model = rt.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = rt.sampler(64, batch_size=4)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    start = rt.restore(model=model, optimizer=opt, sampler=sampler)
    for indices in sampler:
        if rt.step >= steps:
            break
        loss = model(x[indices].to(rt.device)).pow(2).mean()  # the model is on the GPU where there is one
        opt.zero_grad()
        loss.backward()
        opt.step()
        rt.step_done(loss=loss, samples=len(indices))
        if delay_s:
            time.sleep(delay_s)
    rt.finish()
    return start


def test_a_corrupt_latest_snapshot_is_skipped_for_the_previous_one_and_reported(
        control_plane, api):
    job_id = api.post("/v1/jobs", json={"name": "corrupt", "command": ["x"]}).json()["id"]
    env = _job_env(control_plane, job_id)
    _train(runtime.init(env=env), 10)
    assert api.get(f"/v1/jobs/{job_id}/snapshots").json()["latest"] == 10

    latest = _snapshot_dir(control_plane, job_id) / "step-000000000010.pt"
    data = bytearray(latest.read_bytes())
    data[-100] ^= 0xFF
    latest.write_bytes(bytes(data))

    rt = runtime.init(env=env)
    assert _train(rt, 10) == 5
    listed = api.get(f"/v1/jobs/{job_id}/snapshots").json()
    assert {i["step"]: i["bad"] for i in listed["items"]} == {5: False, 10: False}  # 10 rewritten
    reasons = [e["reason"] for e in api.get(f"/v1/jobs/{job_id}/events").json()["items"]]
    assert any("step 10 is corrupt" in r and "resuming from step 5" in r for r in reasons), reasons


def test_checkpoint_stop_snapshots_at_the_step_it_stops_and_resumes_there(
        control_plane, api, etcd):
    job_id = api.post("/v1/jobs", json={"name": "stop", "command": ["x"]}).json()["id"]
    env = _job_env(control_plane, job_id, every=1000)
    edit_job(etcd.endpoint, job_id, control=Control(id=1, action=ControlAction.CHECKPOINT_STOP,
                                                      reason="cancel", requested_at=time.time()))
    rt = runtime.init(env=env, control_poll_s=0.05)
    with pytest.raises(runtime.Stopped) as stopped:
        _train(rt, 10_000, delay_s=0.01)
    assert stopped.value.code == 0
    stored = read_job(etcd.endpoint, job_id)
    assert stored.control_acked == 1
    assert stored.control_acked_step == stored.latest_snapshot.step == stopped.value.step > 0
    # The next start resumes from exactly that step and is not asked to stop again.
    again = runtime.init(env=env, control_poll_s=0.05)
    assert _train(again, stopped.value.step + 3) == stopped.value.step
    assert again.step == stopped.value.step + 3


# ------------------------------------------------------------------ real torchrun, real SIGKILLs

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "--max-restarts=3", "--monitor-interval=0.1"]


def _start_torchrun(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    full_env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1", **env}
    with open(log, "wb") as out:
        return subprocess.Popen(TORCHRUN + args, cwd=REPO, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _workers(proc: subprocess.Popen, script: str) -> list[int]:
    pids = []
    for pid in descendants(proc.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if script.encode() in cmdline and pid_alive(pid):
            pids.append(pid)
    return pids


def _kill_a_worker(proc: subprocess.Popen, script: str) -> int:
    pids = wait_for(lambda: len(_workers(proc, script)) == 2 and _workers(proc, script), 30, "2 workers")
    os.kill(pids[-1], signal.SIGKILL)
    return pids[-1]


def _kill_if_running(proc: subprocess.Popen) -> None:
    """SIGKILL a torchrun still running and everything under it."""
    if proc.poll() is None:
        for pid in descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def _finish(proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> str:
    try:
        proc.wait(timeout_s)
    finally:
        _kill_if_running(proc)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


def _steps_after(text: str, marker_count: int) -> list[int]:
    """Steps printed after the `marker_count`-th `start step=` line."""
    parts = text.split("start step=")
    if len(parts) <= marker_count:
        return []
    return [int(m) for m in re.findall(r"^step=(\d+) ", "start step=".join(parts[marker_count:]), re.M)]


EXAMPLE = ["examples/train.py", "--steps", "70", "--batch", "16", "--width", "32", "--step-delay", "0.03"]


def test_training_with_two_worker_sigkills_ends_bit_for_bit_like_without(control_plane, api, tmp_path):
    # The clean run and the one with faults train side by side: two jobs, each with its own
    # torchrun, snapshots and output file; only the second is killed.
    runs = {}
    try:
        for run in ("clean", "faults"):
            job_id = api.post("/v1/jobs", json={"name": run, "command": ["x"],
                                                "snapshot": {"every_steps": 10, "keep": 3}}).json()["id"]
            env = _job_env(control_plane, job_id, every=10)
            log, out = tmp_path / f"{run}.log", tmp_path / f"{run}.pt"
            runs[run] = (job_id, log, out, _start_torchrun([*EXAMPLE, "--out", str(out)], env, log))
        _, log, _, proc = runs["faults"]
        wait_for(lambda: any(s >= 25 for s in _steps_after(log.read_text(), 1)), 120, "step 25")
        _kill_a_worker(proc, "examples/train.py")
        wait_for(lambda: any(s >= 50 for s in _steps_after(log.read_text(), 2)), 120,
                 "step 50 after the first restart")
        _kill_a_worker(proc, "examples/train.py")
        finals = {}
        for run, (job_id, log, out, proc) in runs.items():
            text = _finish(proc, log)
            if run == "faults":
                starts = [int(s) for s in re.findall(r"^start step=(\d+)", text, re.M)]
                assert len(starts) == 3 and starts[0] == 0 and 20 <= starts[1] < starts[2], starts
            finals[run] = torch.load(out)
            listed = api.get(f"/v1/jobs/{job_id}/snapshots").json()
            assert listed["latest"] == 70 and len(listed["items"]) == 3
    finally:
        for *_, proc in runs.values():  # a run left behind by a failure above
            _kill_if_running(proc)
    assert finals["clean"].keys() == finals["faults"].keys()
    for name, tensor in finals["clean"].items():
        assert torch.equal(tensor, finals["faults"][name]), name


@pytest.mark.integration
def test_the_plain_tutorial_script_resumes_from_its_own_snapshot_after_a_sigkill(tmp_path):
    log = tmp_path / "plain.log"
    proc = _start_torchrun(["examples/plain_ddp.py", "--epochs", "8", "--step-delay", "0.12"],
                           {"FTRAIN_SNAPSHOT_DIR": str(tmp_path)}, log)
    wait_for(lambda: "Epoch 3 | Training snapshot saved" in log.read_text(), 120, "the snapshot of epoch 3")
    _kill_a_worker(proc, "examples/plain_ddp.py")
    text = _finish(proc, log)
    resumed = [int(e) for e in re.findall(r"Resuming training from snapshot at Epoch (\d+)", text)]
    assert len(resumed) == 1 and resumed[0] >= 3, text[-3000:]
    assert "epoch=7 " in text and (tmp_path / "snapshot.pt").exists()
    after = text.split("Resuming training")[1]
    assert f"epoch={resumed[0] - 1} " not in after  # no epoch before the snapshot ran again


def test_logged_scalars_are_reported_as_floats_and_refused_ones_left_out(caplog):
    rt = runtime.init(env={}, total_steps=50)
    rt.log(lr=torch.tensor(0.25), grad_norm=3.0)
    rt.log(lr=0.125, diverged=float("nan"), **{"no spaces": 1.0})
    rt.log(7, loss=torch.tensor(0.5))  # a step given, as other loggers take it
    assert rt.total_steps == 50
    assert rt.progress.scalar_values() == {"lr": 0.125, "grad_norm": 3.0, "loss": 0.5}
    assert "'diverged'" in caplog.text and "'no spaces'" in caplog.text


class RecordingLink:
    """Takes rank 0's progress reports (the control plane's side of the poller)."""

    def __init__(self):
        self.reports: list[dict] = []

    def report_progress(self, step, loss, samples_per_s, final=False, metrics=None, total_steps=None,
                        ranks=None):
        self.reports.append({"step": step, "loss": loss, "final": final, "metrics": metrics,
                             "total_steps": total_steps})

    def control(self):
        return runtime.ControlRequest()


def test_rank0_reports_its_logged_scalars_and_total_steps_with_its_progress():
    rt = runtime.init(env={}, total_steps=10)
    rt.link = link = RecordingLink()
    rt.log(lr=torch.tensor(0.1), loss=0.25)  # no loss given to step_done: the logged one
    rt.step_done(samples=8)
    rt.control.stop_poll.set()  # the poller's last act only: the final report of the step reached
    rt.control.run()
    assert link.reports == [{"step": 1, "loss": 0.25, "final": True, "metrics": {"lr": pytest.approx(0.1)},
                             "total_steps": 10}]


class RateLimitedLink(RecordingLink):
    """A control plane that stores only final reports (as if every other one came within its
    rate limit of the stored one) and answers with the step it holds; the poller's first
    control poll is its last."""

    def __init__(self, rt):
        super().__init__()
        self.rt, self.held = rt, 0

    def report_progress(self, step, loss, samples_per_s, final=False, metrics=None, total_steps=None,
                        ranks=None):
        super().report_progress(step, loss, samples_per_s, final, metrics, total_steps)
        if final:
            self.held = step
        return self.held

    def control(self):
        self.rt.control.stop_poll.set()
        return runtime.ControlRequest()


def test_a_report_the_control_plane_did_not_store_does_not_stand_for_the_final_one():
    """The last periodic report came within the rate limit and was answered, not stored: the
    final report still goes, so the finished job shows the step it ended at (before, the job
    ended showing an earlier step)."""
    rt = runtime.init(env={}, total_steps=10)
    rt.link = link = RateLimitedLink(rt)
    rt.control.poll_s = 0.01
    rt.step_done(samples=8)
    rt.control.run()
    assert [(r["step"], r["final"]) for r in link.reports] == [(1, False), (1, True)]
    assert link.held == 1


@pytest.mark.parametrize("exc, broken", [
    # what gloo raised in a survivor when its peer was SIGKILLed (torch 2.13, CPU)
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:27266. This is typically caused by a remote worker crashing."), True),
    (RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection reset by peer"), True),
    (RuntimeError("NCCL communicator was aborted on rank 0."), True),
    (RuntimeError("CUDA out of memory"), False),
    (ValueError("broken pipe"), False),  # not from a collective
])
def test_an_error_says_whether_a_peer_is_gone(exc, broken):
    assert runtime.is_broken_peer(exc) is broken


def test_wait_for_store_returns_once_rank_0_listens_and_gives_up_at_its_timeout():
    import socket
    import threading

    from tests.helpers.processes import free_port

    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later():
        time.sleep(0.2)
        server.bind(("127.0.0.1", port))
        server.listen()

    t = threading.Thread(target=listen_later)
    t.start()
    start = time.monotonic()
    try:
        assert runtime.wait_for_store("127.0.0.1", str(port), 5.0)
        assert 0.15 < time.monotonic() - start < 4.0  # as soon as it listens, not at the timeout
    finally:
        t.join()
        server.close()
    assert not runtime.wait_for_store("127.0.0.1", str(free_port()), 0.1)  # nobody: gives up
    assert not runtime.wait_for_store(None, None, 5.0)  # no address: nothing to wait for


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA warm-up needs a GPU")
def test_the_cuda_warm_up_draws_no_random_numbers():
    """The warm-up thread runs while the training sets itself up: it must leave every RNG
    stream the training draws from as it was (a restore from memory is exact per step)."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(3)
    before = (torch.get_rng_state(), torch.cuda.get_rng_state(device))
    runtime._warm_cuda(device)
    after = (torch.get_rng_state(), torch.cuda.get_rng_state(device))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
