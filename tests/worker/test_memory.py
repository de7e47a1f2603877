"""The memory tier (worker/memory.py): a copy every step that a restart resumes from, whole
even when the copier died mid-copy, and the runtime choosing between it and the disk tier."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from worker import memory as mem
from worker import rng, runtime


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt


def _step(model, opt, seed: int) -> None:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).device)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _state(model, opt, step: int) -> dict:
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}


def _later(model, opt) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()}


def test_only_an_optimizers_step_changes_the_parameters_and_its_state_and_nothing_without_one():
    model, opt = _model_and_opt()
    _step(model, opt, 0)  # the optimizer has state now
    later = mem.changed_by_step([model, opt, None, 3])
    assert later == _later(model, opt) and len(later) > len(list(model.parameters()))
    assert mem.changed_by_step([model]) == set()  # nothing tells when they change: copied at once


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b.to(a.device))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_a_copy_is_the_state_of_its_step_although_the_optimizer_steps_right_after(tmp_path, monkeypatch):
    finish = mem.MemoryWriter._finish

    def slow_finish(*args):  # a copy slower than the next step's forward and backward
        time.sleep(0.2)
        finish(*args)

    monkeypatch.setattr(mem.MemoryWriter, "_finish", slow_finish)
    model, opt = _model_and_opt()
    writer = mem.MemoryWriter(tmp_path, attempt=3, rank=0)
    opt.register_step_pre_hook(writer.guard)
    _step(model, opt, 0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    writer.capture(_state(model, opt, 1), 1, _later(model, opt))
    _step(model, opt, 1)  # the guard lets the optimizer change the parameters only after the copy
    writer.wait()

    got = mem.load(tmp_path)
    assert got["step"] == 1 and mem.read_held(tmp_path).step == 1
    assert mem.read_held(tmp_path).attempt == 3
    assert _equal(got["model"], expected)
    assert all(torch.equal(a, got["optimizer"]["state"][i]["exp_avg"]) for i, a in enumerate(exp_avg))
    # and it loads into a fresh model and optimizer
    fresh, fresh_opt = _model_and_opt(seed=1)
    fresh.load_state_dict(got["model"])
    fresh_opt.load_state_dict(got["optimizer"])
    assert _equal(fresh.state_dict(), expected)


def test_a_copier_killed_mid_copy_leaves_the_previous_copy_whole(tmp_path, monkeypatch):
    model, opt = _model_and_opt()
    writer = mem.MemoryWriter(tmp_path)
    _step(model, opt, 0)
    writer.capture(_state(model, opt, 1), 1, _later(model, opt))
    writer.wait()
    at_one = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt, 1)
    # The copy of step 2 writes the other slot and dies before it is whole.
    monkeypatch.setattr(mem.MemoryWriter, "_finish", lambda *a, **k: None)
    writer.capture(_state(model, opt, 2), 2, set())  # everything copied at once, nothing named
    writer.wait()

    assert mem.read_held(tmp_path).step == 1
    got = mem.load(tmp_path)
    assert got["step"] == 1 and _equal(got["model"], at_one)
    assert mem.load(tmp_path, step=2) is None


def test_no_room_for_a_copy_turns_the_tier_off_instead_of_crashing(tmp_path, monkeypatch):
    model, opt = _model_and_opt()
    writer = mem.MemoryWriter(tmp_path)
    _step(model, opt, 0)
    writer.capture(_state(model, opt, 1), 1, set())
    writer.wait()

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mem.os, "posix_fallocate", full)
    writer._maps.clear()  # as if the layout changed
    writer.capture(_state(model, opt, 2), 2, set())
    writer.wait()
    assert writer.disabled and "No space left" in writer.disabled
    assert mem.read_held(tmp_path).step == 1  # the whole copy before it is kept
    writer.capture(_state(model, opt, 3), 3, set())  # and nothing more is tried
    assert mem.read_held(tmp_path).step == 1


def test_copies_alternate_slots_and_a_new_writer_keeps_the_whole_one(tmp_path):
    model, opt = _model_and_opt()
    writer = mem.MemoryWriter(tmp_path)
    for step in range(1, 6):
        _step(model, opt, step)
        writer.capture(_state(model, opt, step), step, _later(model, opt))
    writer.wait()
    assert mem.read_held(tmp_path).step == 5
    again = mem.MemoryWriter(tmp_path)  # a restarted worker writes the slot that is not latest
    _step(model, opt, 6)
    again.capture(_state(model, opt, 6), 6, set())
    again.wait()
    assert mem.load(tmp_path)["step"] == 6


def _train(rt: runtime.Runtime, steps: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = rt.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sampler = rt.sampler(64, batch_size=4)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    rt.restore(model=model, optimizer=opt, sampler=sampler)
    for indices in sampler:
        if rt.step >= steps:
            break
        opt.zero_grad()
        model(x[indices].to(rt.device)).pow(2).mean().backward()
        opt.step()
        rt.step_done()
    rt.finish()
    return model


def test_the_runtime_resumes_from_memory_when_it_is_newer_than_the_disk(tmp_path):
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    memory.mkdir()
    env: dict[str, str] = {}

    def init():
        return runtime.init(snapshot_dir=disk, snapshot_every=5, memory_dir=memory, memory_every=1, env=env)

    straight = _train(runtime.init(env={}), 13)
    _train(init(), 8)  # disk: step 5; memory: step 8
    rt = init()
    model = _train(rt, 13)
    assert rt.resumed_from == 8 and rt.resumed_tier == "memory"
    assert torch.equal(model.weight, straight.weight)

    rt = init()
    _train(rt, 13)
    assert rt.resumed_from == 13 and rt.resumed_tier == "memory"


def test_the_runtime_falls_back_to_the_disk_without_a_newer_memory_copy(tmp_path):
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    memory.mkdir()
    _train(runtime.init(snapshot_dir=disk, snapshot_every=5, memory_dir=memory, memory_every=1, env={}), 8)
    for p in memory.iterdir():  # the node lost its memory (a new node, a reboot)
        p.unlink()
    rt = runtime.init(snapshot_dir=disk, snapshot_every=5, memory_dir=memory, env={})
    _train(rt, 9)
    assert rt.resumed_from == 5 and rt.resumed_tier == "disk"


def test_the_picked_interval_counts_what_a_copy_costs_the_steps_beside_it(tmp_path, monkeypatch):
    """The training thread's own time in a copy (0.2 ms here) is not all it costs: the steps
    from its start to the one after its commit ran 3, 3 and 2 ms over the 10 ms of the steps
    with no copy at work. The interval is picked from those 8 ms (20 steps of 10 ms for 4%),
    not from the 0.2 ms (a copy every step)."""
    rt = runtime.init(memory_dir=tmp_path, env={})
    _train(rt, 3)
    rt.marks.on = False
    w = rt.memory.writer
    w.wait()
    w._on_device, w.stalls_s[:], w.commits_s[:], rt.memory.rng_s = True, [0.0001], [0.0001], 0.0
    rt.schedule.copy_work, rt.schedule.quiet_s, rt.schedule.copy_costs, rt.schedule.last_step_t, rt.schedule.step_s = None, None, [], None, None
    rt.schedule.copies_timed = 1  # (not the process's first copy, whose cost is its buffers' set-up)
    busy = iter([True, True, False])
    monkeypatch.setattr(w, "busy", lambda: next(busy))
    t = 100.0
    for took in [0.0, 0.010, 0.010, 0.010, 0.010]:  # no copy at work
        t += took
        rt.schedule.time_step(rt.memory, t)
    rt.schedule.copy_work, rt.schedule.copy_ending = 0.0, False  # a copy starts (`_keep_rng_and_copy`)
    for took in [0.013, 0.013, 0.012, 0.010]:  # beside it; committed in the third; the step after
        t += took
        rt.schedule.time_step(rt.memory, t)
    assert rt.schedule.copy_work is None and rt.schedule.copy_cost_s == pytest.approx(0.008)
    rt._plan_next_copy()
    # aimed at MEMORY_AIM of the budget, of the steps with no copy at work (10 ms)
    assert rt.memory_interval == math.ceil(0.008 / (runtime.MEMORY_AIM * runtime.MEMORY_BUDGET * 0.010))
    assert rt.memory_interval >= 14


def test_the_picked_interval_follows_the_mean_cost_of_the_last_copies(tmp_path, monkeypatch):
    """Each copy's cost read from the steps beside it is noisy: the interval follows the mean of
    the last COPY_COSTS_KEPT copies, so one copy read at 20 ms among copies of 2 ms moves it by
    a sixteenth of the difference (a moving average of weight 0.3 moved it by 30%)."""
    rt = runtime.init(memory_dir=tmp_path, env={})
    _train(rt, 2)
    w = rt.memory.writer
    monkeypatch.setattr(w, "busy", lambda: False)  # each copy whole at the step after it starts
    rt.schedule.copy_work, rt.schedule.quiet_s, rt.schedule.copy_costs, rt.schedule.last_step_t, rt.schedule.step_s = None, None, [], None, None
    t = 100.0
    for took in [0.0, 0.010, 0.010]:
        t += took
        rt.schedule.time_step(rt.memory, t)

    def copy(extra: float) -> None:
        nonlocal t
        rt.schedule.copy_work, rt.schedule.copy_ending = 0.0, False
        for took in [0.010 + extra, 0.010]:  # its cost in the step it runs beside; the step after
            t += took
            rt.schedule.time_step(rt.memory, t)
        for _ in range(3):  # quiet steps between copies
            t += 0.010
            rt.schedule.time_step(rt.memory, t)

    for _ in range(runtime.COPY_COSTS_KEPT + 4):
        copy(0.002)
    assert rt.schedule.copy_cost_s == pytest.approx(0.002)
    copy(0.020)
    assert rt.schedule.copy_cost_s == pytest.approx(0.002 + 0.018 / runtime.COPY_COSTS_KEPT)
    for _ in range(runtime.COPY_COSTS_KEPT):  # the outlier leaves the window
        copy(0.002)
    assert rt.schedule.copy_cost_s == pytest.approx(0.002)


def test_without_a_fixed_interval_copies_are_spaced_to_fit_the_budget(tmp_path):
    rt = runtime.init(memory_dir=tmp_path, env={})
    _train(rt, 3)
    rt.marks.on = False  # the copies' cost alone (the step marks' share: test_last_words.py)
    writer = rt.memory.writer
    writer._on_device = False  # the host path's cost first (on a GPU machine _train took the GPU path)
    rt.schedule.step_s, rt.schedule.quiet_s = 0.1, None
    writer.copies_s[:], writer.stalls_s[:], rt.memory.rng_s = [0.001], [0.0], 0.0
    rt._plan_next_copy()
    assert rt.memory_interval == 1 and rt.schedule.next == rt.step + 1  # 1 ms of a 100 ms step
    # Aimed at MEMORY_AIM (80%) of the 5% budget: 4 ms of a 100 ms step.
    writer.copies_s[:] = [0.0195]
    writer.stalls_s[:] = [0.0005]
    rt._plan_next_copy()
    assert rt.memory_interval == 5 and rt.schedule.next == rt.step + 5  # 20 ms: 4% of 5 steps
    rt.memory.rng_s = 0.005  # the ranks' RNG capture comes with each copy: it counts too
    rt._plan_next_copy()
    assert rt.memory_interval == 7
    rt.memory.rng_s = 0.0
    writer.copies_s[:] = [10.0]
    rt._plan_next_copy()
    assert rt.memory_interval == runtime.MEMORY_EVERY_MAX
    # On the GPU path the copy runs on the copy engine: its cost is the training thread's
    # time and the thread's commit (which holds the GIL), not the whole copy.
    writer._on_device = True
    writer.commits_s[:] = [0.001]
    rt._plan_next_copy()
    assert rt.memory_interval == 1
    writer.commits_s[:] = [0.0195]
    rt._plan_next_copy()
    assert rt.memory_interval == 5
    writer._on_device = False
    fixed = runtime.init(memory_dir=tmp_path, memory_every=3, env={})
    _train(fixed, 7)
    assert fixed.memory_interval == 3 and mem.read_held(tmp_path).step == 6


def test_a_due_copy_skipped_while_one_was_in_flight_is_taken_at_finish(tmp_path, monkeypatch):
    """On a GPU a copy that is due while the previous one is still in flight is skipped (the
    training thread does not wait); the job's last step is copied when the runtime finishes."""
    in_flight = [False]
    monkeypatch.setattr(mem.MemoryWriter, "busy", lambda self: in_flight[0])
    rt = runtime.init(memory_dir=tmp_path, memory_every=1, env={})
    torch.manual_seed(0)
    model = rt.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rt.restore(model=model, optimizer=opt)
    for step in range(1, 5):
        in_flight[0] = step >= 3  # steps 3 and 4: skipped
        opt.zero_grad()
        model(torch.randn(8, 4, device=rt.device)).pow(2).mean().backward()
        opt.step()
        rt.step_done()
    rt.memory.writer.wait()
    assert mem.read_held(tmp_path).step == 2 and rt.memory.writer.skipped == 2
    in_flight[0] = False
    rt.finish()
    assert mem.read_held(tmp_path).step == 4
    assert torch.equal(mem.load(tmp_path)["model"]["weight"], model.weight.detach().cpu())


