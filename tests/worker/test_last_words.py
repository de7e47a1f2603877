"""A survivor's last-words copy (worker/last_words.py, worker/runtime.py `_last_words`): the
state of the last step boundary copied into the node's memory tier when the group breaks,
only while the state is exactly that step's, never labelled with a step it does not hold."""

from __future__ import annotations

import random
import time

import pytest
import torch

from worker import memory as mem
from worker import runtime, step_marks
from worker.last_words import Boundary, GpuMark, gpu_settled_step, last_words_step

MARK = Boundary(step=7, optimizer_steps=7, versions=(3, 1), skeleton=b"")


@pytest.mark.parametrize(("mark", "optimizer_steps", "versions", "held", "kept", "step", "why"), [
    (MARK, 7, (3, 1), 5, False, 7, "the state is that of step 7"),  # K = 5: copied at 5, failed in step 8
    (MARK, 7, (3, 1), -1, False, 7, "holds step -1"),  # nothing copied yet
    (MARK, 8, (3, 1), 5, False, None, "the optimizer began a step after step 7"),  # mid- or post-step
    (MARK, 8, (3, 1), 5, True, None, "the optimizer began a step after step 7"),  # kept buffers or not
    (MARK, 7, (4, 1), 5, False, None, "a buffer changed after step 7"),  # a forward ran (BatchNorm)
    (MARK, 7, (4, 1), 5, True, 7, "the state is that of step 7"),  # ... its buffers kept at the boundary
    (MARK, 7, None, 5, True, None, "tensors were replaced"),  # the plan no longer holds the state
    (MARK, 7, (3, 1), 7, False, None, "holds step 7 already"),  # the copy of step 7 is there
    (MARK, 7, (3, 1), 9, False, None, "holds step 9 already"),  # never older over newer
    (None, 0, (), 5, True, None, "no step completed"),  # failed before its first step
])
def test_last_words_only_for_a_state_that_is_exactly_its_steps(mark, optimizer_steps, versions, held, kept,
                                                               step, why):
    got, reason = last_words_step(mark, optimizer_steps, versions, held, buffers_kept=kept)
    assert got == step and why in reason, reason


def _marks(*flags: str) -> list[GpuMark]:
    """Boundaries of steps 6, 7, ... (optimizer steps as many): "" queued, "b" begun, "d" done."""
    return [GpuMark(6 + i, 6 + i, "b" in f or "d" in f, "d" in f) for i, f in enumerate(flags)]


@pytest.mark.parametrize(("marks", "optimizer", "step", "why"), [
    # stuck in step 8's all-reduce: its optimizer step queued behind it, not begun
    (_marks("d", "d"), [(7, True), (8, False)], 7, "that of step 7"),
    # the host had not reached step 8's optimizer step yet
    (_marks("d", "d"), [(7, True)], 7, "that of step 7"),
    # stuck in step_done(8)'s broadcast: boundary 8 done
    (_marks("d", "d", "d"), [(8, True)], 8, "that of step 8"),
    # step 8's optimizer step ran (or runs): the state is neither 7's nor 8's yet
    (_marks("d", "d", ""), [(7, True), (8, True)], None, "began optimizer step 8 after step 7"),
    # boundary 8's own work (buffers aside) begun, not done
    (_marks("d", "d", "b"), [(7, True), (8, False)], None, "began the boundary after step 7"),
    (_marks("", ""), [], None, "no step boundary has completed"),
    ([], [], None, "no step boundary has completed"),
])
def test_a_gpu_state_is_a_steps_only_when_its_events_prove_it(marks, optimizer, step, why):
    got, reason = gpu_settled_step(marks, optimizer)
    assert got == step and why in reason, reason


