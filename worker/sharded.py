"""Sharded snapshots: an FSDP2 model and its optimizer saved by every rank's own shards with
torch.distributed.checkpoint (DCP), and loaded at any world size.

A sharded snapshot is a directory in the job's snapshot folder:

    <dir>/.step-<step>.dcp.tmp-<token>/      every rank writes into it (DCP's FileSystemWriter)
        __<rank>_<n>.distcp                  each rank's shards of the model and optimizer
        .metadata                            DCP's index, written by rank 0 once every rank's
                                             writes are done (its last collective gathers them)
        ftrain-sums-<rank>.json              each rank: its own files' sizes and SHA-256 tree sums
        ftrain-state.pt                      rank 0: step, world size, every rank's RNG states,
                                             scheduler, sampler, extras (small, weights-only)
        ftrain-manifest.json                 rank 0, last: every file above, size and tree sum
    rename -> <dir>/step-<step:012d>.dcp ; fsync(dir)

Rank 0 commits it to the control plane (path, total size, sha256 of the manifest) only once
the manifest lists every rank's sums: a committed snapshot holds every rank's shards whole.
A restore verifies the manifest's checksum and each file's size and sum against it (a
damaged one is reported and skipped for the one before, as for a snapshot file), and DCP's
load plans put each shard where the new world's ranks want it: 2 ranks' snapshot loads into
1 or 4.

The write runs off the training thread: `dcp.async_save` copies the shards to host memory on
the training thread (the stall) and writes them from a thread, over a gloo group of its own
(a collective from that thread on the training's group would interleave with the training's).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import snapshot as snap
from .protocol import SHARDED_MANIFEST

SUFFIX = ".dcp"
TMP_MARK = snap.SHARDED_TMP_MARK
MANIFEST = SHARDED_MANIFEST
STATE_FILE = "ftrain-state.pt"
SUMS = "ftrain-sums-{rank}.json"
# How long rank 0 waits for the other ranks' sums once its own write is done: they finished
# writing before DCP's last collective returned, so this is only their hashing.
SUMS_WAIT_S = 600.0


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` is sharded with FSDP2 (`fully_shard`): its parameters are DTensors."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch before 2.4
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def snapshot_name(step: int) -> str:
    return f"step-{step:012d}{SUFFIX}"


def is_snapshot_dir(path: str | Path) -> bool:
    return Path(path).name.endswith(SUFFIX)


def model_and_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """The model's and optimizer's sharded state dicts (DTensors), as DCP saves and loads them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> bool:
    """Install this rank's own shards of the optimizer's state (`saved`: the state dict
    `model_and_optimizer` gave, keyed by parameter names, each DTensor as its local shard) as
    the optimizer's state, at the world size they were saved at. `get_state_dict` first makes
    the state by a step with zero gradients (a zero tensor per parameter and state, and every
    op of the step through DTensor's dispatch: 4.2 s of a 6.2 s restore of 100M parameters on
    CPU) only for `set_state_dict` to overwrite it; here each state tensor is made once, from
    its shard, and `Optimizer.load_state_dict` takes it as its own. Returns False, loading
    nothing, where `saved` does not pair up with the optimizer's parameters group by group, or
    holds a state tensor that is neither a scalar nor of its parameter's local shape (then the
    caller loads it the torch way)."""
    saved_groups, saved_state = saved.get("param_groups"), saved.get("state")
    by_name = optimizer_params(optimizer, saved_groups)
    if by_name is None or not isinstance(saved_state, dict):
        return False
    state: dict[str, dict] = {}
    for name, values in saved_state.items():
        param = by_name.get(name)
        if param is None or not isinstance(values, dict):  # not a parameter of this optimizer's
            return False
        state[name] = {}
        for key, value in values.items():
            if (got := _param_state(key, value, param)) is None:
                return False
            state[name][key] = got
    load_named_optimizer_state(optimizer, state, saved_groups)
    return True