def test_memory_every_zero_turns_the_tier_off(tmp_path):
    rt = runtime.init(memory_dir=tmp_path, memory_every=0, env={})
    _train(rt, 3)
    assert rt.memory is None and mem.read_held(tmp_path) is None


def test_leftover_memory_dirs_of_this_agent_are_removed_and_others_kept(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    mine = mem.make_job_dir(tmp_path / "a", "n0", "job1", shm=shm)
    other_dir = mem.make_job_dir(tmp_path / "b", "n0", "job1", shm=shm)  # same name, other data dir
    other_name = mem.make_job_dir(tmp_path / "a", "n1", "job1", shm=shm)
    assert mine.parent == shm
    assert mem.remove_leftovers(tmp_path / "a", "n0", shm=shm) == [mine]
    assert not mine.exists() and other_dir.exists() and other_name.exists()


def test_a_copy_read_back_in_many_chunks_is_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(mem, "READ_CHUNK", 1000)  # a read of many chunks on several threads
    model, opt = _model_and_opt()
    _step(model, opt, 0)
    writer = mem.MemoryWriter(tmp_path)
    writer.capture(_state(model, opt, 1), 1, set())
    writer.wait()
    got = mem.load(tmp_path)
    assert _equal(got["model"], model.state_dict()) and _equal(got["optimizer"], opt.state_dict())


def test_a_copy_read_in_many_chunks_is_verified_by_the_sums_its_threads_took(tmp_path, monkeypatch):
    """Each reading thread sums its chunk; joined, the pair is the whole copy's: a changed
    byte in a later chunk fails it, and so do two words swapped across chunks."""
    monkeypatch.setattr(mem, "READ_CHUNK", 1000)
    model, opt = _model_and_opt()
    _step(model, opt, 0)
    writer = mem.MemoryWriter(tmp_path)
    writer.capture(_state(model, opt, 1), 1, set())
    writer.wait()
    slot = mem.json.loads((tmp_path / mem.LATEST).read_text())["slot"]
    data = (tmp_path / f"slot{slot}.bin").read_bytes()
    flat = torch.empty(len(data), dtype=torch.uint8)
    size, summed = mem._read_parallel(tmp_path / f"slot{slot}.bin", flat)
    assert size == len(data) > 3000
    assert summed == mem.sum64(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    swapped = bytearray(data)
    a, b = next((i, i + 2000) for i in range(0, len(data) - 2008, 8) if data[i:i + 8] != data[i + 2000:i + 2008])
    swapped[a:a + 8], swapped[b:b + 8] = data[b:b + 8], data[a:a + 8]
    (tmp_path / f"slot{slot}.bin").write_bytes(bytes(swapped))
    with pytest.raises(mem.CopyCorrupt):
        mem.read_copy(tmp_path)
    flipped = bytearray(data)
    flipped[2500] ^= 0xFF
    (tmp_path / f"slot{slot}.bin").write_bytes(bytes(flipped))
    with pytest.raises(mem.CopyCorrupt):
        mem.read_copy(tmp_path)
    assert mem.read_slot(tmp_path, slot) is None


@pytest.fixture
def shm_dir():
    base = mem.SHM_ROOT if mem.SHM_ROOT.is_dir() else None
    d = Path(tempfile.mkdtemp(prefix="ftrain-test-memory-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs a GPU")
@pytest.mark.parametrize("path,register,where", [("staged", True, "shm"), ("staged", False, "shm"),
                                                  ("pageable", True, "shm"), ("staged", True, "disk")])
def test_on_a_gpu_a_copy_is_the_state_of_its_step_although_training_goes_on_at_once(
        tmp_path, shm_dir, monkeypatch, path, register, where):
    """On /dev/shm the slot is registered with CUDA; on a disk CUDA may refuse that, and the
    copy goes through a pinned buffer without the refusal reaching the training thread."""
    monkeypatch.setattr(mem.MemoryWriter, "device_path", path)
    monkeypatch.setattr(mem.MemoryWriter, "register_host", register)
    if where == "shm":
        tmp_path = shm_dir
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512),
                                torch.nn.Linear(512, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    writer = mem.MemoryWriter(tmp_path)
    opt.register_step_pre_hook(writer.guard)

    def step(seed: int) -> None:
        x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        opt.zero_grad()
        model(x).pow(2).mean().backward()  # changes the BatchNorm's running stats too
        opt.step()

    for n in range(1, 4):
        step(n)
        expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        exp_avg = [opt.state[p]["exp_avg"].cpu().clone() for p in model.parameters()]
        writer.capture(_state(model, opt, n), n, _later(model, opt))
        step(100 + n)  # at once: forward, backward and optimizer step on the training stream
        step(200 + n)
        writer.wait()
        got = mem.load(tmp_path)
        assert got["step"] == n and mem.read_held(tmp_path).step == n
        assert _equal(got["model"], expected)
        assert all(torch.equal(a, got["optimizer"]["state"][i]["exp_avg"]) for i, a in enumerate(exp_avg))
    if path == "staged" and where == "shm":
        assert writer.host_copy == ("registered" if register else "pinned")


def _flip_a_byte(memory) -> None:
    """Corrupt the bytes of the copy that latest.json names (as a bad page or a stray write would)."""
    slot = mem.json.loads((memory / mem.LATEST).read_text())["slot"]
    with open(memory / f"slot{slot}.bin", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_corrupt_copy_fails_its_checksum_and_the_runtime_falls_back_to_disk(tmp_path):
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    memory.mkdir()
    _train(runtime.init(snapshot_dir=disk, snapshot_every=5, memory_dir=memory, memory_every=1, env={}), 8)
    assert mem.load(memory)["step"] == 8  # whole: it passes
    _flip_a_byte(memory)
    try:
        mem.read_copy(memory)
        raise AssertionError("a corrupt copy was read back")
    except mem.CopyCorrupt as exc:
        assert exc.step == 8 and "checksum mismatch" in str(exc)
    rt = runtime.init(snapshot_dir=disk, snapshot_every=5, memory_dir=memory, memory_every=1, env={})
    _train(rt, 9)
    assert rt.resumed_from == 5 and rt.resumed_tier == "disk"


def test_sum64_is_the_same_whole_or_joined_from_two_ranges():
    """The GPU path sums the GPU's range on the GPU and the CPU tensors' range on the host,
    and joins them; a reader sums the whole slot at once: both must agree, and a changed or
    moved word must change the sum."""
    import numpy as np

    flat = torch.randint(0, 256, (64 * 300 + 4096 * 3,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(1))
    words = flat.view(torch.int64).numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        ref = (int(words.sum(dtype=np.uint64)),
               int((words * np.arange(1, len(words) + 1, dtype=np.uint64)).sum(dtype=np.uint64)))
    assert mem.sum64(flat) == ref
    for cut in (64, 4096, 64 * 77):
        assert mem.sum64_join(mem.sum64(flat[:cut]), mem.sum64(flat[cut:]), cut) == ref
    assert mem._sum64_small(flat) == ref
    for n in (8, 64, 8 * mem.SMALL_WORDS, 8 * mem.SMALL_WORDS + 8):  # Python's words and numpy's alike
        assert mem._sum64_small(flat[:n]) == mem.sum64(flat[:n])
    high = torch.full((64,), 255, dtype=torch.uint8)  # words of 2**64 - 1: the sums wrap
    assert mem._sum64_small(high) == mem.sum64(high)
    # the GPU path's way: the row and column sums of the range padded with zeros to whole blocks
    block = 8 * mem.SUM_BLOCK
    padded = torch.zeros((flat.numel() + block - 1) // block * block, dtype=torch.uint8)
    padded[:flat.numel()] = flat
    on = padded.cuda() if torch.cuda.is_available() else padded
    blocks = on.view(torch.int64).view(-1, mem.SUM_BLOCK)
    rows_at = torch.arange(blocks.shape[0], dtype=torch.int64, device=on.device)
    cols_at = torch.arange(1, mem.SUM_BLOCK + 1, dtype=torch.int64, device=on.device)
    pair = mem._sum64_pair(blocks, rows_at, cols_at).tolist()
    assert (pair[0] & mem._MASK, pair[1] & mem._MASK) == ref
    if torch.cuda.is_available():
        assert mem.sum64(flat.cuda()) == ref
    swapped = flat.clone()
    swapped[:8], swapped[8:16] = flat[8:16].clone(), flat[:8].clone()
    assert mem.sum64(swapped)[0] == ref[0] and mem.sum64(swapped) != ref


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
def test_a_plan_copies_the_state_of_its_step_as_the_full_state_dicts_would(tmp_path, shm_dir, device):
    """The runtime's StatePlan (tensors taken once, the small state afresh each step): each
    copy equals the state_dicts of that step, the learning rate a scheduler moved included
    (on a GPU: the staged path, its checksum summed on the GPU and checked on the CPU)."""
    rt = runtime.init(memory_dir=shm_dir, memory_every=1, env={})
    tmp_path = shm_dir
    model, opt = _model_and_opt()
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    rt.restore(model=model, optimizer=opt, scheduler=sched)
    for n in range(1, 5):
        _step(model, opt, n)
        sched.step()
        rt.step_done()
        rt.memory.writer.wait()
        got = mem.load(tmp_path)
        assert got["step"] == n and rt.memory.plan is not None
        assert _equal(got["model"], model.state_dict()) and _equal(got["optimizer"], opt.state_dict())
        assert got["scheduler"] == sched.state_dict()
        assert got["optimizer"]["param_groups"][0]["lr"] == 0.01 / 2**n
    assert rt.memory.plans == 1
    if device == "cuda":  # from the second copy on, the side stream's work replayed from CUDA graphs
        assert rt.memory.writer._on_device and rt.memory.writer.host_copy == "registered" and rt.memory.writer.graphed == 3
    rt.finish()


@pytest.mark.parametrize("device", _DEVICES)
def test_a_tensor_replaced_under_the_plan_is_not_copied_stale(tmp_path, device):
    """A parameter replaced (`p.data = ...`) after the plan was made: the copy that the plan
    took is not committed (its check fails on the copy thread), the next one is, from a new
    plan, and holds the new tensor."""
    rt = runtime.init(memory_dir=tmp_path, memory_every=1, env={})
    model, opt = _model_and_opt()
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    rt.restore(model=model, optimizer=opt)
    _step(model, opt, 1)
    rt.step_done()
    rt.memory.writer.wait()
    assert mem.read_held(tmp_path).step == 1
    with torch.no_grad():
        model[0].weight.data = model[0].weight.data + 1.0  # a new storage; the plan's is the old one
    rt.step_done()
    rt.memory.writer.wait()
    assert mem.read_held(tmp_path).step == 1 and rt.memory.writer.stale
    rt.step_done()
    rt.memory.writer.wait()
    assert mem.read_held(tmp_path).step == 3 and rt.memory.plans == 2
    assert torch.equal(mem.load(tmp_path)["model"]["0.weight"], model[0].weight.detach().cpu())
    _step(model, opt, 4)  # the new plan's layout comes again (on a GPU: its own graphs, not the old ones)
    rt.step_done()
    rt.memory.writer.wait()
    assert mem.read_held(tmp_path).step == 4
    assert torch.equal(mem.load(tmp_path)["model"]["0.weight"], model[0].weight.detach().cpu())
    rt.finish()


def test_a_state_a_plan_cannot_follow_takes_the_full_path(tmp_path):
    """A module with extra state (`get_extra_state`) or a state_dict hook is copied through
    its state_dict() every time."""

    class Extra(torch.nn.Linear):
        def get_extra_state(self):
            return {"calls": self.calls}

        def set_extra_state(self, state):
            self.calls = state["calls"]

    model = Extra(4, 1)
    model.calls = 0
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert mem.StatePlan.make({"model": model, "optimizer": opt}) is None
    normed = torch.nn.utils.spectral_norm(torch.nn.Linear(4, 1))  # a state_dict hook
    assert mem.StatePlan.make({"model": normed}) is None
    assert mem.StatePlan.make({"model": torch.nn.Linear(4, 1)}) is not None
    rt = runtime.init(memory_dir=tmp_path, memory_every=1, env={})
    rt.restore(model=model, optimizer=opt)
    for n in range(1, 3):
        model.calls = n
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        rt.step_done()
        rt.memory.writer.wait()
        assert mem.load(tmp_path)["model"]["_extra_state"] == {"calls": n}
    rt.finish()


def test_the_rng_ring_keeps_the_last_steps_across_a_restart_and_refuses_a_torn_slot(tmp_path):
    keeper = mem.RngKeeper(tmp_path, rank=1, ring=4)
    states = {n: {"python": (3, tuple(range(n, n + 625)), None),
                  "torch": torch.full((8,), n, dtype=torch.uint8)} for n in range(1, 7)}
    for n, state in states.items():
        keeper.keep(n, state)
    again = mem.RngKeeper(tmp_path, rank=1, ring=4)  # a restarted worker: the old slots stay readable
    for n in (3, 4, 5, 6):
        got = mem.load_rng(tmp_path, 1, n, 4)
        assert got["python"] == states[n]["python"] and torch.equal(got["torch"], states[n]["torch"])
    assert mem.load_rng(tmp_path, 1, 2, 4) is None  # its slot holds step 6 now
    assert mem.load_rng(tmp_path, 0, 6, 4) is None  # another rank's
    with open(tmp_path / "rng.r1.ring", "r+b") as f:  # a byte of step 5's payload changed
        f.seek((5 % 4) * mem.RNG_SLOT + 40)
        b = f.read(1)
        f.seek((5 % 4) * mem.RNG_SLOT + 40)
        f.write(bytes([b[0] ^ 0xFF]))
    assert mem.load_rng(tmp_path, 1, 5, 4) is None and mem.load_rng(tmp_path, 1, 6, 4) is not None
    again.keep(7, states[1])
    assert mem.load_rng(tmp_path, 1, 7, 4)["python"] == states[1]["python"]


def test_a_copy_holds_its_step_s_rng_states_as_the_ring_pickled_them(tmp_path):
    """A copy's metadata takes its RNG states as the rank's ring pickled them at the same step
    (`RngKeeper.pickled`), not pickled again at its commit; loaded, they are the states."""
    import random

    rt = runtime.init(memory_dir=tmp_path, memory_every=1, env={})
    model = rt.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rt.restore(model=model, optimizer=opt)
    for _ in range(3):
        random.random()
        torch.rand(3)  # every generator moves each step
        model(torch.randn(8, 4).to(rt.device)).pow(2).mean().backward()
        opt.step()
        rt.step_done()
        rt.memory.writer.wait()
    now = rng.rng_state()  # nothing drew since the copy of step 3
    got = mem.load(tmp_path)
    assert got["step"] == 3
    assert got["rng"]["python"] == now["python"] and torch.equal(got["rng"]["torch"], now["torch"])
    blob = rt.memory.rng_keeper._pickled["python"][1].blob  # the ring's own pickle, whole in the copy's
    slot = json.loads((tmp_path / mem.LATEST).read_text())["slot"]
    assert blob in (tmp_path / f"slot{slot}.pkl").read_bytes()
    rt.finish()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs a GPU")
def test_on_a_gpu_the_training_thread_commits_a_whole_copy_at_its_next_step(shm_dir):
    """The registered GPU path starts no copy thread: the copy of step 1 is committed by the
    training thread at step 2 (its next `step_done`), once whole, and holds step 1's state."""
    rt = runtime.init(memory_dir=shm_dir, memory_every=1, env={})
    torch.manual_seed(0)
    model = rt.wrap(torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    rt.restore(model=model, optimizer=opt)

    def step() -> None:
        opt.zero_grad()
        model(torch.ones(4, 64, device=rt.device)).pow(2).mean().backward()
        opt.step()
        rt.step_done()

    step()
    weight = model.weight.detach().cpu().clone()
    torch.cuda.synchronize()  # the copy of step 1 is whole on the GPU side, not yet committed
    assert mem.read_held(shm_dir) is None and rt.memory.writer._pending is not None
    step()
    assert mem.read_held(shm_dir).step == 1
    assert torch.equal(mem.load(shm_dir, 1)["model"]["weight"], weight)
    assert rt.memory.writer._thread is None and rt.memory.writer.commits_cpu_s
    rt.finish()
    assert mem.read_held(shm_dir).step == 2


def test_copies_back_to_back_still_have_their_cost_read_against_steps_with_none_at_work(monkeypatch):
    """A GPU copy that runs beside the step after it, each time it is due again: before, no
    step was ever timed with no copy at work, so the copies' cost read as nothing and one came
    every step (a 1B model's step 10% slower on an H200). The schedule times a step with none
    at work before the first copy and after every QUIET_PROBE_COPIES copies, and spaces the
    copies by their cost: 30 ms beside a 100 ms step, for 4 ms a step, one every 8 steps. The
    first copy (3 s: it page-locks its buffers) is not what the others cost: not counted."""
    from types import SimpleNamespace

    from worker import step_timing as st

    clock = [100.0]
    monkeypatch.setattr(st.time, "perf_counter", lambda: clock[0])
    busy = [False]
    writer = SimpleNamespace(busy=lambda: busy[0], skipped=0)
    tier = SimpleNamespace(writer=writer, last_cost_s=lambda: 0.001, link_busy_s=lambda: 0.0)
    marks = SimpleNamespace(on=False, off=False, mark_s=None)
    schedule = st.CopySchedule(None)
    copied = []
    for step in range(1, 301):
        if schedule.decide(step, tier) == st.COPY:
            schedule.started()
            schedule.plan_next(step, tier, marks, on_gpu=True)
            copied.append(step)
            busy[0] = True  # beside the next step
        clock[0] += 0.100 + (0.0 if not busy[0] else 3.0 if len(copied) == 1 else 0.030)
        busy[0] = False
    assert copied[0] > st.QUIET_WARMUP_STEPS + 1  # not before a quiet step was timed
    assert schedule.quiet_s == pytest.approx(0.100, rel=1e-6)
    assert schedule.copy_cost_s == pytest.approx(0.030, rel=1e-6)  # (the first, back to back, left the window)
    assert schedule.interval == math.ceil(0.030 / (st.MEMORY_AIM * st.MEMORY_BUDGET * 0.100)) == 8
    assert copied[1] - copied[0] <= 2  # (the first's 3 s did not space the next)
    extra = 0.030 * len(copied) / (0.100 * 300)
    assert extra <= st.MEMORY_BUDGET