def _loop(rt: runtime.Runtime, model, opt, sched, sampler, x, steps: int, half: bool = False):
    """Train to `steps`; `half`: then the first half of the next step (its batch drawn, its
    forward and backward run), as a step is when a peer's death breaks the backward."""
    for indices in sampler:
        xb = x[indices]
        if rt.step >= steps:
            if half:
                opt.zero_grad()
                (model(xb).pow(2).mean() + torch.rand(()) * 0).backward()
            return
        opt.zero_grad()
        noise = torch.randn(xb.shape) * 0.01  # the torch RNG is part of the step
        model(xb + noise).pow(2).mean().backward()
        opt.step()
        sched.step()
        rt.step_done()


def _parts(rt: runtime.Runtime, width: int = 8):
    torch.manual_seed(0)
    random.seed(0)
    layers = [torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)]
    model = rt.wrap(torch.nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sampler = rt.sampler(64, batch_size=4)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    rt.restore(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    return model, opt, sched, sampler, x


def _fault_free(steps: int = 12) -> dict:
    """The model's state after `steps` steps with no fault, to compare a resumed run with."""
    straight = runtime.init(env={})
    parts = _parts(straight)
    _loop(straight, *parts, steps)
    return parts[0].state_dict()


def _resume_and_match(tmp_path, step: int, expected: dict, steps: int = 12) -> None:
    """A new run on the tier resumes from the copy of `step` and ends with `expected`'s bytes."""
    again = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    parts = _parts(again)
    assert again.resumed_from == step and again.resumed_tier == "memory"
    _loop(again, *parts, steps)
    got = parts[0].state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    again.finish()


def test_a_last_words_copy_resumes_exactly_where_a_fault_free_run_was(tmp_path):
    """K = 5: copies at 5 only; the group breaks in step 8's backward (its batch drawn, the RNG
    moved on). The last words hold step 7 as it was at its end, and a run resumed from them
    ends with the fault-free run's bytes."""
    expected = _fault_free()

    rt = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    _loop(rt, *_parts(rt), 7, half=True)
    rt.memory.writer.wait()
    assert mem.read_held(tmp_path).step == 5
    rt.memory.settle(runtime.SETTLE_S)
    assert rt.at_failure.last_words(runtime.LAST_WORDS_S)
    assert mem.read_held(tmp_path).step == 7
    rt.memory.writer.close()
    _resume_and_match(tmp_path, 7, expected)


_LIVE_WRITER = """
import sys, time
from worker.memory_dirs import hold_last_words
assert hold_last_words(sys.argv[1]) is not None  # the writer's byte, as a live writer holds it
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.integration
def test_a_sibling_speaks_for_its_node_once_the_writer_is_gone_and_never_beside_it(tmp_path):
    """One node, two workers, the writer (local rank 0) SIGKILLed: its sibling, whose state is
    step 7's, copies it into the tier in its place; while the writer lives it does not (two
    ranks never write the tier at once). The copy is step 7's: a run resumed from it ends with
    the fault-free run's bytes."""
    import subprocess
    import sys
    from pathlib import Path

    expected = _fault_free()

    repo = Path(__file__).resolve().parents[2]
    writer = subprocess.Popen([sys.executable, "-c", _LIVE_WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, cwd=repo, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    try:
        assert writer.stdout.readline().strip() == "ready"
        sibling = runtime.init(memory_dir=tmp_path, memory_every=5, env={"LOCAL_RANK": "1"})
        assert sibling.memory.writer is None
        _loop(sibling, *_parts(sibling), 7, half=True)
        began = time.monotonic()
        assert not sibling.at_failure.last_words(0.2)  # the writer lives (it speaks itself)
        assert mem.read_held(tmp_path) is None and time.monotonic() - began >= 0.2
    finally:
        writer.kill()
        writer.wait()
    assert sibling.at_failure.last_words(runtime.LAST_WORDS_S)
    assert mem.read_held(tmp_path).step == 7
    sibling.memory.writer.close()
    _resume_and_match(tmp_path, 7, expected)


def test_no_last_words_once_the_optimizer_began_the_next_step(tmp_path):
    rt = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    model, opt, sched, sampler, x = _parts(rt)
    _loop(rt, model, opt, sched, sampler, x, 7, half=True)
    opt.step()  # the failure comes after the optimizer changed the parameters
    rt.memory.writer.wait()
    assert not rt.at_failure.last_words(runtime.LAST_WORDS_S)
    assert mem.read_held(tmp_path).step == 5
    rt.memory.writer.close()


@pytest.mark.parametrize("kept", [True, False])
def test_a_forward_after_the_step_keeps_its_buffers_out_of_the_last_words(tmp_path, monkeypatch, kept):
    """BatchNorm: step 8's forward moves the running statistics on. Where the runtime keeps the
    buffers aside at each step's end (small ones), the last words hold step 7's; where it does
    not (larger than KEEP_BUFFERS_BYTES), there are none."""
    if not kept:
        monkeypatch.setattr(step_marks, "KEEP_BUFFERS_BYTES", 0)
    rt = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)]
    model = rt.wrap(torch.nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    rt.restore(model=model, optimizer=opt)
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        rt.step_done()
    rt.memory.writer.wait()
    at_7 = {k: v.clone() for k, v in model[1].state_dict().items()}
    model(torch.randn(16, 4))  # step 8's forward: the running statistics moved on
    assert not torch.equal(model[1].running_mean, at_7["running_mean"])
    assert rt.at_failure.last_words(runtime.LAST_WORDS_S) == kept
    copy = mem.load(tmp_path)
    assert copy["step"] == (7 if kept else 5)
    if kept:
        assert all(torch.equal(copy["model"][f"1.{k}"], v) for k, v in at_7.items())
        assert torch.equal(copy["model"]["0.weight"], model[0].weight.detach())
    rt.memory.writer.close()


# The scripts' seven steps of a one-layer model on the runtime `rt` they made.
_SEVEN_STEPS = """\
model = torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
rt.restore(model=model, optimizer=opt)
for _ in range(7):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    rt.step_done()
"""

_SIGTERMED = """
import os, signal, sys, torch
from worker import runtime
rt = runtime.init(memory_dir=sys.argv[1], memory_every=5, env={})
""" + _SEVEN_STEPS + """\
print(torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(), flush=True)
model(torch.randn(8, 4)).pow(2).mean().backward()  # step 8's first half, then the node's agent stops it
os.kill(os.getpid(), signal.SIGTERM)
print("not reached", flush=True)
"""


@pytest.mark.integration
def test_a_sigtermed_worker_says_its_last_words_then_dies_of_the_signal(tmp_path):
    """The node's agent stops a survivor with SIGTERM, often before its next collective fails:
    the state of its last step goes into the tier first, then the signal ends it as before."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _SIGTERMED, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=repo, env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert done.returncode == -15, done.stderr[-2000:]
    assert "not reached" not in done.stdout
    assert mem.read_held(tmp_path).step == 7
    copy = mem.load(tmp_path)
    flat = torch.cat([copy["model"]["weight"].flatten(), copy["model"]["bias"].flatten()])
    assert flat.tolist() == eval(done.stdout.splitlines()[0])  # noqa: S307 - the list it printed


_WRITER = """
import fcntl, os, signal, sys, time
fd = os.open(os.path.join(sys.argv[1], "last-words.lock"), os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), os._exit(0)))  # its last words: 0.3 s
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.integration
def test_a_broken_groups_stop_waits_for_the_writers_last_words_and_only_then(tmp_path, monkeypatch):
    """torchrun's stop of a broken group (worker/rendezvous/monitor.py) SIGTERMs the workers and
    waits while the node's writer holds the tier's last-words lock; with nobody holding it, it
    does not wait."""
    import subprocess
    import sys
    import types

    from worker.rendezvous import monitor

    monkeypatch.setenv("FTRAIN_MEMORY_DIR", str(tmp_path))
    agent = types.SimpleNamespace(_pcontext=types.SimpleNamespace(pids=dict))
    began = time.monotonic()
    monitor.let_them_say_last_words(agent)  # no lock file at all
    assert time.monotonic() - began < 0.1

    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        agent = types.SimpleNamespace(_pcontext=types.SimpleNamespace(pids=lambda: {0: writer.pid}))
        began = time.monotonic()
        monitor.let_them_say_last_words(agent)
        waited = time.monotonic() - began
        assert writer.wait(5) == 0  # it had its SIGTERM and said its last words
        assert 0.25 < waited < monitor.LAST_WORDS_WAIT_S, waited
    finally:
        writer.kill()
        writer.wait()
    began = time.monotonic()
    monitor.let_them_say_last_words(agent)  # the lock file is there, nobody holds it
    assert time.monotonic() - began < 0.1


