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
    rng.r<rank>.ring       each rank's RNG states after step n, for the last copy steps (a
                           ring of fixed slots, slot n % ring); written by every rank at each
                           step its node copies (rank 0 picks them), so that on a
                           restore from memory each rank gets its own back (`RngKeeper`,
                           `load_rng`; a state too large for a slot: rng.r<rank>.<i>.pkl)

Each slot's .pkl holds a checksum of its .bin (`sum64`; on the GPU path its GPU range is
summed on the GPU beside the copy), taken once the copy is whole; a reader verifies it
(`read_copy` raises `CopyCorrupt`; copies with the older xxh3-64 or crc32 are verified too)
and the restore falls back to the next source: a peer's copy, then disk.

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
the host) for the staging copy alone; once the host copy is whole (its event), the training
thread commits the slot at its next step (`poll`; a thread that committed took the GIL in
small turns), or, through a pinned buffer, the thread copies it in and commits it. A capture
that comes while the previous copy is still in flight is skipped (`busy`):
the copies then come as often as the link allows, and the training thread never waits.

What a capture costs the training thread is Python (10-30 us a torch call on a GPU host), so
the runtime hands over a `StatePlan` (the state split once, the same tensor list every step)
and the writer keeps everything derived from that list (`_Layout`: packing, views, the lists
of the batched copies) and, once the list comes again, replays the side stream's work from
two CUDA graphs (worker/memory_gpu.py).
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import pickle
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .memory_gpu import GpuStaging
from .snapshot import map_tensors, over_chunks
from .memory_dirs import (  # noqa: F401 - the agent's side, named here too
    OWNER_FILE,
    SHM_ROOT,
    UNOWNED_AGE_S,
    make_job_dir,
    node_root,
    remove_leftovers,
    remove_orphans,
)

log = logging.getLogger("ftrain.memory")

ALIGN = 64
LATEST = "latest.json"


class CopyCorrupt(RuntimeError):
    """A memory copy whose bytes do not match its checksum."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"memory copy at step {step}: {reason}")
        self.step = step
        self.reason = reason


SUM_BLOCK = 512  # words (8 bytes) per row of `sum64`'s blocked sums: 4 KiB
_MASK = (1 << 64) - 1
SMALL_WORDS = 256  # `_sum64_small` sums up to this many words in Python, more with numpy


def sum64(flat: torch.Tensor) -> tuple[int, int]:
    """The checksum of a packed slot's bytes, on whatever device they are: the words (int64,
    little-endian) summed, and summed weighted by their 1-based position, each modulo 2**64
    (a Fletcher-like pair: a changed word changes the first, two swapped words the second).
    Integer sums are exact in any order, so the GPU that staged a copy and the CPU that reads
    it back get the same pair; torch's kernels run without the GIL (xxhash's held it for the
    whole 25 ms of a 120 MB copy, which the training thread waited for). `flat`: uint8,
    a multiple of 8 bytes."""
    words = flat.view(torch.int64)
    n = words.numel()
    m = n // SUM_BLOCK * SUM_BLOCK
    body, tail = words[:m].view(-1, SUM_BLOCK), words[m:]
    rows, cols = body.sum(1), body.sum(0)
    kw = {"dtype": torch.int64, "device": flat.device}
    s1 = rows.sum() + tail.sum()
    # position of word (r, c) = r * SUM_BLOCK + c + 1
    s2 = ((rows * torch.arange(rows.numel(), **kw)).sum() * SUM_BLOCK
          + (cols * torch.arange(1, SUM_BLOCK + 1, **kw)).sum()
          + (tail * torch.arange(m + 1, n + 1, **kw)).sum())
    if flat.device.type != "cpu":
        pair = torch.stack([s1, s2]).cpu()
        return int(pair[0]) & _MASK, int(pair[1]) & _MASK
    return int(s1) & _MASK, int(s2) & _MASK



def sum64_join(head: tuple[int, int], tail: tuple[int, int], head_bytes: int) -> tuple[int, int]:
    """`sum64` of two ranges one after the other, from each range's own (the first
    `head_bytes` long): positions in the second move up by the first's words."""
    shift = head_bytes // 8
    return (head[0] + tail[0]) & _MASK, (head[1] + tail[1] + shift * tail[0]) & _MASK


def _sum64_small(flat: torch.Tensor) -> tuple[int, int]:
    """`sum64` of a small CPU range (the CPU tensors of a GPU copy: an optimizer's step counts)
    on the training thread, at each commit: a few words in plain Python (numpy's calls and its
    `errstate` took ~0.1 ms of the commit on an H100 host for 8 words), more with numpy."""
    import numpy as np

    array = flat.numpy()
    if array.nbytes <= 8 * SMALL_WORDS:
        words = memoryview(array).cast("B").cast("Q")
        return sum(words) & _MASK, sum(i * w for i, w in enumerate(words, 1)) & _MASK
    words = array.view(np.uint64)
    with np.errstate(over="ignore"):
        return (int(words.sum(dtype=np.uint64)),
                int((words * np.arange(1, len(words) + 1, dtype=np.uint64)).sum(dtype=np.uint64)))


def _sum64_pair(blocks: torch.Tensor, rows_at: torch.Tensor, cols_at: torch.Tensor) -> torch.Tensor:
    """`sum64` of a range viewed as [rows, SUM_BLOCK] int64 words (zeros past its end add
    nothing), as a 2-element int64 tensor on the range's device: no host sync, and capturable
    in a CUDA graph. `rows_at`: arange(rows); `cols_at`: arange(1, SUM_BLOCK + 1), int64 on that
    device. The GPU path sums its staging buffer so and copies the pair to the host beside the
    copy (it copied the row sums and finished them with numpy: ~0.1 ms of the commit per
    100 MB copied, on the training thread)."""
    rows = blocks.sum(1)
    return torch.stack([rows.sum(), (rows * rows_at).sum() * SUM_BLOCK + (blocks.sum(0) * cols_at).sum()])


