"""On a restore from the memory tier every rank gets its own RNG states back (not those of
the node's first rank, nor a fresh seed): two real gloo ranks of one node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.embedded import free_port
from worker import memory as mem
from worker import runtime

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "rng_ranks.py"


def _run_group(memory: Path, steps: int, out: Path, every: int = 1) -> list[str]:
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--memory", str(memory), "--steps",
                                       str(steps), "--out", str(out), "--every", str(every)],
                                      env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


def test_each_rank_resumes_its_own_rng_from_memory(tmp_path):
    """Each rank gets its own RNG states back (not those of the node's first rank, nor a fresh
    seed). Rank 0 picks the copy steps and tells every rank with its per-step broadcast; on CPU
    each rank keeps its RNG states of every step (whichever step a survivor's last-words copy
    holds, worker/last_words.py; on a GPU only at the copy steps: the CUDA capture costs), and a
    restore from the copy is exact for each rank."""
    memory = tmp_path / "memory"
    memory.mkdir()
    _run_group(memory, 6, tmp_path / "first", every=3)  # copies at steps 3 and 6
    ring = 2 * runtime.MEMORY_EVERY_MAX + 2
    for rank in (0, 1):
        kept = [s for s in range(1, 7) if mem.load_rng(memory, rank, s, ring) is not None]
        assert kept == [1, 2, 3, 4, 5, 6]
    first = [(tmp_path / f"first.{r}").read_bytes() for r in (0, 1)]
    assert first[0] != first[1]
    # A restart: both ranks resume from the node's copy of step 6 and stop at once.
    outputs = _run_group(memory, 6, tmp_path / "again", every=3)
    assert all("start step=6 tier=memory" in o for o in outputs), outputs
    assert [(tmp_path / f"again.{r}").read_bytes() for r in (0, 1)] == first