def test_a_failure_inside_step_done_after_the_count_moved_on_copies_that_step(tmp_path, monkeypatch):
    """The group breaks in step_done's own broadcast, after step 8's optimizer step and the
    count: the state is step 8's, and the last words say so."""
    rt = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    model, opt, sched, sampler, x = _parts(rt)
    _loop(rt, model, opt, sched, sampler, x, 7)
    rt.memory.writer.wait()

    def broken(*_args):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(rt, "_agree_on_control", broken)
    opt.zero_grad()
    model(x[:4]).pow(2).mean().backward()
    opt.step()
    with pytest.raises(RuntimeError):
        rt.step_done()
    rt._say_last_words()
    assert rt.step == 8 and mem.read_held(tmp_path).step == 8
    assert torch.equal(mem.load(tmp_path)["model"]["0.weight"], model[0].weight.detach())
    rt.memory.writer.close()


def test_last_words_off_keeps_the_old_ways(tmp_path):
    """FTRAIN_LAST_WORDS=0: no copy at the failure, and the RNG states kept at copy steps only."""
    rt = runtime.init(memory_dir=tmp_path, memory_every=5, env={"FTRAIN_LAST_WORDS": "0"})
    _loop(rt, *_parts(rt), 7, half=True)
    rt.memory.writer.wait()
    rt._say_last_words()
    assert mem.read_held(tmp_path).step == 5 and not rt.boundary_s
    assert [s for s in range(1, 8) if mem.load_rng(tmp_path, 0, s, rt.rng_ring) is not None] == [5]
    rt.memory.writer.close()