def _tensor_from(array: Any) -> torch.Tensor:
    return torch.from_numpy(array)


class _Frozen(dict):
    """A part of a `StatePlan`'s skeleton that stays the same from copy to copy, pickled once
    (`blob`): each copy's metadata then pickles it as one bytes object, not as the dozens of
    `_Ref`s it holds (~0.1 ms under the GIL on a GPU host, each copy)."""

    def __init__(self, data: dict):
        super().__init__(data)
        self.blob = pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)


def _thaw(blob: bytes) -> dict:
    return pickle.loads(blob)


class _Pickled:
    """An object pickled once (`blob`, the way `_dump` pickles), put into a larger pickle as
    those bytes: an RNG state that did not change since the last step (`RngKeeper`)."""

    __slots__ = ("blob",)

    def __init__(self, obj: Any):
        buf = io.BytesIO()
        _dump(obj, buf)
        self.blob = buf.getvalue()


class _Pickler(pickle.Pickler):
    """Pickles small CPU tensors (RNG states) through numpy (torch's own reduction costs
    ~0.2 ms a tensor here, held under the GIL the training thread needs), and a plan's
    `_Frozen` parts and `_Pickled` objects as the bytes they were pickled to once."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is _Frozen or type(obj) is _Pickled:
            return _thaw, (obj.blob,)
        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad
                and obj.dtype in _NUMPY_DTYPES and obj.is_contiguous()):
            return _tensor_from, (obj.numpy(),)
        return NotImplemented


_NUMPY_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64, torch.bool}


def _dump(obj: Any, f: Any) -> None:
    _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)


def freeze(obj: Any) -> bytes:
    """`obj` pickled the way a copy's metadata is (`_Pickler`): a step boundary's state kept
    as it was then, for a survivor's last-words copy (worker/last_words.py)."""
    buf = io.BytesIO()
    _dump(obj, buf)
    return buf.getvalue()


def thaw(blob: bytes) -> Any:
    """What `freeze` kept."""
    return pickle.loads(blob)


def _sum64_text(pair: tuple[int, int]) -> str:
    return f"sum64:{pair[0]:016x}{pair[1]:016x}"


def _digest(data: memoryview, algorithm: str) -> str:
    """The older checksums (copies written before `sum64`), for reading them back."""
    if algorithm == "xxh3_64":
        import xxhash

        return f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"

    return f"crc32:{zlib.crc32(data):08x}"


def checksum(buf: torch.Tensor) -> str:
    """"<algorithm>:<hex>" of a packed slot's bytes (cheap: it runs with every copy)."""
    return _sum64_text(sum64(buf))


def _verify(flat: torch.Tensor, expected: str | None, step: int, summed: tuple[int, int] | None = None) -> None:
    """Raises `CopyCorrupt` unless `flat`'s checksum is `expected`; `summed`: its `sum64`, where
    the read took it already (`_read_parallel`)."""
    if expected is None:
        return  # written before copies had checksums
    algorithm = expected.partition(":")[0]
    if algorithm not in ("sum64", "crc32", "xxh3_64"):
        raise CopyCorrupt(step, f"unknown checksum {expected!r}")
    try:
        if algorithm == "sum64":
            got = _sum64_text(summed) if summed is not None else checksum(flat)
        else:
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


class _Layout:
    """What a capture derives from its list of tensors: their packing, and for the GPU path
    the GPU tensors' range, the lists of each batched copy and the views they copy into
    (made once and kept while the same list comes every step)."""

    def __init__(self, tensors: list[torch.Tensor], key: tuple, packing: list, size: int, later: set[int]):
        self.tensors, self.key, self.packing, self.size = tensors, key, packing, size
        devices = {t.device for t in tensors if t.device.type == "cuda"}
        self.device = devices.pop() if len(devices) == 1 else None  # None: not the one-GPU path
        self.later = [t.untyped_storage().data_ptr() in later for t in tensors]  # copied by the thread
        self.cpu = [i for i, t in enumerate(tensors) if t.device.type != "cuda"]
        self.cpu_src = [tensors[i] for i in self.cpu]
        self.start = self.end = 0
        self.now_src: list[torch.Tensor] = []
        self.late_src: list[torch.Tensor] = []
        self._now: list[int] = []
        self._late: list[int] = []
        if self.device is not None:
            self.start, self.end = _device_range(tensors, packing)
            for i, (t, late) in enumerate(zip(tensors, self.later)):
                if t.device.type == "cuda":
                    (self._late if late else self._now).append(i)
                    (self.late_src if late else self.now_src).append(t)
        self.repeated = False  # the same list came again (a plan's): worth graphs
        self._staged: tuple | None = None  # (staging buffer, views for now_src, views for late_src)
        self._cpu_views: dict[int, tuple] = {}  # slot -> (its buffer's views, the CPU tensors' views)
        self._host: dict[int, tuple] = {}  # slot -> (buffer, its GPU range)

    def staged_views(self, staging: torch.Tensor) -> tuple[list, list]:
        if self._staged is None or self._staged[0] is not staging:
            shifted = [(dtype, shape, off - self.start) for dtype, shape, off in self.packing]
            views = {i: v for i, v in zip(self._now + self._late,
                                          _views(staging, [shifted[i] for i in self._now + self._late]))}
            self._staged = (staging, [views[i] for i in self._now], [views[i] for i in self._late])
        return self._staged[1], self._staged[2]

    def cpu_views(self, slot: int, views: list[torch.Tensor]) -> list[torch.Tensor]:
        known = self._cpu_views.get(slot)
        if known is None or known[0] is not views:
            known = (views, [views[i] for i in self.cpu])
            self._cpu_views[slot] = known
        return known[1]

    def host_range(self, slot: int, buf: torch.Tensor) -> torch.Tensor:
        known = self._host.get(slot)
        if known is None or known[0] is not buf:
            known = (buf, buf[self.start:self.end])
            self._host[slot] = known
        return known[1]


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


