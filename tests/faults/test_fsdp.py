"""FSDP2 jobs on a real cluster (etcd, the control plane, two node agents, torchrun workers
over gloo): examples/train_fsdp.py, a transformer sharded with `fully_shard`, whose
snapshots are every rank's shards (worker/tiers/sharded.py), on disk and in each node's
memory tier with a replica on another node (worker/tiers/sharded_memory.py).

A worker SIGKILLed costs at most one step, from disk or from memory alone; two of them end
bit for bit like a run without; a node lost costs at most one step from memory, whether the
job goes on alone (resharded) or a spare takes its place (the replica sent); a job that goes
2 -> 1 -> 2 nodes (a drain, then the node back) sees each sample of an epoch once and ends
with the very weights of the same resizes made under plain torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from bench.harness import rank0_lines
from tests.helpers.elastic import job, job_spec, log_items, submit, wait_nodes, wait_state
from tests.helpers.faults import (
    KEEP_ALL,
    events_of,
    runs,
    steps_lost,
    wait_workers,
)
from tests.helpers.processes import free_port, pid_alive, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN_FSDP = REPO / "examples" / "train_fsdp.py"
START = re.compile(r"^start step=(\d+) world=(\d+)")
SLOW = [pytest.mark.slow, pytest.mark.skipif(not os.environ.get("FTRAIN_TEST_SLOW"),
                                             reason="slow (minutes): set FTRAIN_TEST_SLOW=1 to run it")]


# One thread per worker, in the job and in its replay under torchrun (which sets it for more
# than one process a node): a matrix product summed by more threads differs in its last bits.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


# The memory tier copies every rank's shards every step (a loaded machine would otherwise
# space the copies out), and disk snapshots are so rare that what a restart does not retrain
# can come only from memory.
MEMORY_EVERY_STEP = {"FTRAIN_MEMORY_EVERY": "1"}
DISK_RARELY = 1000


def fsdp_spec(name: str, steps: int, *args: str, every: int = 1, mn: int = 2, mx: int = 2,
              delay_s: float = 0.1, env: dict | None = None, nproc: int = 1) -> dict:
    return job_spec(name, "--steps", str(steps), "--step-delay", str(delay_s), *args, script=TRAIN_FSDP,
                    mn=mn, mx=mx, nproc_per_node=nproc, snapshot={"every_steps": every, "keep": KEEP_ALL},
                    env={**ONE_THREAD, **(env or {})})


def logged_step(api, job_id: str) -> int:
    got = runs(api, job_id)
    return got[-1][1][-1] if got and got[-1][1] else 0


def test_a_worker_sigkill_of_an_fsdp_job_loses_at_most_one_step(api, agents, tmp_path):
    started = agents(2)
    wait_nodes(api, 2)
    out = tmp_path / "final.pt"
    job_id = submit(api, fsdp_spec("fsdp-kill", 24, "--out", str(out)))
    wait_for(lambda: logged_step(api, job_id) >= 8, 120, "rank 0 past step 8")
    victim = wait_workers(started[1], 1, script=TRAIN_FSDP)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim), 10, "the SIGKILLed worker to die")

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert done["restarts"] == 1
    assert steps_lost(api, job_id, 24) <= 1, runs(api, job_id)
    # Every snapshot is a directory of both ranks' shards; the last one is committed.
    snaps = api.get(f"/v1/jobs/{job_id}/snapshots").json()
    assert snaps["latest"] == 24 and {s["shards"] for s in snaps["items"]} == {2}
    assert all(Path(s["path"]).is_dir() for s in snaps["items"])
    assert set(torch.load(out)) >= {"embed.weight", "head.weight"}


def _replay(tmp_path: Path, worlds: list[tuple[int, int]], steps: int, *args: str) -> dict:
    """The same training without the service: plain torchrun, the runtime's local twin, a
    snapshot every step, stopped and started again at the same steps with the same numbers
    of ranks as the job (`worlds`: (start step, ranks))."""
    out = tmp_path / "replay.pt"
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(REPO), "FTRAIN_SNAPSHOT_DIR": str(tmp_path / "replay"),
           "FTRAIN_SNAPSHOT_EVERY": "1"}
    ends = [start for start, _ in worlds[1:]] + [steps]
    for (_, ranks), end in zip(worlds, ends):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                        "--master-port", str(free_port()), str(TRAIN_FSDP), "--steps", str(end), *args,
                        "--out", str(out)], check=True, cwd=REPO, env=env, capture_output=True, timeout=120)
    return torch.load(out)


def _samples_by_step(seen: Path) -> dict[int, list[int]]:
    """Each step's global batch, from every rank's notes (a step made again: its last notes)."""
    by_rank: dict[tuple[str, int], list[int]] = {}
    for path in seen.parent.glob(f"{seen.name}.*"):
        for line in path.read_text().splitlines():
            step, *indices = map(int, line.split())
            by_rank[(path.name, step)] = indices
    steps: dict[int, list[int]] = {}
    for (_, step), indices in sorted(by_rank.items()):
        steps.setdefault(step, []).extend(indices)
    return steps


@pytest.mark.parametrize("steps", [pytest.param(80, marks=SLOW)])
def test_an_fsdp_job_resized_2_1_2_sees_each_sample_once_and_ends_as_the_same_resizes_without_the_service(api, agents, tmp_path,
                                                                                    steps):
    """64 samples, a global batch of 16: 4 steps an epoch. A drain takes the job to one node
    and its undrain back to two, each a planned change (a sharded snapshot every rank writes,
    resharded on load)."""
    agents(2)
    wait_nodes(api, 2)
    seen, out = tmp_path / "seen", tmp_path / "final.pt"
    data = ("--samples", "64")
    job_id = submit(api, fsdp_spec("fsdp-resize", steps, *data, "--out", str(out),
                                   "--seen", str(seen), every=1000, mn=1, mx=2, delay_s=0.2))
    wait_for(lambda: job(api, job_id)["world_size"] == 2 and logged_step(api, job_id) >= 10, 120,
             "two ranks past step 10")
    assert api.post("/v1/nodes/n1/drain").status_code == 202
    wait_for(lambda: job(api, job_id)["world_size"] == 1 and len(runs(api, job_id)) >= 2, 120, "one rank")
    wait_for(lambda: logged_step(api, job_id) >= runs(api, job_id)[-1][0] + 10, 120, "ten steps on one rank")
    assert api.post("/v1/nodes/n1/undrain").status_code == 200
    wait_for(lambda: len(runs(api, job_id)) >= 3, 120, "two ranks again")

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=180)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert steps_lost(api, job_id, steps, restarts=2) == 0, runs(api, job_id)
    worlds = [(int(step), int(world)) for item in rank0_lines(api, job_id)
              if (m := START.match(item["line"])) for step, world in [m.groups()]]
    assert [world for _, world in worlds] == [2, 1, 2], worlds

    by_step = _samples_by_step(seen)
    assert sorted(by_step) == list(range(1, steps + 1))
    for epoch in range(steps // 4):
        count = Counter(i for step in range(4 * epoch + 1, 4 * epoch + 5) for i in by_step[step])
        assert sorted(count) == list(range(64)) and set(count.values()) == {1}, f"epoch {epoch}"

    # Bit for bit the weights of the same resizes made without the service (a run that never
    # resized differs in the last bits: its sums over the batch are added in another order).
    final, replay = torch.load(out), _replay(tmp_path, worlds, steps, *data)
    assert final.keys() == replay.keys()
    assert [name for name in final if not torch.equal(final[name], replay[name])] == []


def _memory_restores(api, job_id: str) -> list[str]:
    """The restore points the control plane decided from the members' memory."""
    return [e["reason"] for e in events_of(api, job_id) if "in the memory of" in e["reason"]]


