"""A node agent SIGKILLed under a plain script's two-node job: how soon the node is lost and
the survivor trains again, with real agents, torchrun and gloo workers.

A dead process closes every connection it holds, and the control plane hears that at once
(service/presence.py). The survivor's workers here are asleep between steps for longer than
the blip bound when the agent dies, as an NCCL worker blocked in a collective with a dead
peer is: they print nothing that says a peer is gone, and torchrun reports no broken group,
until the loss is known. So nothing but the agent's closed connections tells the control
plane, and the test prints the figure (kill to loss, kill to training again).
"""

from __future__ import annotations

import time

import pytest

from service.presence import ALL_CLOSED
from tests.helpers.elastic import SCRIPT, steps, submit, wait_nodes
from tests.helpers.faults import events_of, plain_spec, wait_workers
from tests.helpers.processes import pid_alive, wait_for

pytestmark = pytest.mark.integration

LOST = "node n1 lost (its agent's connection closed)"


def test_a_plain_scripts_dead_agent_is_lost_from_its_closed_connections_not_the_blip_bound(
        api, agents, control_plane):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    # 8 s between steps: longer than the 5 s blip bound, so a survivor's own error cannot be
    # what tells (gloo fails the survivor's next collective only when it wakes).
    job_id = submit(api, plain_spec("deadagent", 1000, every=1000, mn=1, mx=2, step_time_s=8.0))
    wait_for(lambda: any(w == 2 for _, w in steps(api, job_id)), 90, "a step at world size 2")
    wait_workers(b, 1, SCRIPT)
    killed_at = time.time()
    b.proc.kill()  # the agent alone: its torchrun and workers follow it (PR_SET_PDEATHSIG)
    b.proc.wait()
    lost = wait_for(lambda: next((e for e in events_of(api, job_id) if e["reason"] == LOST), None), 30,
                    "n1 lost, from its agent's closed connections")
    again = wait_for(lambda: next((e for e in events_of(api, job_id) if e["time"] > killed_at
                                   and e["reason"].startswith("training again")), None), 60,
                     "training again on n0")
    detect_s, again_s = lost["time"] - killed_at, again["time"] - killed_at
    print(f"\nplain script, agent SIGKILL: lost after {detect_s:.2f} s, training again after {again_s:.2f} s")
    assert not pid_alive(b.pid)
    # What confirmed it: the agent's closed connections, not a survivor's report nor the bound.
    said = "".join(p.read_text() for p in control_plane.workdir.glob("control-plane-*.log"))
    assert f"node n1 lost: its agent's connection dropped and did not come back ({ALL_CLOSED})" in said, said
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
