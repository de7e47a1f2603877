"""One contract for every snapshot tier (worker/tiers/api.py `SnapshotTier`): the disk tier
(files committed through the local twin's index), the memory tier (this node's copy in
/dev/shm or a temporary folder) and the peer tier (a copy another rank's node holds, sent
to a rank whose node lacks it; two ranks in threads, over real gloo collectives).

Each case runs against each tier: what is saved is given back exactly, the newest copy is
the one given back, a damaged copy is never given back (an older whole one or none is), and
the tier's storage stays bounded however many copies are saved."""

from __future__ import annotations

import copy
import json
import pickle
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from worker import memory as mem
from worker import rng as rngs
from worker import snapshot as snap
from worker.links import LocalLink
from worker.tiers.api import Found, SnapshotTier, Worker, load_into
from worker.tiers.disk import DiskTier
from worker.tiers.memory import MemoryTier
from worker.tiers.peer import PeerTier

CPU = torch.device("cpu")


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optimizer": opt, "scheduler": torch.optim.lr_scheduler.StepLR(opt, 5)}


def _train(objects: dict[str, Any], steps: int) -> None:
    model, opt, sched = objects["model"], objects["optimizer"], objects["scheduler"]
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _states(objects: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({name: obj.state_dict() for name, obj in objects.items()})


class GlooWire:
    """Real gloo collectives between two ranks in threads of this process (a process group
    made directly on a shared store): what the peer tier sends over, as `GroupWire` sends it
    over the default group in a job."""

    def __init__(self, store: dist.Store, rank: int):
        self.rank = rank
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("tiers", store), rank, 2, timedelta(seconds=30))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        got = [torch.empty_like(tensor) for _ in range(2)]
        self.pg.allgather([got], [tensor]).wait()
        return got

    def all_gather_object(self, obj: Any) -> list:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [int(t) for t in self._gather(torch.tensor([data.numel()]))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        return [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(self._gather(padded), sizes)]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        data = pickle.dumps(obj) if self.rank == src else b""
        size = torch.tensor([len(data)])
        self.broadcast(size, src)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == src else \
            torch.empty(int(size), dtype=torch.uint8)
        self.broadcast(buf, src)
        return pickle.loads(buf.numpy().tobytes())


def _both(calls: list[Callable[[], Any]]) -> list:
    """Run each rank's call in a thread of its own; their results, by rank."""
    out: list = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return out


class Harness:
    """One tier as the contract drives it: save, newest, load, the newest copy damaged, the
    files it keeps and how many it may."""

    tier: SnapshotTier
    bound: int

    def save(self, objects: dict[str, Any], step: int) -> None:
        assert self.tier.save(objects, step, [rngs.rng_state()])
        self.tier.wait()

    def newest(self) -> Found | None:
        return self.tier.newest()

    def load(self, found: Found) -> dict:
        return self.tier.load(found)

    def damage(self) -> None:
        raise NotImplementedError

    def files(self) -> list[Path]:
        raise NotImplementedError

    def close(self) -> None:
        self.tier.close()


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_latest_slot(directory: Path) -> None:
    """A byte of the memory copy that `latest.json` names flipped (as a bad page would)."""
    slot = json.loads((directory / mem.LATEST).read_text())["slot"]
    _flip_middle_byte(directory / f"slot{slot}.bin")


class DiskHarness(Harness):
    def __init__(self, tmp_path: Path):
        self.directory = tmp_path / "disk"
        link = LocalLink(self.directory, keep=2)
        worker = Worker(rank=0, local_rank=0, world_size=1, distributed=False, device=CPU, link=link)
        self.tier = DiskTier(worker, self.directory, snap.AsyncWriter(self.directory, link.commit, keep=2))
        self.bound = 2

    def save(self, objects: dict[str, Any], step: int) -> None:
        assert self.tier.save(objects, step, [rngs.rng_state()], blocking=True)

    def damage(self) -> None:
        _flip_middle_byte(max(self.files(), key=lambda p: p.stat().st_mtime_ns))

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("*.pt"))