def _kill_a_worker_past(api, agent, job_id: str, step: int, workers: int = 1) -> None:
    """SIGKILL one of `agent`'s `workers` once rank 0 logged `step` in the current run."""
    wait_for(lambda: (got := runs(api, job_id)) and got[-1][1] and got[-1][1][-1] >= step, 120,
             f"rank 0 past step {step}")
    victim = wait_workers(agent, workers, script=TRAIN_FSDP)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim), 10, "the SIGKILLed worker to die")


def test_a_worker_sigkill_of_an_fsdp_job_resumes_from_every_ranks_shards_in_memory(api, agents, tmp_path):
    started = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, fsdp_spec("fsdp-memory", 24, every=DISK_RARELY, env=MEMORY_EVERY_STEP))
    _kill_a_worker_past(api, started[1], job_id, 8)

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert done["restarts"] == 1
    assert steps_lost(api, job_id, 24) <= 1, runs(api, job_id)
    restart = runs(api, job_id)[1][0]
    assert any(f"resumes from step {restart} in the memory of n0, n1" in r
               for r in _memory_restores(api, job_id)), events_of(api, job_id)
    lines = [item["line"] for item in rank0_lines(api, job_id)]
    assert any(f"resumed from memory (step {restart}, its own shards" in line for line in lines)


@pytest.mark.parametrize("steps", [pytest.param(40, marks=SLOW)])
def test_an_fsdp_job_with_two_worker_sigkills_ends_bit_for_bit_like_one_without(api, agents, tmp_path, steps):
    """Both restarts resume from the memory tier (disk snapshots are too rare to help) at the
    same world size; the weights end as those of the same training under plain torchrun,
    never stopped."""
    started = agents(2)
    wait_nodes(api, 2)
    out = tmp_path / "final.pt"
    job_id = submit(api, fsdp_spec("fsdp-twice", steps, "--out", str(out), every=DISK_RARELY,
                                   env=MEMORY_EVERY_STEP))
    _kill_a_worker_past(api, started[1], job_id, 10)
    wait_for(lambda: len(runs(api, job_id)) >= 2, 120, "the first restart")
    _kill_a_worker_past(api, started[0], job_id, 25)

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=180)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    steps_lost(api, job_id, steps, restarts=2)  # every run trained on from where it started
    got = runs(api, job_id)
    assert all(max(before[1]) - after[0] <= 1 for before, after in zip(got, got[1:])), got
    assert len(_memory_restores(api, job_id)) >= 2, events_of(api, job_id)
    final, clean = torch.load(out), _replay(tmp_path, [(0, 2)], steps)
    assert final.keys() == clean.keys()
    assert [name for name in final if not torch.equal(final[name], clean[name])] == []


