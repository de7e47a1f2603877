"""The memory tier: a copy of the training state every step, in node-local shared memory
that outlives the worker process.

The disk snapshot (`worker.snapshot`) is the durable tier, taken every N steps; what a
failure costs is the steps since the last one. The memory tier is in front of it: every
`every` steps (1 by default) the first worker of each node copies the state (model,
optimizer, scheduler, sampler position, its RNG states, the step) into files in a
directory the node agent owns (`FTRAIN_MEMORY_DIR`, under /dev/shm: a tmpfs, so the
files are memory), which the agent keeps while the node works on the job and deletes
when it leaves it. A SIGKILLed worker's copy is still there for its restarted group; with
DDP every rank holds the whole model, so every node keeps its own copy and a lost node
loses nothing either.

Layout of the directory (one writer, the node's local rank 0; any number of readers):

    slot0.bin, slot1.bin   the tensors, packed (each at a 64-byte aligned offset)
    slot0.pkl, slot1.pkl   the rest of the state, tensors replaced by their index, and
                           the packing (dtype, shape, offset of each tensor)
    latest.json            {"slot": s, "step": n, "attempt": a, ...}: the slot that is whole
    rng.r<rank>.<i>.pkl    each rank's RNG states after step n, for the last steps (a ring:
                           i = n % ring); written by every rank, so that on a restore from
                           memory each rank gets its own back (`save_rng`, `load_rng`)

Each slot's .pkl holds a checksum of its .bin (xxh3-64, or crc32 where xxhash is not
installed), taken once the copy is whole; a reader verifies it (`read_copy` raises
`CopyCorrupt`) and the restore falls back to the next source: a peer's copy, then disk.

A copy goes into the slot that `latest.json` does not name, and `latest.json` is replaced
(rename) only once the copy is complete: a worker killed in the middle of a copy leaves
the previous copy whole and named.

The copy stalls training as little as it can. Parameters and optimizer state change only
in `optimizer.step()`, so `capture` copies everything else (buffers, which a forward pass
may change; the small state) at once and hands the parameters and optimizer state to a
thread that copies them while the next step's forward and backward run; an optimizer
step pre-hook (`guard`) waits for that thread before the optimizer may touch them.

On a GPU (`capture`'s device path) nothing on the training thread waits for the copy:
the packing puts the GPU's tensors first, so they fill one contiguous range of the slot;
`capture` records an event on the training stream at the step boundary, copies the
buffers into a GPU staging buffer of that range's size on the training stream (a forward
may change them next), and on a side stream that waits for the event copies the
parameters and optimizer state into it too (device to device: fractions of a millisecond),
then the whole range to the host in one non-blocking copy. The slot's pages are registered
with CUDA (page-locked), so that copy is a DMA straight into /dev/shm at the link's speed,
beside the training kernels; where registration is refused, into a pinned buffer that the
thread then copies into the slot. The guard makes the training stream wait (on the GPU, not
the host) for the staging copy alone; the thread waits for the host copy and commits the
slot. A capture that comes while the previous copy is still in flight is skipped (`busy`):
the copies then come as often as the link allows, and the training thread never waits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("ftrain.memory")

ALIGN = 64
LATEST = "latest.json"
SHM_ROOT = Path("/dev/shm")
_PREFIX = "ftrain-mem."


class CopyCorrupt(RuntimeError):
    """A memory copy whose bytes do not match its checksum."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"memory copy at step {step}: {reason}")
        self.step = step
        self.reason = reason


def _digest(data: memoryview, algorithm: str) -> str:
    if algorithm == "xxh3_64":
        import xxhash

        return f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"
    import zlib

    return f"crc32:{zlib.crc32(data):08x}"


