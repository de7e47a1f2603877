"""The GPUs a node has and its workers may use.

A node's GPUs are those `nvidia-smi --query-gpu` lists on this host, narrowed to the ones
`CUDA_VISIBLE_DEVICES` names when that is set (by hand, or by `ftrain node --gpus`, which
sets it for the agent and so for every worker it starts). The node reports their count and
model at registration; `nproc_per_node: "auto"` is their count (one worker when there are none).

`parse_gpus` and `visible` are pure; `detect` runs nvidia-smi (when it is on PATH).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Gpu:
    index: str
    uuid: str
    name: str


@dataclass(frozen=True)
class NodeGpus:
    count: int
    model: str | None  # the first visible GPU's name; None without any (or without nvidia-smi)


def parse_gpus(value: str) -> list[str]:
    """`--gpus` as a list of device ids: '0,1' -> ['0', '1']; 'none' or '' -> [].

    Raises ValueError for an empty item or a repeated one."""
    value = value.strip()
    if value in ("", "none"):
        return []
    items = [v.strip() for v in value.split(",")]
    if any(not v or "=" in v or " " in v for v in items):
        raise ValueError(f"--gpus {value!r}: a comma-separated list of GPU indices or UUIDs, or 'none'")
    if len(set(items)) != len(items):
        raise ValueError(f"--gpus {value!r} names a GPU twice")
    return items


def visible(listed: list[Gpu], cuda_visible: str | None) -> list[Gpu] | int:
    """The listed GPUs that `CUDA_VISIBLE_DEVICES` leaves visible, in its order.

    Unset: all of them. CUDA stops at the first id it cannot match ('-1' hides all).
    With nothing listed (no nvidia-smi) the answer is only a count: the ids it names."""
    if cuda_visible is None:
        return listed
    ids = [v.strip() for v in cuda_visible.split(",") if v.strip()]
    if not listed:
        count = 0
        for v in ids:
            if not (v.isdigit() or v.startswith(("GPU-", "MIG-"))):
                break
            count += 1
        return count
    out: list[Gpu] = []
    for v in ids:
        match = [g for g in listed if g.index == v or (v.startswith("GPU-") and g.uuid.startswith(v))]
        if not match or match[0] in out:
            break
        out.append(match[0])
    return out


def split(gpus: list[str], parts: int) -> list[list[str]]:
    """`gpus` dealt out in `parts` contiguous shares, as even as can be (earlier ones larger).

    With fewer GPUs than parts, the last parts get none."""
    base, extra = divmod(len(gpus), parts)
    out, i = [], 0
    for p in range(parts):
        n = base + (1 if p < extra else 0)
        out.append(gpus[i:i + n])
        i += n
    return out


def list_gpus() -> list[Gpu]:
    """The GPUs `nvidia-smi` lists on this host ([] without nvidia-smi or when it fails)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    gpus = []
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) == 3 and parts[0].isdigit():
            gpus.append(Gpu(*parts))
    return gpus


def detect(environ: dict[str, str] | None = None) -> NodeGpus:
    """This node's GPUs: nvidia-smi's list narrowed by CUDA_VISIBLE_DEVICES."""
    environ = os.environ if environ is None else environ
    seen = visible(list_gpus(), environ.get(CUDA_VISIBLE_DEVICES))
    if isinstance(seen, int):
        return NodeGpus(seen, None)
    return NodeGpus(len(seen), seen[0].name if seen else None)


def unknown(ids: list[str], listed: list[Gpu]) -> list[str]:
    """The ids in `ids` that name none of the `listed` GPUs (none are checked without a list)."""
    if not listed:
        return []
    return [v for v in ids if visible(listed, v) == []]


def host_ids(environ: dict[str, str] | None = None) -> list[str]:
    """The ids of this host's GPUs that `ftrain up` deals out to its agents: nvidia-smi's UUIDs
    (CUDA's own order of devices may differ from nvidia-smi's indices; a UUID is the same
    GPU for both), narrowed by `up`'s own CUDA_VISIBLE_DEVICES; without nvidia-smi, the ids
    CUDA_VISIBLE_DEVICES names, if any."""
    environ = os.environ if environ is None else environ
    cvd = environ.get(CUDA_VISIBLE_DEVICES)
    listed = list_gpus()
    seen = visible(listed, cvd)
    if isinstance(seen, int):
        return [v.strip() for v in (cvd or "").split(",") if v.strip()][:seen]
    return [g.uuid or g.index for g in seen]