@pytest.mark.parametrize("steps", [pytest.param(24, marks=SLOW)])
def test_an_fsdp_job_that_loses_a_node_goes_on_alone_from_its_shards_in_memory_resharded(
        api, agents, tmp_path, steps):
    """A node's agent SIGKILLed with its whole tree: the job (1 to 2 nodes) goes on alone. The
    survivor holds its own shards and the replica of the lost node's (disk snapshots are too
    rare to help): rank 0 joins them and the group of one reshards them from memory."""
    started = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, fsdp_spec("fsdp-node", steps, mn=1, mx=2, every=DISK_RARELY, env=MEMORY_EVERY_STEP))
    wait_for(lambda: job(api, job_id)["world_size"] == 2 and logged_step(api, job_id) >= 8, 120,
             "two ranks past step 8")
    killed = started[1].kill_tree()
    wait_for(lambda: not any(pid_alive(p) for p in killed), 10, "every process of agent n1 to die")

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=180)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert steps_lost(api, job_id, steps) <= 1, runs(api, job_id)
    restart = runs(api, job_id)[1][0]
    assert any(f"resumes from step {restart} in the memory of n0" in r
               for r in _memory_restores(api, job_id)), events_of(api, job_id)
    lines = [item["line"] for item in rank0_lines(api, job_id)]
    assert any(f"shards of step {restart} were saved by 2 ranks and the group has 1 now: rank 0 joins them"
               in line for line in lines), "\n".join(line for line in lines if "ftrain.runtime" in line)
    assert any(f"resumed from memory (step {restart}, the shards of its 2 ranks, joined on rank 0 and resharded)"
               in line for line in lines), "\n".join(line for line in lines if "ftrain.runtime" in line)
    assert any(m and m.group(2) == "1" for m in map(START.match, lines))


@pytest.mark.parametrize("steps", [pytest.param(24, marks=SLOW)])
def test_an_fsdp_job_that_loses_a_node_resumes_from_the_replica_of_its_shards_on_another(
        api, agents, tmp_path, steps):
    """Three nodes, a job of two: a member's agent SIGKILLed with its whole tree, the spare
    takes its place at the same world size. The lost node's shards are in the survivor's
    memory (each rank keeps a replica of the next node's), which sends them to the rank that
    now needs them: the job resumes from memory, not from disk."""
    started = agents(3)
    wait_nodes(api, 3)
    job_id = submit(api, fsdp_spec("fsdp-replica", steps, every=DISK_RARELY, env=MEMORY_EVERY_STEP))
    wait_for(lambda: logged_step(api, job_id) >= 8, 120, "two ranks past step 8")
    members = job(api, job_id)["nodes"]
    lost = next(agent for agent in started if agent.name == members[-1])
    killed = lost.kill_tree()
    wait_for(lambda: not any(pid_alive(p) for p in killed), 10, f"every process of agent {lost.name} to die")

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=180)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert lost.name not in job(api, job_id)["nodes"]
    assert steps_lost(api, job_id, steps) <= 1, runs(api, job_id)
    restart = runs(api, job_id)[1][0]
    assert any(f"resumes from step {restart} in the memory of" in r for r in _memory_restores(api, job_id)), \
        events_of(api, job_id)
    lines = [item["line"] for item in log_items(api, job_id)]
    assert any(f"resumed from memory (step {restart}, its shards sent by rank" in line for line in lines)


@pytest.mark.parametrize("steps", [pytest.param(60, marks=SLOW)])
def test_an_hsdp_job_resumes_a_worker_sigkill_from_memory_and_ends_bit_for_bit_like_one_without(
        api, agents, tmp_path, steps):
    """HSDP: two nodes of two ranks, the model sharded over each node's ranks and replicated
    across the nodes (a 2 x 2 mesh). A worker SIGKILLed: the group resumes from every rank's
    shards in memory, at most one step lost, and ends with the weights of the same run under
    plain torchrun without the fault."""
    started = agents(2, nproc=2)
    wait_nodes(api, 2)
    out = tmp_path / "final.pt"
    job_id = submit(api, fsdp_spec("hsdp", steps, "--replicate", "2", "--out", str(out), every=DISK_RARELY,
                                   env=MEMORY_EVERY_STEP, nproc=2))
    _kill_a_worker_past(api, started[1], job_id, 8, workers=2)

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=180)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert steps_lost(api, job_id, steps) <= 1, runs(api, job_id)
    restart = runs(api, job_id)[1][0]
    assert any(f"resumes from step {restart} in the memory of" in r for r in _memory_restores(api, job_id)), \
        events_of(api, job_id)
    final = torch.load(out)
    clean = _replay(tmp_path, [(0, 4), (restart, 4)], steps, "--replicate", "2")
    assert final.keys() == clean.keys()
    assert [name for name in final if not torch.equal(final[name], clean[name])] == []