class MemoryHarness(Harness):
    def __init__(self, tmp_path: Path):
        self.directory = tmp_path / "memory"
        self.directory.mkdir()
        worker = Worker(rank=0, local_rank=0, world_size=1, distributed=False, device=CPU)
        self.tier = MemoryTier(worker, self.directory, every=1)
        self.tier.open_writer()
        self.bound = 2  # two slots: the whole one, and the one a copy goes into

    def damage(self) -> None:
        _damage_latest_slot(self.directory)

    def files(self) -> list[Path]:
        return sorted(self.directory.glob("slot*.bin"))


class PeerHarness(Harness):
    """Rank 0's node holds the copies; rank 1's node holds none and is sent rank 0's."""

    def __init__(self, tmp_path: Path):
        store = dist.HashStore()
        wires = _both([lambda r=r: GlooWire(store, r) for r in (0, 1)])  # the group forms with both
        self.memories, self.peers = [], []
        for rank in (0, 1):
            directory = tmp_path / f"node{rank}"
            directory.mkdir()
            worker = Worker(rank=rank, local_rank=0, world_size=2, distributed=True, device=CPU)
            memory = MemoryTier(worker, directory, every=1)
            if rank == 0:
                memory.open_writer()
            self.memories.append(memory)
            self.peers.append(PeerTier(worker, memory, wires[rank]))
        self.tier = self.peers[0]
        self.bound = 2  # rank 0's node's two slots; rank 1's node holds none

    def newest(self) -> Found | None:
        mine = _both([m.newest for m in self.memories])
        _both([lambda i=i: self.peers[i].gather(mine[i]) for i in (0, 1)])
        assert self.peers[0].helds == self.peers[1].helds
        return self.peers[1].newest()

    def load(self, found: Found) -> dict:
        got = _both([lambda i=i: self.peers[i].load(found) for i in (0, 1)])
        assert _same(got[0], got[1])  # the holder's own copy and the one it sent are the same
        return got[1]

    def damage(self) -> None:
        _damage_latest_slot(self.memories[0].directory)

    def files(self) -> list[Path]:
        return [p for m in self.memories for p in sorted(m.directory.glob("slot*.bin"))]

    def close(self) -> None:
        for memory in self.memories:
            memory.close()


@pytest.fixture(params=["disk", "memory", "peer"])
def tier(request, tmp_path) -> Iterator[Harness]:
    harness = {"disk": DiskHarness, "memory": MemoryHarness, "peer": PeerHarness}[request.param](tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def test_nothing_saved_means_nothing_to_restore(tier):
    assert tier.newest() is None


def test_what_is_saved_is_given_back_exactly(tier):
    objects = _objects(0)
    _train(objects, 3)
    expected = _states(objects)
    tier.save(objects, 3)
    found = tier.newest()
    assert found is not None and found.step == 3
    state = tier.load(found)
    assert state["step"] == 3
    fresh = _objects(1)
    load_into(fresh, state)
    assert _same(_states(fresh), expected)


def test_the_newest_save_is_the_one_given_back(tier):
    objects = _objects(0)
    for step in (1, 2, 3):
        _train(objects, 1)
        tier.save(objects, step)
    expected = _states(objects)
    found = tier.newest()
    assert found is not None and found.step == 3
    assert _same({k: tier.load(found)[k] for k in expected}, expected)


def test_a_damaged_copy_is_never_given_back(tier):
    objects = _objects(0)
    _train(objects, 1)
    tier.save(objects, 1)
    older = _states(objects)
    _train(objects, 1)
    tier.save(objects, 2)
    tier.damage()
    found = tier.newest()
    assert found is None or found.step < 2  # an older whole copy, or none
    if found is not None:
        assert found.step == 1 and _same({k: tier.load(found)[k] for k in older}, older)


def test_storage_stays_bounded_however_many_copies_are_saved(tier):
    objects = _objects(0)
    for step in range(1, 8):
        _train(objects, 1)
        tier.save(objects, step)
    assert 0 < len(tier.files()) <= tier.bound
    found = tier.newest()
    assert found is not None and found.step == 7