def checksum(buf: torch.Tensor) -> str:
    """"<algorithm>:<hex>" of a packed slot's bytes (cheap: it runs with every copy)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return _digest(memoryview(buf.numpy()), "crc32")
    return _digest(memoryview(buf.numpy()), "xxh3_64")


def _verify(flat: torch.Tensor, expected: str | None, step: int) -> None:
    if expected is None:
        return  # written before copies had checksums
    algorithm = expected.partition(":")[0]
    if algorithm not in ("crc32", "xxh3_64"):
        raise CopyCorrupt(step, f"unknown checksum {expected!r}")
    try:
        got = _digest(memoryview(flat.numpy()), algorithm)
    except ImportError:
        log.warning("memory copy at step %d has an xxh3 checksum and xxhash is not installed here; "
                    "not verified", step)
        return
    if got != expected:
        raise CopyCorrupt(step, f"checksum mismatch (stored {expected}, read {got})")


@dataclass(frozen=True)
class _Ref:
    """Where a tensor was in the state: its index in the packed slot."""

    index: int


@dataclass(frozen=True)
class Held:
    """What a node's memory tier holds: the newest whole copy."""

    step: int
    attempt: int
    rank: int  # the rank that wrote it
    time: float


_ATOMS = (int, float, str, bool, bytes, type(None))


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by a `_Ref` into `tensors` (appended to). Runs on
    the training thread every copy: lists and tuples of plain values (Python's RNG state,
    625 ints) are kept as they are, and tensors that need no grad are not detached."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach() if obj.requires_grad else obj)
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _ATOMS for v in obj):
            return obj if isinstance(obj, tuple) else list(obj)  # a list may change after
        if isinstance(obj, list):
            return [_split(v, tensors) for v in obj]
        return tuple(_split(v, tensors) for v in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_join(v, tensors) for v in obj)
    return obj


