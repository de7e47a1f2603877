"""The memory tier of an FSDP2 model: every rank's own shards in its node's memory tier, and
a replica of them on another node.

With DDP a node's first rank copies the whole state, which every rank holds. With FSDP2
each rank holds only its shards of the parameters and of the optimizer's state, so every
rank is a writer: its local state dict (the DTensors' local shards, the optimizer's state,
the scheduler, sampler and extras, its RNG states, the step, the world size and its rank)
goes into a writer of its own, `<node's memory dir>/shard-r<rank>/`, with the same slots,
checksums, budget and schedule as the DDP copy (worker/memory.py, worker/tiers/memory.py).
Every rank copies at the steps rank 0 picks, and never skips one (it waits for its own
previous copy instead), so the ranks' copies are of the same steps. Each copy also goes to
the next rank on another node, which keeps it as `replica-r<rank>/`: a lost node's shards are
still in the group's memory. That exchange runs on a thread of the tier's own, over a gloo
group only it uses (every rank exchanges the same copy steps in the same order): once a copy
is committed, the thread sends the slot's bytes (the model is not read again) and receives
the copies sent to this rank straight into their replicas' free slots, each committed under
its sender's checksum (a replica half received or torn in transit reads as none). The next
copy waits for the exchange only if it is not over, and that wait is the copy's stall.

A restore lists every copy on each node (split among the node's ranks; both slots of each,
by the metadata each slot's writer committed: a rank killed mid-copy leaves its other ranks'
copies a step ahead of its own) and the ranks gather which (shard, step) each holds; once the
step is chosen (below), only its copies are read, each by the rank that sends it, and
verified; a torn one (its writer killed while overwriting the slot) counts as none, and the
ranks choose again without it:

- the group's memory copy is the newest step whose every shard, saved at some world size,
  some rank holds (this world size's wins a tie: `plan_newest`);
- saved at this world size, each rank loads its own shard (the parameters' local tensors
  filled in place, the optimizer's state made from its shards: `load_local_optimizer_state`),
  sent to it by the rank that read it where that is another;
- saved at another world size (each shard a dim-0 slice, FSDP2's default), the shards go to
  rank 0, which puts each parameter's and state's slices together on its device and scatters
  the new world's slices from there (`load_joined`);
- else there is no memory copy, and the group restores from disk, where DCP reshards.

Each node's first rank reports the agreed step to the control plane, which decides the
restore point as for DDP (service/decide/restore.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import memory as mem
from .. import sharded
from .. import snapshot as snap
from ..links import LinkError, ServiceLink
from .api import SNAPSHOT_FORMAT, Found, Worker
from .memory import MemoryTier
from .peer import PeerTier, Wire
from .sharded import SHARDED_OBJECTS

log = logging.getLogger("ftrain.runtime")


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def local_shards(state: Any, dtensor: type, found: list[torch.Tensor]) -> Any:
    """`state` with each DTensor replaced by its local shard (appended to `found`)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, dtensor):
            return t
        found.append(shard := t.to_local())
        return shard

    return snap.map_tensors(state, local)


def into_template(saved: Any, like: Any, dtensor: type) -> Any:
    """`saved` (local shards) put into `like` (the model's and optimizer's sharded state now,
    at the same world size): each DTensor's local shard copied in place, the rest as saved."""
    if isinstance(like, dtensor):
        local = like.to_local()
        if local.shape != saved.shape:
            raise ValueError(f"a memory shard of shape {tuple(saved.shape)} does not fit this rank's "
                             f"{tuple(local.shape)}")
        local.copy_(saved)
        return like
    if isinstance(saved, dict) and isinstance(like, dict):
        return {k: into_template(v, like.get(k), dtensor) for k, v in saved.items()}
    if isinstance(saved, list) and isinstance(like, list) and len(saved) == len(like):
        return [into_template(a, b, dtensor) for a, b in zip(saved, like)]
    return mem.owned(saved)  # an optimizer's step counter: not a view that holds the whole copy


# How long closing the tier waits for the exchange of replicas in flight (a peer already gone
# leaves it to the group's timeout).
CLOSE_WAIT_S = 60.0
SHARD_DIR = "shard-r{rank}"  # a rank's own shards, in its node's memory tier
REPLICA_DIR = "replica-r{rank}"  # another node's rank's shards, kept on this node


