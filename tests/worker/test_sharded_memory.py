"""The memory tier of FSDP2 models (worker/tiers/sharded_memory.py): the pure choice of the
step and of who sends each shard, and real groups of 1 or 2 ranks over gloo (spawned
processes, the runtime's local twin with a memory directory) on a small model sharded with
`fully_shard` in mixed precision."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers.processes import free_port
from tests.worker.test_sharded_snapshots import _assert_same, _full_states
from worker import memory as mem
from worker.tiers.sharded_memory import buddy_of, joined, plan_newest, plan_reshard, plan_restore


def _dim0(helds: list[dict]) -> list[dict]:
    """Each copy's world size as (world size, its shards dim-0 slices)."""
    return [{shard: {step: (w, True) for step, w in per.items()} for shard, per in h.items()} for h in helds]


@pytest.mark.parametrize("helds,world,expected", [
    ([{0: {5: 2, 4: 2}}, {1: {4: 2}}], 2, (4, [0, 1])),  # rank 1 died mid-copy of step 5
    ([{0: {5: 2}, 1: {5: 2}}, {}], 2, (5, [0, 0])),  # rank 1's node is new: rank 0 holds its replica
    ([{0: {5: 2}}, {0: {5: 2}, 1: {5: 2}}], 2, (5, [0, 1])),  # each shard from its own rank if it can
    ([{0: {5: 2}, 1: {5: 2}}], 1, (None, [])),  # saved by two ranks: not at this size
    ([{0: {7: 1}}, {1: {7: 2}}], 2, (None, [])),  # shard 0 of another world
    ([{}, {}], 2, (None, [])),
])
def test_the_restore_takes_the_newest_step_whose_every_shard_some_rank_holds(helds, world, expected):
    assert plan_restore(_dim0(helds), world) == expected


@pytest.mark.parametrize("helds,world,expected", [
    ([{0: {5: 2}, 1: {5: 2}}], 1, (5, 2, [0, 0])),  # a node lost: its shards' replica on the survivor
    ([{0: {5: 1}}, {}], 2, (5, 1, [0])),  # grown from one rank to two
    ([{0: {5: 2}}], 1, (None, 1, [])),  # the lost node's shards nowhere
    ([{0: {9: 4}, 1: {9: 4}}, {0: {6: 2}, 1: {6: 2}}], 3, (6, 2, [1, 1])),  # the newest whole one
])
def test_at_another_size_the_newest_step_whose_every_old_shard_is_held_is_resharded(helds, world, expected):
    assert plan_reshard(_dim0(helds), world) == expected


@pytest.mark.parametrize("helds,world,expected", [
    # Grown back to two: step 3 of the two ranks (shards and replicas), step 6 of one rank since.
    ([{0: {3: 2, 6: 1}, 1: {3: 2}}, {0: {3: 2}, 1: {3: 2}}], 2, (6, 1, [0])),
    ([{0: {6: 2}}, {1: {6: 2}, 0: {6: 1}}], 2, (6, 2, [0, 1])),  # a tie: this world size's, no resharding
    ([{0: {7: 2}, 1: {7: 2}}, {0: {5: 1}}], 2, (7, 2, [0, 0])),  # this size's is newer (rank 0 holds both)
    ([{0: {7: 4}}, {}], 2, (None, 2, [])),  # neither whole
])
def test_the_restore_takes_the_newest_whole_step_whatever_world_size_saved_it(helds, world, expected):
    assert plan_newest(_dim0(helds), world) == expected


def test_shards_that_are_not_dim0_slices_are_not_resharded_from_memory():
    assert plan_reshard([{0: {5: (2, False)}, 1: {5: (2, False)}}], 1) == (None, 1, [])


def test_a_joined_state_holds_no_view_of_the_copies_it_was_joined_from() -> None:
    class Sharded:  # stands for DTensor: the leaves that are joined
        pass

    copies = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(2)]
    shards = [{"w": c[64:96].view(torch.float32), "step": c[:4].view(torch.float32).view([])} for c in copies]
    whole = joined(shards, {"w": Sharded(), "step": None}, Sharded)
    assert whole["w"].numel() == 16
    # The step counter, a view of a 1 MiB copy, pickles as its 4 bytes, not as the copy.
    assert len(pickle.dumps(whole["step"])) < 4096 < len(pickle.dumps(shards[0]["step"]))