def _aligned(t: torch.Tensor) -> int:
    return (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN


def _packing(tensors: list[torch.Tensor]) -> tuple[list[tuple[torch.dtype, tuple, int]], int]:
    """(dtype, shape, offset) of each tensor in a packed buffer, and the buffer's size. The
    GPU's tensors come last, so that they fill one range (`_device_range`) that one copy moves;
    the others keep their order from offset 0 (where the first version put them)."""
    offsets = [0] * len(tensors)
    offset = 0
    for i in sorted(range(len(tensors)), key=lambda i: tensors[i].device.type == "cuda"):
        offsets[i] = offset
        offset += _aligned(tensors[i])
    out = [(t.dtype, tuple(t.shape), offsets[i]) for i, t in enumerate(tensors)]
    return out, max(offset, ALIGN)


def _device_range(tensors: list[torch.Tensor], packing: list) -> tuple[int, int]:
    """(start, end) of the GPU tensors' range at the end of the packed buffer."""
    spans = [(off, off + _aligned(t)) for t, (_, _, off) in zip(tensors, packing) if t.device.type == "cuda"]
    return min(a for a, _ in spans), max(b for _, b in spans)


def _views(buf: torch.Tensor, packing: list[tuple[torch.dtype, tuple, int]]) -> list[torch.Tensor]:
    views = []
    for dtype, shape, offset in packing:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = 1
        for d in shape:
            numel *= d
        views.append(buf[offset:offset + numel * itemsize].view(dtype).view(shape))
    return views


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_held(directory: str | Path) -> Held | None:
    """The newest whole copy in `directory`, or None."""
    try:
        d = json.loads((Path(directory) / LATEST).read_text())
        return Held(step=int(d["step"]), attempt=int(d["attempt"]), rank=int(d["rank"]),
                    time=float(d["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


READ_CHUNK = 64 << 20


def _read_parallel(path: Path, into: torch.Tensor) -> int:
    """Read the file into `into` (fresh memory) in chunks on several threads: faulting in
    fresh pages is most of a read from tmpfs, and it scales with cores."""
    view = memoryview(into.numpy())
    size = len(view)
    chunks = [(off, min(READ_CHUNK, size - off)) for off in range(0, size, READ_CHUNK)]
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(chunk: tuple[int, int]) -> int:
            off, n = chunk
            done = 0
            while done < n:
                got = os.preadv(fd, [view[off + done:off + n]], off + done)
                if got == 0:
                    break
                done += got
            return done

        workers = min(8, os.cpu_count() or 1, len(chunks))
        if workers <= 1:
            return sum(map(read, chunks))
        with ThreadPoolExecutor(workers) as pool:
            return sum(pool.map(read, chunks))
    finally:
        os.close(fd)


def read_copy(directory: str | Path, step: int | None = None) -> tuple[dict, torch.Tensor, list] | None:
    """The newest whole copy as (skeleton, packed bytes, packing), in this process's own
    memory (the files may be overwritten by the next copy at any time); None if there is
    none, or not of `step`. Raises `CopyCorrupt` when its bytes fail their checksum."""
    directory = Path(directory)
    try:
        latest = json.loads((directory / LATEST).read_text())
        if step is not None and int(latest["step"]) != step:
            return None
        slot = int(latest["slot"])
        with open(directory / f"slot{slot}.pkl", "rb") as f:
            meta = pickle.load(f)
        if meta["step"] != int(latest["step"]):
            return None
        flat = torch.empty(meta["size"], dtype=torch.uint8)
        if _read_parallel(directory / f"slot{slot}.bin", flat) != meta["size"]:
            return None
        # Two copies finished while this one was read would have overwritten the slot.
        now = json.loads((directory / LATEST).read_text())
        if (now.get("slot"), now.get("step")) != (slot, meta["step"]):
            return None
    except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError):
        return None
    _verify(flat, meta.get("checksum"), meta["step"])
    return meta["skeleton"], flat, meta["packing"]


def unpack(skeleton: Any, flat: torch.Tensor, packing: list) -> dict:
    """The state a copy holds, its tensors views of `flat` (which this process owns)."""
    return _join(skeleton, _views(flat, packing))


def load(directory: str | Path, step: int | None = None) -> dict | None:
    """The newest whole copy's state (of `step`, if given), or None."""
    got = read_copy(directory, step)
    return None if got is None else unpack(*got)


class MemoryWriter:
    """The writer of one node's memory tier: `capture` each step, `guard` before the
    optimizer's step. See the module docstring."""

    # "staged": the GPU path of the module docstring; "pageable": the first version (each
    # GPU tensor copied by the thread on a side stream straight into the slot's pageable
    # pages, the optimizer's guard waiting for the thread): kept for bench/snapshot.py's
    # comparison, and used where the GPU tensors are on more than one device.
    device_path = "staged"
    register_host = True  # False: copy through a pinned buffer (the fallback), for the bench

    def __init__(self, directory: str | Path, attempt: int = 0, rank: int = 0):
        self.directory = Path(directory)
        self.attempt = attempt
        self.rank = rank
        held = read_held(self.directory)
        self._latest_slot = self._slot_of_latest()
        self.held: Held | None = held
        self._maps: dict[int, tuple[list, torch.Tensor]] = {}  # slot -> (packing, mapped bytes)
        self._thread: threading.Thread | None = None  # the copy thread, started at the first copy
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # its work: (args of _finish, done)
        self._current: threading.Event | None = None  # set once the copy in flight is whole
        self._error: BaseException | None = None
        self._stream = None
        self._on_device = False  # the copy in flight is the GPU path's (the guard need not join it)
        self._staged = None  # GPU path: (event, device) the optimizer's step waits for: staging done
        self._staging: tuple[list, torch.Tensor] | None = None  # (packing, GPU bytes)
        self._pinned: dict[int, bool] = {}  # slot -> its mapping is registered with CUDA
        self._bounce: torch.Tensor | None = None  # pinned host buffer where registration is refused
        self.host_copy: str | None = None  # "registered" or "pinned": how the GPU path reaches the slot
        self.disabled: str | None = None  # why the tier is off (no room for a copy)
        self.stalls_s: list[float] = []  # per capture: the training thread's time in capture + guard
        self.copies_s: list[float] = []  # per capture: from capture to the copy being whole
        self.setups_s: list[float] = []  # one-time work of a capture (slot mapped, registered, buffers)
        self._setup_s = 0.0
        self.commits_s: list[float] = []  # GPU path, per copy: the thread's Python work once the copy is in
        self.skipped = 0  # captures skipped because the previous copy was still in flight
        self._layout_cache: tuple | None = None  # (dtypes, shapes, devices) -> packing, size
        self._view_cache: dict[tuple, tuple] = {}  # buffer name -> (buffer, views of it)

    def _slot_of_latest(self) -> int | None:
        try:
            return int(json.loads((self.directory / LATEST).read_text())["slot"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _mapped(self, slot: int, packing: list, size: int) -> torch.Tensor:
        known = self._maps.get(slot)
        if known is not None and known[0] == packing:
            return known[1]
        began = time.perf_counter()
        path = self.directory / f"slot{slot}.bin"
        self._unmap(slot)
        with open(path, "wb") as f:
            # Reserve the pages now: a write through the mapping into a tmpfs that is full
            # (a container's 64 MiB /dev/shm) would be a SIGBUS, not an error.
            os.posix_fallocate(f.fileno(), 0, size)
        buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._maps[slot] = (packing, buf)
        self._setup_s += time.perf_counter() - began
        return buf

    def _unmap(self, slot: int) -> None:
        known = self._maps.pop(slot, None)
        if known is not None and self._pinned.pop(slot, False):
            if self._stream is not None:
                self._stream.synchronize()
            torch.cuda.cudart().cudaHostUnregister(known[1].data_ptr())

    def _register(self, slot: int, buf: torch.Tensor) -> bool:
        """Page-lock the slot's mapping for CUDA (once per mapping), so that a non-blocking
        copy from the GPU lands in it directly; False where CUDA refuses."""
        if slot not in self._pinned:
            began = time.perf_counter()
            ok = False
            if self.register_host:
                got: list = []

                def register() -> None:
                    try:  # 1: cudaHostRegisterPortable, as torch.distributed.checkpoint's stager does
                        got.append(int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 1)))
                    except (RuntimeError, AttributeError) as exc:
                        log.info("memory tier: cannot register the slot with CUDA (%s)", exc)

                # In a thread of its own: CUDA keeps a refused call's error per thread, and the
                # training thread's next kernel launch would raise it.
                t = threading.Thread(target=register, name="memory-register")
                t.start()
                t.join()
                ok = got == [0]
                if not ok:
                    log.info("memory tier: CUDA refused to register the slot; copying through a "
                             "pinned buffer")
            self._pinned[slot] = ok
            self.host_copy = "registered" if ok else "pinned"
            self._setup_s += time.perf_counter() - began
        return self._pinned[slot]

    def _layout(self, tensors: list[torch.Tensor]) -> tuple[list, int]:
        """`_packing` of `tensors`, kept while their dtypes, shapes and devices stay the same
        (every step, in training): the training thread's time in a capture is mostly Python."""
        key = tuple((t.dtype, t.shape, t.device) for t in tensors)
        if self._layout_cache is None or self._layout_cache[0] != key:
            self._layout_cache = (key, *_packing(tensors))
            self._view_cache.clear()
        return self._layout_cache[1], self._layout_cache[2]

    def _views_of(self, name: tuple, buf: torch.Tensor, packing: list) -> list[torch.Tensor]:
        """`_views(buf, packing)`, kept per buffer while the layout stays (`_layout`)."""
        known = self._view_cache.get(name)
        if known is None or known[0] is not buf:
            known = (buf, _views(buf, packing))
            self._view_cache[name] = known
        return known[1]

    def busy(self) -> bool:
        """The GPU path's previous copy is still in flight: a capture now would be skipped."""
        done = self._current
        return self._on_device and done is not None and not done.is_set()

    def last_cost_s(self) -> float:
        """What the last copy cost the training loop: on the GPU path the training thread's
        time alone (the copy runs on the copy engine); otherwise also the copy thread's whole
        time (it takes a core)."""
        stall = self.stalls_s[-1] if self.stalls_s else 0.0
        if self._on_device:  # plus the thread's commit, which holds the GIL the training thread needs
            return stall + (self.commits_s[-1] if self.commits_s else 0.0)
        return stall + (self.copies_s[-1] if self.copies_s else 0.0)

    def capture(self, state: dict, step: int, later: set[int]) -> None:
        """Start the copy of `state` at `step`. Tensors whose storage pointer is in `later`
        (parameters, optimizer state: changed only by the optimizer's step) are copied in
        a thread (on a GPU: on a side stream); everything else now."""
        if self.disabled:
            return
        if self.busy():
            self.skipped += 1
            return
        start = time.perf_counter()
        self._setup_s = 0.0
        self.wait()
        tensors: list[torch.Tensor] = []
        skeleton = _split(state, tensors)
        packing, size = self._layout(tensors)
        slot = 1 if self._latest_slot == 0 else 0
        try:
            buf = self._mapped(slot, packing, size)
        except OSError as exc:
            self.disabled = f"no room for a copy of {size / 2**20:.0f} MiB in {self.directory}: {exc}"
            log.warning("memory tier off: %s; restarts resume from the disk tier (give /dev/shm "
                        "room for two copies, e.g. docker's --shm-size)", self.disabled)
            (self.directory / f"slot{slot}.bin").unlink(missing_ok=True)
            return
        views = self._views_of(("slot", slot), buf, packing)
        meta = {"step": step, "size": size, "packing": packing, "skeleton": skeleton}
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        if len(devices) == 1 and self.device_path == "staged":
            device = devices.pop()
            try:
                deferred, event = self._capture_device(tensors, views, packing, buf, slot, later, device)
            except torch.cuda.OutOfMemoryError:  # no room for the staging buffer (before any copy)
                log.warning("memory tier: no GPU memory for a staging copy of %.0f MiB; copying "
                            "through pageable memory (slower)", size / 2**20)
                self.device_path, self._staging = "pageable", None
                deferred, event = self._capture_host(tensors, views, later)
        else:
            deferred, event = self._capture_host(tensors, views, later)
        self._on_device = event is not None and event[0] == "staged"
        if self._thread is None:  # one thread for the writer's life: starting one per copy
            self._thread = threading.Thread(target=self._serve, name="memory-copy", daemon=True)
            self._thread.start()  # made the training thread wait for its start
        self._current = threading.Event()
        self._jobs.put(((deferred, meta, slot, event, start), self._current))
        # One-time work (mapping a slot, registering it, making buffers) is counted apart:
        # the stall is what every copy costs, and the interval is picked from it.
        self.stalls_s.append(time.perf_counter() - start - self._setup_s)
        if self._setup_s:
            self.setups_s.append(self._setup_s)

    def _capture_host(self, tensors: list, views: list, later: set[int]) -> tuple[list, Any]:
        """Tensors not in `later` now (a GPU's too: a forward may change its buffers next), the
        rest by the thread (GPU ones on a side stream)."""
        deferred = []
        for src, dst in zip(tensors, views):
            if src.untyped_storage().data_ptr() not in later:
                dst.copy_(src)
            else:
                deferred.append((src, dst))
        event = None
        if any(s.device.type == "cuda" for s, _ in deferred):
            event = torch.cuda.Event()
            event.record()
            if self._stream is None:
                self._stream = torch.cuda.Stream()
        return deferred, None if event is None else ("pageable", event, self._stream)

    def _capture_device(self, tensors: list, views: list, packing: list, buf: torch.Tensor, slot: int,
                        later: set[int], device: torch.device) -> tuple[list, Any]:
        """The GPU path (module docstring): enqueue the copies, return the thread's work."""
        start, end = _device_range(tensors, packing)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        if self._staging is None or self._staging[0] != packing:
            began = time.perf_counter()
            self._staging = None
            self._staging = (packing, torch.empty(end - start, dtype=torch.uint8, device=device))
            self._setup_s += time.perf_counter() - began
        staging = self._staging[1]
        on_device = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
        shifted = [(dtype, shape, off - start) for dtype, shape, off in (packing[i] for i in on_device)]
        staged_views = self._views_of(("staging",), staging, shifted)
        now: tuple[list, list] = ([], [])
        late: tuple[list, list] = ([], [])
        for i, dst in zip(on_device, staged_views):
            src = tensors[i]
            pair = late if src.untyped_storage().data_ptr() in later else now
            pair[0].append(dst)
            pair[1].append(src)
        # CPU tensors (small: counters, RNG states) now, the optimizer's too: the guard
        # does not wait for the thread on this path.
        for src, dst in zip(tensors, views):
            if src.device.type != "cuda":
                dst.copy_(src)
        training = torch.cuda.current_stream(device)
        if now[0]:
            torch._foreach_copy_(now[0], now[1])  # on the training stream: a forward may change them
        boundary = torch.cuda.Event()
        boundary.record(training)
        side = self._stream
        side.wait_event(boundary)
        with torch.cuda.stream(side):
            if late[0]:
                torch._foreach_copy_(late[0], late[1])
            staged = torch.cuda.Event()
            staged.record(side)
            deferred: list = []
            if self._register(slot, buf):
                buf[start:end].copy_(staging, non_blocking=True)
            else:
                if self._bounce is None or self._bounce.numel() != end - start:
                    began = time.perf_counter()
                    self._bounce = torch.empty(end - start, dtype=torch.uint8, pin_memory=True)
                    self._setup_s += time.perf_counter() - began
                self._bounce.copy_(staging, non_blocking=True)
                deferred = [(self._bounce, buf[start:end])]
            done = torch.cuda.Event()
            done.record(side)
        self._staged = (staged, device)
        return deferred, ("staged", done)

    def _finish(self, deferred: list, meta: dict, slot: int, event, started: float) -> None:
        try:
            if event is not None and event[0] == "staged":
                event[1].synchronize()  # the host copy, beside training (the GIL released meanwhile)
                committing = time.perf_counter()
                for src, dst in deferred:  # from the pinned buffer, where registration was refused
                    dst.copy_(src)
            elif event is not None:  # the pageable path: the copies on the side stream, here
                _, boundary, stream = event
                with torch.cuda.stream(stream):
                    stream.wait_event(boundary)
                    for src, dst in deferred:
                        dst.copy_(src)
                    stream.synchronize()
            else:
                for src, dst in deferred:
                    dst.copy_(src)
            meta["checksum"] = checksum(self._maps[slot][1])
            with open(self.directory / f".slot{slot}.pkl.tmp", "wb") as f:
                pickle.dump(meta, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(self.directory / f".slot{slot}.pkl.tmp", self.directory / f"slot{slot}.pkl")
            now = time.time()
            _write_json(self.directory / LATEST, {"slot": slot, "step": meta["step"], "attempt": self.attempt,
                                                  "rank": self.rank, "time": now})
            self._latest_slot = slot
            self.held = Held(meta["step"], self.attempt, self.rank, now)
            self.copies_s.append(time.perf_counter() - started)
            if event is not None and event[0] == "staged":
                self.commits_s.append(time.perf_counter() - committing)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def _serve(self) -> None:
        """The copy thread: each copy's second half (`_finish`), in order, until `close`."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            args, done = job
            try:
                self._finish(*args)
            finally:
                done.set()

    def wait(self, stall: bool = True) -> None:
        """Block until the copy in flight is whole (the optimizer may then change the state).
        `stall`: count the wait as the training thread's (False: a benchmark's untimed wait)."""
        done = self._current
        if done is not None:
            start = time.perf_counter()
            done.wait()
            self._current = None
            if self.stalls_s and stall:
                self.stalls_s[-1] += time.perf_counter() - start
        if self._error is not None:
            error, self._error = self._error, None
            log.warning("memory copy failed (%s); training goes on, the disk tier still holds", error)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the copy in flight to be whole (a worker on its way out:
        that copy is the newest step it holds); True if none is left in flight."""
        done = self._current
        return done is None or done.wait(timeout_s)

    def close(self) -> None:
        """The copy in flight whole, then the slots' CUDA registrations undone and the GPU
        buffers freed (a mapping unmapped while registered would make a later registration
        of the same addresses, by another writer of this process, fail)."""
        self.wait()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        for slot in list(self._maps):
            self._unmap(slot)
        self._view_cache.clear()
        self._layout_cache = None
        self._staging = None
        self._bounce = None

    def guard(self, *_args, **_kwargs) -> None:
        """An optimizer step pre-hook: the copy must be whole before the optimizer changes it.
        On the GPU path that is the staging copy, and the wait is the training stream's."""
        if self._on_device:
            staged, self._staged = self._staged, None
            if staged is not None:
                torch.cuda.current_stream(staged[1]).wait_event(staged[0])
            return
        self.wait()


def _rng_path(directory: Path, rank: int, step: int, ring: int) -> Path:
    return directory / f"rng.r{rank}.{step % ring}.pkl"


def save_rng(directory: str | Path, rank: int, step: int, state: dict, ring: int) -> None:
    """Keep `rank`'s RNG states after `step` (every rank, every step: a few KB), so that a
    restore from whichever step the node's copy holds gives each rank its own back."""
    path = _rng_path(Path(directory), rank, step, ring)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump({"step": step, "rng": state}, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def load_rng(directory: str | Path, rank: int, step: int, ring: int) -> dict | None:
    """`rank`'s RNG states after `step`, if this node kept them."""
    try:
        with open(_rng_path(Path(directory), rank, step, ring), "rb") as f:
            got = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return got["rng"] if isinstance(got, dict) and got.get("step") == step else None


class RngKeeper:
    """One rank's RNG states, kept beside the memory tier every step by a thread (`save_rng`):
    the training thread only hands them over (pickling and writing them cost ~0.1-0.3 ms a
    step on 2 busy cores). When writes fall behind, the newest step's states win."""

    def __init__(self, directory: str | Path, rank: int, ring: int):
        self.directory, self.rank, self.ring = Path(directory), rank, ring
        self._pending: tuple[int, dict] | None = None
        self._cv = threading.Condition()
        self._busy = False
        self.error: OSError | None = None
        threading.Thread(target=self._run, name="ftrain-rng", daemon=True).start()

    def keep(self, step: int, state: dict) -> None:
        with self._cv:
            self._pending = (step, state)
            self._cv.notify_all()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until the states handed over are written."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None)
                assert self._pending is not None
                (step, state), self._pending = self._pending, None
                self._busy = True
            try:
                if self.error is None:
                    save_rng(self.directory, self.rank, step, state, self.ring)
            except OSError as exc:
                self.error = exc
                log.warning("rank %d cannot keep its RNG states in %s (%s); a restore from memory "
                            "will not give them back", self.rank, self.directory, exc)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


# ------------------------------------------------------------------ the agent's side

def node_root(data_dir: str | Path, node: str, shm: Path = SHM_ROOT) -> str:
    """The name prefix of this agent's memory directories: its data directory and name
    (agents of one name in different data directories share the machine in tests)."""
    tag = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]
    return f"{_PREFIX}{tag}.{node}."


def make_job_dir(data_dir: str | Path, node: str, job_id: str, shm: Path = SHM_ROOT) -> Path:
    """A fresh memory directory for `job_id` on this node (0700), under /dev/shm when it
    is there, else the data directory (then it is disk, and only outlives the worker)."""
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(data_dir) / "memory"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = base / f"{node_root(data_dir, node, shm)}{job_id}.{os.urandom(4).hex()}"
    path.mkdir(mode=0o700)
    return path


def remove_leftovers(data_dir: str | Path, node: str, shm: Path = SHM_ROOT) -> list[Path]:
    """Remove the memory directories a previous agent of this name and data directory left
    (it was killed); called by the agent when it starts."""
    prefix = node_root(data_dir, node, shm)
    removed = []
    for base in (shm, Path(data_dir) / "memory"):
        if not base.is_dir():
            continue
        for p in base.iterdir():
            if p.name.startswith(prefix):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed
