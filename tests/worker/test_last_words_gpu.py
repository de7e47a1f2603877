"""A GPU survivor's last words (worker/runtime.py `_last_words_gpu`): with the host ahead of
the GPU, the copy holds the step whose boundary the GPU's events prove done, copied while the
training stream is stuck (a dead peer's collective, stood in for by a long GPU sleep queued on
it), and nothing when the GPU is in the middle of an optimizer step. Needs a CUDA device."""

from __future__ import annotations

import random
import time

import pytest
import torch

from worker import memory as mem
from worker import runtime

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STUCK_CYCLES = 3_000_000_000  # about 1.5-2 s of GPU time: the stream is stuck meanwhile


def _parts(rt: runtime.Runtime):
    torch.manual_seed(0)
    random.seed(0)
    layers = [torch.nn.Linear(4, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 1)]
    model = rt.wrap(torch.nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sampler = rt.sampler(64, batch_size=4)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)).to(rt.device)
    rt.restore(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    return model, opt, sched, sampler, x


def _step(rt, model, opt, sched, xb, finish: bool = True) -> None:
    opt.zero_grad()
    noise = torch.randn(xb.shape, device=xb.device) * 0.01  # the CUDA RNG is part of the step
    model(xb + noise).pow(2).mean().backward()
    opt.step()
    if finish:
        sched.step()
        rt.step_done()


def _loop(rt, model, opt, sched, sampler, x, steps: int) -> None:
    for indices in sampler:
        if rt.step >= steps:
            return
        _step(rt, model, opt, sched, x[indices.to(x.device) if torch.is_tensor(indices) else indices])
        torch.cuda.synchronize()


def _fault_free(steps: int = 12) -> dict:
    straight = runtime.init(env={})
    parts = _parts(straight)
    _loop(straight, *parts, steps)
    return {k: v.cpu() for k, v in parts[0].state_dict().items()}


def _next_batch(rt, sampler, x):
    it = iter(sampler)
    return x[next(it)]


def test_gpu_last_words_hold_the_step_the_gpu_finished_while_its_stream_is_stuck(tmp_path):
    """K = 5 (a copy at 5); then the training stream is stuck (a GPU sleep, as a dead peer's
    all-reduce would hold it) with step 8's forward, backward and optimizer step queued behind.
    The last words are said while it is stuck, hold step 7 (BatchNorm's statistics as at
    step 7's end, though step 8's forward is queued), and a run resumed from them ends with the
    fault-free run's bytes."""
    expected = _fault_free()
    rt = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    model, opt, sched, sampler, x = _parts(rt)
    _loop(rt, model, opt, sched, sampler, x, 7)
    rt.memory.writer.wait()
    assert mem.read_held(tmp_path).step == 5
    xb = _next_batch(rt, sampler, x)  # (indexing with a host list waits for the stream: first)
    torch.cuda._sleep(STUCK_CYCLES)  # the stuck collective
    _step(rt, model, opt, sched, xb, finish=False)  # step 8 queued behind it
    stuck = torch.cuda.Event()
    stuck.record()
    began = time.monotonic()
    rt.memory.settle(runtime.SETTLE_S)
    assert rt.at_failure.last_words(runtime.LAST_WORDS_S)
    took = time.monotonic() - began
    assert not stuck.query(), f"the stream moved on before the copy was done ({took:.2f} s): no proof"
    assert mem.read_held(tmp_path).step == 7
    torch.cuda.synchronize()
    rt.memory.writer.close()

    again = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    parts = _parts(again)
    assert again.resumed_from == 7 and again.resumed_tier == "memory"
    _loop(again, *parts, 12)
    got = parts[0].state_dict()
    assert all(torch.equal(got[k].cpu(), expected[k]) for k in expected)
    again.finish()


def test_gpu_no_last_words_while_the_gpu_runs_the_next_optimizer_step(tmp_path):
    """Step 8's optimizer step queued and begun on the GPU, its boundary not reached (the
    stream stuck right after the optimizer's kernels): the state is no step's, so no copy
    (the tier keeps step 5), within GPU_SETTLE_S of looking."""
    rt = runtime.init(memory_dir=tmp_path, memory_every=5, env={})
    model, opt, sched, sampler, x = _parts(rt)
    _loop(rt, model, opt, sched, sampler, x, 7)
    rt.memory.writer.wait()
    _step(rt, model, opt, sched, _next_batch(rt, sampler, x), finish=False)
    torch.cuda._sleep(STUCK_CYCLES)  # stuck after step 8's optimizer kernels, before its boundary
    began = time.monotonic()
    rt.memory.settle(runtime.SETTLE_S)
    assert not rt.at_failure.last_words(runtime.LAST_WORDS_S)
    assert time.monotonic() - began < runtime.GPU_SETTLE_S + 0.5
    assert mem.read_held(tmp_path).step == 5
    torch.cuda.synchronize()
    rt.memory.writer.close()


_STUCK_WORKER = """
import sys, time, torch
sys.path.insert(0, sys.argv[2])
from tests.worker.test_last_words_gpu import _parts, _loop, _next_batch, _step
from worker import runtime
rt = runtime.init(memory_dir=sys.argv[1], memory_every=5, env={})
model, opt, sched, sampler, x = _parts(rt)
_loop(rt, model, opt, sched, sampler, x, 7)
rt.memory.writer.wait()
xb = _next_batch(rt, sampler, x)
torch.cuda._sleep(40_000_000_000)  # ~20 s: the collective its dead peer never joins
_step(rt, model, opt, sched, xb, finish=False)
print("stuck", flush=True)
torch.cuda.synchronize()  # the main thread waits here, as it would in NCCL
print("woke", flush=True)
"""


@pytest.mark.integration
def test_a_gpu_worker_stuck_behind_its_stream_hears_sigterm_says_its_last_words_and_exits(tmp_path):
    """SIGTERM while the main thread waits on a stuck stream (Python cannot run its handler
    there): a thread of the runtime hears it, the tier gets step 7, and the worker exits at
    once, not when the stream would come free (its agent would SIGKILL it after its grace)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_WORKER, str(tmp_path), str(repo)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=repo,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(repo), os.environ.get("PYTHONPATH")]))})
    try:
        assert proc.stdout.readline().strip() == "stuck", proc.stderr.read()[-2000:]
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    assert took < runtime.SETTLE_S + runtime.LAST_WORDS_S, f"exited {took:.1f} s after SIGTERM"
    assert mem.read_held(tmp_path).step == 7