@pytest.mark.parametrize("rank,nodes,expected", [
    (0, ["a", "b"], 1), (1, ["a", "b"], 0),
    (1, ["a", "a", "b", "b"], 2), (3, ["a", "a", "b", "b"], 0),
    (0, ["a", "a"], None), (0, [None], None),
])
def test_each_rank_replicates_to_the_next_rank_on_another_node(rank, nodes, expected):
    assert buddy_of(rank, nodes) == expected


def test_a_slot_torn_by_a_writer_killed_mid_copy_reads_as_none_not_as_a_copy(tmp_path: Path) -> None:
    writer = mem.MemoryWriter(tmp_path)
    for step in (1, 2):
        writer.capture({"step": step, "w": torch.full((64,), float(step))}, step, set())
        writer.wait()
    writer.close()
    assert {mem.read_slot(tmp_path, s)[0]["step"] for s in (0, 1)} == {1, 2}
    older = 0 if mem.read_slot(tmp_path, 0)[0]["step"] == 1 else 1
    with open(tmp_path / f"slot{older}.bin", "r+b") as f:  # the next copy, half written
        f.write(b"\x7f" * 32)
    assert mem.read_slot(tmp_path, older) is None
    assert mem.read_slot(tmp_path, 1 - older) is not None



def test_a_replica_is_a_copy_only_once_received_whole_and_committed_under_its_senders_checksum(
        tmp_path: Path) -> None:
    (tmp_path / "own").mkdir()
    (tmp_path / "replica").mkdir()
    sender, kept = mem.MemoryWriter(tmp_path / "own"), mem.MemoryWriter(tmp_path / "replica")
    sent: list[tuple[dict, torch.Tensor]] = []
    sender.on_done = lambda meta, buf: sent.append((meta, buf.clone()))
    for step in (1, 2):
        sender.capture({"step": step, "w": torch.full((256,), float(step))}, step, set())
        sender.wait()
    (first, first_bytes), (second, second_bytes) = sent
    slot, into = kept.free_slot(first["packing"], first["size"])
    into.copy_(first_bytes)
    kept.commit(first, slot)
    slot, into = kept.free_slot(second["packing"], second["size"])
    into[:128].copy_(second_bytes[:128])  # the receiver died here: half of step 2 in its free slot
    assert mem.read_slot(tmp_path / "replica", slot) is None
    assert mem.read_copy(tmp_path / "replica")[0]["step"] == 1
    into.copy_(second_bytes)
    into[-1] ^= 0xFF  # whole, but a byte torn in transit: the sender's checksum catches it
    kept.commit(second, slot)
    with pytest.raises(mem.CopyCorrupt):
        mem.read_copy(tmp_path / "replica")
    into.copy_(second_bytes)
    assert mem.read_copy(tmp_path / "replica")[0]["step"] == 2
    sender.close()
    kept.close()