def _read_parallel(path: Path, into: torch.Tensor) -> tuple[int, tuple[int, int] | None]:
    """Read the file into `into` (fresh memory) in chunks on several threads: faulting in
    fresh pages is most of a read from tmpfs, and it scales with cores. Each thread also takes
    the `sum64` of its chunk while its bytes are in cache (a 12 GB copy: verified in the read's
    time, not in 2.7 s more on one core after it). Returns the bytes read and the whole file's
    `sum64` (None where it was not read whole)."""
    view = memoryview(into.numpy())
    size = len(view)
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(off: int, n: int) -> tuple[int, tuple[int, int] | None]:
            done = 0
            while done < n:
                got = os.preadv(fd, [view[off + done:off + n]], off + done)
                if got == 0:
                    break
                done += got
            pair = sum64(into[off:off + done]) if done % 8 == 0 else None
            return done, pair

        got = over_chunks(size, READ_CHUNK, read)
    finally:
        os.close(fd)
    total = sum(n for n, _ in got)
    if total != size or any(pair is None for _, pair in got):
        return total, None
    whole, before = (0, 0), 0
    for n, pair in got:
        whole, before = sum64_join(whole, pair, before), before + n
    return total, whole


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
        size, summed = _read_parallel(directory / f"slot{slot}.bin", flat)
        if size != meta["size"]:
            return None
        # Two copies finished while this one was read would have overwritten the slot.
        now = json.loads((directory / LATEST).read_text())
        if (now.get("slot"), now.get("step")) != (slot, meta["step"]):
            return None
    except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError):
        return None
    _verify(flat, meta.get("checksum"), meta["step"], summed)
    return meta["skeleton"], flat, meta["packing"]


def slot_meta(directory: str | Path, slot: int) -> dict | None:
    """What the copy in `slot` says of itself (step, rank, world size, size, checksum), without
    reading its bytes; None if there is none. Its bytes may still be torn: `read_slot` tells."""
    try:
        with open(Path(directory) / f"slot{slot}.pkl", "rb") as f:
            meta = pickle.load(f)
        return meta if isinstance(meta, dict) and "step" in meta else None
    except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError):
        return None


def read_slot(directory: str | Path, slot: int) -> tuple[dict, torch.Tensor, list] | None:
    """The copy in `slot` (0 or 1), whichever step it holds, verified; None if it is not whole
    (a copy was being written into it when its writer died: its bytes fail their checksum, which
    for the slot `latest.json` does not name is expected, not damage). A writer's two slots hold
    its last two copies: every rank of a sharded job keeps its own, and the group resumes from
    the newest step that every rank holds in one of them (worker/tiers/sharded_memory.py)."""
    directory = Path(directory)
    try:
        with open(directory / f"slot{slot}.pkl", "rb") as f:
            meta = pickle.load(f)
        flat = torch.empty(meta["size"], dtype=torch.uint8)
        size, summed = _read_parallel(directory / f"slot{slot}.bin", flat)
        if size != meta["size"]:
            return None
        _verify(flat, meta.get("checksum"), meta["step"], summed)
    except (OSError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError, CopyCorrupt):
        return None
    return meta["skeleton"], flat, meta["packing"]


def unpack(skeleton: Any, flat: torch.Tensor, packing: list) -> dict:
    """The state a copy holds, its tensors views of `flat` (which this process owns)."""
    return _join(skeleton, _views(flat, packing))


def owned(obj: Any) -> Any:
    """`obj` with every tensor that is a view of a copy's packed bytes (`unpack`'s) made a
    tensor of its own. A view keeps the whole copy alive, and pickling one (a broadcast of
    objects, `torch.save`) writes the whole copy: an optimizer's step counter, 8 bytes, would
    carry a rank's every shard with it, once per parameter."""
    return map_tensors(obj, _own)


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def load(directory: str | Path, step: int | None = None) -> dict | None:
    """The newest whole copy's state (of `step`, if given), or None."""
    got = read_copy(directory, step)
    return None if got is None else unpack(*got)


