"""A worker that snapshots at its last step ends: `rt.finish()` leaves no gloo work item
waiting for the GIL when the script returns and DDP's reducer destroys the process group.

Found as a user would: `min == max == 2` jobs whose step count is a multiple of
`snapshot.every_steps` stayed RUNNING at their last step, about one run in five (a rank
hung in `~ProcessGroupGloo`, joining a gloo thread that waited for the GIL to drop
`gather_object`'s tensors). Here two real processes form a gloo group again and again in
one interpreter each, with a longer GIL switch interval (which widens the race): without
`runtime._settle_collectives` one of them hangs within a few rounds (seen in 2 of 3 runs of
10 rounds); with it, every round ends.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.processes import REPO

pytestmark = pytest.mark.integration

ROUNDS = 6

SCRIPT = r"""
import os, sys
sys.setswitchinterval(0.05)
import torch
from worker import runtime

rank, ports, directory = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
for i, port in enumerate(ports):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0")
    rt = runtime.init(snapshot_dir=f"{directory}/{i}", snapshot_every=1000, memory_every=0,
                      env=dict(os.environ))
    model = rt.wrap(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.restore(model=model, optimizer=optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    rt.snapshot()  # gather_object of every rank's RNG: the last collective before the end
    rt.finish()
    del model, optimizer, rt  # DDP's reducer goes, and the process group with it
    print(f"round {i} ended", flush=True)
"""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_workers_that_snapshot_at_their_last_step_end_every_time(tmp_path):
    script = tmp_path / "rounds.py"
    script.write_text(SCRIPT)
    ports = ",".join(map(str, free_ports(ROUNDS)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), ports, str(tmp_path / "snaps")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    deadline = time.monotonic() + 30 + 10 * ROUNDS
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
    ended = [out.count("ended") for out in outputs]
    assert not hung and ended == [ROUNDS, ROUNDS], (ended, outputs[0][-2000:], outputs[1][-2000:])
    assert [p.returncode for p in procs] == [0, 0]
