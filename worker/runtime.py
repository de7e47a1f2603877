"""The training-side runtime: the boilerplate of a fault-tolerant DDP script, done once.

    from . import runtime

    rt = runtime.init(total_steps=max_steps)              # process group, device, snapshots
    model = rt.wrap(Net())                                # to the device, DDP when distributed
    opt = torch.optim.AdamW(model.parameters())
    sampler = rt.sampler(len(dataset), batch_size=32, seed=0)
    rt.restore(model=model, optimizer=opt, sampler=sampler)  # resume from the latest snapshot
    for indices in sampler:
        if rt.step >= max_steps:
            break
        loss = train_step(dataset[indices])
        rt.log(lr=scheduler.get_last_lr()[0])             # any scalar: curves on the dashboard
        rt.step_done(loss=loss, samples=len(indices) * rt.world_size)
    rt.finish()

What `init` does, from the environment torchrun and ftrain give each worker:

- `RANK`, `LOCAL_RANK`, `WORLD_SIZE` (and `MASTER_ADDR`/`MASTER_PORT`, read by
  `init_process_group`): picks `nccl` when CUDA is there, else `gloo`; sets the CUDA
  device from `LOCAL_RANK` *before* `init_process_group`; passes a timeout (60 s by
  default: gloo's own default of 30 min turns a lost peer into a 30 min hang).
- `FTRAIN_JOB_ID`, `FTRAIN_SERVER`, `FTRAIN_JOB_TOKEN`, `FTRAIN_ATTEMPT`: the control plane
  that lists and commits snapshots, takes progress reports and says when to stop.
- `FTRAIN_SNAPSHOT_DIR`, `FTRAIN_SNAPSHOT_EVERY`, `FTRAIN_SNAPSHOT_KEEP`: where, how often,
  how many (from the job spec). Arguments of `init` win over these.
- `FTRAIN_GLOBAL_BATCH_SIZE`: used by `rt.sampler` when it is given no batch size.

Snapshots: every `snapshot_every` steps rank 0 copies the state (model, optimizer, LR
scheduler, sampler position, every rank's torch/CUDA/numpy/python RNG state, the step)
to host memory -- the only stall, measured and logged per snapshot -- and a background
thread writes it atomically with a sha256 checksum, commits it to the control plane
(fenced by `FTRAIN_ATTEMPT`), and deletes what the commit prunes. A commit that cannot
reach the control plane keeps its file and is retried in the background while training
goes on (`worker.snapshot.AsyncWriter`); a refused one (a newer attempt) ends the worker.
On start, rank 0 picks the latest committed snapshot, verifies its checksum (reporting a
bad one and falling back to the one before), and broadcasts the choice; every rank loads it.

Metrics: rank 0 reports its step, loss and samples/s, and the scalars given to
`rt.log(step, name=value, ...)` (the latest value of each), with its progress; the control
plane keeps a bounded, downsampled history of them per job (`GET /v1/jobs/{id}/metrics`,
the dashboard's curves). `init(total_steps=N)` (or `rt.total_steps = N`) gives the job's
percent done and time left.

Planned changes: a thread on rank 0 polls the job's control endpoint (every 0.5 s) and
reports progress (every 1 s). At each step boundary rank 0 broadcasts what it last heard
("decide once, broadcast"), so every rank acts at the same step: `checkpoint_stop`
snapshots there and exits 0 (`Stopped`); `checkpoint_pause` snapshots there and waits to
be restarted by its agent.

The local twin: without `RANK` and `FTRAIN_JOB_ID` the same script runs as one process
with no process group and no service -- `python train.py` -- snapshotting (if a directory
is given) into a local directory with a `snapshots.json` index in place of the control
plane. Same code path, so it can be stepped through in a debugger. A VSCode
`.vscode/launch.json` for it:

    {
      "version": "0.2.0",
      "configurations": [
        {
          "name": "train.py (local twin)",
          "type": "debugpy",
          "request": "launch",
          "program": "${workspaceFolder}/examples/train.py",
          "args": ["--steps", "50", "--out", "/tmp/final.pt"],
          "cwd": "${workspaceFolder}",
          "env": {"FTRAIN_SNAPSHOT_DIR": "/tmp/ftrain-snapshots", "FTRAIN_SNAPSHOT_EVERY": "10"},
          "justMyCode": false
        }
      ]
    }

(Leave out `FTRAIN_SNAPSHOT_DIR` to run without snapshots; delete the directory to start
over.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import handoff
from . import rng as rng_module
from . import sharded
from . import snapshot as snap
from . import stacks
from .control import ControlChannel
from .data import ResumableSampler
from .env import (
    FTRAIN_ATTEMPT,
    FTRAIN_COMMIT_WAIT_S,
    FTRAIN_CUDA_WARMUP,
    FTRAIN_GLOBAL_BATCH_SIZE,
    FTRAIN_GROUP,
    FTRAIN_JOB_ID,
    FTRAIN_JOB_TOKEN,
    FTRAIN_LAST_WORDS,
    FTRAIN_MEMORY_DIR,
    FTRAIN_MEMORY_EVERY,
    FTRAIN_NODE,
    FTRAIN_SERVER,
    FTRAIN_SNAPSHOT_DIR,
    FTRAIN_SNAPSHOT_EVERY,
    FTRAIN_SNAPSHOT_KEEP,
)
from .failure_flush import GPU_SETTLE_S, LAST_WORDS_S, SETTLE_S, FailureFlush, flush_output  # noqa: F401
from .links import (  # noqa: F401 - CommittedSnapshot, ControlRequest, Fenced, LinkError: for `runtime.` users
    CommittedSnapshot,
    ControlRequest,
    Fenced,
    Link,
    LinkError,
    LocalLink,
    ServiceLink,
    report_broken_peer,
)
from .peer_watch import PeerWatch
from .progress import Progress
from .protocol import PEER_GONE
from .step_marks import GPU_RING, KEEP_BUFFERS_BYTES, StepMarks  # noqa: F401
from .step_timing import (  # noqa: F401 - the budget's figures, for `runtime.` users
    COPY,
    COPY_COSTS_KEPT,
    COPY_NONE,
    COPY_SKIPPED,
    MARKS_PROBE_STEPS,
    MARKS_SHARE,
    MEMORY_AIM,
    MEMORY_BUDGET,
    CopySchedule,
    StepClock,
)
from .tiers.api import SNAPSHOT_FORMAT, Found, Worker, load_into  # noqa: F401
from .tiers.disk import DiskTier
from .tiers.memory import MEMORY_EVERY_MAX, MEMORY_PLAN_REMAKES, MemoryTier, Prefetch  # noqa: F401
from .tiers.peer import PeerTier
from .tiers.restore import choose
from .tiers.sharded import ShardedDiskTier
from .tiers.sharded_memory import ShardedMemoryTier, ShardedPeerTier

full_model_state = sharded.full_model_state  # the whole model's state_dict, FSDP2 or not (`runtime.` users)

log = logging.getLogger("ftrain.runtime")

EXIT_PAUSE_TIMEOUT = 75  # EX_TEMPFAIL: nobody restarted a paused group; torchrun restarts it


class Stopped(SystemExit):
    """Raised by `step_done` after the snapshot of a `checkpoint_stop` (cancel): exit 0."""

    def __init__(self, step: int):
        super().__init__(0)
        self.step = step


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def is_broken_peer(exc: BaseException) -> bool:
    """Whether an error that ends a worker says its process group lost a peer."""
    if isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in PEER_GONE)


def _report_broken_peers(link: Link, node: str, rt: Runtime | None = None) -> None:
    """When the worker dies of a broken peer, tell the control plane first (service/presence.py:
    a member whose agent's connection dropped as well is lost at once, not after the longer
    bound a network blip gets); meanwhile settle the memory tier's copy in flight and say the
    last words (worker/failure_flush.py), at most LAST_WORDS_S in all. Then the previous hook
    runs as before (the traceback), and the worker exits at once (`_exit_now`)."""
    previous = sys.excepthook

    def hook(kind, exc, tb) -> None:
        broken = is_broken_peer(exc)
        if broken:
            began = time.monotonic()
            report = report_broken_peer(link, node, f"{kind.__name__}: {exc}")
            if rt is not None:  # beside the report: the node's torchrun may stop this worker soon
                rt._say_last_words()
            report.join(max(0.0, began + 1.0 - time.monotonic()))
        previous(kind, exc, tb)
        if broken:
            _exit_now(1)

    sys.excepthook = hook


def _exit_now(code: int) -> None:
    """End a worker whose process group broke, skipping the interpreter's teardown.

    That teardown (a full garbage collection over every object torch made, then the broken
    group's destructors) took 2-4 s on 2 busy cores after a peer's SIGKILL (0.07 s with this),
    and torch's agent restarts the group only once every local worker has exited: the whole
    job waited for it. Nothing of the runtime's is lost: the memory tier's copies are whole
    or ignored (as after a SIGKILL), and a disk snapshot is committed or not."""
    flush_output()
    logging.shutdown()
    os._exit(code)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _warm_cuda(device: torch.device) -> None:
    """Meet the costs of a first training step once, on a thread of its own, while the main
    thread makes the process group and DDP (NCCL's communicator: 0.5-0.8 s on two H100s): a
    cuBLAS handle and its workspace (handed back to torch's pool when this thread ends, for
    the training thread to take), the autograd engine's thread for the GPU, and the kernels
    of a linear layer, ReLU, a mean and AdamW's step loaded. Measured on two H100s before
    this: a restarted worker's first forward 0.22 s, backward 0.08 s, optimizer step 0.07-0.10 s.
    No random numbers are drawn (the training's RNG streams stay as they are); its own stream.
    FTRAIN_CUDA_WARMUP=0 turns it off."""
    began = time.perf_counter()
    try:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                w = torch.zeros(64, 64, device=device, requires_grad=True)
                b = torch.zeros(64, device=device, requires_grad=True)
                x = torch.ones(32, 64, device=device)
                y = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w, b)), w, b)
                y.pow(2).mean().backward()
                torch.optim.AdamW([w, b], lr=1e-3).step()
            stream.synchronize()
        log.debug("CUDA warm-up done in %.3f s", time.perf_counter() - began)
    except Exception as exc:  # noqa: BLE001 - only a head start; the training does it all anyway
        log.info("CUDA warm-up failed (%s); the first step makes up for it", exc)


class Runtime:
    """One worker's view of the job; made by `init`. See the module docstring. A façade over
    its parts, each behind one seam: the snapshot tiers (`disk`, `memory`, `peer`:
    worker/tiers/), the copy schedule and step timing (`schedule`), the step marks and the
    flush at a failure (`marks`, `at_failure`), the control channel (`control`) and progress
    reporting (`progress`)."""

    def __init__(self, worker: Worker, *, snapshot_every: int | None = None,
                 global_batch_size: int | None = None, pause_timeout_s: float = 600.0,
                 disk: DiskTier | None = None, memory: MemoryTier | None = None,
                 progress: Progress | None = None, control: ControlChannel | None = None,
                 last_words: bool = True):
        self.worker = worker
        self.snapshot_every = snapshot_every
        self.global_batch_size = global_batch_size
        self.pause_timeout_s = pause_timeout_s
        self.disk = disk
        self.memory = memory
        self.peer = PeerTier(worker, memory)
        self.schedule = CopySchedule(memory.every if memory is not None else None)
        self.marks = StepMarks(worker.device.type == "cuda")
        self.clock = StepClock(worker.device.type == "cuda", worker.world_size)
        self.at_failure = FailureFlush(worker, memory, self.marks, last_words) if memory is not None else None
        self.progress = progress if progress is not None else Progress(worker)
        self.control = control if control is not None else ControlChannel(worker, self.progress)
        self.step = 0
        self.resumed_from: int | None = None
        self.resumed_tier: str | None = None  # "memory" or "disk", once restored from a snapshot
        self.phases_s: dict[str, float] = {}  # start-up and restore, timed (logged)
        self._state: dict[str, Any] = {}
        self._peer_watch: PeerWatch | None = None  # the node leader's part of the job's ring
        self._warm: threading.Thread | None = None  # `_warm_cuda`, while the process group and DDP start
        self._finished = False

    # -------------------------------------------------------------- what the script reads
    rank = property(lambda self: self.worker.rank)
    local_rank = property(lambda self: self.worker.local_rank)
    world_size = property(lambda self: self.worker.world_size)
    distributed = property(lambda self: self.worker.distributed)
    device = property(lambda self: self.worker.device)
    node = property(lambda self: self.worker.node)
    attempt = property(lambda self: self.worker.attempt)
    is_chief = property(lambda self: self.worker.is_chief)
    snapshot_dir = property(lambda self: self.disk.directory if self.disk is not None else None)
    memory_dir = property(lambda self: self.memory.directory if self.memory is not None else None)
    memory_every = property(lambda self: self.schedule.every)
    memory_interval = property(lambda self: self.schedule.interval)
    rng_ring = property(lambda self: self.memory.rng_ring if self.memory is not None else 0)
    boundary_s = property(lambda self: self.marks.boundary_s)
    stalls_s = property(lambda self: self.disk.stalls_s if self.disk is not None else [])
    waits_s = property(lambda self: self.disk.waits_s if self.disk is not None else [])

    @property
    def link(self) -> Link | None:
        return self.worker.link

    @link.setter
    def link(self, link: Link | None) -> None:
        self.worker.link = link

    @property
    def total_steps(self) -> int | None:
        """The steps the script means to make: reported, for percent done and an ETA."""
        return self.progress.total_steps

    @total_steps.setter
    def total_steps(self, steps: int | None) -> None:
        self.progress.total_steps = steps

    # -------------------------------------------------------------- set-up
    def wrap(self, model: torch.nn.Module, sync_batchnorm: bool = False, comm_hook: Any = None,
             comm_state: Any = None, **ddp_kwargs) -> torch.nn.Module:
        """Move `model` to this worker's device; under a process group, wrap it in DDP.

        DDP takes one communication hook: the runtime's times the gradient all-reduce (each
        rank's wait in it, for stragglers: worker/step_timing.py) and runs `comm_hook` (with
        `comm_state`) inside, where a script would have called `register_comm_hook`."""
        if sync_batchnorm and self.distributed:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device)
        if not self.distributed:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        began = time.perf_counter()  # DDP's first collective: NCCL's communicator is made here
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
        self.phases_s["ddp_s"] = time.perf_counter() - began
        wrapped.register_comm_hook(comm_state, self.clock.hook(comm_hook))
        return wrapped

    def sampler(self, num_samples: int, batch_size: int | None = None, *, seed: int = 0,
                shuffle: bool = True, global_batch_size: int | None = None) -> ResumableSampler:
        """A resumable, sharded data order; without a batch size, the job's global batch."""
        if batch_size is None and global_batch_size is None:
            global_batch_size = self.global_batch_size
            if global_batch_size is None:
                raise ValueError("give batch_size (per rank) or global_batch_size, or set "
                                 "global_batch_size in the job spec (FTRAIN_GLOBAL_BATCH_SIZE)")
        return ResumableSampler(num_samples, batch_size, rank=self.rank, world_size=self.world_size,
                                seed=seed, shuffle=shuffle, global_batch_size=global_batch_size)

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                scheduler: Any = None, sampler: ResumableSampler | None = None,
                **extra: Any) -> int:
        """Register what a snapshot holds and load the latest good one; returns the step.

        `extra` objects need `state_dict()` and `load_state_dict()` (a GradScaler, an EMA).
        An FSDP2 model (`fully_shard`) is snapshotted by every rank's shards instead
        (worker/tiers/sharded.py).
        """
        if sharded.is_sharded(model):
            self._shard_snapshots()
        self._state = {"model": _unwrap(model), "optimizer": optimizer, "scheduler": scheduler,
                       "sampler": sampler, **{f"extra.{k}": v for k, v in extra.items()}}
        # What each node's memory tier holds (verified; its first rank reports it under this
        # attempt); then the control plane decides the restore point (service/decide/restore.py)
        # and rank 0 broadcasts it. The gather is the barrier after which every report is in,
        # and tells ranks whose node lacks the chosen copy which rank sends it.
        if isinstance(self.disk, ShardedDiskTier):
            self.disk.prepare(self._state)
        if isinstance(self.peer, ShardedPeerTier):
            self.peer.objects = self._state
        with self._phase("read_memory_s"):
            mine = self.memory.newest() if self.memory is not None else None
        with self._phase("gather_s"):
            # The node leaders' peer-watch addresses, and each rank's node (its step times are
            # reported by node), travel with the same gather.
            got = self.peer.gather(mine, (self._start_peer_watch() if self.distributed else None, self.node))
            addresses = [address for address, _node in got]
            self.clock.nodes = [node for _address, node in got]
            if self._peer_watch is not None:
                self._peer_watch.join(addresses, self.rank)
        with self._phase("choose_s"):
            chosen = choose(self.link, self.disk, self.peer) if self.is_chief else None
            if self.distributed:
                box = [chosen]
                dist.broadcast_object_list(box, src=0)
                chosen = box[0]
        with self._phase("load_s"):
            self._load(chosen, mine)
        self.peer.close()  # the copies read for the restore: their memory let go
        log.info("rank %d: started and restored in phases (s): %s", self.rank,
                 ", ".join(f"{k[:-2]} {v:.3f}" for k, v in self.phases_s.items()))
        if self.memory is not None and self.memory.writer is not None and optimizer is not None:
            # The copy of a step is whole before the optimizer changes what it copies.
            optimizer.register_step_pre_hook(self.memory.writer.guard)
        if self.at_failure is not None:
            self.at_failure.start(self._state)
        self.control.start()
        if self.memory is not None:
            self.memory.start_reports()
        return self.step

    def _shard_snapshots(self) -> None:
        """An FSDP2 model: every rank saves its own shards to disk (DCP) and to its node's memory
        tier (worker/tiers/sharded_memory.py). The flush at a failure and the step marks, which
        copy a node's one whole replicated state, are not used."""
        if self.disk is not None and not isinstance(self.disk, ShardedDiskTier):
            self.disk = ShardedDiskTier(self.disk)
        if self.memory is None or isinstance(self.memory, ShardedMemoryTier):
            return
        log.info("rank %d: the model is sharded (FSDP2): snapshots are every rank's shards, on disk "
                 "and in its node's memory tier", self.rank)
        if self.at_failure is not None:
            self.at_failure.put_back_sigterm()
            self.at_failure.release()
        self.memory.close()
        self.at_failure = None
        self.marks.stop()
        self.memory = ShardedMemoryTier(self.worker, self.memory.directory, self.memory.every)
        self.memory.open_writer()
        self.peer = ShardedPeerTier(self.worker, self.memory)

    @contextlib.contextmanager
    def _phase(self, name: str):
        began = time.perf_counter()
        yield
        self.phases_s[name] = time.perf_counter() - began

    def _start_peer_watch(self) -> str | None:
        """A node's first worker joins the job's ring of peer connections (worker/peer_watch.py),
        so that a node lost while NCCL holds the survivors is reported at once."""
        if self.local_rank != 0 or not isinstance(self.link, ServiceLink) or not self.node:
            return None
        link, node = self.link, self.node

        def lost(detail: str) -> None:
            try:
                link.report_broken(node, detail)
            finally:  # on a GPU the training thread may be stuck in NCCL for good: speak from here
                if self.device.type == "cuda":
                    self._say_last_words()

        self._peer_watch = PeerWatch(lost)
        try:
            return self._peer_watch.listen()
        except OSError as exc:
            log.info("rank %d: no peer watch (%s); a lost node is found by its lease", self.rank, exc)
            self._peer_watch = None
            return None

    def _load(self, chosen: tuple | None, mine: Found | None) -> None:
        """Every rank loads what rank 0 chose: a memory copy (this node's, or sent by the rank
        that holds it) or a committed snapshot."""
        if chosen is None:
            log.info("rank %d: no committed snapshot; starting at step 0", self.rank)
            return
        tier, step, where = chosen
        start = time.perf_counter()
        if tier == "disk":
            assert self.disk is not None  # rank 0's choice, in this rank's snapshot directory
            state = self.disk.load(Found(step, where))
            rngs = state.get("rng") or []
            rng = rngs[self.rank % len(rngs)] if rngs else None
        else:
            assert self.memory is not None
            state = self.peer.load(Found(step, where))
            # Each rank's own RNG states of that step, kept on its node; failing that, the
            # writer's (the node's first rank) for the node's first rank.
            rng = self.memory.rng_of(step)
            if rng is None and self.local_rank == 0 and mine is not None and mine.step == step:
                rng = state.get("rng")
            if rng is None:
                log.info("rank %d: no RNG state of step %d on this node; keeping this process's own",
                         self.rank, step)
        load_into(self._state, state)
        if rng is not None:
            rng_module.set_rng_state(rng)
        self.step = int(state["step"])
        self.resumed_from, self.resumed_tier = self.step, tier
        if tier == "disk":
            log.info("rank %d: resumed from %s (step %d)", self.rank, self.disk.resolve(where), self.step)
        else:
            log.info("rank %d: resumed from memory (step %d, %s) in %.3f s", self.rank, self.step,
                     self.peer.where_from(step, where, mine), time.perf_counter() - start)

    # -------------------------------------------------------------- the loop
    def step_done(self, loss: float | torch.Tensor | None = None, samples: int | None = None) -> None:
        """Call after each optimizer step: counts it, reports, snapshots, obeys control."""
        flush = self.at_failure
        if flush is not None:
            flush.busy = True
        try:
            self._step_done(loss, samples)
        finally:
            if flush is not None:
                flush.not_busy()

    def _step_done(self, loss: float | torch.Tensor | None, samples: int | None) -> None:
        self.step += 1
        memory, marks = self.memory, self.marks
        if marks.on:  # before any collective: a failure in one finds this step's mark
            assert memory is not None and self.at_failure is not None
            marks.mark(self.step, self.world_size, memory, self._state, self.at_failure.speaks())
        self.progress.samples += samples if samples is not None else (self.global_batch_size or 0)
        if self.is_chief and self.progress.step_done(self.step, loss, self.progress.samples):
            self.control.wake_poll.set()
        # One broadcast a step (rank 0's): the control decision, whether the memory tier
        # copies this step, and whether the step marks stop. Every node copies at the steps
        # rank 0 picks; without the marks each rank takes its RNG states only then.
        if memory is not None and memory.writer is not None:
            memory.writer.poll()  # the copy in flight committed once whole (GPU path)
        action, control_id, copy = self._agree_on_control()
        if copy == COPY:
            self._copy_to_memory()
        elif copy == COPY_SKIPPED:
            self.schedule.missed = self.step
        if action != "none":
            self._obey(action, control_id)
        elif self.snapshot_every and self.step % self.snapshot_every == 0:
            self.snapshot()
        self.clock.own_work_done()

    def log(self, step: int | None = None, **scalars: float | torch.Tensor) -> None:
        """Note scalars of this step (`rt.log(lr=..., grad_norm=...)`); rank 0 reports the
        latest of each with its progress (tensors are read then, not here). `step` is
        accepted for symmetry with other loggers: the runtime's own step is the one reported.
        A `loss` logged here is the reported loss when `step_done` is given none."""
        if self.is_chief:
            self.progress.log(**scalars)

    def _agree_on_control(self) -> tuple[str, int, int]:
        """Rank 0's control decision, and its word on the memory tier's copy and on the step
        marks: every rank gets the same answer."""
        def decide_copy() -> int:
            return self.schedule.decide(self.step, self.memory) if self.memory is not None else COPY_NONE

        action, control_id, copy, marks_off = self.control.agree(decide_copy, self.marks.off, self.clock)
        self.clock.step_ended()
        if self.is_chief:
            self.progress.ranks = self.clock.gathered
        if marks_off and self.marks.on:  # rank 0 found the marks too dear (`CopySchedule.plan_next`)
            self.marks.stop()
        return action, control_id, copy

    def _copy_to_memory(self) -> None:
        """A copy step: every rank keeps its RNG states of this step in its ring; a node's
        first rank starts its copy (skipped if its own previous copy is still in flight)."""
        memory = self.memory
        if memory is None:
            return
        if self.marks.on and self.marks.rng is not None:  # kept with the step's mark
            rng = self.marks.rng
        else:
            rng = memory.take_rng(self.step)
        w = memory.writer
        if w is None:
            return
        if not memory.ready():
            w.skipped += 1
            self.schedule.missed = self.step
            return
        memory.save(self._state, self.step, rng)
        if self.is_chief:  # the interval is rank 0's to pick (`CopySchedule.decide`)
            self.schedule.started()
            self._plan_next_copy()

    def _plan_next_copy(self) -> None:
        """Rank 0: the steps until the next copy (worker/step_timing.py)."""
        assert self.memory is not None
        self.schedule.plan_next(self.step, self.memory, self.marks, self.device.type == "cuda")

    def _obey(self, action: str, control_id: int) -> None:
        self.control.handled = control_id
        log.info("rank %d: %s at step %d (control %d)", self.rank, action, self.step, control_id)
        saved = self.snapshot(control_id=control_id, blocking=True)
        if self.distributed:  # only rank 0 knows whether the save went through
            t = torch.tensor([int(bool(saved))], dtype=torch.int64, device=self.device)
            dist.broadcast(t, src=0)
            saved = bool(t[0])
        if action == "checkpoint_stop":
            self.finish()
            raise Stopped(self.step)
        if not saved:
            # Pausing now would lose the steps since the latest snapshot anyway: keep
            # training; the control plane goes ahead without the ack after its timeout.
            log.error("rank %d: step %d could not be saved for the planned change; training "
                      "goes on until the group is restarted", self.rank, self.step)
            return
        # checkpoint_pause: the agent restarts the group from this snapshot; wait for it. The
        # state is that of a step boundary: a SIGTERM (the restart) ends the worker at once.
        self.control.stop()
        if self.at_failure is not None:
            self.at_failure.not_busy()
        deadline = time.monotonic() + self.pause_timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
        log.error("rank %d: paused at step %d and not restarted within %g s; exiting with %d "
                  "so the group restarts", self.rank, self.step, self.pause_timeout_s, EXIT_PAUSE_TIMEOUT)
        raise SystemExit(EXIT_PAUSE_TIMEOUT)

    def snapshot(self, control_id: int | None = None, blocking: bool = False) -> bool:
        """Snapshot now (every rank must call it at the same step). Rank 0's answer, for a
        blocking save: False if the storage refused the write (the others answer True)."""
        if self.disk is None or self.disk.writer is None:
            if control_id is not None:
                log.warning("no snapshot directory: step %d is not saved", self.step)
            return True
        began = time.perf_counter()
        rng = rng_module.rng_state()
        if self.distributed:
            rngs: list | None = [None] * self.world_size if self.is_chief else None
            dist.gather_object(rng, rngs, dst=0)
        else:
            rngs = [rng]
        if not self.is_chief and not self.disk.every_rank_saves:
            return True
        return self.disk.save(self._state, self.step, rngs, control_id=control_id, blocking=blocking,
                              began=began)

    def _say_last_words(self) -> None:
        """The flush at a failure (worker/failure_flush.py), where this worker has a memory tier."""
        if self.at_failure is not None:
            self.at_failure.say()

    # -------------------------------------------------------------- the end
    def finish(self) -> None:
        """Wait for the save in flight, stop reporting, leave the process group."""
        self._finish(clean=True)

    def _finish(self, clean: bool) -> None:
        if self._finished:
            return
        self._finished = True
        flush, memory = self.at_failure, self.memory
        if flush is not None:
            flush.busy = True  # a SIGTERM now: no last words into a writer being closed
            flush.finished = True
            flush.put_back_sigterm()
        if self._warm is not None:  # done long ago, unless the run was only a few steps
            self._warm.join(5.0)
        saved = False  # the last snapshot committed or handed over, the memory tier flushed
        try:
            if memory is not None:
                memory.stop_reports()
                missed = self.schedule.missed == self.step
                if missed and self._state:
                    # The last step's copy was due and skipped (a copy in flight): the writers copy
                    # it now (`MemoryTier.flush`), so every rank keeps its RNG states of it.
                    memory.keep_rng(self.step, rng_module.rng_state())
                if memory.writer is not None:
                    memory.flush(self._state, self.step, missed)
                if flush is not None:
                    flush.release()
                memory.close()
            if self.disk is not None:
                self.disk.close()  # what the control plane did not take: to the agent
            saved = True
        finally:
            self._end(clean, saved)

    def _end(self, clean: bool, saved: bool) -> None:
        """The end's second half, whatever the first did: reporting stopped, the peers told,
        the process group left."""
        if self.at_failure is not None:
            self.at_failure.release()
        if not self.control.stop() and clean:  # stuck in a call: its final report never went
            self.progress.leave_final()
        if self._peer_watch is not None:  # a goodbye: the peers do not report this as a loss
            self._peer_watch.close()
        if self.distributed and dist.is_initialized():
            if clean:
                _settle_collectives()
            dist.destroy_process_group()
        if clean and saved:  # (and every rank passed the barrier above)
            self.progress.say_finished()
        if self.at_failure is not None and self.at_failure.term_pending:  # a SIGTERM while finishing
            self.at_failure.end_on_sigterm()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and is_broken_peer(exc):  # before `_finish` closes the writer
            self._say_last_words()
        self._finish(clean=exc_type is None)  # no barrier with peers that may be gone


def _settle_collectives() -> None:
    """Let gloo's threads let go of the last collective's tensors before the process ends.

    A gloo work item that held tensors made in Python (`gather_object`'s, at a snapshot)
    is destroyed on gloo's own thread, which takes the GIL to drop them. DDP's reducer
    keeps the process group alive past `destroy_process_group`, and when the script
    returns, its destructor joins gloo's threads while holding the GIL: if that drop is
    still pending, the worker hangs for ever after its last step (seen: one `min == max
    == 2` job in five stayed RUNNING at its last step). A barrier waits without the GIL,
    so the pending drop runs meanwhile; the short sleep gives it the GIL once more.
    """
    dist.barrier()
    time.sleep(0.01)


# How long a rank other than 0 waits for rank 0's store to listen before it connects anyway.
STORE_WAIT_S = 10.0


def wait_for_store(addr: str | None, port: str | None, timeout_s: float) -> bool:
    """Wait until rank 0's TCPStore (MASTER_ADDR:MASTER_PORT) accepts connections; False at
    the timeout (or without an address), and `init_process_group` then tries as it would.

    torch's store client that finds no server yet retries only after a backoff: ~0.5 s of
    every restart, where the ranks start together and rank 0's server is up a few ms after
    the others try (measured on 2 cores: connected 0.58 s after a start 0.1 s ahead of the
    server; 0.11 s with this). A plain connect every 10 ms costs nothing by comparison."""
    if not addr or not port or not port.isdigit():
        return False
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((addr, int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _leave_to_agent(env: Mapping[str, str], link: Link | None, node: str | None):
    """`worker.handoff.leave` for this worker (commits=..., progress=...), or None where no
    node agent can take anything over (the local twin, a plain torchrun)."""
    directory = env.get(FTRAIN_SNAPSHOT_DIR)
    if not isinstance(link, ServiceLink) or not node or not directory:
        return None
    return functools.partial(handoff.leave, directory, node, link.attempt)


def _commit_end(env: Mapping[str, str], link: Link, node: str | None) -> dict[str, Any]:
    """How rank 0's end treats commits the control plane has not taken: waited for
    `FTRAIN_COMMIT_WAIT_S` (default 10 s), then, under a node agent, handed over to it
    (worker/handoff.py)."""
    out: dict[str, Any] = {}
    wait_s = env.get(FTRAIN_COMMIT_WAIT_S)
    if wait_s:
        try:
            out["commit_wait_s"] = max(0.0, float(wait_s))
        except ValueError:
            log.warning("%s=%r is not a number of seconds: ignored", FTRAIN_COMMIT_WAIT_S, wait_s)
    leave = _leave_to_agent(env, link, node)
    if leave is not None:
        assert isinstance(link, ServiceLink)
        out["hand_over"] = lambda items: leave(commits=[link.request_of(*item) for item in items])
    return out


def init(*, backend: str | None = None, timeout_s: float = 60.0, snapshot_dir: str | Path | None = None,
         snapshot_every: int | None = None, snapshot_keep: int | None = None,
         control_poll_s: float = 0.5, progress_every_s: float = 1.0, pause_timeout_s: float = 600.0,
         total_steps: int | None = None, memory_dir: str | Path | None = None,
         memory_every: int | None = None, env: Mapping[str, str] | None = None) -> Runtime:
    """Set up this worker from its environment (see the module docstring); arguments win."""
    env = os.environ if env is None else env
    stacks.register(env)  # a worker exec'd without the fork server (whose workers have it already)
    distributed = "RANK" in env and "WORLD_SIZE" in env
    rank = int(env.get("RANK", 0))
    local_rank = int(env.get("LOCAL_RANK", 0))
    world_size = int(env.get("WORLD_SIZE", 1))
    memory_dir = memory_dir or env.get(FTRAIN_MEMORY_DIR) or None
    memory_every = memory_every if memory_every is not None else _env_int(env, FTRAIN_MEMORY_EVERY)
    memory_on = bool(memory_dir) and memory_every != 0
    # A restarted worker reads its node's memory copy (and verifies it) while CUDA and the
    # process group start, instead of after them (worker/tiers/memory.py).
    prefetch = Prefetch(Path(memory_dir)) if memory_on else None
    phases: dict[str, float] = {}
    began = time.perf_counter()
    use_cuda = torch.cuda.is_available() and backend in (None, "nccl")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    warm = None
    if use_cuda:
        torch.cuda.set_device(device)  # before init_process_group, so NCCL binds the right GPU
        if env.get(FTRAIN_CUDA_WARMUP, "1") != "0":
            warm = threading.Thread(target=_warm_cuda, args=(device,), name="ftrain-cuda-warmup", daemon=True)
            warm.start()
    phases["device_s"] = time.perf_counter() - began
    if distributed and not dist.is_initialized():
        if rank != 0:
            began = time.perf_counter()
            wait_for_store(env.get("MASTER_ADDR"), env.get("MASTER_PORT"), min(timeout_s, STORE_WAIT_S))
            phases["store_wait_s"] = time.perf_counter() - began
        began = time.perf_counter()
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"),
                                timeout=timedelta(seconds=timeout_s))
        phases["process_group_s"] = time.perf_counter() - began

    directory = snapshot_dir or env.get(FTRAIN_SNAPSHOT_DIR) or None
    every = snapshot_every or _env_int(env, FTRAIN_SNAPSHOT_EVERY) or (100 if directory else None)
    keep = snapshot_keep or _env_int(env, FTRAIN_SNAPSHOT_KEEP) or 3
    link: Link | None = None
    job_id = env.get(FTRAIN_JOB_ID)
    if job_id:
        missing = [n for n in (FTRAIN_SERVER, FTRAIN_JOB_TOKEN) if not env.get(n)]
        if missing:
            raise RuntimeError(f"{FTRAIN_JOB_ID} is set but {', '.join(missing)} is not: this worker "
                               "cannot reach its control plane (is it started by an ftrain node?)")
        link = ServiceLink(env[FTRAIN_SERVER], job_id, env[FTRAIN_JOB_TOKEN],
                           _env_int(env, FTRAIN_ATTEMPT) or 0, group=env.get(FTRAIN_GROUP))
    elif directory:
        link = LocalLink(directory, keep)
    worker = Worker(rank=rank, local_rank=local_rank, world_size=world_size, distributed=distributed,
                    device=device, link=link, node=env.get(FTRAIN_NODE) or None,
                    attempt=_env_int(env, FTRAIN_ATTEMPT) or 0)
    memory = MemoryTier(worker, Path(memory_dir), memory_every, prefetch) if memory_on else None
    writer = None
    if directory and link is not None:
        writer = snap.AsyncWriter(directory, link.commit, keep=keep, **_commit_end(env, link, worker.node))
    disk = DiskTier(worker, Path(directory) if directory else None, writer) if link is not None else None
    progress = Progress(worker, total_steps, leave=_leave_to_agent(env, link, worker.node))
    rt = Runtime(worker, snapshot_every=every if directory else None,
                 global_batch_size=_env_int(env, FTRAIN_GLOBAL_BATCH_SIZE), pause_timeout_s=pause_timeout_s,
                 disk=disk, memory=memory, progress=progress,
                 control=ControlChannel(worker, progress, control_poll_s, progress_every_s),
                 last_words=env.get(FTRAIN_LAST_WORDS, "1") != "0")
    rt.phases_s = phases
    rt._warm = warm
    if memory is not None and local_rank == 0:
        memory.open_writer()
        assert rt.at_failure is not None
        rt.at_failure.claim_writer()
    if distributed and isinstance(link, ServiceLink) and worker.node:
        _report_broken_peers(link, worker.node, rt)
    log.info("rank %d/%d on %s; job %s; snapshots %s every %s steps", rank, world_size, device,
             job_id or "(local twin)", directory or "off", rt.snapshot_every)
    return rt