def optimizer_params(optimizer: torch.optim.Optimizer, saved_groups: Any) -> dict[str, torch.Tensor] | None:
    """The optimizer's parameters by the names a saved state dict's groups give them (paired by
    place, group by group, as `Optimizer.load_state_dict` pairs them), or None where the groups
    do not pair up."""
    groups = optimizer.param_groups
    if (not isinstance(saved_groups, list) or len(groups) != len(saved_groups)
            or any(len(g["params"]) != len(s.get("params", ())) for g, s in zip(groups, saved_groups))):
        return None
    return {name: param for g, s in zip(groups, saved_groups) for param, name in zip(g["params"], s["params"])}


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, dict], groups: list[dict]) -> None:
    """`Optimizer.load_state_dict` of a state keyed by parameter names (`groups` name them, in
    the optimizer's order), each state tensor already the optimizer's own."""
    ids = {name: i for i, name in enumerate(n for g in groups for n in g["params"])}
    optimizer.load_state_dict({"state": {ids[name]: values for name, values in state.items()},
                               "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in groups]})


def _param_state(key: str, value: Any, param: torch.Tensor) -> Any:
    """One saved state entry of `param`, made the optimizer's: a shard of the parameter's
    local shape as a DTensor of the parameter's mesh and placements, on its device; a scalar
    (a step counter) as a tensor of its own; None where it fits neither."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, torch.Tensor):
        return value
    if not isinstance(param, DTensor):
        return value.clone()  # `load_state_dict` moves it to the parameter's device
    local = param.to_local()
    if key != "step" and value.shape == local.shape:
        own = torch.empty(local.shape, dtype=value.dtype, device=local.device)
        own.copy_(value)  # a tensor of its own: a view would keep the whole copy it was read into
        return DTensor.from_local(own, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    if value.dim() == 0:
        return value.clone()
    return None


def full_model_state(model: torch.nn.Module) -> dict:
    """The whole model's state_dict on the CPU: gathered from every rank's shards for an FSDP2
    model (a collective: every rank calls it), the plain state_dict for any other."""
    if not is_sharded(model):
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        return {k: v.detach().cpu() for k, v in inner.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class HostShards:
    """A rank's shards copied to host memory at a snapshot, into buffers kept from one snapshot
    to the next (page-locked where the shards are on a GPU): the copy is one pass at the link's
    speed, with nothing allocated or pinned after the first snapshot. DCP's own staging copies
    into fresh pageable memory each time (a 12 GB state stalled a step for 24 s on an H200) and
    its reusable stager fails on the classes a GPU DTensor's spec holds from its second use."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # in the order the state's tensors come
        self._next = 0
        self._on_gpu = False

    def copy(self, state: Any) -> Any:
        """`state` with every tensor copied to host memory (a DTensor: its local shard, in a
        DTensor of the same mesh and placements), whole when this returns."""
        self._next, self._on_gpu = 0, False
        out = self._walk(state)
        if self._on_gpu:  # the copies went on this stream (not the memory tier's: it is not waited for)
            torch.cuda.current_stream().synchronize()
        return out

    def close(self) -> None:
        self.buffers = []

    def _walk(self, state: Any) -> Any:
        from torch.distributed.tensor import DTensor

        def host(x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                return DTensor.from_local(self._host(x.to_local()), x.device_mesh, x.placements,
                                          shape=x.shape, stride=x.stride(), run_check=False)
            return self._host(x.detach())

        return snap.map_tensors(state, host)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        buf = self.buffers[i] if i < len(self.buffers) else None
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            if i < len(self.buffers):
                self.buffers[i] = buf
            else:
                self.buffers.append(buf)
        buf.copy_(t, non_blocking=True)
        self._on_gpu = self._on_gpu or t.device.type == "cuda"
        return buf


def _as_is() -> Any:
    """A DCP stager that stages nothing: the state it is given is already a copy (HostShards')."""
    try:
        from torch.distributed.checkpoint.staging import AsyncStager
    except ImportError:  # pragma: no cover - older torch
        return None

    class AsIs(AsyncStager):
        _synchronize_after_execute = False

        def stage(self, state_dict: Any) -> Any:
            return state_dict

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return AsIs()


def start_save(state: dict, tmp: Path, group: Any, host: HostShards | None = None) -> Future:
    """Every rank: copy its shards to host memory (here: `host`'s kept buffers, else DCP's own
    staging) and write them from a thread (DCP)."""
    import torch.distributed.checkpoint as dcp

    as_is = _as_is() if host is not None else None
    if as_is is None:
        return dcp.async_save(state, checkpoint_id=str(tmp), process_group=group)
    return dcp.async_save(host.copy(state), checkpoint_id=str(tmp), process_group=group, async_stager=as_is)


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: Path) -> None:
    """Every rank: its shards of `path`'s model and optimizer, resharded for this world (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict, set_model_state_dict

    state = model_and_optimizer(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _sha256(path: Path) -> str:
    """The file's SHA-256 in one pass (the sums of manifests written before tree sums)."""
    digest = hashlib.new(snap.CHECKSUM_ALGO)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return f"{snap.CHECKSUM_ALGO}:{digest.hexdigest()}"


TREE_CHUNK = 64 << 20  # part of the sum's kind (TREE_ALGO): a file summed again is cut alike
TREE_ALGO = f"{snap.CHECKSUM_ALGO}-tree-64MiB"


def tree_sum(path: Path) -> str:
    """The file's SHA-256 tree sum: the SHA-256 of its 64 MiB chunks' SHA-256 digests, one
    after the other, the chunks hashed on several threads at once (`snap.over_chunks`). One
    SHA-256 of a whole file is one core's pass: 10.7 s of a 25 s restore of a 12 GB shard on
    an H200 host, and as long again before its commit."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)

    def chunk(start: int, length: int) -> bytes:
        digest = hashlib.new(snap.CHECKSUM_ALGO)
        at, end = start, start + length
        while at < end:
            data = os.pread(fd, min(1 << 22, end - at), at)
            if not data:
                raise OSError(f"{path} ended at byte {at} of {size}")
            digest.update(data)
            at += len(data)
        return digest.digest()

    try:
        digests = snap.over_chunks(size, TREE_CHUNK, chunk)
    finally:
        os.close(fd)
    return f"{TREE_ALGO}:{hashlib.new(snap.CHECKSUM_ALGO, b''.join(digests)).hexdigest()}"


def _matches(path: Path, want: str) -> bool:
    """Whether the file has the sum `want`, taken the way `want` names (a tree sum, or one
    SHA-256 of the whole file in manifests written before tree sums)."""
    algo = want.partition(":")[0]
    if algo == TREE_ALGO:
        return tree_sum(path) == want
    if algo == snap.CHECKSUM_ALGO:
        return _sha256(path) == want
    raise snap.SnapshotCorrupt(f"{path}: the manifest's sum {want[:40]!r} is of no kind this version knows")


def _write_json(path: Path, data: Any) -> bytes:
    """Atomically (temporary file, fsync, rename); returns the bytes written."""
    body = json.dumps(data, indent=1, sort_keys=True).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return body


def write_own_sums(tmp: Path, rank: int) -> None:
    """Every rank, once its DCP write is done: its own shard files' sizes and checksums."""
    files = {p.name: [p.stat().st_size, tree_sum(p)] for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}
    _write_json(tmp / SUMS.format(rank=rank), files)


def _wait_for_sums(tmp: Path, world_size: int, timeout_s: float) -> dict[str, list]:
    """Rank 0: every rank's sums (each written atomically), merged; OSError at the timeout."""
    deadline = time.monotonic() + timeout_s
    files: dict[str, list] = {}
    for rank in range(world_size):
        path = tmp / SUMS.format(rank=rank)
        while not path.exists():
            if time.monotonic() >= deadline:
                raise OSError(f"rank {rank} did not report its shards of {tmp.name} within {timeout_s:g} s")
            time.sleep(0.01)
        files.update(json.loads(path.read_text()))
    return files


@dataclass
class ShardedSave(snap.PendingSnapshot):
    """Rank 0's part of one sharded snapshot, completed by `AsyncWriter`'s thread: its own
    DCP write awaited, every rank's sums gathered, the small state written, the manifest
    written last, the directory renamed into place."""

    future: Future
    tmp: Path
    world_size: int
    small_state: dict
    sums_wait_s: float = SUMS_WAIT_S

    def complete(self, directory: Path, step: int) -> snap.WrittenSnapshot:
        began = time.perf_counter()
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            try:
                self.future.result()
            except CheckpointException as exc:  # a rank's storage refused: this snapshot is lost, not the run
                raise OSError(f"the shards of step {step} were not all written: {exc}") from exc
            write_own_sums(self.tmp, 0)
            files = _wait_for_sums(self.tmp, self.world_size, self.sums_wait_s)
            state_file = snap.write_atomic(self.small_state, self.tmp, step)
            os.replace(state_file.path, self.tmp / STATE_FILE)
            for name in (".metadata", STATE_FILE):
                files[name] = [(self.tmp / name).stat().st_size, tree_sum(self.tmp / name)]
            body = _write_json(self.tmp / MANIFEST, {"step": step, "world_size": self.world_size,
                                                      "files": files})
            final = directory / snapshot_name(step)
            if final.exists():  # an uncommitted write of this step by an earlier group
                shutil.rmtree(final)
            os.replace(self.tmp, final)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        snap.fsync_dir(directory)
        digest = hashlib.new(snap.CHECKSUM_ALGO, body).hexdigest()
        size = len(body) + sum(size for size, _ in files.values())
        return snap.WrittenSnapshot(step=step, path=str(final), size=size,
                                    checksum=f"{snap.CHECKSUM_ALGO}:{digest}",
                                    write_s=time.perf_counter() - began, shards=self.world_size)


def verify(path: Path, checksum: str, size: int | None = None) -> None:
    """Raise SnapshotCorrupt unless the directory's manifest has this checksum and every file it
    lists is there with its size and checksum."""
    try:
        body = (path / MANIFEST).read_bytes()
        actual = f"{snap.CHECKSUM_ALGO}:{hashlib.new(snap.CHECKSUM_ALGO, body).hexdigest()}"
        if actual != checksum:
            raise snap.SnapshotCorrupt(f"{path}/{MANIFEST} has checksum {actual}, the commit said {checksum}")
        files = json.loads(body)["files"]
        total = len(body)
        for name, (want_size, want_sum) in sorted(files.items()):
            file = path / name
            got = file.stat().st_size
            if got != want_size:
                raise snap.SnapshotCorrupt(f"{file} is {got} bytes, the manifest says {want_size}")
            if not _matches(file, want_sum):
                raise snap.SnapshotCorrupt(f"{file} does not match its checksum in the manifest")
            total += got
    except OSError as exc:
        raise snap.SnapshotCorrupt(f"cannot read {path}: {exc}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise snap.SnapshotCorrupt(f"{path}/{MANIFEST} is not a manifest: {exc}") from exc
    if size is not None and total != size:
        raise snap.SnapshotCorrupt(f"{path} holds {total} bytes, the commit said {size}")


def checkpoint_group(backend: str | None = None) -> Any:
    """A gloo group for DCP's writes from a thread (every rank calls it, at the same point)."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend=backend or "gloo")