def _group(rank: int, world: int, port: int, snapshots: str, memory: str, out: str, name: str,
           until: int, disk: bool = True, nodes: int = 1) -> None:
    """One rank: a model sharded in bfloat16 mixed precision, restored, trained to `until`,
    snapshotted on disk there (with `disk`); its full states (restored and final) and where it
    resumed from. With `nodes`, the ranks are spread over that many nodes (as few as the world
    allows), each with a memory tier of its own."""
    per_node = max(1, world // nodes)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if nodes > 1:
        os.environ["FTRAIN_NODE"] = node = f"n{rank // per_node}"
        Path(memory, node).mkdir(exist_ok=True)
        memory = str(Path(memory, node))
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from worker import runtime

    rt = runtime.init(snapshot_dir=snapshots, snapshot_every=1000, memory_dir=memory, memory_every=1,
                      timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = rt.restore(model=model, optimizer=optimizer)
    restored = _full_states(model, optimizer) if start else None
    # The optimizer's step counters (plain tensors) own their bytes: a view of the copy they
    # were read from would keep it alive, and a broadcast of them would pickle all of it.
    views = [k for st in optimizer.state.values() for k, v in st.items()
             if type(v) is torch.Tensor and v.untyped_storage().nbytes() > v.numel() * v.element_size()]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    while rt.step < until:
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rt.step_done(loss=loss)
    assert not disk or rt.snapshot(blocking=True)
    final = _full_states(model, optimizer)
    rt.finish()
    if rank == 0:
        torch.save({"start": start, "tier": rt.resumed_tier, "restored": restored, "final": final, "views": views},
                   Path(out, f"{name}.pt"))


def _run_group(world: int, tmp_path: Path, name: str, until: int, disk: bool = True, nodes: int = 1) -> dict:
    memory = tmp_path / "memory"
    memory.mkdir(exist_ok=True)
    mp.spawn(_group, args=(world, free_port(), str(tmp_path / "snapshots"), str(memory), str(tmp_path), name,
                           until, disk, nodes), nprocs=world)
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def test_a_mixed_precision_fsdp_group_resumes_from_its_shards_in_memory_at_the_same_size_and_another(
        tmp_path: Path) -> None:
    first = _run_group(2, tmp_path, "first", until=4)
    again = _run_group(2, tmp_path, "again", until=6)  # the same world: every rank's shards in memory
    one = _run_group(1, tmp_path, "one", until=8)  # another world: the shards joined and resharded

    assert (again["start"], again["tier"]) == (4, "memory")
    _assert_same(again["restored"], first["final"], "memory, 2 -> 2")
    assert all(t.dtype == torch.float32 for t in again["restored"]["model"].values())
    assert (one["start"], one["tier"]) == (6, "memory")
    _assert_same(one["restored"], again["final"], "memory, 2 -> 1")
    assert again["views"] == one["views"] == []


@pytest.mark.parametrize("worlds", [(2, 1, 2), (4, 2, 4)])
def test_a_group_resized_and_grown_back_resumes_from_the_newest_shards_in_memory_whatever_their_world(
        tmp_path: Path, worlds: tuple[int, int, int]) -> None:
    """Two nodes, no disk snapshot at all: every restore is the memory tier's. Grown back, the
    group still holds whole copies of an older step saved at its own size (the first group's
    shards and their replicas on the other node), and the newer copy saved at the smaller size:
    it resumes from the newer, resharded."""
    first, smaller, again = worlds
    before = _run_group(first, tmp_path, "before", until=3, disk=False, nodes=2)
    shrunk = _run_group(smaller, tmp_path, "shrunk", until=6, disk=False, nodes=2)
    grown = _run_group(again, tmp_path, "grown", until=8, disk=False, nodes=2)

    assert before["start"] == 0
    assert (shrunk["start"], shrunk["tier"]) == (3, "memory")
    _assert_same(shrunk["restored"], before["final"], f"memory, {first} -> {smaller}")
    assert (grown["start"], grown["tier"]) == (6, "memory")
    _assert_same(grown["restored"], shrunk["final"], f"memory, {smaller} -> {again}")


def test_a_copy_whose_bytes_are_torn_is_passed_over_for_the_step_every_shard_holds_whole(
        tmp_path: Path) -> None:
    _run_group(2, tmp_path, "first", until=4)
    # Rank 1's copy of step 4 torn, as by its writer killed while overwriting the slot: only the
    # chosen step's copies are read, so this is found once step 4 is chosen, and the group
    # chooses again: step 3, in every rank's other slot.
    where = tmp_path / "memory" / "shard-r1"
    slot = next(s for s in (0, 1) if mem.slot_meta(where, s)["step"] == 4)
    with open(where / f"slot{slot}.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    shutil.rmtree(tmp_path / "snapshots")  # the disk's step 4 would be chosen over memory's 3
    again = _run_group(2, tmp_path, "again", until=6)
    assert (again["start"], again["tier"]) == (3, "memory")


def _two_nodes(rank: int, world: int, port: int, root: str, steps: int) -> None:
    """One rank on a node of its own (its own memory folder): a sharded model trained `steps`
    steps with a copy at each; which threads exchanged the replicas, and the tier's timings."""
    import threading

    from worker.tiers.sharded_memory import ShardedMemoryTier

    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), FTRAIN_NODE=f"node-{rank}")
    from torch.distributed.fsdp import fully_shard

    from worker import runtime

    on_training_thread: list[bool] = []
    exchange = ShardedMemoryTier._exchange

    def watched(self, *args, **kwargs):
        on_training_thread.append(threading.current_thread() is threading.main_thread())
        return exchange(self, *args, **kwargs)

    ShardedMemoryTier._exchange = watched
    memory = Path(root, f"node-{rank}")
    memory.mkdir(exist_ok=True)
    rt = runtime.init(snapshot_dir=str(Path(root, "snapshots")), snapshot_every=1000, memory_dir=str(memory),
                      memory_every=1, timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt.restore(model=model, optimizer=optimizer)
    x, y = torch.randn(8, 6), torch.randn(8, 1)
    while rt.step < steps:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        rt.step_done(loss=loss)
    tier = rt.memory
    assert isinstance(tier, ShardedMemoryTier)
    rt.finish()
    torch.save({"on_training_thread": on_training_thread, "stalls_s": tier.writer.stalls_s,
                "copies": len(tier.writer.stalls_s),
                "replicate_s": tier.replicate_s, "waits_s": getattr(tier, "replica_waits_s", None), "buddy": tier.buddy},
               Path(root, f"rank{rank}.pt"))


def test_replicas_are_exchanged_off_the_training_thread_from_the_slots_bytes(tmp_path: Path) -> None:
    mp.spawn(_two_nodes, args=(2, free_port(), str(tmp_path), 4), nprocs=2)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["buddy"] == 1 - rank
        assert got["on_training_thread"] and not any(got["on_training_thread"]), \
            "the replicas were exchanged on the training thread (its time the copy's stall)"
        # One exchange per copy, timed on its own thread; the training thread's waits for the
        # previous one (before each later copy) are what the copy's stall counts of it.
        assert len(got["replicate_s"]) == got["copies"] >= 4
        assert len(got["waits_s"]) == got["copies"] - 1
        assert all(stall >= wait for stall, wait in zip(got["stalls_s"][1:], got["waits_s"]))
        own = mem.read_copy(tmp_path / f"node-{rank}" / f"shard-r{rank}")
        replica = mem.read_copy(tmp_path / f"node-{1 - rank}" / f"replica-r{rank}")  # verified
        assert own is not None and replica is not None
        assert (replica[0]["rank"], replica[0]["step"]) == (rank, own[0]["step"]) == (rank, 4)
        assert torch.equal(replica[1], own[1])


def test_off_a_gpu_the_exchange_of_replicas_counts_in_the_copys_cost(tmp_path: Path) -> None:
    """Its thread takes a core as the copy thread does; on a GPU host only the training
    thread's wait for it counts (in the stall)."""
    from worker.tiers.api import Worker
    from worker.tiers.sharded_memory import ShardedMemoryTier

    tier = ShardedMemoryTier(Worker(rank=0, local_rank=0, world_size=2, distributed=False,
                                    device=torch.device("cpu"), link=None), tmp_path, None)
    w = tier.open_writer()
    w.stalls_s[:], w.copies_s[:], tier.rng_s = [0.001], [0.010], 0.0
    assert tier.last_cost_s() == pytest.approx(0.011)
    tier.replicate_s[:] = [0.030]
    assert tier.last_cost_s() == pytest.approx(0.041)
    w._on_device, w.commits_s[:] = True, [0.0005]
    assert tier.last_cost_s() == pytest.approx(0.0015)
    tier.close()


def test_without_a_fixed_interval_copies_come_no_sooner_than_the_last_exchange_of_replicas_ends(
        tmp_path: Path) -> None:
    """A GPU host: the copy costs the training thread 1 ms of a 450 ms step (a copy every
    step), but its exchange of replicas took 3 s: the next copy would wait for it. One every
    1 + 7 steps (the commit's step, then the exchange's)."""
    from types import SimpleNamespace

    from worker.step_timing import CopySchedule
    from worker.tiers.api import Worker
    from worker.tiers.sharded_memory import ShardedMemoryTier

    tier = ShardedMemoryTier(Worker(rank=0, local_rank=0, world_size=2, distributed=False,
                                    device=torch.device("cpu"), link=None), tmp_path, None)
    w = tier.open_writer()
    w._on_device, w.stalls_s[:], w.commits_s[:], tier.rng_s = True, [0.0005], [0.0005], 0.0
    schedule, marks = CopySchedule(None), SimpleNamespace(on=False, off=False, mark_s=None)
    schedule.step_s = schedule.quiet_s = 0.45
    schedule.plan_next(10, tier, marks, on_gpu=True)
    assert schedule.interval == 1
    tier.replicate_s.append(3.0)
    schedule.plan_next(11, tier, marks, on_gpu=True)
    assert (schedule.interval, schedule.next) == (8, 19)
    tier.close()


def _optimizer_load(rank: int, port: int) -> None:
    """One rank of a group of one: an AdamW state saved as local shards, installed into a fresh
    optimizer directly; then saved states the direct load must refuse, leaving no state."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from worker import sharded
    from worker.tiers.sharded_memory import local_shards

    dist.init_process_group("gloo")

    def sharded_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        fully_shard(model[0])
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    model, optimizer = sharded_model()
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 6)).pow(2).mean().backward()
        optimizer.step()
    optimizer.param_groups[0]["lr"] = 5e-3  # as a scheduler leaves it
    saved = local_shards(sharded.model_and_optimizer(model, optimizer), DTensor, [])["optimizer"]
    saved = mem.owned(pickle.loads(pickle.dumps(saved)))  # plain tensors, as a copy holds them

    fresh_model, fresh = sharded_model()
    assert sharded.load_local_optimizer_state(fresh, saved)
    assert fresh.param_groups[0]["lr"] == 5e-3
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        want, got = optimizer.state[p], fresh.state[q]
        assert want.keys() == got.keys()
        for key in want:
            assert type(got[key]) is type(want[key]), key
            if isinstance(want[key], DTensor):
                assert got[key].placements == want[key].placements
                assert torch.equal(got[key].to_local(), want[key].to_local()), key
            else:
                assert torch.equal(got[key], want[key]), key
    # With the parameters too, it trains on as the one it was saved from, bit for bit.
    with torch.no_grad():
        for p, q in zip(model.parameters(), fresh_model.parameters()):
            q.to_local().copy_(p.to_local())
    x = torch.randn(8, 6)
    for m, o in ((model, optimizer), (fresh_model, fresh)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(p.to_local(), q.to_local())

    # What rank 0 tells every rank before a resharded load: the states to join, or torch's way.
    from worker.tiers.sharded_memory import joined_plan

    whole = local_shards(sharded.model_and_optimizer(model, optimizer), DTensor, [])
    plan = joined_plan([whole], fresh_model, fresh)
    assert plan is not None
    assert {(name, key) for name, key, _ in plan["sliced"]} == {
        (name, key) for name, values in saved["state"].items() for key in values if key != "step"}
    assert {key for _, key in plan["scalars"]} == {"step"}
    lacking = {**whole, "optimizer": {**whole["optimizer"], "state": {}}}
    assert joined_plan([whole, lacking], fresh_model, fresh) is None  # an old rank without a state
    with pytest.raises(RuntimeError, match="holds no"):
        joined_plan([{**whole, "model": {}}], fresh_model, fresh)

    first = saved["param_groups"][0]["params"][0]
    odd = {**saved, "state": {**saved["state"], first: {**saved["state"][first], "row": torch.zeros(3)}}}
    fewer_groups = {**saved, "param_groups": []}
    stranger = {**saved, "state": {**saved["state"], "not.a.parameter": {"step": torch.tensor(1.0)}}}
    for refused in (odd, fewer_groups, stranger):
        _, again = sharded_model()
        assert not sharded.load_local_optimizer_state(again, refused)
        assert not again.state and again.param_groups[0]["lr"] == 1e-2
    dist.destroy_process_group()


def test_an_optimizers_state_is_made_from_its_local_shards_or_left_for_torchs_load() -> None:
    mp.spawn(_optimizer_load, args=(free_port(),), nprocs=1)
