"""The training-side runtime: the boilerplate of a fault-tolerant DDP script, done once.

    from worker import runtime

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

import ctypes
import functools
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from worker import handoff
from worker import memory as mem
from worker import snapshot as snap
from worker.data import ResumableSampler
from worker.env import (
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
from worker.last_words import Boundary, GpuMark, gpu_settled_step, last_words_step
from worker.links import (  # noqa: F401 - CommittedSnapshot, Fenced: for `runtime.` users
    CommittedSnapshot,
    ControlRequest,
    Fenced,
    Link,
    LinkError,
    LocalLink,
    ServiceLink,
    report_broken_peer,
)
from worker.memory_dirs import hold_last_words, start_speaking, stop_speaking, take_writer
from worker.peer_watch import PeerWatch
from worker.protocol import MAX_METRICS, METRIC_NAME, PEER_GONE

log = logging.getLogger("ftrain.runtime")

SNAPSHOT_FORMAT = 1
# The memory tier's share of a step that its copies may cost, when it picks its own
# interval (FTRAIN_MEMORY_EVERY unset), and the longest interval it picks.
MEMORY_BUDGET = 0.05
MEMORY_EVERY_MAX = 50
# The share of MEMORY_BUDGET the picked interval aims at: a copy's cost varies from copy to
# copy (its commit 0.6-1.1 ms for the same 10M model on an H100 host) and the interval is
# picked from an average of the last few, so an interval aimed at the whole budget went over it
# about half the time (5.7%, 5.7%, 6.4% by means in three runs).
MEMORY_AIM = 0.8
COPY_COSTS_KEPT = 16  # the copies whose cost to the steps beside them the interval is picked from
# How often the memory tier makes its StatePlan (worker/memory.py) before it keeps to the full
# state_dict() path: a plan found stale each time (a state_dict hook that makes new tensors)
# would otherwise never commit a copy.
MEMORY_PLAN_REMAKES = 4
EXIT_PAUSE_TIMEOUT = 75  # EX_TEMPFAIL: nobody restarted a paused group; torchrun restarts it

_ACTIONS = {"none": 0, "checkpoint_pause": 1, "checkpoint_stop": 2}
_ACTION_NAMES = {v: k for k, v in _ACTIONS.items()}
# Rank 0's word on the memory tier, broadcast with the control decision each step.
_COPY_NONE, _COPY, _COPY_SKIPPED = 0, 1, 2


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


class _HostRng:
    """The Python and numpy global RNGs' states, taken every step boundary (`_mark_boundary`)
    at little cost: the object last taken is given again while the state is the same, so that
    the RNG ring can reuse its pickle (`mem.RngKeeper`). numpy's `get_state` alone cost 74 us
    on an H100 host (its MT19937 key copied number by number); its raw state is read instead
    (2.5 KB), and `get_state` called only when that moved. Exact: the legacy generator's
    cached Gaussian can only appear through a draw, which moves the raw state, so a state
    taken with no cached Gaussian stays the state while the raw one does not move."""

    def __init__(self):
        self.python: tuple | None = None
        self.numpy: tuple | None = None
        self._raw = b""
        self._probe: tuple[Any, int] | None = None  # (bit generator, address of its raw state)
        try:
            import numpy as np

            self._np = np
        except ImportError:
            self._np = None

    def python_state(self) -> tuple:
        state = random.getstate()
        if state != self.python:
            self.python = state
        return self.python

    def numpy_state(self) -> tuple | None:
        np = self._np
        if np is None:
            return None
        try:
            bg = np.random.mtrand._rand._bit_generator
            if self._probe is None or self._probe[0] is not bg:
                self._probe = (bg, bg.ctypes.state_address if type(bg).__name__ == "MT19937" else 0)
            address = self._probe[1]
        except AttributeError:  # another numpy: no probe
            address = 0
        if not address:
            return np.random.get_state()
        raw = ctypes.string_at(address, _MT19937_BYTES)
        if raw != self._raw or self.numpy is None or self.numpy[3]:  # moved, or a Gaussian cached
            self.numpy, self._raw = np.random.get_state(), raw
        return self.numpy


_MT19937_BYTES = 624 * 4 + 4  # numpy's mt19937_state: the key, then its position
_HOST_RNG = _HostRng()


def _rng_state() -> dict:
    state: dict[str, Any] = {"python": _HOST_RNG.python_state(), "torch": torch.get_rng_state()}
    numpy_state = _HOST_RNG.numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    if torch.cuda.is_initialized():  # what get_rng_state_all gives, without its per-device checks
        state["cuda"] = [g.get_state() for g in torch.cuda.default_generators]
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_broken_peer(exc: BaseException) -> bool:
    """Whether an error that ends a worker says its process group lost a peer."""
    if isinstance(exc, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in PEER_GONE)


# What a worker whose group broke gives its memory tier's copy in flight before it exits.
SETTLE_S = 1.0
# What it gives, all in all, to that and to its last-words copy (`Runtime._last_words`): a
# state that cannot be copied within it leaves the tier's older copy.
LAST_WORDS_S = 2.0
# Buffers (BatchNorm's statistics: a forward changes them) of at most this many bytes in all
# are copied aside at each step's end, so that last words said after the next forward still
# hold the step's own (`Runtime._mark_boundary`); larger ones are not, and a forward since the
# boundary then means no last words.
KEEP_BUFFERS_BYTES = 1 << 20
# On a GPU: the step boundaries and optimizer steps whose CUDA events are kept (the host is at
# most a step ahead of the GPU: `step_done` reads rank 0's broadcast every step), and how long
# a survivor's last words wait for a stream caught in an optimizer step to reach the next
# boundary (or the collective it then waits in for good).
GPU_RING = 4
GPU_SETTLE_S = 0.25
# With the copy interval picked by the runtime (no FTRAIN_MEMORY_EVERY), a GPU job's step marks
# stay on while they cost at most this share of MEMORY_BUDGET of the step (measured over the
# first MARKS_PROBE_STEPS steps at least): on shorter steps, a lost step costs less than the
# marks would over a few hundred steps, and the copies keep the whole budget.
MARKS_SHARE = 0.8
MARKS_PROBE_STEPS = 20


class _EventPool:
    """CUDA events used in turn (a new one each time cost ~80 us a step on an H100 host in a
    busy loop, its creation and an old one's destruction): more than the runtime keeps
    (GPU_RING boundaries with two each, GPU_RING optimizer steps), so that none is recorded
    again while it is still looked at."""

    def __init__(self, size: int):
        self._events: list[torch.cuda.Event] = []
        self._size = size
        self._next = 0
        self._stream: tuple | None = None  # (the current stream's ids, its Stream)

    def _current(self) -> torch.cuda.Stream | None:
        """The current stream, as a `Stream` made again only when it changed (`record()`
        without one looked it up in Python: 40 us a call on a busy H100 host, 3 us with it)."""
        try:
            ids = torch._C._cuda_getCurrentStream(torch.cuda.current_device())
        except (AttributeError, RuntimeError, TypeError):
            return None
        if self._stream is None or self._stream[0] != ids:
            self._stream = (ids, torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2]))
        return self._stream[1]

    def record(self) -> torch.cuda.Event:
        """An event recorded on the current stream now."""
        if len(self._events) < self._size:
            self._events.append(torch.cuda.Event())
        event = self._events[self._next % len(self._events)]
        self._next += 1
        event.record(self._current())
        return event


def _report_broken_peers(link: Link, node: str, rt: Runtime | None = None) -> None:
    """When the worker dies of a broken peer, tell the control plane first (service/presence.py:
    a member whose agent's connection dropped as well is lost at once, not after the longer
    bound a network blip gets); meanwhile settle the memory tier's copy in flight and say the
    last words (`Runtime._last_words`), at most LAST_WORDS_S in all. Then the previous hook
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
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
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


class _Prefetch:
    """`mem.read_copy(directory)` in a thread of its own, started before CUDA and the process
    group (a restarted worker's copy read and verified meanwhile, not after them)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._got: tuple | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="ftrain-memory-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._got = mem.read_copy(self.directory)
        except BaseException as exc:  # noqa: BLE001 - raised where the restore reads it
            self._error = exc

    def result(self) -> tuple | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._got


@dataclass
class Runtime:
    """One worker's view of the job; made by `init`. See the module docstring."""

    rank: int
    local_rank: int
    world_size: int
    distributed: bool
    device: torch.device
    link: Link | None
    snapshot_dir: Path | None
    snapshot_every: int | None
    global_batch_size: int | None = None
    control_poll_s: float = 0.5
    progress_every_s: float = 1.0
    pause_timeout_s: float = 600.0
    total_steps: int | None = None  # the steps the script means to make: percent and ETA
    memory_dir: Path | None = None  # the node's memory tier (worker/memory.py)
    memory_every: int | None = None  # steps between copies; None: picked to fit MEMORY_BUDGET
    memory_interval: int = 1  # the interval in use (memory_every, or the one picked)
    _memory_next: int = 0  # the step of the next copy
    _memory_missed: int = -1  # the last step whose due copy was skipped (a copy in flight)
    _rng_s: float = 0.0  # the last copy step's RNG capture (taken on copy steps only, on a GPU)
    # On CPU, every rank keeps its RNG states of every step (`_mark_boundary`) and notes each
    # step boundary, for a last-words copy (worker/last_words.py): the node's writer's, or a
    # sibling's once the writer is gone.
    _every_step: bool = False
    last_words: bool = True  # FTRAIN_LAST_WORDS=0: no last words, no per-step marks
    _optimizer_steps: int = 0  # optimizer steps begun (a step pre-hook counts them)
    _boundary: Boundary | None = None
    _boundary_plan: Any = None  # the StatePlan whose tensors `_boundary.skeleton` refers to
    _boundary_rng: dict | None = None  # this rank's RNG states at the last step boundary
    _watched: list = field(default_factory=list)  # the plan's tensors an optimizer step leaves alone
    _watched_plan: Any = None  # the plan `_watched` was taken from
    _kept: list | None = None  # copies of `_watched` as at the last boundary (small buffers only)
    # On a GPU: the last boundaries with their CUDA events (Boundary, plan, begun, done) and
    # the last optimizer steps' (count, event), oldest first (`_gpu_state_step`)
    _gpu_marks: list = field(default_factory=list)
    _gpu_steps: list = field(default_factory=list)
    _gpu_events: _EventPool = field(default_factory=lambda: _EventPool(4 * GPU_RING))
    # On a GPU: the plan's tensors in host memory (an optimizer's step counts), copied at each
    # boundary into a ring of copies (`_host_copies`): the host changes them as soon as it runs
    # the next optimizer step, long before the GPU does.
    _host_plan: Any = None
    _host_tensors: list = field(default_factory=list)
    _host_ring: list | None = None
    _host_next: int = 0
    _words_lock: threading.Lock = field(default_factory=threading.Lock)  # one speaker at a time
    _speaker: int | None = None  # the thread saying the last words now
    boundary_s: list[float] = field(default_factory=list)  # per step: `_mark_boundary`'s time (bench)
    _mark_s: float | None = None  # `_mark_boundary`'s time (moving average): taken from the copies' budget
    _marks_off: bool = False  # on a GPU, rank 0 found the marks too dear for the steps (`_plan_next_copy`)
    _busy: bool = False  # in `step_done` or `_finish`: a SIGTERM's last words wait for its end
    _saying: bool = False  # saying the last words now
    _term_pending: bool = False  # a SIGTERM came while busy
    _sigterm_before: Any = None  # the SIGTERM handler `_on_sigterm` replaced (put back at the end)
    _sigterm_watch: bool = False  # on a GPU, a thread hears SIGTERM through the wakeup fd (`_watch_sigterm`)
    _last_words_lock: int | None = None  # fd of the tier's last-words lock (worker/memory_dirs.py)
    _prefetch: _Prefetch | None = None  # this node's memory copy, read while the worker starts
    phases_s: dict[str, float] = field(default_factory=dict)  # start-up and restore, timed (logged)
    _warm: threading.Thread | None = None  # `_warm_cuda`, while the process group and DDP start
    _step_s: float | None = None  # the step period (moving average), for the picked interval
    _quiet_s: float | None = None  # the same over the steps with no copy at work (`_time_step`)
    _copy_work: float | None = None  # the copy at work's cost so far (None: no copy at work)
    _copy_ending: bool = False  # the copy at work was committed: its last step is being timed
    # what the last COPY_COSTS_KEPT copies cost the steps beside them (`_copy_cost_s`: their mean)
    _copy_costs: list[float] = field(default_factory=list)
    _told_interval: tuple[int, float] | None = None  # the interval the log last heard of, when
    _last_step_t: float | None = None
    attempt: int = 0
    step: int = 0
    resumed_from: int | None = None
    resumed_tier: str | None = None  # "memory" or "disk", once restored from a snapshot
    _memory: mem.MemoryWriter | None = None  # the node's first rank writes the memory tier
    _peer_watch: PeerWatch | None = None  # the node leader's part of the job's ring (worker/peer_watch.py)
    _memory_plan: mem.StatePlan | None = None  # its state split once (worker/memory.StatePlan)
    _memory_plans: int = 0  # plans made so far (at most MEMORY_PLAN_REMAKES)
    node: str | None = None  # FTRAIN_NODE: the name its memory tier is reported under
    memory_report_s: float = 1.0
    _rng_keeper: mem.RngKeeper | None = None  # each rank's RNG states beside the node's memory tier
    _reporter: threading.Thread | None = None
    _stop_report: threading.Event = field(default_factory=threading.Event)
    stalls_s: list[float] = field(default_factory=list)  # per snapshot: the training loop's stall
    waits_s: list[float] = field(default_factory=list)  # of which: waiting for the previous save
    _state: dict[str, Any] = field(default_factory=dict)
    _writer: snap.AsyncWriter | None = None
    _leave: Callable[..., Any] | None = None  # what the node agent takes over (worker/handoff.py)
    _staging: snap.HostStaging = field(default_factory=snap.HostStaging)
    _poller: threading.Thread | None = None
    _stop_poll: threading.Event = field(default_factory=threading.Event)
    # Wakes the poller: to stop, or to report the run's first step at once (the control plane
    # records a recovery's end, "training again", at the new group's first report).
    _wake_poll: threading.Event = field(default_factory=threading.Event)
    _control: ControlRequest = field(default_factory=ControlRequest)
    _handled_control: int = 0
    _progress: tuple | None = None
    _samples: int = 0
    _scalars: dict[str, Any] = field(default_factory=dict)  # rt.log's latest, reported by the poller
    _refused: set[str] = field(default_factory=set)  # scalars warned about (not reported)
    _finished: bool = False

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    # -------------------------------------------------------------- set-up
    def wrap(self, model: torch.nn.Module, sync_batchnorm: bool = False, **ddp_kwargs) -> torch.nn.Module:
        """Move `model` to this worker's device; under a process group, wrap it in DDP."""
        if sync_batchnorm and self.distributed:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(self.device)
        if not self.distributed:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        began = time.perf_counter()  # DDP's first collective: NCCL's communicator is made here
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
        self.phases_s["ddp_s"] = time.perf_counter() - began
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
        """
        self._state = {"model": _unwrap(model), "optimizer": optimizer, "scheduler": scheduler,
                       "sampler": sampler, **{f"extra.{k}": v for k, v in extra.items()}}
        # What each node's memory tier holds (verified; its first rank reports it under this
        # attempt); then the control plane decides the restore point (service/decide/restore.py)
        # and rank 0 broadcasts it. The gather is the barrier after which every report is in,
        # and tells ranks whose node lacks the chosen copy which rank sends it.
        began = time.perf_counter()
        copy, held = self._read_memory()
        self.phases_s["read_memory_s"] = time.perf_counter() - began
        began = time.perf_counter()
        helds = [held]
        if self.distributed:
            # The node leaders' peer-watch addresses travel with the same gather.
            address = self._start_peer_watch()
            got: list = [None] * self.world_size
            dist.all_gather_object(got, (held, address))
            helds = [g[0] for g in got]
            if self._peer_watch is not None:
                self._peer_watch.join([g[1] for g in got], self.rank)
        self.phases_s["gather_s"] = time.perf_counter() - began
        began = time.perf_counter()
        chosen = self._choose(helds) if self.is_chief else None
        if self.distributed:
            box = [chosen]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
        self.phases_s["choose_s"] = time.perf_counter() - began
        began = time.perf_counter()
        if chosen is None:
            log.info("rank %d: no committed snapshot; starting at step 0", self.rank)
        elif chosen[0] == "memory":
            self._load_memory(chosen[1], chosen[2], helds, copy)
        else:
            self._load(chosen[1])
        self.phases_s["load_s"] = time.perf_counter() - began
        log.info("rank %d: started and restored in phases (s): %s", self.rank,
                 ", ".join(f"{k[:-2]} {v:.3f}" for k, v in self.phases_s.items()))
        if self._memory is not None and optimizer is not None:
            # The copy of a step is whole before the optimizer changes what it copies.
            optimizer.register_step_pre_hook(self._memory.guard)
        self._start_boundaries()
        self._start_poller()
        self._start_memory_reports()
        return self.step

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

    def _start_memory_reports(self) -> None:
        """The node's first rank tells the control plane what its memory tier holds, about
        once a second, so that the snapshot list shows both tiers."""
        if self._memory is None or not isinstance(self.link, ServiceLink) or not self.node \
                or self._reporter is not None:
            return
        self._reporter = threading.Thread(target=self._report_memory, name="ftrain-memory-report",
                                          daemon=True)
        self._reporter.start()

    def _report_memory(self) -> None:
        assert self._memory is not None and self.link is not None and self.node is not None
        reported = None
        while not self._stop_report.wait(self.memory_report_s):
            held = self._memory.held
            if held is None or held.step == reported:
                continue
            try:
                self.link.report_memory(self.node, held.step)
                reported = held.step
            except LinkError as exc:
                if exc.status == 409:  # a stale attempt, or the job ended: nothing more to say
                    log.info("memory tier reports stop: %s", exc)
                    return
                log.debug("memory tier report failed: %s", exc)

    def _read_copy(self) -> tuple | None:
        """`mem.read_copy` of this node's tier: the one `init` started reading, if it did."""
        assert self.memory_dir is not None
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None and prefetch.directory == self.memory_dir:
            return prefetch.result()
        return mem.read_copy(self.memory_dir)

    def _read_memory(self) -> tuple[tuple | None, int]:
        """This node's memory copy (verified) and its step (-1: none). A corrupt one counts as
        none, so the restore falls back to a peer's copy or disk, and the job's events say so."""
        if self.memory_dir is None:
            return None, -1
        try:
            copy = self._read_copy()
        except mem.CopyCorrupt as exc:
            log.warning("rank %d: %s; falling back to the next source (a peer's copy, then disk)",
                        self.rank, exc)
            if self.local_rank == 0 and self.link is not None:
                try:
                    self.link.report_memory_corrupt(self.node or "local", exc.step, exc.reason)
                except LinkError as err:
                    log.warning("rank %d: could not report the corrupt memory copy: %s", self.rank, err)
            return None, -1
        if copy is None:
            return None, -1
        held = int(copy[0]["step"])
        if self.local_rank == 0 and self.node and isinstance(self.link, ServiceLink):
            try:
                self.link.report_memory_held(self.node, held)
            except LinkError as exc:
                log.warning("rank %d: could not report this node's memory copy (step %d): %s; the "
                            "restore point will not count it", self.rank, held, exc)
        return copy, held

    def _choose(self, helds: list[int]) -> tuple | None:
        """Rank 0: ("memory", step, source rank) when the control plane's restore point is a
        memory copy some rank holds, else ("disk", path) or None."""
        self._await_handed_over()
        newest = max(helds)
        if newest >= 0 and self.link is None:
            return ("memory", newest, helds.index(newest))
        if newest >= 0 and self.link is not None:
            point = self.link.restore_point(newest)
            log.info("restore point: %s", point.reason)
            if point.tier == "memory" and point.step in helds:
                return ("memory", point.step, helds.index(point.step))
            if point.tier == "memory":
                log.warning("restore point: step %s is held by no rank of this group; trying disk",
                            point.step)
        path = self._choose_snapshot()
        return None if path is None else ("disk", path)

    def _await_handed_over(self) -> None:
        """Rank 0, before it asks for the restore point: the commits that an earlier group of
        this attempt (torchrun restarted it) left its node agent are made first
        (worker/handoff.py `wait_pending`), or the restore could pick an older snapshot."""
        if self.snapshot_dir is None or not isinstance(self.link, ServiceLink):
            return
        if not handoff.pending(self.snapshot_dir, self.link.attempt):
            return
        log.info("rank %d: waiting for the snapshot commits an earlier group of attempt %d left "
                 "its node agent before choosing where to resume", self.rank, self.link.attempt)
        if not handoff.wait_pending(self.snapshot_dir, self.link.attempt):
            log.warning("rank %d: the snapshot commits an earlier group left its node agent were not "
                        "made within %.0f s; resuming from the latest the control plane lists",
                        self.rank, handoff.PENDING_WAIT_S)

    def _load_memory(self, step: int, src: int, helds: list[int], copy: tuple | None) -> None:
        """Load the memory copy of `step`: from this node's tier where it holds that step,
        else sent by rank `src` (one broadcast of the packed bytes)."""
        start = time.perf_counter()
        sent = False
        if any(h != step for h in helds):  # some rank lacks it: `src` sends its copy to all
            sent = True
            box = [(copy[0], copy[2], copy[1].numel()) if self.rank == src and copy is not None else None]
            dist.broadcast_object_list(box, src=src)
            skeleton, packing, size = box[0]
            flat = copy[1] if self.rank == src else torch.empty(size, dtype=torch.uint8)
            wire = flat.to(self.device) if self.device.type == "cuda" else flat
            dist.broadcast(wire, src=src)
            if helds[self.rank] != step:
                copy = (skeleton, wire.cpu() if wire is not flat else flat, packing)
        assert copy is not None and copy[0]["step"] == step
        state = mem.unpack(*copy)
        for name, obj in self._state.items():
            if obj is not None and state.get(name) is not None:
                obj.load_state_dict(state[name])
        # Each rank's own RNG states of that step, kept on its node (`_save_rng`); failing
        # that, the writer's (the node's first rank) for the node's first rank.
        rng = mem.load_rng(self.memory_dir, self.rank, step, self.rng_ring) if self.memory_dir else None
        if rng is None and self.local_rank == 0 and helds[self.rank] == step:
            rng = state.get("rng")
        if rng is not None:
            _set_rng_state(rng)
        else:
            log.info("rank %d: no RNG state of step %d on this node; keeping this process's own",
                     self.rank, step)
        self.step = int(state["step"])
        self.resumed_from, self.resumed_tier = self.step, "memory"
        log.info("rank %d: resumed from memory (step %d, %s) in %.3f s", self.rank, self.step,
                 f"sent by rank {src}" if sent and helds[self.rank] != step else "this node's copy",
                 time.perf_counter() - start)

    def _choose_snapshot(self) -> str | None:
        """Rank 0: the newest committed snapshot that passes its checksum (reporting others)."""
        if self.link is None:
            return None
        if self.snapshot_dir is not None:
            snap.cleanup_temporaries(self.snapshot_dir)
        items, latest = self.link.snapshots()
        if latest is None:
            return None
        for item in sorted(items, key=lambda i: i.step, reverse=True):
            if item.bad or item.step > latest:
                continue
            path = self._resolve(item.path)
            try:
                snap.verify(path, item.checksum, item.size)
                return str(path)
            except snap.SnapshotCorrupt as exc:
                log.warning("snapshot at step %d is corrupt, trying the one before: %s", item.step, exc)
                self.link.report_corrupt(item.step, str(exc))
        return None

    def _resolve(self, path: str) -> Path:
        """A committed file in this node's view of the job's snapshot directory: the committed
        path where it is in that directory, else the same file name there (the directory of
        another node, or a forged commit's `/tmp/evil.pt`: every rank loads the file, so a file
        elsewhere is never opened). Without a directory (the local twin): its own commits."""
        p = Path(path)
        if self.snapshot_dir is None or snap.in_directory(p, self.snapshot_dir):
            return p
        return self.snapshot_dir / p.name

    def _load(self, path: str) -> None:
        path = str(self._resolve(path))  # rank 0's choice, in this rank's snapshot directory
        state = snap.load(path)
        for name, obj in self._state.items():
            if obj is not None and state.get(name) is not None:
                obj.load_state_dict(state[name])
        rngs = state.get("rng") or []
        if rngs:
            _set_rng_state(rngs[self.rank % len(rngs)])
        self.step = int(state["step"])
        self.resumed_from, self.resumed_tier = self.step, "disk"
        log.info("rank %d: resumed from %s (step %d)", self.rank, path, self.step)

    # -------------------------------------------------------------- the loop
    def step_done(self, loss: float | torch.Tensor | None = None, samples: int | None = None) -> None:
        """Call after each optimizer step: counts it, reports, snapshots, obeys control."""
        self._busy = True
        try:
            self._step_done(loss, samples)
        finally:
            self._busy = False
            if self._term_pending:
                self._end_on_sigterm()

    def _step_done(self, loss: float | torch.Tensor | None, samples: int | None) -> None:
        self.step += 1
        if self._every_step:  # before any collective: a failure in one finds this step's mark
            self._mark_boundary()
        self._samples += samples if samples is not None else (self.global_batch_size or 0)
        if self.is_chief:
            if isinstance(loss, torch.Tensor):
                loss = loss.detach()
            first = self._progress is None
            self._progress = (self.step, loss, self._samples, time.monotonic())
            if first:
                self._wake_poll.set()
        # One broadcast a step (rank 0's): the control decision, whether the memory tier
        # copies this step, and whether the step marks stop. Every node copies at the steps
        # rank 0 picks; without the marks each rank takes its RNG states only then.
        if self._memory is not None:
            self._memory.poll()  # the copy in flight committed once whole (GPU path)
        action, control_id, copy = self._agree_on_control()
        if copy == _COPY:
            self._keep_rng_and_copy()
        elif copy == _COPY_SKIPPED:
            self._memory_missed = self.step
        if action != "none":
            self._obey(action, control_id)
        elif self.snapshot_every and self.step % self.snapshot_every == 0:
            self.snapshot()

    def log(self, step: int | None = None, **scalars: float | torch.Tensor) -> None:
        """Note scalars of this step (`rt.log(lr=..., grad_norm=...)`); rank 0 reports the
        latest of each with its progress (tensors are read then, not here). `step` is
        accepted for symmetry with other loggers: the runtime's own step is the one reported.
        A `loss` logged here is the reported loss when `step_done` is given none."""
        if not self.is_chief:
            return
        for name, value in scalars.items():
            self._scalars[name] = value.detach() if isinstance(value, torch.Tensor) else value

    @property
    def rng_ring(self) -> int:
        """How many steps of RNG states each rank keeps: enough to outlast two copies."""
        return 2 * max(self.memory_every or 0, MEMORY_EVERY_MAX) + 2

    def _settle_memory(self, timeout_s: float) -> None:
        """The memory tier's copy in flight made whole, and this rank's RNG states written, in
        at most `timeout_s` (a worker about to exit at once: a copy of the step before the
        fault is consistent, since the optimizer waits for the copy before it changes the
        state, and it is the newest step this node holds)."""
        deadline = time.monotonic() + timeout_s
        if self._memory is not None:
            self._memory.settle(timeout_s)
        if self._rng_keeper is not None:
            self._rng_keeper.flush(max(0.0, deadline - time.monotonic()))

    def _save_rng(self, rng: dict) -> None:
        """Write this step's RNG states into the rank's ring (worker/memory.RngKeeper)."""
        assert self.memory_dir is not None
        if self._rng_keeper is None:
            self._rng_keeper = mem.RngKeeper(self.memory_dir, self.rank, self.rng_ring)
        self._rng_keeper.keep(self.step, rng)

    def _time_step(self, now: float | None = None) -> None:
        """The step period (moving average), and what a copy costs the steps it runs beside:
        the steps from its start to the one after its commit, each less the period of the
        steps with no copy at work. (The training thread's own time in a copy, which the
        interval was picked from alone, was about half of what the copies cost the step time
        on an H100 host: the commit's Python, the GPU's staging copy beside the step's
        kernels, the host's other threads.)"""
        now = time.perf_counter() if now is None else now
        if self._last_step_t is not None:
            took = now - self._last_step_t
            self._step_s = took if self._step_s is None else 0.8 * self._step_s + 0.2 * took
            if self._copy_work is None:
                self._quiet_s = took if self._quiet_s is None else 0.8 * self._quiet_s + 0.2 * took
            else:
                if self._quiet_s is not None:
                    self._copy_work += took - self._quiet_s
                w = self._memory
                if self._copy_ending:  # the step after the copy's commit: its cost is all in
                    if self._quiet_s is not None:
                        # Each copy's own figure is its steps' noise as much as its cost (one
                        # 10M copy on an H100 read -2 to +4.6 ms): the mean of the last few.
                        self._copy_costs.append(max(0.0, self._copy_work))
                        del self._copy_costs[:-COPY_COSTS_KEPT]
                    self._copy_work, self._copy_ending = None, False
                elif w is None or not w.busy():
                    self._copy_ending = True
        self._last_step_t = now

    @property
    def _copy_cost_s(self) -> float | None:
        """What a copy costs the steps beside it: the mean over the last copies (None: none yet)."""
        return sum(self._copy_costs) / len(self._copy_costs) if self._copy_costs else None

    def _copy_decision(self) -> int:
        """Rank 0: does the memory tier copy this step (_COPY), was the copy due but skipped
        because rank 0's previous copy is still in flight (_COPY_SKIPPED), or neither. Rank 0
        follows its own writer's cost (`_plan_next_copy`); every node copies when it says so."""
        if self.memory_dir is None:
            return _COPY_NONE
        if self._memory is None:  # no writer here (its node's tier is elsewhere): a fixed interval
            return _COPY if self.step % (self.memory_every or 1) == 0 else _COPY_NONE
        self._time_step()
        due = self.step % self.memory_every == 0 if self.memory_every else self.step >= self._memory_next
        if not due:
            return _COPY_NONE
        if self._memory.busy():  # the GPU's previous copy is in flight: skipped (see finish)
            self._memory.skipped += 1
            return _COPY_SKIPPED
        return _COPY

    def _keep_rng_and_copy(self) -> None:
        """A copy step: every rank keeps its RNG states of this step in its ring; a node's
        first rank starts its copy (skipped if its own previous copy is still in flight)."""
        if self.memory_dir is None:
            return
        if self._every_step and self._boundary_rng is not None:  # kept with the step's mark
            rng = self._boundary_rng
        else:
            start = time.perf_counter()
            rng = _rng_state()
            self._save_rng(rng)
            self._rng_s = time.perf_counter() - start
        w = self._memory
        if w is None:
            return
        if w.busy():
            w.skipped += 1
            self._memory_missed = self.step
            return
        self._copy_to_memory(rng)
        if self.is_chief:  # the interval is rank 0's to pick (`_copy_decision`)
            if self._copy_work is None:
                self._copy_work, self._copy_ending = 0.0, False
            self._plan_next_copy()

    def _flush_memory(self) -> None:
        """At the end: the copy in flight whole; the last step's copy if it was due and skipped
        (a copy was in flight), so the tier holds the state the job ended with; the writer's
        buffers freed."""
        w = self._memory
        assert w is not None
        try:
            w.wait()
            if self._memory_missed == self.step and not w.disabled and self._state:
                self._copy_to_memory()
                w.wait()
        except Exception as exc:  # noqa: BLE001 - the end of the job must not fail for it
            log.warning("memory tier: the last copy failed (%s); the disk tier still holds", exc)
        finally:
            w.close()

    def _plan_next_copy(self) -> None:
        """Without a fixed interval: copy again after as many steps as keep the copies'
        cost within MEMORY_BUDGET of the step time, less what the step boundaries' marks cost
        every step (`_mark_boundary`, for last words: with them a fault loses at most a step
        whatever the interval, so the copies get what the marks leave, down to one every
        MEMORY_EVERY_MAX steps). The cost is the training thread's time in the copy, plus on a
        CPU the copy thread's whole time (it takes a core); on a GPU the copy runs on the copy
        engine, and a copy still in flight skips the next (`_copy_decision`)."""
        if self.memory_every:
            self.memory_interval = self.memory_every
            return
        w = self._memory
        assert w is not None
        marks_room = MARKS_SHARE * MEMORY_BUDGET * (self._step_s or 0.0)
        if self._every_step and self.device.type == "cuda" and self._step_s and self._mark_s \
                and self.step >= MARKS_PROBE_STEPS and self._mark_s > marks_room:
            # Steps too short for the marks: every rank stops them at this step's broadcast.
            self._marks_off = True
            log.info("memory tier: no step marks (last words) from step %d: they cost %.2f ms of a "
                     "%.2f ms step, more than %.1f%%; a fault costs up to the copy interval",
                     self.step, self._mark_s * 1e3, self._step_s * 1e3, MARKS_SHARE * MEMORY_BUDGET * 100)
        cost = w.last_cost_s() + self._rng_s  # every rank's RNG capture comes with a copy
        if self._copy_cost_s is not None:  # what the copies cost the steps beside them
            cost = max(cost, self._copy_cost_s)
        k = 1
        if self._step_s:
            marks = (self._mark_s or 0.0) if self._every_step and not self._marks_off else 0.0
            # Of the steps with no copy at work where known: the budget is a share of the step
            # the job would take without the tier.
            room = MEMORY_AIM * MEMORY_BUDGET * (self._quiet_s or self._step_s) - marks
            if room <= 0:
                k = MEMORY_EVERY_MAX
            elif cost > room:
                k = min(MEMORY_EVERY_MAX, math.ceil(cost / room))
        # The job's log hears of the interval when it is first picked, then at most once a
        # minute if it moved; the step-to-step wobble (it was a third of a job's log) goes to
        # debug.
        now = time.monotonic()
        told = self._told_interval
        if k != self.memory_interval or told is None:
            loud = told is None or (k != told[0] and now - told[1] >= 60.0)
            log.log(logging.INFO if loud else logging.DEBUG,
                    "memory tier: a copy every %d step(s) (copy %.1f ms, step %.1f ms, step marks %.2f "
                    "ms, budget %.0f%%)", k, cost * 1e3, (self._step_s or 0) * 1e3,
                    (self._mark_s or 0.0) * 1e3 if self._every_step else 0.0, MEMORY_BUDGET * 100)
            if loud:
                self._told_interval = (k, now)
        self.memory_interval = k
        self._memory_next = self.step + k

    def _copy_to_memory(self, rng: dict | None = None) -> None:
        """Start the copy of this step into the node's memory tier (worker/memory.py): through
        the `StatePlan` (made at the first copy, again when the copy thread finds it stale, at
        most MEMORY_PLAN_REMAKES times), else the full `state_dict()`s every copy."""
        w = self._memory
        assert w is not None
        if rng is None:
            rng = _rng_state()
        elif self._rng_keeper is not None:  # as the ring pickled them (the same objects once loaded)
            rng = self._rng_keeper.pickled(rng) or rng
        header = {"format": SNAPSHOT_FORMAT, "step": self.step, "world_size": self.world_size, "rng": rng}
        plan = self._plan()
        if plan is not None:
            w.capture_split({**header, **plan.state()}, plan.tensors, self.step, plan.later, check=plan.check)
            return
        objects = {name: obj for name, obj in self._state.items() if obj is not None}
        state: dict[str, Any] = {**header, **{name: obj.state_dict() for name, obj in objects.items()}}
        w.capture(state, self.step, mem.changed_by_step(objects.values()))

    def _plan(self) -> mem.StatePlan | None:
        """The writer's `StatePlan`: made at the first copy (or step boundary), again when the
        copy thread found it stale, at most MEMORY_PLAN_REMAKES times."""
        w = self._memory
        if w is not None and w.stale:  # a copy's check found a tensor replaced: not committed
            w.stale = False
            self._memory_plan = None
            log.info("memory tier: the state's tensors changed (a tensor replaced, optimizer state "
                     "added); taking them again")
        if self._memory_plan is None and self._memory_plans < MEMORY_PLAN_REMAKES:
            self._memory_plans += 1
            self._memory_plan = mem.StatePlan.make(self._state)
            if self._memory_plan is None:
                self._memory_plans = MEMORY_PLAN_REMAKES  # not a state a plan can follow
        return self._memory_plan

    # -------------------------------------------------------------- last words (CPU)
    def _start_boundaries(self) -> None:
        """With a memory tier: every rank keeps its RNG states of every step, and notes every
        step boundary (`_mark_boundary`), counting optimizer steps with a pre-hook (the writer,
        and its siblings: any of them may have to speak for the node). On a GPU the host runs
        ahead of the GPU, so the boundaries and optimizer steps also record CUDA events, which
        tell what ran (worker/last_words.py, "on a GPU")."""
        if self.memory_dir is None or not self.last_words \
                or (self.device.type == "cpu" and torch.cuda.is_initialized()):
            return
        self._every_step = True
        optimizers = [o for o in self._state.values() if isinstance(o, torch.optim.Optimizer)]
        if not optimizers:
            if self._memory is not None:
                log.info("memory tier: no optimizer among the state: no last-words copy (nothing "
                         "tells when the parameters change)")
            return
        if self._memory is None:
            # A sibling of the node's writer: it speaks when the writer is gone (`_take_writer`).
            # Its byte of the lock: torchrun's stop of a broken group waits for it (monitor.py).
            self._last_words_lock = hold_last_words(self.memory_dir, self.local_rank)
            if self._last_words_lock is None:
                return
        elif self._last_words_lock is None:
            return  # the writer could not claim the tier (`_claim_writer`): no last words
        for opt in optimizers:
            opt.register_step_pre_hook(self._count_optimizer_step)
        if threading.current_thread() is threading.main_thread():
            before = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._sigterm_before = signal.SIG_DFL if before is None else before  # None: set in C
            if self.device.type == "cuda" and not callable(self._sigterm_before):
                self._watch_sigterm()

    def _watch_sigterm(self) -> None:
        """On a GPU: hear SIGTERM on a thread of its own. Python runs a signal's handler on the
        main thread between bytecodes, and a GPU survivor's main thread may be stuck in NCCL
        (or in a read of the GPU behind it) for good: its agent's SIGTERM then went unheard
        and the worker lingered until the agent's grace ran out and it was SIGKILLed (2.5 s
        of every recovery on two H100s). The signal's C handler writes its number to the
        wakeup fd at once; this thread says the last words and ends the process as the signal
        would have. Not where the script set its own handler (it may mean to go on) or where
        another wakeup fd is set (an event loop's)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous != -1:  # another owner (or none could be set): leave it
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return

        def watch() -> None:
            while True:
                try:
                    got = os.read(read, 64)
                except OSError:
                    return
                if not got:
                    return
                if signal.SIGTERM in got and not self._finished:
                    self._say_last_words()
                    for stream in (sys.stdout, sys.stderr):
                        try:
                            stream.flush()
                        except (OSError, ValueError):
                            pass
                    os._exit(128 + signal.SIGTERM)

        self._sigterm_watch = True
        threading.Thread(target=watch, name="ftrain-sigterm", daemon=True).start()

    def _claim_writer(self) -> None:
        """The node's writer (`init`, before its first collective, so before any sibling can
        complete a step): on CPU with last words, byte 0 of the tier's last-words lock, held
        until its writer is closed (`_finish`) or it dies. A sibling writes the tier only once
        it has that byte (`_take_writer`): never beside a live writer."""
        if self.memory_dir is None or not self.last_words:
            return
        self._last_words_lock = hold_last_words(self.memory_dir)
        if self._last_words_lock is None:
            log.warning("memory tier: another process holds the writer's lock of %s; no last words "
                        "from this node", self.memory_dir)

    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM (the node agent replacing the attempt after a lost node, torchrun stopping
        the group): the last words first (a survivor often hears of the fault this way before
        its next collective fails), then the signal's own end. In the middle of `step_done`
        (its state half made), or of this thread's own last words, they wait for its end."""
        if self._busy or self._speaker == threading.get_ident():
            self._term_pending = True
            return
        self._end_on_sigterm()

    def _say_last_words(self) -> None:
        """The copy in flight settled, then the last words, in LAST_WORDS_S at most (a worker on
        its way out: a broken group, a SIGTERM); a SIGTERM meanwhile waits for them. From any
        thread (on a GPU the peer watch's, when the training thread is stuck in NCCL); one at
        a time: a second caller waits for the first one's words and returns."""
        if self._speaker == threading.get_ident():
            return
        if not self._words_lock.acquire(blocking=False):
            if self._words_lock.acquire(timeout=SETTLE_S + LAST_WORDS_S + 1.0):
                self._words_lock.release()
            return
        self._speaker = threading.get_ident()
        self._saying = True
        began = time.monotonic()
        fd = self._last_words_lock if self._speaks() else None
        speaking = fd is not None and start_speaking(fd, self.local_rank)  # a stop waits for it
        try:
            self._settle_memory(SETTLE_S)
            self._last_words(max(0.0, began + LAST_WORDS_S - time.monotonic()))
        finally:
            if speaking and self._last_words_lock is not None:
                stop_speaking(self._last_words_lock, self.local_rank)
            self._saying = False
            self._speaker = None
            self._words_lock.release()

    def _end_on_sigterm(self) -> None:
        self._term_pending = False
        self._say_last_words()
        before = self._sigterm_before
        if callable(before):  # the script's own handler, which may go on training
            if self._memory is not None:
                self._memory.wait(stall=False)  # the last words whole before the optimizer may step
            before(signal.SIGTERM, None)
        elif before != signal.SIG_IGN:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _count_optimizer_step(self, *_args, **_kwargs) -> None:
        self._optimizer_steps += 1
        if self._every_step and self.device.type == "cuda":  # before the step's kernels, in stream order
            self._gpu_steps.append((self._optimizer_steps, self._gpu_events.record()))
            del self._gpu_steps[:-GPU_RING]

    def _versions(self, plan: mem.StatePlan) -> tuple[int, ...]:
        """The version counters of the plan's tensors that an optimizer step does not change
        (buffers: a few; read every step). Whether the plan still holds the state's tensors is
        checked at the failure and again before the copy is committed (`StatePlan.check`)."""
        if self._watched_plan is not plan:
            self._watched_plan = plan
            self._watched = [t for t in plan.tensors if t.untyped_storage().data_ptr() not in plan.later]
            size = sum(t.numel() * t.element_size() for t in self._watched)
            self._kept = [t.clone() for t in self._watched] if 0 < size <= KEEP_BUFFERS_BYTES else None
        return tuple(t._version for t in self._watched)

    def _host_copies(self, plan: mem.StatePlan) -> list | None:
        """On a GPU, at a boundary: the plan's host tensors copied into the next slot of a ring
        (one more slot than boundaries kept); None where they are too large to copy every step
        (then no last words)."""
        if self._host_plan is not plan:
            self._host_plan = plan
            self._host_tensors = [t for t in plan.tensors if t.device.type != "cuda"]
            size = sum(t.numel() * t.element_size() for t in self._host_tensors)
            self._host_ring = None if size > KEEP_BUFFERS_BYTES else \
                [[t.clone() for t in self._host_tensors] for _ in range(GPU_RING + 1)]
        if self._host_ring is None:
            return None
        if not self._host_tensors:
            return []
        slot = self._host_ring[self._host_next % len(self._host_ring)]
        self._host_next += 1
        torch._foreach_copy_(slot, self._host_tensors)
        return slot

    def _mark_boundary(self) -> None:
        """The end of a step (`step_done`, before any collective): this rank's RNG states into
        its ring in the node's tier (every rank, every step: whichever step a copy ends up
        holding, each rank has its own states of it); on a rank that may speak (the node's
        writer, a sibling holding its lock byte), the `Boundary`."""
        began = time.perf_counter()
        on_gpu = self.device.type == "cuda"
        # before the boundary's GPU work (its buffers copied aside), if it has any
        begun = self._gpu_events.record() if on_gpu and self._kept is not None else None
        rng = _rng_state()
        self._save_rng(rng)
        self._boundary_rng = rng
        if self._speaks() and self._optimizer_steps:
            plan = self._plan()
            self._boundary_plan = plan
            if plan is None:
                self._boundary = None
            else:
                header = {"format": SNAPSHOT_FORMAT, "step": self.step, "world_size": self.world_size}
                versions = self._versions(plan)
                if self._kept is not None:  # the buffers as they are at this boundary, aside
                    torch._foreach_copy_(self._kept, self._watched)
                self._boundary = Boundary(self.step, self._optimizer_steps, versions,
                                          mem.freeze({**header, **plan.state()}), rng)
                if on_gpu:
                    self._gpu_marks.append((self._boundary, plan, begun, self._gpu_events.record(),
                                            self._host_copies(plan)))
                    del self._gpu_marks[:-GPU_RING]
        took = time.perf_counter() - began
        self._mark_s = took if self._mark_s is None else 0.8 * self._mark_s + 0.2 * took
        self.boundary_s.append(took)
        if len(self.boundary_s) > 1000:
            del self.boundary_s[:500]

    def _last_words(self, timeout_s: float) -> bool:
        """A worker whose group broke (its exit hook, after `_settle_memory`): if its state is
        exactly that of its last step boundary and the node's tier holds an older step, copy it
        there, within `timeout_s` (a copy not whole by then is not committed: the older one
        stays). True if the copy was made. The node's writer (local rank 0, CPU), or a sibling
        once the writer is gone (`_take_writer`)."""
        mark = self._boundary
        if not self._every_step or self._finished or not self._speaks():
            return False
        began = time.perf_counter()
        w = self._memory if self._memory is not None else self._take_writer(timeout_s)
        if w is None or w.disabled:
            return False
        if self.device.type == "cuda":
            return self._last_words_gpu(w, max(0.0, timeout_s - (time.perf_counter() - began)))
        try:
            plan = self._boundary_plan
            versions = self._versions(plan) if plan is not None and plan.check() else None
            held = w.held.step if w.held is not None else -1
            kept = self._kept if plan is not None and self._watched_plan is plan else None
            step, why = last_words_step(mark, self._optimizer_steps, versions, held,
                                        buffers_kept=kept is not None)
            if plan is None and self._memory_plans >= MEMORY_PLAN_REMAKES:
                why = "its state is copied through state_dict() (no plan can follow it step by step)"
            if step is None or plan is None or mark is None or not self._may_copy(w, why, step):
                return False
            state, tensors = self._words_parts(mark, plan, kept)
            w.capture_split(state, tensors, step, plan.later, check=plan.check)
            w.settle(max(0.0, timeout_s - (time.perf_counter() - began)))
        except Exception as exc:  # noqa: BLE001 - the worker is on its way out; the older copy stays
            log.warning("rank %d: the last-words copy failed (%s); the memory tier keeps its older copy",
                        self.rank, exc)
            return False
        made = w.held is not None and w.held.step == step
        log.info("rank %d: last words: %s (step %d) in %.1f ms; %s", self.rank,
                 "copied the state into the node's memory tier" if made else "no copy within the time",
                 step, (time.perf_counter() - began) * 1e3, why)
        return made

    def _may_copy(self, w: mem.MemoryWriter, why: str, step: int | None) -> bool:
        """Whether the last words go on: a step to copy (else `why` is logged) and no copy in
        flight left unwhole."""
        if step is None:
            log.info("rank %d: no last-words copy: %s", self.rank, why)
            return False
        if not w.settle(0.0):
            log.info("rank %d: no last-words copy: the copy in flight is not whole", self.rank)
            return False
        return True

    def _words_parts(self, mark: Boundary, plan: mem.StatePlan, kept: list | None,
                     host: list = ()) -> tuple[dict, list]:
        """The last words' skeleton and tensors: the boundary's skeleton (the RNG states a
        restore may fall back to are the node's first rank's, `_load_memory`), the plan's
        tensors with the buffers as they were at the boundary (not as a forward left them) and,
        on a GPU, its host tensors as they were then (not as the host's next optimizer step
        left them)."""
        state = {**mem.thaw(mark.skeleton), "rng": mark.rng if self.local_rank == 0 else None}
        swap = {id(t): k for t, k in zip(self._watched, kept)} if kept is not None else {}
        swap.update({id(t): k for t, k in zip(self._host_tensors, host)})
        return state, [swap.get(id(t), t) for t in plan.tensors] if swap else plan.tensors

    def _gpu_state_step(self) -> tuple[tuple | None, str]:
        """On a GPU: the (Boundary, plan, its host tensors' copies) whose state the GPU holds
        now, as its events prove (`gpu_settled_step`), or None; and why."""
        marks, steps = list(self._gpu_marks), list(self._gpu_steps)
        seen = [GpuMark(b.step, b.optimizer_steps, begun is not None and begun.query(), done.query())
                for b, _, begun, done, _ in marks]
        step, why = gpu_settled_step(seen, [(n, ev.query()) for n, ev in steps])
        if step is None:
            return None, why
        entry = next(e for e in marks if e[0].step == step)
        return (entry[0], entry[1], entry[4]), why

    def _last_words_gpu(self, w: mem.MemoryWriter, timeout_s: float) -> bool:
        """`_last_words` on a GPU. The host may be stuck (in NCCL, in a read of the GPU) or
        ahead; the events say which boundary the GPU's state is at. A stream caught between
        a boundary and the next collective (an optimizer step running) is given
        GPU_SETTLE_S to reach the next boundary. The copy runs on a stream of its own; the
        events are read again once it is whole, and a state that moved meanwhile is not
        committed."""
        began = time.monotonic()
        deadline = began + timeout_s
        while True:
            found, why = self._gpu_state_step()
            if found is not None or time.monotonic() >= min(deadline, began + GPU_SETTLE_S):
                break
            time.sleep(0.002)
        if found is None:
            log.info("rank %d: no last-words copy: %s", self.rank, why)
            return False
        mark, plan, host = found
        if host is None:
            log.info("rank %d: no last-words copy: the state's tensors in host memory are too large "
                     "to copy at every step boundary", self.rank)
            return False
        try:
            ok = self._watched_plan is plan and self._host_plan is plan and plan.check()
            versions = tuple(t._version for t in self._watched) if ok else None
            held = w.held.step if w.held is not None else -1
            kept = self._kept if ok else None
            step, why = last_words_step(mark, mark.optimizer_steps, versions, held,
                                        buffers_kept=kept is not None)
            if not self._may_copy(w, why, step):
                return False
            state, tensors = self._words_parts(mark, plan, kept, host)

            def still() -> bool:  # the same boundary, its state untouched while it was copied
                again = self._gpu_state_step()[0]
                return again is not None and again[0] is mark

            made = w.capture_now(state, tensors, step, still, check=plan.check)
        except Exception as exc:  # noqa: BLE001 - the worker is on its way out; the older copy stays
            log.warning("rank %d: the last-words copy failed (%s); the memory tier keeps its older copy",
                        self.rank, exc)
            return False
        log.info("rank %d: last words: %s (step %d) in %.1f ms; %s", self.rank,
                 "copied the GPU's state into the node's memory tier" if made
                 else "no copy (the GPU's state moved while it was copied)",
                 step, (time.monotonic() - began) * 1e3, why)
        return made

    def _speaks(self) -> bool:
        """Whether this rank may say last words: the node's writer (its tier on), or a sibling
        holding its byte of the tier's last-words lock (`_start_boundaries`)."""
        if self._memory is not None:
            return not self._memory.disabled
        return self._last_words_lock is not None

    def _take_writer(self, timeout_s: float) -> mem.MemoryWriter | None:
        """A sibling whose group broke: take the writer's byte of the lock (the writer is gone:
        SIGKILLed, or it has said its own last words and exited), waiting up to `timeout_s`,
        then write the tier as its writer (a `MemoryWriter` of its own: the next slot after
        the one `latest.json` names, committed as every copy). None: the writer is alive, or
        nothing to say."""
        fd = self._last_words_lock
        if fd is None or self.memory_dir is None or self._boundary is None:
            return None
        began = time.perf_counter()
        if not take_writer(fd, timeout_s):
            log.info("rank %d: no last-words copy: the node's writer is alive (it speaks)", self.rank)
            return None
        self._memory = mem.MemoryWriter(self.memory_dir, attempt=self.attempt, rank=self.rank)
        for obj in self._state.values():  # a script that goes on after SIGTERM: copies whole first
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._memory.guard)
        log.info("rank %d: the node's writer is gone (waited %.1f ms): this rank writes its memory tier",
                 self.rank, (time.perf_counter() - began) * 1e3)
        return self._memory

    def _agree_on_control(self) -> tuple[str, int, int]:
        """Rank 0 decides from what its poller last heard, and whether the memory tier copies
        this step (`_copy_decision`); every rank gets the same answer."""
        code, control_id = 0, 0
        copy = _COPY_NONE
        if self.is_chief:
            ctl = self._control
            if ctl.id > self._handled_control and ctl.action in _ACTIONS:
                code, control_id = _ACTIONS[ctl.action], ctl.id
            copy = self._copy_decision()
        marks_off = int(self._marks_off)
        if self.distributed:
            t = torch.tensor([code, control_id, copy, marks_off], dtype=torch.int64, device=self.device)
            dist.broadcast(t, src=0)
            code, control_id, copy, marks_off = (int(v) for v in t.tolist())
        if marks_off and self._every_step:  # rank 0 found the marks too dear (`_plan_next_copy`)
            self._marks_off = True
            self._every_step = False
            self._boundary = None
            self._gpu_marks.clear()
        return _ACTION_NAMES.get(code, "none"), control_id, copy

    def _obey(self, action: str, control_id: int) -> None:
        self._handled_control = control_id
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
        self._stop_poller()
        self._busy = False
        if self._term_pending:
            self._end_on_sigterm()
        deadline = time.monotonic() + self.pause_timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.5)
        log.error("rank %d: paused at step %d and not restarted within %g s; exiting with %d "
                  "so the group restarts", self.rank, self.step, self.pause_timeout_s, EXIT_PAUSE_TIMEOUT)
        raise SystemExit(EXIT_PAUSE_TIMEOUT)

    def snapshot(self, control_id: int | None = None, blocking: bool = False) -> bool:
        """Snapshot now (every rank must call it at the same step). Rank 0's answer, for a
        blocking save: False if the storage refused the write (the others answer True)."""
        if self.link is None or self.snapshot_dir is None:
            if control_id is not None:
                log.warning("no snapshot directory: step %d is not saved", self.step)
            return True
        start = time.perf_counter()
        rng = _rng_state()
        if self.distributed:
            rngs: list | None = [None] * self.world_size if self.is_chief else None
            dist.gather_object(rng, rngs, dst=0)
        else:
            rngs = [rng]
        if not self.is_chief:
            return True
        assert self._writer is not None
        self._writer.wait_written()  # one write in flight: waiting for it is part of the stall
        waited_s = time.perf_counter() - start
        state = {"format": SNAPSHOT_FORMAT, "step": self.step, "world_size": self.world_size,
                 "time": time.time(), "rng": rngs}
        live = {name: None if obj is None else obj.state_dict() for name, obj in self._state.items()}
        state.update(self._staging.copy(live))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the non-blocking copies into pinned memory
        stall_s = time.perf_counter() - start
        self.stalls_s.append(stall_s)
        self.waits_s.append(waited_s)
        log.info("snapshot step=%d stall_ms=%.1f (waiting for the previous save %.1f, copy-off %.1f)",
                 self.step, stall_s * 1e3, waited_s * 1e3, (stall_s - waited_s) * 1e3)
        self._writer.submit(state, self.step, stall_s, control_id, blocking=blocking)
        return not (blocking and self._writer.failed_step == self.step)

    # -------------------------------------------------------------- rank 0's poller
    def _start_poller(self) -> None:
        if not self.is_chief or not isinstance(self.link, ServiceLink) or self._poller is not None:
            return
        self._stop_poll.clear()
        self._poller = threading.Thread(target=self._poll, name="ftrain-control", daemon=True)
        self._poller.start()

    def _stop_poller(self) -> bool:
        """Stop rank 0's poller (after its final progress report); False if it did not end
        within 5 s (a call to a control plane that does not answer)."""
        ended = True
        if self._poller is not None:
            self._stop_poll.set()
            self._wake_poll.set()
            self._poller.join(timeout=5)
            ended = not self._poller.is_alive()
            self._poller = None
        return ended

    def _poll(self) -> None:
        assert self.link is not None
        last_report, last_samples, last_t = 0.0, None, None
        reported = None  # the step last reported

        def report(final: bool = False) -> None:
            nonlocal last_samples, last_t, reported
            assert self.link is not None and self._progress is not None
            step, _loss, samples, at = self._progress
            rate = None
            if last_t is not None and at > last_t and samples >= last_samples:
                rate = (samples - last_samples) / (at - last_t)
            last_samples, last_t = samples, at
            loss_value, metrics = self._loss_and_metrics()
            try:
                held = self.link.report_progress(step, loss_value, rate, final=final,
                                                 metrics=metrics, total_steps=self.total_steps)
                if held is None or held == step:  # else not stored (the rate limit): the final one goes
                    reported = step
            except LinkError as exc:
                log.debug("progress report failed: %s", exc)
                if final:
                    self._leave_final_progress(rate)

        while not self._stop_poll.is_set():
            try:
                self._control = self.link.control()
            except LinkError as exc:
                log.debug("control poll failed: %s", exc)
            now = time.monotonic()
            if self._progress is not None and now - last_report >= self.progress_every_s:
                last_report = now
                report()
            self._wake_poll.wait(self.control_poll_s)
            self._wake_poll.clear()
        if self._progress is not None and self._progress[0] != reported:
            report(final=True)  # the step the run ended at, before the job can finish

    def _leave_final_progress(self, rate: float | None = None) -> None:
        """The final progress report did not land (the control plane is away): the node agent
        sends it before it reports the end (worker/handoff.py)."""
        if self._leave is None or self._progress is None or not isinstance(self.link, ServiceLink):
            return
        step = self._progress[0]
        loss, metrics = self._loss_and_metrics()
        body = self.link.progress_request(step, loss, rate, True, metrics, self.total_steps)
        try:
            self._leave(progress=body)
        except OSError as exc:
            log.warning("the final progress report (step %d) could not be left to the node agent: %s",
                        step, exc)

    def _say_finished(self) -> None:
        """This node's workers finished the run: said by its first worker to the control plane
        (or left to its node agent when none answers, worker/handoff.py), so that the node
        counts as finished even if its agent dies before it sees their exit (torchrun's exit
        barrier, the agent's report: seconds in which a SIGKILL made a finished job FAILED or
        run again; service/decide/outcome.py `vanished`). Only after every rank's last
        barrier, rank 0's final snapshot committed or handed over and its final progress sent:
        nothing of the run is left to do but the exit."""
        if self.local_rank != 0 or not isinstance(self.link, ServiceLink) or not self.node:
            return
        try:
            if not self.link.report_finished(self.node):
                log.info("the control plane did not take node %s's word that the run finished "
                         "(not a live member of attempt %d)", self.node, self.attempt)
            return
        except LinkError as exc:
            if exc.status is not None and exc.status < 500:
                log.warning("node %s's word that the run finished was refused: %s", self.node, exc)
                return
            log.info("node %s's word that the run finished did not land (%s): left to the node agent",
                     self.node, exc)
        if self._leave is not None:
            try:
                self._leave(finished=True)
            except OSError as exc:
                log.warning("node %s's word that the run finished could not be left to the node "
                            "agent: %s", self.node, exc)

    def _loss_and_metrics(self) -> tuple[float | None, dict[str, float]]:
        """What a progress report of `_progress` carries: the loss (`step_done`'s, else a
        logged `loss`) and the other logged scalars."""
        assert self._progress is not None
        metrics = self._scalar_values()
        logged_loss = metrics.pop("loss", None)
        loss = self._progress[1]
        return (float(loss) if loss is not None else logged_loss), metrics

    def _scalar_values(self) -> dict[str, float]:
        """The logged scalars as floats; a name or value the control plane would refuse
        (not finite, more than MAX_METRICS) is left out, with a warning once."""
        values: dict[str, float] = {}
        for name, value in list(self._scalars.items()):
            number = float(value)
            if not math.isfinite(number) or not METRIC_NAME.match(name) or len(values) >= MAX_METRICS:
                if name not in self._refused:
                    self._refused.add(name)
                    log.warning("metric %r = %s is not reported (names: letters, digits, _ . / -; "
                                "finite values; at most %d metrics)", name, number, MAX_METRICS)
                continue
            values[name] = number
        return values

    # -------------------------------------------------------------- the end
    def finish(self) -> None:
        """Wait for the save in flight, stop reporting, leave the process group."""
        self._finish(clean=True)

    def _finish(self, clean: bool) -> None:
        if self._finished:
            return
        self._busy = True  # a SIGTERM now: no last words into a writer being closed
        self._finished = True
        if self._sigterm_before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_before)
            if self._sigterm_watch:
                signal.set_wakeup_fd(-1)
        self._prefetch = None  # a copy read ahead and never restored from: its memory freed
        if self._warm is not None:  # done long ago, unless the run was only a few steps
            self._warm.join(5.0)
        saved = False  # the last snapshot committed or handed over, the memory tier flushed
        try:
            self._stop_report.set()
            if self.memory_dir is not None and self._memory_missed == self.step and self._state:
                # The last step's copy was due and skipped (a copy in flight): the writers copy
                # it now (`_flush_memory`), so every rank keeps its RNG states of it.
                self._save_rng(_rng_state())
            if self._memory is not None:
                self._flush_memory()
            if self._last_words_lock is not None:  # nothing more to say: a stop need not wait
                # (after the writer's last copy: a sibling takes the tier only once it is closed)
                os.close(self._last_words_lock)
                self._last_words_lock = None
            if self._rng_keeper is not None:
                self._rng_keeper.flush()
            if self._writer is not None:
                self._writer.finish()  # what the control plane did not take: to the agent
            saved = True
        finally:
            if self._last_words_lock is not None:
                os.close(self._last_words_lock)
                self._last_words_lock = None
            if not self._stop_poller() and clean:  # stuck in a call: its final report never went
                self._leave_final_progress()
            if self._peer_watch is not None:  # a goodbye: the peers do not report this as a loss
                self._peer_watch.close()
            if self.distributed and dist.is_initialized():
                if clean:
                    _settle_collectives()
                dist.destroy_process_group()
            if clean and saved:  # (and every rank passed the barrier above)
                self._say_finished()
            if self._term_pending:  # a SIGTERM while finishing: its own end now
                self._end_on_sigterm()

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
    distributed = "RANK" in env and "WORLD_SIZE" in env
    rank = int(env.get("RANK", 0))
    local_rank = int(env.get("LOCAL_RANK", 0))
    world_size = int(env.get("WORLD_SIZE", 1))
    memory_dir = memory_dir or env.get(FTRAIN_MEMORY_DIR) or None
    memory_every = memory_every if memory_every is not None else _env_int(env, FTRAIN_MEMORY_EVERY)
    memory_on = bool(memory_dir) and memory_every != 0
    # A restarted worker reads its node's memory copy (and verifies it) while CUDA and the
    # process group start, instead of after them (`Runtime._read_copy`).
    prefetch = _Prefetch(Path(memory_dir)) if memory_on else None
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
    rt = Runtime(rank=rank, local_rank=local_rank, world_size=world_size, distributed=distributed,
                 device=device, link=link, snapshot_dir=Path(directory) if directory else None,
                 snapshot_every=every if directory else None,
                 global_batch_size=_env_int(env, FTRAIN_GLOBAL_BATCH_SIZE),
                 control_poll_s=control_poll_s, progress_every_s=progress_every_s,
                 pause_timeout_s=pause_timeout_s, total_steps=total_steps,
                 attempt=_env_int(env, FTRAIN_ATTEMPT) or 0,
                 node=env.get(FTRAIN_NODE) or None)
    rt.phases_s = phases
    rt.last_words = env.get(FTRAIN_LAST_WORDS, "1") != "0"
    rt._prefetch = prefetch
    rt._warm = warm
    if memory_on:
        rt.memory_dir, rt.memory_every = Path(memory_dir), memory_every
        if local_rank == 0:
            rt._memory = mem.MemoryWriter(memory_dir, attempt=rt.attempt, rank=rank)
            rt._claim_writer()
    if directory and link is not None:
        rt._writer = snap.AsyncWriter(directory, link.commit, keep=keep, **_commit_end(env, link, rt.node))
    rt._leave = _leave_to_agent(env, link, rt.node)
    if distributed and isinstance(link, ServiceLink) and rt.node:
        _report_broken_peers(link, rt.node, rt)
    log.info("rank %d/%d on %s; job %s; snapshots %s every %s steps", rank, world_size, device,
             job_id or "(local twin)", directory or "off", rt.snapshot_every)
    return rt