_PAUSED = """
import os, signal, sys, threading, time, torch
from worker import runtime
rt = runtime.init(memory_dir=sys.argv[1], memory_every=5, snapshot_dir=sys.argv[2], snapshot_every=1000,
                  pause_timeout_s=30, env={})
""" + _SEVEN_STEPS + """\
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()  # the agent's restart
rt.at_failure.busy = True  # as in step_done, which obeys a checkpoint_pause
rt._obey("checkpoint_pause", 1)
"""


@pytest.mark.integration
def test_a_paused_worker_ends_at_once_on_sigterm_after_its_last_words(tmp_path):
    """A group paused at a step boundary for a planned change waits to be restarted: the
    restart's SIGTERM ends it at once (it came inside step_done, whose end never comes)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "m").mkdir()
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _PAUSED, str(tmp_path / "m"), str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=60, cwd=repo,
                          env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert done.returncode == -15, done.stderr[-2000:]
    assert time.monotonic() - began < 25  # not the 30 s pause
    assert mem.read_held(tmp_path / "m").step == 7


# torchrun's stand-in: starts its worker and, on SIGTERM, waits for it as torchrun's shutdown does.
_TORCHRUN = """
import signal, subprocess, sys, time
child = subprocess.Popen(sys.argv[1:])
print(child.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *_: (child.wait(), sys.exit(0)))
child.wait()
time.sleep(60)
"""

# A worker whose last-words copy takes 0.8 s (a large model's), more than a replaced attempt's grace.
_SLOW_SPEAKER = """
import sys, time, torch
from worker import memory as mem
from worker import runtime
finish = mem.MemoryWriter._finish
def slow(self, *args, **kwargs):
    if args[1]["step"] == 7:
        time.sleep(0.8)
    return finish(self, *args, **kwargs)