class ShardedMemoryTier(MemoryTier):
    """Every rank's own shards in its node's memory tier, and a replica of another node's
    rank's shards; see the module docstring."""

    def __init__(self, worker: Worker, directory: Path, every: int | None):
        super().__init__(worker, directory, every)
        self.copies: dict[tuple[int, int], tuple] = {}  # (shard's rank, step) -> a copy read here
        self.listed: dict[tuple[int, int], tuple[Path, int]] = {}  # (shard's rank, step) -> (dir, slot)
        self.buddy: int | None = None  # the rank (on another node) that keeps this rank's replica
        self.sources: list[int] = []  # the ranks (on other nodes) whose replicas this rank keeps
        self.group: Any = None  # the replica thread's own gloo group (None: every rank on one node)
        self.replicas: dict[int, mem.MemoryWriter] = {}  # source rank -> the writer of its replica
        self.replicate_s: list[float] = []  # per copy: its exchange of replicas, on the replica thread
        self.replica_waits_s: list[float] = []  # per copy: the training thread's wait for the last one
        self.replica_error: str | None = None  # why the replicas stopped (a peer gone mid-exchange)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (metadata, slot bytes or None, done)
        self._exchanged: threading.Event | None = None  # set once the last copy's exchange is over
        self._thread: threading.Thread | None = None
        self._waited = 0.0  # the training thread's wait for the last exchange, before this copy
        self.rng: tuple[int, Any] | None = None  # (step, RNG states) of the shard this rank loaded
        self.dim0: bool | None = None  # every shard a dim-0 slice (FSDP2's default): reshardable

    def open_writer(self) -> mem.MemoryWriter:
        """Every rank writes its own shards (its own directory in the node's tier)."""
        mine = self.directory / SHARD_DIR.format(rank=self.worker.rank)
        mine.mkdir(mode=0o700, exist_ok=True)
        self.writer = mem.MemoryWriter(mine, attempt=self.worker.attempt, rank=self.worker.rank)
        self.writer.on_done = self._copied
        return self.writer

    def set_peers(self, nodes: list[Any]) -> None:
        """Which rank keeps this rank's replica (the next rank on another node) and whose this
        rank keeps; none on one node (a lost node takes every copy with it anyway). Every rank
        calls it at the same point (the group for the replicas is made here)."""
        rank = self.worker.rank
        self.buddy = buddy_of(rank, nodes)
        self.sources = [r for r in range(len(nodes)) if r != rank and buddy_of(r, nodes) == rank]
        if self.group is None and len(set(nodes)) > 1:
            self.group = sharded.checkpoint_group()

    def start_reports(self) -> None:
        """The node's first rank reports what its own shards' copy holds (one report a node)."""
        if self.worker.local_rank == 0:
            super().start_reports()

    def ready(self) -> bool:
        """Every rank copies each step rank 0 picks: its own previous copy is waited for, never
        skipped (a skipped shard would leave the group without a step that every rank holds),
        and so is the previous copy's exchange of replicas if it is not over (the replicas
        are then never more than one copy behind, and the exchanges never pile up)."""
        assert self.writer is not None
        self.writer.wait()
        self._waited = self._wait_exchange()
        return True

    def wait(self) -> None:
        super().wait()
        self._wait_exchange(stall=False)

    def last_cost_s(self) -> float:
        """The copy's cost, and off a GPU the last exchange of replicas too: its thread takes a
        core, as the copy thread does (on a GPU host the exchange holds no core of the
        training's: what it costs is the training thread's wait for it, in the stall)."""
        cost = super().last_cost_s()
        if self.replicate_s and self.writer is not None and not self.writer.on_device:
            cost += self.replicate_s[-1]
        return cost

    def link_busy_s(self) -> float:
        """The last exchange of replicas: the next copy waits for it if it comes sooner."""
        return self.replicate_s[-1] if self.replicate_s else 0.0

    def _wait_exchange(self, stall: bool = True) -> float:
        """The training thread waits for the last exchange of replicas if it is not over (its
        time: counted in the next copy's stall, `save`, so the budget sees it at once)."""
        done, self._exchanged = self._exchanged, None
        if done is None:
            return 0.0
        began = time.perf_counter()
        done.wait()
        waited = time.perf_counter() - began
        if stall:
            self.replica_waits_s.append(waited)
        return waited

    def save(self, objects: Mapping[str, Any], step: int, rng: Any = None) -> bool:
        """Start the copy of this rank's local state at `step`: the shards (copied off in the
        writer's thread, before the optimizer's next step) and the small state (now). Once
        it is whole, the replica thread exchanges it with the ranks on other nodes (`_copied`)."""
        w = self.writer
        assert w is not None
        dtensor = _dtensor_type()
        shards: list[torch.Tensor] = []
        big = sharded.model_and_optimizer(objects["model"], objects.get("optimizer"))
        local = local_shards(big, dtensor, shards)
        if self.dim0 is None:
            self.dim0 = all(_is_dim0(p, dtensor) for p in objects["model"].parameters())
        state: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "step": step, "rank": self.worker.rank,
                                 "world_size": self.worker.world_size, "rng": rng, "sharded": local,
                                 "dim0": self.dim0}
        for name, obj in objects.items():
            if name not in SHARDED_OBJECTS and obj is not None:
                state[name] = obj.state_dict()
        # Only the optimizer's step changes the shards and its state: copied in the writer's
        # thread meanwhile (the optimizer's step pre-hook waits for it).
        later = {t.untyped_storage().data_ptr() for t in shards + _tensors(local.get("optimizer", {}))}
        if self.group is not None:
            self._exchanged = threading.Event()  # before the capture: its copy may end at once
        copies = len(w.stalls_s)
        w.capture(state, step, later)
        if len(w.stalls_s) == copies:  # no copy started (the tier off): the exchange sends none
            self._copied({"step": step}, None)
        else:  # the wait for the last exchange (`ready`) is this copy's stall
            w.stalls_s[-1] += self._waited
        self._waited = 0.0
        return not w.disabled

    def _copied(self, meta: dict, buf: torch.Tensor | None) -> None:
        """A copy of this rank's ended (the writer's `on_done`, on whichever thread ended it):
        its exchange handed to the replica thread, with the slot's bytes if it was committed.
        Every rank hands over one exchange per copy step, so the ranks' exchanges pair up."""
        if self.group is None or self._exchanged is None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="ftrain-memory-replica", daemon=True)
            self._thread.start()
        self._jobs.put((meta, buf, self._exchanged))

    def _serve(self) -> None:
        """The replica thread: each copy's exchange, in order, until `close`. A failed one (a
        peer gone) ends the replicas: a later exchange could pair with the wrong step's."""
        while (job := self._jobs.get()) is not None:
            meta, buf, done = job
            began = time.perf_counter()
            try:
                if self.replica_error is None:
                    self._replicate(meta, buf)
            except Exception as exc:  # noqa: BLE001 - training goes on; restores use the rest
                self.replica_error = str(exc)
                log.warning("rank %d: the exchange of memory replicas failed (%s); no more replicas "
                            "this run (a lost node restores from the disk tier)", self.worker.rank, exc)
            finally:
                self.replicate_s.append(time.perf_counter() - began)
                done.set()

    def _replicate(self, meta: dict, buf: torch.Tensor | None) -> None:
        """Send this rank's copy (the committed slot's bytes, checksummed; none if the copy was
        not committed) to its buddy, and receive the sources' into their replica writers'
        free slots, each committed under its sender's checksum once whole: the sizes, then the
        metadata, then the bytes, point to point over the replica thread's group."""
        head = mem.freeze(meta) if buf is not None and self.buddy is not None else b""
        out = [torch.frombuffer(bytearray(head), dtype=torch.uint8), buf] if head else []
        sizes = {src: [torch.zeros(2, dtype=torch.int64)] for src in self.sources}
        self._exchange([torch.tensor([len(head), buf.numel() if head else 0], dtype=torch.int64)]
                       if self.buddy is not None else [], sizes)
        sent = {src: [int(n) for n in got[0].tolist()] for src, got in sizes.items()}
        heads = {src: [torch.empty(n[0], dtype=torch.uint8)] for src, n in sent.items() if n[0]}
        self._exchange(out[:1], heads)
        metas = {src: mem.thaw(t[0].numpy().tobytes()) for src, t in heads.items()}
        slots = {src: self._free_slot(src, m) for src, m in metas.items()}
        self._exchange(out[1:], {src: [into[:sent[src][1]]] for src, (_, into) in slots.items()})
        for src, (slot, _) in slots.items():
            if slot is not None:
                self._replica_writer(src).commit(metas[src], slot)

    def _free_slot(self, src: int, meta: dict) -> tuple[int | None, torch.Tensor]:
        """Where `src`'s copy is received: its replica writer's free slot, or where the node's
        tier has no room for it, memory of this process's, let go after (the bytes must still
        be received, or the sender's exchange would wait for good)."""
        try:
            return self._replica_writer(src).free_slot(meta["packing"], meta["size"])
        except OSError as exc:
            log.warning("rank %d: no room for rank %d's replica (%.0f MiB) in %s: %s; it is not kept",
                        self.worker.rank, src, meta["size"] / 2**20, self.directory, exc)
            return None, torch.empty(meta["size"], dtype=torch.uint8)

    def _exchange(self, out: list[torch.Tensor], into: dict[int, list[torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, t, self.buddy, self.group) for t in out]
        ops += [dist.P2POp(dist.irecv, t, src, self.group) for src, ts in into.items() for t in ts]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    def _replica_writer(self, src: int) -> mem.MemoryWriter:
        w = self.replicas.get(src)
        if w is None:
            where = self.directory / REPLICA_DIR.format(rank=src)
            where.mkdir(mode=0o700, exist_ok=True)
            w = mem.MemoryWriter(where, attempt=self.worker.attempt, rank=self.worker.rank)
            self.replicas[src] = w
        return w

    # -------------------------------------------------------------- restoring
    def newest(self) -> Found | None:
        """Nothing yet: which copies a rank reads depends on its node's other ranks, known at
        the gather (`list_node`)."""
        return None

    def list_node(self, index: int, count: int) -> dict[int, dict[int, tuple[int, bool]]]:
        """This rank's share (`index` of `count` ranks on the node) of the node's copies, both
        slots of each, by what each says of itself (their bytes are read only for the step the
        group restores: `read`): {shard's rank: {step: (the world size it was saved at, whether
        its shards are dim-0 slices)}}."""
        dirs = sorted(self.directory.glob("shard-r*")) + sorted(self.directory.glob("replica-r*"))
        self.copies, self.listed = {}, {}
        held_here: dict[int, dict[int, tuple[int, bool]]] = {}
        for where in dirs[index::count]:
            for slot in (0, 1):
                meta = mem.slot_meta(where, slot)
                said = meta.get("skeleton") if meta is not None else None
                if not isinstance(said, dict) or "rank" not in said:
                    continue
                shard, step = int(said["rank"]), int(said["step"])
                self.listed[(shard, step)] = (where, slot)
                held_here.setdefault(shard, {})[step] = (int(said["world_size"]), bool(said.get("dim0")))
        return held_here

    def read(self, shard: int, step: int) -> bool:
        """Read and verify the copy of `shard` at `step` that `list_node` found here (kept for
        the load); False if its bytes fail their checksum (a writer killed mid-copy tore it, or
        damage: reported where it is the copy its writer last committed)."""
        where, slot = self.listed[(shard, step)]
        got = mem.read_slot(where, slot)
        if got is not None and (int(got[0]["rank"]), int(got[0]["step"])) == (shard, step):
            self.copies[(shard, step)] = got
            return True
        held = mem.read_held(where)
        if held is not None and held.step == step:
            self._report_corrupt(where, step)
        return False

    def _report_corrupt(self, where: Path, step: int) -> None:
        worker, link = self.worker, self.worker.link
        reason = f"the shards in {where.name} fail their checksum"
        log.warning("rank %d: memory copy at step %d: %s; falling back to the next source", worker.rank,
                    step, reason)
        if link is not None:
            try:
                link.report_memory_corrupt(worker.node or "local", step, reason)
            except LinkError as exc:
                log.warning("rank %d: could not report the corrupt memory copy: %s", worker.rank, exc)

    def load_shards(self, copy: tuple, objects: Mapping[str, Any]) -> dict:
        """A copy of this rank's shards: loaded into the model and optimizer in place; returns
        the rest of the state (step, rng, scheduler, sampler, extras)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        state = mem.unpack(*copy)
        big = state.pop("sharded")
        state = mem.owned(state)  # what the runtime keeps (RNG states...) holds not the copy
        model, optimizer = objects["model"], objects.get("optimizer")
        like = get_model_state_dict(model)
        if missing := sorted(like.keys() - big["model"].keys()):
            raise RuntimeError(f"the memory copy holds no {', '.join(missing[:5])} of the model")
        dtensor = _dtensor_type()
        with torch.no_grad():
            saved_model = into_template(big["model"], like, dtensor)
        # The model's shards are in place now (`into_template` wrote into its parameters):
        # loading them again costs a DTensor copy of each, ~1 s at 1B parameters. The rest (a
        # buffer, a module left unsharded) is loaded, and the optimizer's state.
        rest = {k: v for k, v in saved_model.items() if not isinstance(v, dtensor)}
        options = StateDictOptions(strict=False)
        if rest:
            set_model_state_dict(model, rest, options=options)
        if optimizer is not None and not sharded.load_local_optimizer_state(optimizer, big.get("optimizer", {})):
            # Saved in a shape the direct load does not know: torch's way (it makes the state
            # by a step with zero gradients, which the shards then overwrite in place).
            like_optim = sharded.model_and_optimizer(model, optimizer)["optimizer"]
            with torch.no_grad():
                saved_optim = into_template(big.get("optimizer", {}), like_optim, dtensor)
            set_state_dict(model, optimizer, model_state_dict={}, optim_state_dict=saved_optim, options=options)
        self.copies = {}
        self.rng = (int(state["step"]), state.get("rng"))
        return state

    def load_full(self, full: dict | None, objects: Mapping[str, Any]) -> None:
        """Every rank: the whole model and optimizer state that rank 0 put together from the
        shards of another world size (`full`, None elsewhere), broadcast and sharded for this one."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        model, optimizer = objects["model"], objects.get("optimizer")
        full = full if full is not None else {"model": {}, "optimizer": {}}
        if optimizer is None:
            set_model_state_dict(model, full["model"], options=options)
        else:
            set_state_dict(model, optimizer, model_state_dict=full["model"],
                           optim_state_dict=full["optimizer"], options=options)
        self.copies = {}

    def rng_of(self, step: int) -> dict | None:
        """This rank's RNG states of `step`: those kept with the shard it loaded."""
        return self.rng[1] if self.rng is not None and self.rng[0] == step else super().rng_of(step)

    def flush(self, objects: Mapping[str, Any], step: int, missed: bool) -> None:
        """At the end: the last copy whole and its replicas exchanged (every rank's last copy
        step is the same: `ready` skips none), then the writer's buffers freed."""
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the end of the job must not fail for it
            log.warning("memory tier: the last copy failed (%s); the disk tier still holds", exc)
        finally:
            if self.writer is not None:
                self.writer.close()

    def close(self) -> None:
        """The replica thread ends after the exchange in flight (a peer already gone fails it
        at the group's timeout: the thread is a daemon, and holds the bytes it sends)."""
        self.copies = {}
        if self._thread is not None:
            self._jobs.put(None)
            if self._exchanged is None or self._exchanged.wait(CLOSE_WAIT_S):
                self._thread.join(CLOSE_WAIT_S)
            self._thread = None
        for w in self.replicas.values():
            w.close()
        super().close()


def buddy_of(rank: int, nodes: list[Any]) -> int | None:
    """The next rank after `rank` (cyclically) on another node than its, or None."""
    n = len(nodes)
    return next((other for k in range(1, n) if nodes[other := (rank + k) % n] != nodes[rank]), None)


def _is_dim0(param: Any, dtensor: type) -> bool:
    from torch.distributed.tensor import Shard

    return not isinstance(param, dtensor) or tuple(param.placements) == (Shard(0),)


def joined(shards: list[Any], like: Any, dtensor: type) -> Any:
    """The whole state from every old rank's local state (in rank order): each DTensor of
    `like` (the state's structure now) the old ranks' dim-0 slices one after the other; the
    rest as the first rank saved it."""
    first = shards[0]
    if isinstance(like, dtensor):
        return torch.cat(shards, dim=0)
    if isinstance(first, dict) and isinstance(like, dict):
        return {k: joined([s[k] for s in shards], like.get(k), dtensor) for k in first}
    if isinstance(first, list) and isinstance(like, list) and len(first) == len(like):
        return [joined([s[i] for s in shards], like[i], dtensor) for i in range(len(first))]
    # An optimizer's step counter, a view of the first rank's copy: made its own, or the
    # broadcast of the whole state pickles that copy once per parameter.
    return mem.owned(first)


def _tensors(state: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    mem._split(state, found)
    return found


class ShardedPeerTier(PeerTier):
    """The group's shards in memory: a step is restorable when every rank's shard of it,
    saved at this world size, is on some node of the group (its own, or a replica); a shard
    not on its rank's node is sent by the rank that read it (see the module docstring)."""

    def __init__(self, worker: Worker, local: ShardedMemoryTier, wire: Wire | None = None):
        super().__init__(worker, local, wire)
        self.local: ShardedMemoryTier = local
        self.objects: Mapping[str, Any] = {}
        self.complete: int | None = None  # the newest step every shard is held at (`gather`)
        self.sources: list[int] = []  # shard i's copy of `complete` is read by rank sources[i]
        self.saved_world = worker.world_size  # the world size the shards of `complete` were saved at
        self.group: Any = None

    def gather(self, mine: Found | None, extra: Any = None) -> list:
        """Every rank's node (and `extra`); then the node's copies, each read and verified by one
        of its ranks; then the newest step that every shard is held at, which each node's first
        rank reports, and a barrier after which every report is in (rank 0 then asks for the
        restore point). Returns every rank's `extra`."""
        worker = self.worker
        if worker.distributed:
            if self.group is None:
                self.group = sharded.checkpoint_group()
            got = self.wire.all_gather_object((worker.node, extra))
        else:
            got = [(worker.node, extra)]
        nodes = [g[0] for g in got]
        siblings = [r for r, node in enumerate(nodes) if node == nodes[worker.rank]]
        held = self.local.list_node(siblings.index(worker.rank), len(siblings))
        helds = self.wire.all_gather_object(held) if worker.distributed else [held]
        while True:
            self._plan(helds)
            # Only the copies of the chosen step are read, each by the rank that sends it:
            # one copy per shard, not every slot of every node's writers and replicas.
            torn = [shard for shard, src in enumerate(self.sources)
                    if src == worker.rank and not self.local.read(shard, self.complete)]
            torns = self.wire.all_gather_object(torn) if worker.distributed else [torn]
            if not any(torns):
                break
            for rank, shards in enumerate(torns):  # those copies are none: plan again without them
                for shard in shards:
                    helds[rank][shard].pop(self.complete)
        if worker.is_chief and (self.saved_world != worker.world_size or self.complete is None):
            self._say_why_not(helds)
        self.helds = [self.complete if self.complete is not None else -1] * worker.world_size
        self._report(self.complete)
        if worker.distributed:
            self.wire.all_gather_object(None)
            self.local.set_peers(nodes)
        return [g[1] for g in got]

    def _plan(self, helds: list[dict[int, dict[int, tuple[int, bool]]]]) -> None:
        """The step to restore (`complete`), the world size it was saved at, and who sends each
        shard (`plan_newest`)."""
        self.complete, self.saved_world, self.sources = plan_newest(helds, self.worker.world_size)

    def _say_why_not(self, helds: list[dict[int, dict[int, tuple[int, bool]]]]) -> None:
        world = self.worker.world_size
        if self.complete is not None:
            log.info("the memory tier's shards of step %d were saved by %d ranks and the group has %d now: "
                     "rank 0 joins them and the group reshards them from memory", self.complete,
                     self.saved_world, world)
            return
        saved_at = sorted({w for h in helds for steps in h.values() for w, _ in steps.values()} - {world})
        if saved_at:
            log.info("the memory tier's shards were saved by %s ranks and the group has %d now: "
                     "restoring from disk, where DCP reshards them", "/".join(map(str, saved_at)), world)
        elif any(helds):
            log.info("the memory tier holds no step of every rank's shards (a node's copies lost with "
                     "it, and no replica of them): restoring from disk")

    def _report(self, step: int | None) -> None:
        worker, link = self.worker, self.worker.link
        if step is None or worker.local_rank != 0 or not worker.node or not isinstance(link, ServiceLink):
            return
        try:
            link.report_memory_held(worker.node, step)
        except LinkError as exc:
            log.warning("rank %d: could not report this node's shards in memory (step %d): %s; the "
                        "restore point will not count them", worker.rank, step, exc)

    def sent(self, step: int) -> bool:
        return step == self.complete and any(src != i for i, src in enumerate(self.sources))

    def where_from(self, step: int, where: Any, mine: Found | None) -> str:
        if step == self.complete and self.saved_world != self.worker.world_size:
            return f"the shards of its {self.saved_world} ranks, joined on rank 0 and resharded"
        src = self.sources[self.worker.rank] if step == self.complete else self.worker.rank
        if src == self.worker.rank:
            return "its own shards in its node's memory"
        return f"its shards sent by rank {src}, from a copy on that rank's node"

    def load(self, found: Found) -> dict:
        """Every rank at once: the shards whose copy another rank read are sent to their rank
        (in the order of the shards' ranks: each send meets its receive), then each rank loads
        its own in place (into `objects`, which the runtime sets before the restore)."""
        step, rank = found.step, self.worker.rank
        assert step == self.complete
        if self.saved_world != self.worker.world_size:
            return self._load_resharded(step)
        mine = None
        for shard, src in enumerate(self.sources):
            if src == shard == rank:
                mine = self.local.copies[(shard, step)]
            elif rank == src:
                self._send(self.local.copies[(shard, step)], shard)
            elif rank == shard:
                mine = self._receive(src)
        assert mine is not None
        return self.local.load_shards(mine, self.objects)

    def close(self) -> None:
        """The copies read for the restore let go (a restore from disk did not load them)."""
        self.local.copies = {}
        super().close()

    def _send(self, copy: tuple, dst: int) -> None:
        skeleton, flat, packing = copy
        dist.send_object_list([(skeleton, packing, flat.numel())], dst=dst, group=self.group)
        dist.send(flat, dst=dst, group=self.group)

    def _receive(self, src: int) -> tuple:
        box: list = [None]
        dist.recv_object_list(box, src=src, group=self.group)
        skeleton, packing, size = box[0]
        flat = torch.empty(size, dtype=torch.uint8)
        dist.recv(flat, src=src, group=self.group)
        return skeleton, flat, packing

    def _load_resharded(self, step: int) -> dict:
        """Shards of another world size: every old rank's sent to rank 0, which puts each
        parameter's and state's old dim-0 slices together on its device and scatters the new
        world's slices from there (`load_joined`); torch's way (the whole state joined in host
        memory, loaded with `set_state_dict`'s broadcast) where the state holds what that
        does not know. Each rank takes the RNG states of the old rank of its number (modulo
        the old world), as a disk restore does."""
        rank = self.worker.rank
        got: dict[int, tuple] = {}
        for shard, src in enumerate(self.sources):
            if src == rank == 0:
                got[shard] = self.local.copies[(shard, step)]
            elif rank == src:
                self._send(self.local.copies[(shard, step)], 0)
            elif rank == 0:
                got[shard] = self._receive(src)
        olds, rest, plan = None, None, None
        model, optimizer = self.objects["model"], self.objects.get("optimizer")
        if rank == 0:
            states = [mem.unpack(*got[shard]) for shard in range(self.saved_world)]
            olds = [s.pop("sharded") for s in states]
            rest = mem.owned({**states[0], "rngs": [s.get("rng") for s in states]})
            try:
                plan = joined_plan(olds, model, optimizer)
            except RuntimeError as exc:  # every rank raises it, not rank 0 alone (the rest would wait)
                plan = {"error": str(exc)}
        if self.worker.distributed:
            box = [(rest, plan)]
            dist.broadcast_object_list(box, src=0, group=self.group)
            rest, plan = box[0]
        if plan is not None and "error" in plan:
            raise RuntimeError(plan["error"])
        if plan is not None:
            load_joined(olds, plan, model, optimizer)
            self.local.copies = {}
        else:
            full = None
            if rank == 0:
                like = sharded.model_and_optimizer(model, optimizer)
                full = joined(olds, like, _dtensor_type())
            self.local.load_full(full, self.objects)
        rngs = rest.pop("rngs")
        self.local.rng = (step, rngs[rank % len(rngs)])
        return rest



def joined_plan(olds: list[dict], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    """Rank 0, for `load_joined`: what every rank needs to know of the old ranks' local states
    (`olds`) besides the slices, which only rank 0 holds: the model's entries that are not
    sharded, the optimizer's parameter groups, its scalar states (step counters), and which of
    its states are dim-0 slices to join. None where the states do not fit that (a state of
    another shape, a parameter missing, groups that do not pair up): torch's way then."""
    dtensor = _dtensor_type()
    params = _model_entries(model)
    first = olds[0]
    if missing := sorted(params.keys() - first["model"].keys()):
        raise RuntimeError(f"the memory copy holds no {', '.join(missing[:5])} of the model")
    plan: dict[str, Any] = {"model_rest": {k: mem.owned(v) for k, v in first["model"].items()
                                           if not isinstance(params.get(k), dtensor)},
                            "groups": None, "sliced": [], "scalars": {}}
    saved = first.get("optimizer")
    if optimizer is None or not saved:
        return plan
    by_name = sharded.optimizer_params(optimizer, saved.get("param_groups"))
    if by_name is None:
        return None
    for name, values in saved.get("state", {}).items():
        param = by_name.get(name)
        if param is None or not isinstance(values, dict):
            return None
        for key, value in values.items():
            if not (isinstance(param, dtensor) and isinstance(value, torch.Tensor) and value.dim() > 0):
                plan["scalars"][(name, key)] = mem.owned(value)
                continue
            if key == "step":  # a step counter that is not a scalar: not a slice to join
                return None
            try:
                rows = sum(old["optimizer"]["state"][name][key].shape[0] for old in olds)
            except (KeyError, TypeError, AttributeError):  # an old rank without this state
                return None
            if (rows, *value.shape[1:]) != tuple(param.shape):
                return None
            plan["sliced"].append((name, key, value.dtype))
    plan["groups"] = saved["param_groups"]
    return plan


def load_joined(olds: list[dict] | None, plan: dict, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank, at once: each sharded parameter and optimizer state put together on rank 0's
    device from the old ranks' dim-0 slices (`olds`, rank 0's; None elsewhere) and scattered
    from there as this world's shards (`distribute_tensor`): the parameters' local shards
    filled in place, the optimizer's state made from its shards and loaded with
    `Optimizer.load_state_dict`. Nothing is joined in host memory, and the optimizer's state
    is not first made by a step with zero gradients, as `set_state_dict` makes it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import distribute_tensor

    dtensor = _dtensor_type()

    def scattered(part: str, name: str, key: str | None, like: Any, dtype: torch.dtype) -> Any:
        whole = torch.empty(like.shape, dtype=dtype, device=like.to_local().device)
        if olds is not None:
            at = 0
            for old in olds:
                piece = old[part][name] if key is None else old[part]["state"][name][key]
                whole[at:at + piece.shape[0]].copy_(piece)
                at += piece.shape[0]
        return distribute_tensor(whole, like.device_mesh, like.placements)

    with torch.no_grad():
        for name, param in sorted(_model_entries(model).items()):
            if isinstance(param, dtensor):
                param.to_local().copy_(scattered("model", name, None, param, param.dtype).to_local())
    if plan["model_rest"]:
        set_model_state_dict(model, plan["model_rest"], options=StateDictOptions(strict=False))
    if optimizer is None or plan["groups"] is None:
        return
    by_name = sharded.optimizer_params(optimizer, plan["groups"])
    assert by_name is not None  # rank 0 paired them, and every rank's optimizer is the same
    state: dict[str, dict] = {}
    for (name, key), value in plan["scalars"].items():
        state.setdefault(name, {})[key] = value
    for name, key, dtype in plan["sliced"]:
        state.setdefault(name, {})[key] = scattered("optimizer", name, key, by_name[name], dtype)
    sharded.load_named_optimizer_state(optimizer, state, plan["groups"])


def _model_entries(model: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def plan_newest(helds: list[dict[int, dict[int, tuple[int, bool]]]],
                world_size: int) -> tuple[int | None, int, list[int]]:
    """The newest step the group can restore from memory: (step, the world size its shards were
    saved at, the rank that sends each shard), or (None, world_size, []). A step saved at this
    world size wins a tie (each rank loads its own shard); a newer one of another size is
    resharded: a group grown back still holds whole copies of the step before it shrank (the
    shards and their replicas on the other nodes), older than what the smaller group saved."""
    same, sources = plan_restore(helds, world_size)
    other = plan_reshard(helds, world_size)
    if same is not None and (other[0] is None or same >= other[0]):
        return same, world_size, sources
    return other


def plan_restore(helds: list[dict[int, dict[int, tuple[int, bool]]]], world_size: int,
                 dim0_only: bool = False) -> tuple[int | None, list[int]]:
    """The newest step whose every shard (0 .. world_size - 1), saved at `world_size` (and, with
    `dim0_only`, as dim-0 slices), some rank read (`helds`: each rank's {shard: {step: (world
    size saved at, dim-0 slices)}}), and for each shard the rank that sends it: its own rank
    where it read it, else the first that did. (None, []) where there is no such step."""
    def fits(saved: tuple[int, bool] | None) -> bool:
        return saved is not None and saved[0] == world_size and (saved[1] or not dim0_only)

    def holders(shard: int, step: int) -> list[int]:
        return [r for r, h in enumerate(helds) if fits(h.get(shard, {}).get(step))]

    steps = {step for h in helds for per in h.values() for step, saved in per.items() if fits(saved)}
    for step in sorted(steps, reverse=True):
        found = [holders(shard, step) for shard in range(world_size)]
        if all(found):
            return step, [shard if shard in got else got[0] for shard, got in enumerate(found)]
    return None, []


def plan_reshard(helds: list[dict[int, dict[int, tuple[int, bool]]]],
                 world_size: int) -> tuple[int | None, int, list[int]]:
    """For a group of another size than the copies': the newest step whose every shard of some
    other world size is held, as dim-0 slices (which rank 0 can join): (step, that world size,
    the rank that sends each shard), or (None, world_size, [])."""
    worlds = {saved[0] for h in helds for per in h.values() for saved in per.values()} - {world_size}
    best: tuple[int | None, int, list[int]] = (None, world_size, [])
    for world in sorted(worlds):
        step, sources = plan_restore(helds, world, dim0_only=True)
        if step is not None and (best[0] is None or step > best[0]):
            best = (step, world, sources)
    return best
