"""Sharded snapshots of FSDP2 models (worker/sharded.py, worker/tiers/sharded.py), with real
torch.distributed: processes spawned in groups of 1 or 2 ranks over gloo, each running the
runtime (its local twin: a snapshot folder with its index) on a small model sharded with
`fully_shard`.

A job that goes 2 -> 1 -> 2 ranks restores, at each resize, every parameter and optimizer
state bit-exactly as the group before saved it (DCP's load reshards them), and its sampler
gives each sample of the epoch exactly once across both resizes."""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.processes import free_port
from worker import sharded
from worker import snapshot as snap

SAMPLES, GLOBAL_BATCH = 96, 12  # 8 steps an epoch; a batch splits over 1, 2, 3 or 4 ranks


def _full_states(model, optimizer) -> dict:
    """The whole model's and optimizer's state, gathered from every rank (a collective), copied
    (in a group of one, the gathered tensors are the parameters themselves)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return copy.deepcopy({"model": model_sd, "optimizer": optim_sd})


def _group(rank: int, world: int, port: int, directory: str, out: str, name: str, until: int,
           also: int | None) -> None:
    """One rank of a group: restore, train to step `until`, snapshot there (and at step `also`),
    note its states (restored, at `also`, final) and the samples of each step it made."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from torch.distributed.fsdp import fully_shard

    from worker import runtime

    rt = runtime.init(snapshot_dir=directory, snapshot_every=1000, timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model[::2]:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    sampler = rt.sampler(SAMPLES, global_batch_size=GLOBAL_BATCH, seed=7)
    start = rt.restore(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)
    restored = _full_states(model, optimizer) if start else None
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g)
    seen, at_also = [], None
    for indices in sampler:
        loss = torch.nn.functional.mse_loss(model(x[indices]), y[indices]) * sampler.loss_weight
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        seen.append([rt.step + 1, indices])
        rt.step_done(loss=loss)
        if rt.step == also:
            assert rt.snapshot(blocking=True)
            at_also = _full_states(model, optimizer)
        if rt.step >= until:  # here, as a planned change snapshots: before the next batch is taken
            break
    assert rt.snapshot(blocking=True)
    final = _full_states(model, optimizer)
    rt.finish()
    Path(out, f"{name}-seen-{rank}.json").write_text(json.dumps(seen))
    if rank == 0:
        torch.save({"start": start, "restored": restored, "also": at_also, "final": final},
                   Path(out, f"{name}.pt"))


