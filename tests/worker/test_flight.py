"""A worker's flight-recorder trace on the agent's request (worker/flight.py): torch records
every collective of a process group, and a thread of the worker dumps them into its folder
while its main thread waits in one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worker import flight
from tests.helpers.processes import wait_for
from worker.procs import is_alive

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("env,expected", [
    ({}, {"TORCH_FR_BUFFER_SIZE": "2000"}),
    ({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_FR_BUFFER_SIZE": "0"}),  # turned off by the job
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}),
])
def test_the_recorder_is_on_in_a_workers_environment_unless_it_says_otherwise(env, expected):
    env = dict(env)
    flight.default_env(env)
    assert env == expected
    assert flight.is_on(env) is (expected != {"TORCH_FR_BUFFER_SIZE": "0"})


def entry(seq, op, pg=("0", "default_pg")):
    return {"collective_seq_id": seq, "profiling_name": op, "process_group": list(pg)}


def test_groups_say_where_each_process_group_stood():
    trace = {"entries": [entry(4, "gloo:broadcast"), entry(5, "gloo:all_reduce"), entry(1, "gloo:barrier", ("1", "sub"))],
             "pg_status": {"0": {"last_enqueued_collective": "5", "last_completed_collective": "4"},
                           "1": {"last_enqueued_collective": "1", "last_completed_collective": "1"},
                           "2": {"last_enqueued_collective": "-1", "last_completed_collective": "-1"}}}
    assert flight.groups(trace) == [
        {"pg": "default_pg", "last_enqueued": 5, "last_completed": 4, "op": "gloo:all_reduce"},
        {"pg": "sub", "last_enqueued": 1, "last_completed": 1, "op": "gloo:barrier"},
        {"pg": "2", "last_enqueued": -1, "last_completed": -1, "op": None}]
    assert flight.groups({}) == []
    assert flight.summary(3, flight.groups(trace)[:1]) == (
        "ftrain: rank 3's flight recorder (the job was taken for hung): group default_pg: "
        "last enqueued #5 gloo:all_reduce, last completed #4")
    assert flight.summary(3, None).endswith("no dump (the recorder is off, or the worker did not answer)")


def test_a_dump_joins_the_cpu_and_the_nccl_recorders():
    """NCCL's groups record apart from gloo's: one trace of both, entries in the order they were
    made, and a group in both recorders (a CPU and a CUDA backend) as far as either saw it."""
    cpu = {"entries": [dict(entry(7, "gloo:all_reduce", ("1", "sub")), time_created_ns=30)],
           "pg_status": {"0": {"last_enqueued_collective": "2", "last_completed_collective": "2"},
                         "1": {"last_enqueued_collective": "7", "last_completed_collective": "6"}}}
    nccl = {"entries": [dict(entry(5, "nccl:all_reduce"), time_created_ns=20),
                        dict(entry(6, "nccl:all_reduce"), time_created_ns=40)],
            "pg_status": {"0": {"last_enqueued_collective": "6", "last_completed_collective": "5"}}}
    trace = flight.merge([cpu, nccl])
    assert [e["collective_seq_id"] for e in trace["entries"]] == [5, 7, 6]
    assert flight.groups(trace) == [
        {"pg": "default_pg", "last_enqueued": 6, "last_completed": 5, "op": "nccl:all_reduce"},
        {"pg": "sub", "last_enqueued": 7, "last_completed": 6, "op": "gloo:all_reduce"}]
    assert flight.merge([{}, {}]) == {"entries": [], "pg_status": {}}


WORKER = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from worker import stacks
    rank, port, folder, backend = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    assert stacks.register({"TORCHELASTIC_ERROR_FILE": os.path.join(folder, "error.json"),
                            "TORCH_FR_BUFFER_SIZE": "2000"})
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.ones(4, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    t.sum().item()  # NCCL's collectives are asynchronous: these three are done
    print("ready", flush=True)
    if rank == 1:
        time.sleep(60)  # never reaches the next all_reduce
    dist.all_reduce(t)  # rank 0 waits here, in C++
    t.sum().item()  # (NCCL: here, for the kernel that waits for rank 1)
""")

BACKENDS = ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs two GPUs"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_blocked_in_a_collective_gives_its_trace_when_asked(tmp_path, backend):
    """Rank 1 sleeps in Python; rank 0 waits for it in all_reduce #4. Both answer from their
    thread, and their traces say rank 0 entered #4 and rank 1 did not."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_FR_BUFFER_SIZE": "2000"}
    procs = {}
    for rank in (0, 1):
        (tmp_path / f"r{rank}").mkdir()
        argv = [sys.executable, "-c", WORKER, str(rank), str(port), str(tmp_path / f"r{rank}"), backend]
        procs[rank] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        for proc in procs.values():
            assert proc.stdout.readline() == "ready\n"
        def dumps() -> dict:
            asked = flight.ask({rank: p.pid for rank, p in procs.items()} | {2: os.getpid()})
            assert sorted(asked) == [0, 1]  # this process listens on no socket: not asked
            return flight.read_dumps(asked, 30.0)

        # Rank 0 enters all_reduce #4 a moment after it said "ready": asked again until it has.
        traces = wait_for(lambda: (got := dumps()) and got[0]["entries"][-1]["collective_seq_id"] == 4 and got,
                          30, "rank 0 to enter all_reduce #4")
        assert all(is_alive(p.pid) for p in procs.values())
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    found = {rank: flight.groups(t) for rank, t in traces.items()}
    # (a completion is recorded by the backend's own thread, a moment after the collective returns)
    assert {rank: [(g["pg"], g["last_enqueued"], g["op"]) for g in groups] for rank, groups in found.items()} == {
        0: [("default_pg", 4, f"{backend}:all_reduce")], 1: [("default_pg", 3, f"{backend}:all_reduce")]}
    assert found[0][0]["last_completed"] in (2, 3) and found[1][0]["last_completed"] in (2, 3)
    assert traces[0]["entries"][-1]["collective_seq_id"] == 4
