"""Stragglers on real agents: the runtime example on two nodes (gloo DDP), one of its ranks
sleeping half as long again per step, is flagged by node and rank within the window: an
event, the job's `stragglers`, a metric and a mark on the dashboard's job page. The same job
with every rank at the same pace is never flagged."""

from __future__ import annotations

import os

import pytest

from tests.helpers.elastic import events, job, submit, wait_nodes
from tests.helpers.processes import REPO, wait_for

pytestmark = pytest.mark.integration
WINDOW_S = 8.0


def spec(name: str, *extra: str, window_s: float = WINDOW_S, **fields) -> dict:
    return {"name": name, "working_dir": str(REPO),
            "command": ["python", "examples/train.py", "--steps", "100000", "--step-delay", "0.25",
                        "--width", "32", *extra],
            "nodes": {"min": 2, "max": 2}, "snapshot": {"every_steps": 25, "keep": 2},
            "straggler_window_s": window_s, **fields}


def timed_for(api, job_id: str, seconds: float) -> dict:
    """Wait until the job's ranks have been timed for `seconds`; the job then."""
    def long_enough():
        j = job(api, job_id)
        p = j["progress"] or {}
        return p.get("ranks_since") is not None and p["time"] - p["ranks_since"] >= seconds and j
    return wait_for(long_enough, 120, f"job {job_id}'s ranks to be timed for {seconds:g} s")


def test_a_rank_half_as_slow_again_is_flagged_by_node_and_rank(api, agents, control_plane):
    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, spec("slow", "--slow-rank", "1", "--slow-by", "1.5"))
    j = timed_for(api, job_id, 0)
    flagged = wait_for(lambda: (j := job(api, job_id))["stragglers"] and j, 60 + WINDOW_S,
                       f"job {job_id} to flag a straggler")
    node_of_rank_1 = next(r["node"] for r in flagged["progress"]["ranks"] if r["rank"] == 1)
    assert node_of_rank_1 in ("n0", "n1")
    [s] = flagged["stragglers"]
    assert (s["rank"], s["node"]) == (1, node_of_rank_1) and s["factor"] >= 1.3
    # Flagged within the window of the ranks being first timed, give or take a report.
    assert s["since"] - j["progress"]["ranks_since"] <= WINDOW_S + 4
    lines = [e["reason"] for e in events(api, job_id) if e["reason"].startswith("straggler")]
    assert lines and f"rank 1 on node {node_of_rank_1}" in lines[0]
    metrics = api.get("/metrics").text
    assert f'ftrain_job_straggler_factor{{job="{job_id}",node="{node_of_rank_1}",rank="1"}}' in metrics
    from tests.integration.test_dashboard import dashboard, sign_in  # skips without playwright

    with dashboard(control_plane) as page:
        sign_in(page, control_plane)
        page.goto(f"{control_plane.url}/ui/#/jobs/{job_id}")
        page.wait_for_selector('#facts [data-straggler-rank="1"]')
        assert f"on {node_of_rank_1}" in page.inner_text("#facts .straggler")
    api.post(f"/v1/jobs/{job_id}/cancel")


def test_a_healthy_job_is_not_flagged(api, agents):
    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, spec("even"))
    j = timed_for(api, job_id, 2.5 * WINDOW_S)
    assert j["stragglers"] == []
    assert not [e for e in events(api, job_id) if e["reason"].startswith("straggler")]
    assert len(j["progress"]["ranks"]) == 2 and all(r["steps"] > 0 for r in j["progress"]["ranks"])
    api.post(f"/v1/jobs/{job_id}/cancel")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("FTRAIN_TEST_SLOW"), reason="slow (minutes): set FTRAIN_TEST_SLOW=1 to run it")
def test_a_healthy_job_is_not_flagged_over_default_windows(api, agents):
    """The default window (60 s), with snapshots every 25 steps, for two and a half windows."""
    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, spec("even-long", window_s=60.0))
    wait_for(lambda: (p := job(api, job_id)["progress"] or {}).get("ranks_since")
             and p["time"] - p["ranks_since"] >= 150, 240, "150 s of step times")
    assert job(api, job_id)["stragglers"] == []
    assert not [e for e in events(api, job_id) if e["reason"].startswith("straggler")]
    api.post(f"/v1/jobs/{job_id}/cancel")


def test_a_straggler_node_is_replaced_by_a_free_one_losing_no_step(api, agents):
    """`straggler_action: replace`: the ranks on n1 sleep half as long again; n2 comes free
    after the job started. n1 is swapped for n2 at a step boundary (the planned change that a
    drain makes), and the group resumes from exactly the step it paused at."""
    from tests.integration.test_planned import rank0, starts, stop_before

    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, spec("swap", "--slow-node", "n1", straggler_action="replace"))
    timed_for(api, job_id, 0)
    agents(1)
    wait_nodes(api, 3)
    wait_for(lambda: any(e["reason"].startswith("straggler node n1 replaced by n2") for e in events(api, job_id)),
             60 + WINDOW_S, "n1 to be replaced by n2")
    wait_for(lambda: len(starts(api, job_id)) >= 2, 60, "the group to start again")
    j = job(api, job_id)
    assert sorted(j["nodes"]) == ["n0", "n2"] and j["restarts"] == 0
    index, resumed, world = starts(api, job_id)[1]
    assert world == 2 and resumed == stop_before(rank0(api, job_id), index) > 0
    api.post(f"/v1/jobs/{job_id}/cancel")