def _slot_of_latest(directory: Path) -> int | None:
    """The slot `latest.json` names (the whole one), if any."""
    try:
        return int(json.loads((directory / LATEST).read_text())["slot"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class MemoryWriter:
    """The writer of one node's memory tier: `capture` each step, `guard` before the
    optimizer's step. See the module docstring."""

    # "staged": the GPU path of the module docstring; "pageable": the first version (each
    # GPU tensor copied by the thread on a side stream straight into the slot's pageable
    # pages, the optimizer's guard waiting for the thread): kept for bench/snapshot.py's
    # comparison, and used where the GPU tensors are on more than one device.
    device_path = "staged"
    register_host = True  # False: copy through a pinned buffer (the fallback), for the bench
    # Replay the side stream's work (the batched copy into staging; the checksum's sums and
    # the copy to the slot) as two CUDA graphs once the same layout comes a second time (a
    # plan's): two launches where there were a dozen calls. False: enqueue them one by one.
    graphs = True
    # GPU path with the slot registered: the copy's commit (checksum from the GPU's sums, plan
    # check, metadata, `latest.json`) runs on the training thread once the copy is whole
    # (`poll`, each step), not on the copy thread: ~0.3 ms of Python either way, but on the
    # copy thread it took the GIL from the training thread in many small turns (its wall time
    # 1-2 ms a copy on an H100 host). False: the copy thread commits (for the bench).
    commit_inline = True

    def __init__(self, directory: str | Path, attempt: int = 0, rank: int = 0):
        self.directory = Path(directory)
        self.attempt = attempt
        self.rank = rank
        held = read_held(self.directory)
        self._latest_slot = _slot_of_latest(self.directory)
        self.held: Held | None = held
        self._maps: dict[int, tuple[list, torch.Tensor]] = {}  # slot -> (packing, mapped bytes)
        self._thread: threading.Thread | None = None  # the copy thread, started at the first copy
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # its work: (args of _finish, done)
        self._current: threading.Event | None = None  # set once the copy in flight is whole
        # A copy in flight whose commit the training thread makes (`commit_inline`): the args
        # of `_finish`, and the CUDA event of the copy being whole.
        self._pending: tuple | None = None
        self._error: BaseException | None = None
        self._stream = None
        self._on_device = False  # the copy in flight is the GPU path's (the guard need not join it)
        self._staged = None  # GPU path: (event, device) the optimizer's step waits for: staging done
        self.host_copy: str | None = None  # "registered" or "pinned": how the GPU path reaches the slot
        self.disabled: str | None = None  # why the tier is off (no room for a copy)
        self.stalls_s: list[float] = []  # per capture: the training thread's time in capture + guard
        self.copies_s: list[float] = []  # per capture: from capture to the copy being whole
        self.setups_s: list[float] = []  # one-time work of a capture (slot mapped, registered, buffers)
        self._setup_s = 0.0
        self.commits_s: list[float] = []  # GPU path, per copy: the thread's Python work once the copy is in
        self.commits_cpu_s: list[float] = []  # the same, the committing thread's CPU time
        self.commit_thread_cpu = 0.0
        self.skipped = 0  # captures skipped because the previous copy was still in flight
        self._layout_cache: _Layout | None = None  # the last capture's tensors, their packing and copy lists
        self._gpu = GpuStaging(self)  # the GPU path's buffers, events and graphs (worker/memory_gpu.py)
        self.checksums_s: list[float] = []  # per copy: the checksum's time on the copy thread
        self.stale = False  # a copy's `check` failed: the runtime's plan no longer holds the state
        self._view_cache: dict[tuple, tuple] = {}  # buffer name -> (buffer, views of it)
        # Called once each copy this writer started has ended, from the thread that ended it:
        # (its metadata, the slot's bytes if it was committed, else None).
        self.on_done: Callable[[dict, torch.Tensor | None], None] | None = None

    def _mapped(self, slot: int, packing: list, size: int) -> torch.Tensor:
        known = self._maps.get(slot)
        if known is not None and (known[0] is packing or known[0] == packing):
            return known[1]
        began = time.perf_counter()
        path = self.directory / f"slot{slot}.bin"
        self._unmap(slot)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # A slot of the same size (a restarted worker's, the previous one's) keeps its
            # pages: emptying it and reserving them again cost its first copy ~20 ms per 100 MB.
            # The copy overwrites every byte its checksum covers.
            st = os.fstat(fd)
            if st.st_size != size:
                os.ftruncate(fd, 0)
            # Reserve the pages now: a write through the mapping into a tmpfs that is full
            # (a container's 64 MiB /dev/shm) would be a SIGBUS, not an error. (All of them
            # held already: nothing to reserve.)
            if st.st_size != size or st.st_blocks * 512 < size:
                os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        buf = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._maps[slot] = (packing, buf)
        self._setup_s += time.perf_counter() - began
        return buf

    @property
    def graphed(self) -> int:
        """Copies whose side-stream work was replayed from CUDA graphs."""
        return self._gpu.graphed

    def _unmap(self, slot: int) -> None:
        self._gpu.forget(slot)
        known = self._maps.pop(slot, None)
        if known is not None and self._gpu.pinned.pop(slot, False):
            if self._stream is not None:
                self._stream.synchronize()
            torch.cuda.cudart().cudaHostUnregister(known[1].data_ptr())

    def _layout(self, tensors: list[torch.Tensor], later: set[int]) -> _Layout:
        """The `_Layout` of `tensors`. The same list as last time (a runtime's `StatePlan`
        hands over one list every step) costs nothing; another list of the same dtypes,
        shapes and devices keeps the packing and the buffers' views, and only sorts its
        tensors again by `later`."""
        lay = self._layout_cache
        if lay is not None and lay.tensors is tensors:
            lay.repeated = True
            return lay
        key = tuple((t.dtype, t.shape, t.device) for t in tensors)
        if lay is None or lay.key != key:
            packing, size = _packing(tensors)
            self._view_cache.clear()
        else:
            packing, size = lay.packing, lay.size
        lay = _Layout(tensors, key, packing, size, later)
        self._layout_cache = lay
        return lay

    def _views_of(self, name: tuple, buf: torch.Tensor, packing: list) -> list[torch.Tensor]:
        """`_views(buf, packing)`, kept per buffer while the layout stays (`_layout`)."""
        known = self._view_cache.get(name)
        if known is None or known[0] is not buf:
            known = (buf, _views(buf, packing))
            self._view_cache[name] = known
        return known[1]

    def busy(self) -> bool:
        """The GPU path's previous copy is still in flight: a capture now would be skipped."""
        if self._pending is not None:
            return not self.poll()
        done = self._current
        return self._on_device and done is not None and not done.is_set()

    def poll(self) -> bool:
        """Commit the copy in flight if it is whole (training thread, every step; a CUDA
        event query while a copy is in flight, nothing otherwise). True if none is left."""
        pending = self._pending
        if pending is None:
            return True
        if not pending[3][1].query():
            return False
        self._commit_pending()
        return True

    def _commit_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[3][1].synchronize()
            self._finish(*pending)
            self._raise_error()

    @property
    def on_device(self) -> bool:
        """The last copy took the GPU path (its copy on the copy engine, not a core)."""
        return self._on_device

    def last_cost_s(self) -> float:
        """What the last copy cost the training loop: on the GPU path the training thread's
        time alone (the copy and its checksum run on the GPU) plus the commit (on the training
        thread, or on the copy thread where it holds the GIL the training thread needs);
        otherwise also the copy thread's whole time (it takes a core)."""
        stall = self.stalls_s[-1] if self.stalls_s else 0.0
        if self._on_device:
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
        tensors: list[torch.Tensor] = []
        skeleton = _split(state, tensors)
        self.capture_split(skeleton, tensors, step, later)

    def capture_split(self, skeleton: Any, tensors: list[torch.Tensor], step: int, later: set[int],
                      check: Callable[[], bool] | None = None) -> None:
        """`capture` of a state already split (`_split`): `skeleton` refers to `tensors` by
        index. A runtime's `StatePlan` hands over the same `tensors` list every step, so the
        layout, the views and the lists of the batched copies are made once. `check`, if
        given, runs on the copy thread once the copy is whole: False (the plan's tensors are
        no longer the state's) leaves the copy uncommitted and sets `stale`."""
        if self.disabled:
            return
        if self.busy():
            self.skipped += 1
            return
        start = time.perf_counter()
        self._setup_s = 0.0
        self.wait()
        lay = self._layout(tensors, later)
        slot = 1 if self._latest_slot == 0 else 0
        try:
            buf = self._mapped(slot, lay.packing, lay.size)
        except OSError as exc:
            self.disabled = f"no room for a copy of {lay.size / 2**20:.0f} MiB in {self.directory}: {exc}"
            log.warning("memory tier off: %s; restarts resume from the disk tier (give /dev/shm "
                        "room for two copies, e.g. docker's --shm-size)", self.disabled)
            (self.directory / f"slot{slot}.bin").unlink(missing_ok=True)
            return
        meta = {"step": step, "size": lay.size, "packing": lay.packing, "skeleton": skeleton}
        views = self._views_of(("slot", slot), buf, lay.packing)
        if lay.device is not None and self.device_path == "staged":
            try:
                deferred, event = self._gpu.capture(lay, buf, slot, views)
            except torch.cuda.OutOfMemoryError:  # no room for the staging buffer (before any copy)
                log.warning("memory tier: no GPU memory for a staging copy of %.0f MiB; copying "
                            "through pageable memory (slower)", lay.size / 2**20)
                self.device_path, self._gpu.staging = "pageable", None
                deferred, event = self._capture_host(lay, views)
        else:
            deferred, event = self._capture_host(lay, views)
        self._on_device = event is not None and event[0] == "staged"
        if self._on_device and not deferred and self.commit_inline:
            self._pending = (deferred, meta, slot, event, start, check)
            self._current = None
            self._count_stall(start)
            return
        if self._thread is None:  # one thread for the writer's life: starting one per copy
            self._thread = threading.Thread(target=self._serve, name="memory-copy", daemon=True)
            self._thread.start()  # made the training thread wait for its start
        self._current = threading.Event()
        self._jobs.put(((deferred, meta, slot, event, start, check), self._current))
        self._count_stall(start)

    def capture_now(self, skeleton: Any, tensors: list[torch.Tensor], step: int,
                    confirm: Callable[[], bool], check: Callable[[], bool] | None = None) -> bool:
        """A GPU survivor's last words: copy `tensors` into the free slot at once and commit it,
        on a stream of its own that waits for nothing (the training stream may be stuck in a
        collective for good), from whichever thread speaks. `confirm` runs once the copy is
        whole: False (the state moved while it was read) leaves the copy uncommitted. True if
        committed. Any copy in flight must be settled first (`settle`)."""
        if self.disabled:
            return False
        started = time.perf_counter()
        lay = self._layout(tensors, set())
        slot = 1 if self._latest_slot == 0 else 0
        buf = self._mapped(slot, lay.packing, lay.size)
        views = self._views_of(("slot", slot), buf, lay.packing)
        device = lay.device
        if device is not None:
            self._gpu.register(slot, buf)
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                for src, dst in zip(lay.tensors, views):
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            for src, dst in zip(lay.tensors, views):
                dst.copy_(src)
        if not confirm():
            return False
        meta = {"step": step, "size": lay.size, "packing": lay.packing, "skeleton": skeleton}
        self._finish([], meta, slot, None, started, check)
        self._raise_error()
        return self.held is not None and self.held.step == step

    def _count_stall(self, start: float) -> None:
        # One-time work (mapping a slot, registering it, making buffers) is counted apart:
        # the stall is what every copy costs, and the interval is picked from it.
        self.stalls_s.append(time.perf_counter() - start - self._setup_s)
        if self._setup_s:
            self.setups_s.append(self._setup_s)

    def _capture_host(self, lay: _Layout, views: list) -> tuple[list, Any]:
        """Tensors not in `later` now (a GPU's too: a forward may change its buffers next), the
        rest by the thread (GPU ones on a side stream)."""
        deferred = []
        for src, dst, late in zip(lay.tensors, views, lay.later):
            if not late:
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

    def _finish(self, deferred: list, meta: dict, slot: int, event, started: float,
                check: Callable[[], bool] | None = None) -> None:
        committed: int | None = None
        try:
            buf = self._maps[slot][1]
            if event is not None and event[0] == "staged":
                _, done, sums, start = event
                done.synchronize()  # the host copy, beside training (the GIL released meanwhile)
                committing = time.perf_counter()
                self.commit_thread_cpu = time.thread_time()
                for src, dst in deferred:  # from the pinned buffer, where registration was refused
                    dst.copy_(src)
                # The checksum: the GPU's range summed on the GPU beside the copy (`_sum64_pair`),
                # the small CPU range here.
                summing = time.perf_counter()
                pair = sums[0].tolist()
                on_gpu = (pair[0] & _MASK, pair[1] & _MASK)
                head = _sum64_small(buf[:start]) if start else (0, 0)
                meta["checksum"] = _sum64_text(sum64_join(head, on_gpu, start))
            else:
                if event is not None:  # the pageable path: the copies on the side stream, here
                    _, boundary, stream = event
                    with torch.cuda.stream(stream):
                        stream.wait_event(boundary)
                        for src, dst in deferred:
                            dst.copy_(src)
                        stream.synchronize()
                else:
                    for src, dst in deferred:
                        dst.copy_(src)
                summing = time.perf_counter()
                meta["checksum"] = checksum(buf)
            self.checksums_s.append(time.perf_counter() - summing)
            if check is not None and not check():
                self.stale = True  # the runtime makes its plan again; this copy is not committed
                return
            self.commit(meta, slot)
            committed = slot
            self.copies_s.append(time.perf_counter() - started)
            if event is not None and event[0] == "staged":
                self.commits_s.append(time.perf_counter() - committing)
                self.commits_cpu_s.append(time.thread_time() - self.commit_thread_cpu)
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc
        finally:
            if self.on_done is not None:
                self.on_done(meta, None if committed is None else self._maps[committed][1])

    def commit(self, meta: dict, slot: int) -> None:
        """Name `slot` (whole; `meta`: its step, packing, skeleton and checksum) the newest copy:
        its .pkl, then `latest.json` (renamed in, so a reader sees the old copy or the new)."""
        with open(self.directory / f".slot{slot}.pkl.tmp", "wb") as f:
            _dump(meta, f)
        os.replace(self.directory / f".slot{slot}.pkl.tmp", self.directory / f"slot{slot}.pkl")
        now = time.time()
        _write_json(self.directory / LATEST, {"slot": slot, "step": meta["step"], "attempt": self.attempt,
                                              "rank": self.rank, "time": now})
        self._latest_slot = slot
        self.held = Held(meta["step"], self.attempt, self.rank, now)

    def free_slot(self, packing: list, size: int) -> tuple[int, torch.Tensor]:
        """The slot `latest.json` does not name, mapped for a copy of `size` bytes: where a copy
        made elsewhere (another node's rank's, checksummed there) is received, then `commit`ted
        under its sender's checksum (a reader verifies the bytes: a copy torn in transit, or
        half received when this process died, reads as none)."""
        slot = 1 if self._latest_slot == 0 else 0
        return slot, self._mapped(slot, packing, size)

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
        if self._pending is not None:
            start = time.perf_counter()
            self._commit_pending()
            if self.stalls_s and stall:
                self.stalls_s[-1] += time.perf_counter() - start
            return
        done = self._current
        if done is not None:
            start = time.perf_counter()
            done.wait()
            self._current = None
            if self.stalls_s and stall:
                self.stalls_s[-1] += time.perf_counter() - start
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            log.warning("memory copy failed (%s); training goes on, the disk tier still holds", error)

    def settle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the copy in flight to be whole and committed (a worker on
        its way out: that copy is the newest step it holds); True if none is left in flight."""
        if self._pending is not None:
            deadline = time.monotonic() + timeout_s
            while not self.poll():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.001)
            return True
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
        self._gpu.close()

    def guard(self, *_args, **_kwargs) -> None:
        """An optimizer step pre-hook: the copy must be whole before the optimizer changes it.
        On the GPU path that is the staging copy, and the wait is the training stream's."""
        if self._on_device:
            staged, self._staged = self._staged, None
            if staged is not None:
                torch.cuda.current_stream(staged[1]).wait_event(staged[0])
            return
        self.wait()


class StatePlan:
    """A training loop's state split once into the tensors it holds and the skeleton around
    them, so that a capture every step costs no `state_dict()` and no walk over the tensors.

    A module's parameters and buffers and an optimizer's state tensors are the same tensors
    from step to step (changed in place), so the plan keeps the tensors that the first
    `state_dict()` gave (views of them) and the skeleton that refers to them; each step it
    takes afresh only what is small and changes: an optimizer's `param_groups` (a scheduler
    moves the learning rate), and the whole `state_dict()` of the other objects (scheduler,
    sampler, extras), which hold no tensors. `check` runs on the copy thread before a copy is
    committed: it reads the addresses of the tensors the modules and optimizers hold now
    (their own dicts, no `state_dict()`) and compares them with the plan's, so a copy made
    after a tensor was replaced (`p.data = ...`, optimizer state that appears later) is never
    committed and the runtime makes the plan again. `make` returns None for a state it cannot
    follow this way (a state_dict hook, a module's extra state, an optimizer state that is
    not all tensors, tensors in the other objects' state): such a loop takes the full path
    every step."""

    def __init__(self, objects: dict[str, Any], skeleton: dict, groups: dict[str, list], live: list[str],
                 tensors: list[torch.Tensor], later: set[int]):
        self.objects, self.skeleton, self.groups, self.live = objects, skeleton, groups, live
        self.tensors, self.later = tensors, later
        self.addresses: list = []  # `_addresses` when made: what `check` compares

    @staticmethod
    def _static(objects: dict[str, Any]) -> tuple[dict, dict, list[torch.Tensor]] | None:
        """(skeletons, param groups' indices, tensors) of the modules and optimizers."""
        skeleton: dict[str, Any] = {}
        groups: dict[str, list] = {}
        tensors: list[torch.Tensor] = []
        for name, obj in objects.items():
            if isinstance(obj, torch.nn.Module):
                sd = obj.state_dict()
                if any(k.endswith("_extra_state") for k in sd):
                    return None
                skeleton[name] = _split(sd, tensors)
            elif isinstance(obj, torch.optim.Optimizer):
                sd = obj.state_dict()
                if any(not isinstance(v, torch.Tensor) for st in sd["state"].values() for v in st.values()):
                    return None
                if any(isinstance(v, torch.Tensor) for g in sd["param_groups"] for v in g.values()):
                    return None
                skeleton[name] = _split(sd["state"], tensors)
                groups[name] = [g["params"] for g in sd["param_groups"]]
        return skeleton, groups, tensors

    @classmethod
    def make(cls, objects: dict[str, Any]) -> StatePlan | None:
        objects = {k: v for k, v in objects.items() if v is not None}
        if any(_hooked(obj) for obj in objects.values()):
            return None
        static = cls._static(objects)
        if static is None:
            return None
        skeleton, groups, tensors = static
        addresses = _addresses(objects)
        if [a for a in addresses if not isinstance(a, tuple)] != [t.data_ptr() for t in tensors]:
            return None  # state_dict() gave other tensors than the objects' own: not followable
        live = [k for k in objects if k not in skeleton]
        for name in live:
            found: list[torch.Tensor] = []
            _split(objects[name].state_dict(), found)
            if found:
                return None
        later = changed_by_step(objects.values())
        skeleton = {k: _Frozen(v) if isinstance(v, dict) else v for k, v in skeleton.items()}
        plan = cls(objects, skeleton, groups, live, tensors, later)
        plan.addresses = addresses
        return plan

    def state(self) -> dict:
        """This step's skeleton of every object (referring to `tensors`)."""
        out: dict[str, Any] = {}
        for name, obj in self.objects.items():
            if name in self.groups:
                groups = []
                for group, params in zip(obj.param_groups, self.groups[name]):
                    packed = {k: v for k, v in group.items() if k != "params"}
                    packed["params"] = params
                    groups.append(packed)
                out[name] = {"state": self.skeleton[name], "param_groups": groups}
            elif name in self.skeleton:
                out[name] = self.skeleton[name]
            else:
                out[name] = obj.state_dict()
        return out

    def check(self) -> bool:
        """The plan still holds the state: its objects hold the tensors `make` found, at the
        same addresses (read from the modules' and optimizers' own dicts: no `state_dict()`,
        no torch call)."""
        try:
            return _addresses(self.objects) == self.addresses
        except RuntimeError:  # a dict changed while it was read (state made by the optimizer now)
            return False


def changed_by_step(objects: Iterable[Any]) -> set[int]:
    """The storages (`data_ptr`) of `objects` that only an optimizer's step changes: modules'
    parameters and optimizers' state; a capture copies them in a thread (`capture`). Empty
    without an optimizer among `objects`: nothing then tells when the parameters change, and
    they are copied at once."""
    objects = list(objects)
    if not any(isinstance(obj, torch.optim.Optimizer) for obj in objects):
        return set()
    later: set[int] = set()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            later.update(p.untyped_storage().data_ptr() for p in obj.parameters())
        elif isinstance(obj, torch.optim.Optimizer):
            later.update(v.untyped_storage().data_ptr() for st in obj.state.values()
                         for v in st.values() if isinstance(v, torch.Tensor))
    return later


def _hooked(obj: Any) -> bool:
    """`obj`'s state_dict() may give other than its own tensors (a state_dict hook)."""
    if isinstance(obj, torch.nn.Module):
        return any(m._state_dict_hooks or m._state_dict_pre_hooks for m in obj.modules())
    return bool(getattr(obj, "_optimizer_state_dict_pre_hooks", None)
                or getattr(obj, "_optimizer_state_dict_post_hooks", None))


def _addresses(objects: dict[str, Any]) -> list:
    """The data addresses of the tensors the modules and optimizers among `objects` hold, in
    the order of their `state_dict()`s (a module's own parameters, its persistent buffers,
    then its children's; an optimizer's state as it was made), and each optimizer's group
    sizes."""
    out: list = []
    for obj in objects.values():
        if isinstance(obj, torch.nn.Module):
            for _, m in obj.named_modules(remove_duplicate=False):
                out.extend(p.data_ptr() for p in m._parameters.values() if p is not None)
                skip = m._non_persistent_buffers_set
                out.extend(b.data_ptr() for k, b in m._buffers.items() if b is not None and k not in skip)
        elif isinstance(obj, torch.optim.Optimizer):
            for st in obj.state.values():
                out.extend(v.data_ptr() if isinstance(v, torch.Tensor) else None for v in st.values())
            out.append(tuple(len(g["params"]) for g in obj.param_groups))
    return out

def _rng_path(directory: Path, rank: int, step: int, ring: int) -> Path:
    return directory / f"rng.r{rank}.{step % ring}.pkl"


def save_rng(directory: str | Path, rank: int, step: int, state: dict, ring: int) -> None:
    """Keep `rank`'s RNG states after `step` (every rank, every step: a few KB), so that a
    restore from whichever step the node's copy holds gives each rank its own back."""
    path = _rng_path(Path(directory), rank, step, ring)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        _dump({"step": step, "rng": state}, f)
    os.replace(tmp, path)


RNG_SLOT = 32 << 10  # bytes per step in a rank's RNG ring file: header + pickled states (~11 KB)
_RNG_HEAD = struct.Struct("<QII")  # step, payload length, crc32 of the payload


def _ring_path(directory: Path, rank: int) -> Path:
    return directory / f"rng.r{rank}.ring"


def load_rng(directory: str | Path, rank: int, step: int, ring: int) -> dict | None:
    """`rank`'s RNG states after `step`, if this node kept them (its ring file, or the file
    of one step that an oversized state went to)."""
    try:
        with open(_ring_path(Path(directory), rank), "rb") as f:
            f.seek((step % ring) * RNG_SLOT)
            head = f.read(_RNG_HEAD.size)
            kept, length, crc = _RNG_HEAD.unpack(head)
            payload = f.read(length) if length <= RNG_SLOT - _RNG_HEAD.size else b""
        if kept == step and len(payload) == length and zlib.crc32(payload) == crc:
            got = pickle.loads(payload)
            return got["rng"] if isinstance(got, dict) and got.get("step", step) == step else None
    except (OSError, struct.error, EOFError, pickle.UnpicklingError):
        pass
    try:
        with open(_rng_path(Path(directory), rank, step, ring), "rb") as f:
            got = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None
    return got["rng"] if isinstance(got, dict) and got.get("step") == step else None


class RngKeeper:
    """One rank's RNG states, kept beside the memory tier at each copy step, in a ring file of
    fixed slots mapped into memory (`rng.r<rank>.ring`, slot = step % ring): each is
    one pickle of a few KB and a copy into the mapping, on the training thread. (A thread
    that wrote a file per step cost the training thread ~0.6 ms a step on an H100 host,
    through the GIL.) A slot's header (step, length, crc32) is written after its payload,
    so a worker killed mid-write leaves a slot that `load_rng` refuses, not a wrong one."""

    def __init__(self, directory: str | Path, rank: int, ring: int):
        self.directory, self.rank, self.ring = Path(directory), rank, ring
        self.error: OSError | None = None
        self._pickled: dict[str, tuple] = {}  # state name -> (the object, its `_Pickled`)
        self._payload: bytes | None = None  # the last slot's payload, while no state changed
        self._kept: tuple[dict, dict] | None = None  # the last state kept, and its pickled parts
        self._map: mmap.mmap | None = None
        path = _ring_path(self.directory, rank)
        size = ring * RNG_SLOT
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != size:  # a ring of another length: a fresh one
                    os.ftruncate(fd, 0)
                os.posix_fallocate(fd, 0, size)  # pages reserved: a full /dev/shm is an error, not SIGBUS
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.error = exc
        log.warning("rank %d cannot keep its RNG states in %s (%s); a restore from memory "
                    "will not give them back", self.rank, self.directory, exc)

    def keep(self, step: int, state: dict) -> None:
        if self.error is not None or self._map is None:
            return
        # Each state pickled again only when it changed: the Python and numpy ones come as the
        # same objects while they do not (the runtime's `_HostRng`), torch's are compared by
        # their bytes (a step of a GPU job seldom draws from the CPU's generator); and where
        # none changed but the CUDA generator's (its offset moves every step) the payload is
        # made of the same pieces. Pickling them all every step cost ~90 us on an H100 host.
        # (The step is in the slot's header; `load_rng` takes a payload without one.)
        known = self._pickled
        parts = {}
        changed = False
        for name, value in state.items():
            key: Any = value
            if name == "torch" and isinstance(value, torch.Tensor):
                key = value.numpy().tobytes()
            elif name == "cuda" and isinstance(value, list):
                key = tuple(t.numpy().tobytes() for t in value)
            got = known.get(name)
            if got is None or (got[0] is not key if name in ("python", "numpy") else got[0] != key):
                got = known[name] = (key, _Pickled(value))
                changed = True
            parts[name] = got[1]
        self._kept = (state, parts)
        if changed or self._payload is None:
            buf = io.BytesIO()
            _dump({"rng": parts}, buf)
            self._payload = bytes(buf.getbuffer())
        payload = self._payload
        n = len(payload)
        if n > RNG_SLOT - _RNG_HEAD.size:  # a state larger than a slot: a file of its own
            try:
                save_rng(self.directory, self.rank, step, state, self.ring)
            except OSError as exc:
                self._fail(exc)
            return
        at = (step % self.ring) * RNG_SLOT
        _RNG_HEAD.pack_into(self._map, at, 0, 0, 0)  # the slot is not whole while it is written
        self._map[at + _RNG_HEAD.size:at + _RNG_HEAD.size + n] = payload
        _RNG_HEAD.pack_into(self._map, at, step, n, zlib.crc32(payload))

    def pickled(self, state: dict) -> dict | None:
        """The parts `keep` pickled `state` to, if it was the last state kept (the very
        object): a copy's metadata holds them as those bytes (`_Pickler`), so the copy's
        commit does not pickle the same RNG states again (~0.15 ms on an H100 host)."""
        kept = self._kept
        return dict(kept[1]) if kept is not None and kept[0] is state else None

    def flush(self, timeout_s: float = 5.0) -> None:
        """Nothing is pending: `keep` writes at once (kept for the runtime's finish)."""