mem.MemoryWriter._finish = slow
rt = runtime.init(memory_dir=sys.argv[1], memory_every=5, env={})
""" + _SEVEN_STEPS + """\
rt.memory.writer.wait()
print("ready", flush=True)
time.sleep(60)
"""

# A worker that may speak (its lock byte held) but never does: stuck where no SIGTERM handler runs.
_STUCK = """
import signal, sys, time
from worker.memory_dirs import hold_last_words
signal.signal(signal.SIGTERM, signal.SIG_IGN)
assert hold_last_words(sys.argv[1]) is not None
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.integration
@pytest.mark.parametrize("worker", ["speaking", "stuck"])
def test_a_replaced_attempts_stop_waits_past_its_grace_for_last_words_being_said_only(tmp_path, worker):
    """The node agent stops a replaced attempt with a 0.3 s grace (worker/agent.py
    REPLACE_GRACE_S). A worker saying last words that take 0.8 s gets them whole (up to
    LAST_WORDS_WAIT_S); one that only may speak (stuck) is killed after the grace as before."""
    import subprocess
    import sys
    from pathlib import Path

    from worker.agent import REPLACE_GRACE_S
    from worker.memory_dirs import LAST_WORDS_WAIT_S
    from worker.torchrun import Torchrun, WorkerGroup

    class Shipper:
        def add(self, *args) -> None:
            pass

    repo = Path(__file__).resolve().parents[2]
    memory = tmp_path / "m"
    memory.mkdir()
    script = _SLOW_SPEAKER if worker == "speaking" else _STUCK
    proc = subprocess.Popen([sys.executable, "-c", _TORCHRUN, sys.executable, "-c", script, str(memory)],
                            stdout=subprocess.PIPE, text=True, cwd=repo,
                            env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    t = Torchrun("n1", "http://cp", tmp_path, None, Shipper())
    t.group = WorkerGroup("j", 1, proc)
    t.memory = ("j", memory)
    try:
        child = int(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "ready"
        began = time.monotonic()
        t.stop("the job moved to a new attempt", grace_s=REPLACE_GRACE_S)
        took = time.monotonic() - began
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["kill", "-9", str(child)], capture_output=True)
    if worker == "speaking":
        assert mem.read_held(memory).step == 7  # whole: not cut short at 0.3 s (step 5 kept)
        assert 0.8 < took < LAST_WORDS_WAIT_S + 1.0, took
    else:
        assert took < 1.0, took  # the grace alone, not LAST_WORDS_WAIT_S


@pytest.mark.parametrize(("mark_ms", "step_ms", "off"), [
    (0.25, 1.5, True),  # an H100's 10M-parameter step of batch 32: the marks cost 17%
    (0.04, 4.5, False),  # 0.9%: within MARKS_SHARE of the budget
    (0.25, 50.0, False),
])
def test_gpu_marks_stop_when_they_cost_more_than_their_share_of_the_budget(tmp_path, mark_ms, step_ms, off):
    """With the interval picked by the runtime, rank 0 stops the marks of a GPU job whose steps
    are too short for them (every rank at the next broadcast); the copies then get the whole
    budget. Where they stay, the copies get what the marks leave."""
    worker = runtime.Worker(rank=0, local_rank=0, world_size=1, distributed=False, device=torch.device("cuda"))
    rt = runtime.Runtime(worker, memory=runtime.MemoryTier(worker, tmp_path, None))
    rt.memory.open_writer()
    rt.memory.writer.stalls_s.append(0.5e-3)  # a copy's cost on the training thread
    rt.marks.on, rt.step = True, runtime.MARKS_PROBE_STEPS
    rt.schedule.step_s, rt.marks.mark_s = step_ms / 1e3, mark_ms / 1e3
    rt._plan_next_copy()
    assert rt.marks.off is off
    room = runtime.MEMORY_AIM * runtime.MEMORY_BUDGET * rt.schedule.step_s - (0 if off else rt.marks.mark_s)
    assert rt.memory_interval == min(runtime.MEMORY_EVERY_MAX, max(1, -(-0.5e-3 // room)))
    rt._agree_on_control()  # (not distributed: its own decision)
    assert rt.marks.on is not off
