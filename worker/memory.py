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
step pre-hook (`guard`) waits for that thread before the optimizer may touch them. On a
GPU the thread copies on a side stream that waits for the training stream's event.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
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


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by a `_Ref` into `tensors` (appended to)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _Ref(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_split(v, tensors) for v in obj]
    if isinstance(obj, tuple):
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


def _packing(tensors: list[torch.Tensor]) -> tuple[list[tuple[torch.dtype, tuple, int]], int]:
    """(dtype, shape, offset) of each tensor in a packed buffer, and the buffer's size."""
    out, offset = [], 0
    for t in tensors:
        out.append((t.dtype, tuple(t.shape), offset))
        nbytes = t.numel() * t.element_size()
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return out, max(offset, ALIGN)


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

    def __init__(self, directory: str | Path, attempt: int = 0, rank: int = 0):
        self.directory = Path(directory)
        self.attempt = attempt
        self.rank = rank
        held = read_held(self.directory)
        self._latest_slot = self._slot_of_latest()
        self.held: Held | None = held
        self._maps: dict[int, tuple[list, torch.Tensor]] = {}  # slot -> (packing, mapped bytes)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream = None
        self.disabled: str | None = None  # why the tier is off (no room for a copy)
        self.stalls_s: list[float] = []  # per capture: the training thread's time in capture + guard
        self.copies_s: list[float] = []  # per capture: from capture to the copy being whole

    def _slot_of_latest(self) -> int | None:
        try:
            return int(json.loads((self.directory / LATEST).read_text())["slot"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _mapped(self, slot: int, packing: list, size: int) -> torch.Tensor:
        known = self._maps.get(slot)
        if known is not None and known[0] == packing:
            return known[1]
        path = self.directory / f"slot{slot}.bin"
        self._maps.pop(slot, None)
        with open(path, "wb") as f:
            # Reserve the pages now: a write through the mapping into a tmpfs that is full
            # (a container's 64 MiB /dev/shm) would be a SIGBUS, not an error.
            os.posix_fallocate(f.fileno(), 0, size)
        buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._maps[slot] = (packing, buf)
        return buf

    def capture(self, state: dict, step: int, later: set[int]) -> None:
        """Start the copy of `state` at `step`. Tensors whose storage pointer is in `later`
        (parameters, optimizer state: changed only by the optimizer's step) are copied in
        a thread; everything else now."""
        if self.disabled:
            return
        start = time.perf_counter()
        self.wait()
        tensors: list[torch.Tensor] = []
        skeleton = _split(state, tensors)
        packing, size = _packing(tensors)
        slot = 1 if self._latest_slot == 0 else 0
        try:
            buf = self._mapped(slot, packing, size)
        except OSError as exc:
            self.disabled = f"no room for a copy of {size / 2**20:.0f} MiB in {self.directory}: {exc}"
            log.warning("memory tier off: %s; restarts resume from the disk tier (give /dev/shm "
                        "room for two copies, e.g. docker's --shm-size)", self.disabled)
            (self.directory / f"slot{slot}.bin").unlink(missing_ok=True)
            return
        views = _views(buf, packing)
        deferred = []
        for src, dst in zip(tensors, views):
            if src.device.type == "cpu" and src.untyped_storage().data_ptr() not in later:
                dst.copy_(src)
            else:
                deferred.append((src, dst))
        meta = {"step": step, "size": size, "packing": packing, "skeleton": skeleton}
        event = None
        if any(s.device.type == "cuda" for s, _ in deferred):
            event = torch.cuda.Event()
            event.record()
            if self._stream is None:
                self._stream = torch.cuda.Stream()
        self._thread = threading.Thread(target=self._finish, args=(deferred, meta, slot, event, start),
                                        name=f"memory-copy-{step}", daemon=True)
        self._thread.start()
        self.stalls_s.append(time.perf_counter() - start)

    def _finish(self, deferred: list, meta: dict, slot: int, event, started: float) -> None:
        try:
            if event is not None:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(event)
                    for src, dst in deferred:
                        dst.copy_(src)
                    self._stream.synchronize()
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
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def wait(self) -> None:
        """Block until the copy in flight is whole (the optimizer may then change the state)."""
        t = self._thread
        if t is not None:
            start = time.perf_counter()
            t.join()
            self._thread = None
            if self.stalls_s:
                self.stalls_s[-1] += time.perf_counter() - start
        if self._error is not None:
            error, self._error = self._error, None
            log.warning("memory copy failed (%s); training goes on, the disk tier still holds", error)

    def guard(self, *_args, **_kwargs) -> None:
        """An optimizer step pre-hook: the copy must be whole before the optimizer changes it."""
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