def _run_group(world: int, directory: Path, out: Path, name: str, until: int, also: int | None = None) -> dict:
    mp.spawn(_group, args=(world, free_port(), str(directory), str(out), name, until, also), nprocs=world)
    return torch.load(out / f"{name}.pt", weights_only=False)


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (p, q) in enumerate(zip(a, b)):
            _assert_same(p, q, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("worlds", [(2, 1, 2), (4, 2, 4)])
def test_resizes_restore_every_parameter_and_optimizer_state_and_each_sample_once(
        tmp_path: Path, worlds: tuple[int, int, int]) -> None:
    big, small, _ = worlds
    directory, out = tmp_path / "snapshots", tmp_path / "out"
    out.mkdir()
    two = _run_group(big, directory, out, "two", until=3)
    one = _run_group(small, directory, out, "one", until=11)  # across the epoch's end (8 steps)
    again = _run_group(big, directory, out, "again", until=16)

    assert (one["start"], again["start"]) == (3, 11)
    _assert_same(one["restored"], two["final"], f"{big} -> {small}")
    _assert_same(again["restored"], one["final"], f"{small} -> {big}")
    assert again["final"]["optimizer"]["state"], "the optimizer's state is restored, not begun anew"

    # Each step's global batch: the union of the ranks' samples of it, each step made once.
    steps: dict[int, list[int]] = {}
    for name, world in (("two", big), ("one", small), ("again", big)):
        for rank in range(world):
            for step, indices in json.loads((out / f"{name}-seen-{rank}.json").read_text()):
                steps.setdefault(step, []).extend(indices)
    assert sorted(steps) == list(range(1, 17))
    assert all(len(batch) == GLOBAL_BATCH for batch in steps.values())
    for epoch, first in enumerate((1, 9)):
        count = Counter(i for step in range(first, first + 8) for i in steps[step])
        assert sorted(count) == list(range(SAMPLES)) and set(count.values()) == {1}, f"epoch {epoch}"

    # The snapshots are directories of shards, committed with the ranks that wrote them.
    index = json.loads((directory / "snapshots.json").read_text())
    assert [(i["step"], i["shards"]) for i in index["items"]] == [(3, big), (11, small), (16, big)]
    assert all(Path(i["path"]).is_dir() for i in index["items"])


def test_a_damaged_shard_is_reported_and_the_snapshot_before_is_loaded(tmp_path: Path) -> None:
    directory, out = tmp_path / "snapshots", tmp_path / "out"
    out.mkdir()
    first = _run_group(1, directory, out, "first", until=4, also=2)
    shard = next((directory / sharded.snapshot_name(4)).glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    again = _run_group(1, directory, out, "again", until=5)
    assert again["start"] == 2
    _assert_same(again["restored"], first["also"], "fallback")
    # Marked bad, then pruned by the next commit, its directory deleted with it.
    index = json.loads((directory / "snapshots.json").read_text())
    assert [i["step"] for i in index["items"]] == [2, 5]
    assert not (directory / sharded.snapshot_name(4)).exists()


def _pending(tmp: Path, world: int, wait_s: float) -> sharded.ShardedSave:
    (tmp / "__0_0.distcp").write_bytes(b"rank 0's shards")
    (tmp / ".metadata").write_bytes(b"DCP's index")
    done: Future = Future()
    done.set_result(None)
    return sharded.ShardedSave(done, tmp, world, {"step": 1}, sums_wait_s=wait_s)


def test_a_sharded_snapshot_is_not_complete_until_every_rank_has_reported_its_shards(tmp_path: Path) -> None:
    tmp = tmp_path / f".{sharded.snapshot_name(1)}{sharded.TMP_MARK}x"
    tmp.mkdir()
    with pytest.raises(OSError, match="rank 1 did not report its shards"):
        _pending(tmp, 2, wait_s=0.2).complete(tmp_path, 1)
    assert not (tmp_path / sharded.snapshot_name(1)).exists() and not tmp.exists()

    tmp.mkdir()
    (tmp / "__1_0.distcp").write_bytes(b"rank 1's shards")
    sharded.write_own_sums(tmp, 1)
    written = _pending(tmp, 2, wait_s=5).complete(tmp_path, 1)
    final = Path(written.path)
    assert final == tmp_path / sharded.snapshot_name(1) and written.shards == 2
    sharded.verify(final, written.checksum, written.size)
    (final / "__1_0.distcp").write_bytes(b"rank 1's shardz")
    with pytest.raises(snap.SnapshotCorrupt, match="__1_0.distcp does not match"):
        sharded.verify(final, written.checksum, written.size)


def test_a_tree_sum_changes_with_any_byte_and_with_the_order_of_its_chunks(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sharded, "TREE_CHUNK", 1024)
    data = os.urandom(4 * 1024 + 500)  # 5 chunks, the last one short
    file = tmp_path / "__0_0.distcp"
    file.write_bytes(data)
    whole = sharded.tree_sum(file)
    assert whole.startswith(f"{sharded.TREE_ALGO}:")
    assert sharded.tree_sum(file) == whole
    flipped = bytearray(data)
    flipped[3 * 1024 + 5] ^= 1
    file.write_bytes(flipped)
    assert sharded.tree_sum(file) != whole
    file.write_bytes(data[1024:2048] + data[:1024] + data[2048:])  # two chunks swapped
    assert sharded.tree_sum(file) != whole
    file.write_bytes(data[:-1])
    assert sharded.tree_sum(file) != whole


def _manifest_dir(tmp_path: Path, sums) -> tuple[Path, str]:
    """A snapshot directory of one file whose manifest gives it the sum `sums(file)`."""
    import hashlib

    directory = tmp_path / "step-000000000001.dcp"
    directory.mkdir()
    file = directory / "__0_0.distcp"
    file.write_bytes(b"shard bytes" * 1000)
    body = json.dumps({"step": 1, "world_size": 1, "files": {file.name: [file.stat().st_size, sums(file)]}}).encode()
    (directory / sharded.MANIFEST).write_bytes(body)
    return directory, f"sha256:{hashlib.sha256(body).hexdigest()}"


def test_a_manifest_of_whole_file_sums_still_verifies_and_one_of_an_unknown_kind_does_not(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    directory, checksum = _manifest_dir(tmp_path / "old", sharded._sha256)
    sharded.verify(directory, checksum)
    (directory / "__0_0.distcp").write_bytes(b"shard bytez" * 1000)
    with pytest.raises(snap.SnapshotCorrupt, match="does not match its checksum"):
        sharded.verify(directory, checksum)

    (tmp_path / "new").mkdir()
    directory, checksum = _manifest_dir(tmp_path / "new", sharded.tree_sum)
    sharded.verify(directory, checksum)

    (tmp_path / "odd").mkdir()
    directory, checksum = _manifest_dir(tmp_path / "odd", lambda f: "md5:0123")
    with pytest.raises(snap.SnapshotCorrupt, match="of no kind this version knows"):
        sharded.verify(directory, checksum)
