"""GPU-aware nodes on CPU: a fake nvidia-smi on the agents' PATH lists two "GPUs"; real agents
(`ftrain node --gpus`) report them, and a job that asks for `gpus_per_node` runs only where
they are, each node's workers seeing their node's GPU alone (CUDA_VISIBLE_DEVICES), with
`nproc_per_node: "auto"` one worker per GPU."""

from __future__ import annotations

import os
import stat
import sys

from tests.helpers.processes import NodeAgentProc, wait_for

SCRIPT = ("import os; print('sees', os.environ.get('CUDA_VISIBLE_DEVICES'), "
          "'local', os.environ['LOCAL_WORLD_SIZE'], 'world', os.environ['WORLD_SIZE'], flush=True)")


def fake_nvidia_smi(folder) -> str:
    """A `nvidia-smi` that lists two GPUs for --query-gpu; returns a PATH with it first."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nvidia-smi"
    path.write_text("#!/bin/sh\nprintf '0, GPU-aaaa, Fake H100\\n1, GPU-bbbb, Fake H100\\n'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_a_gpu_job_runs_only_on_the_nodes_with_gpus_each_seeing_its_own(control_plane, api, tmp_path):
    env = {"PATH": fake_nvidia_smi(tmp_path / "bin")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    nodes = [NodeAgentProc(control_plane, name, tmp_path / "nodes", env=env, args=["--gpus", gpus])
             for name, gpus in (("g0", "0"), ("g1", "GPU-bbbb"), ("cpu", "none"))]
    try:
        for n in nodes:
            n.start()

        def listed():
            items = {n["name"]: n for n in api.get("/v1/nodes").json()["items"]}
            return items if len(items) == 3 else None
        seen = wait_for(listed, 30, "three nodes registered")
        assert {k: (v["gpus"], v["gpu_model"]) for k, v in seen.items()} == {
            "g0": (1, "Fake H100"), "g1": (1, "Fake H100"), "cpu": (0, None)}

        big = api.post("/v1/jobs", json={"name": "two-each", "command": ["true"], "gpus_per_node": 2})
        assert big.status_code == 201, big.text
        spec = {"name": "gpu-job", "command": [sys.executable, "-c", SCRIPT], "gpus_per_node": 1,
                "nodes": {"min": 2, "max": 3}, "nproc_per_node": "auto"}
        resp = api.post("/v1/jobs", json=spec)
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["id"]

        def ended():
            j = api.get(f"/v1/jobs/{job_id}").json()
            return j if j["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") else None
        job = wait_for(ended, 60, "the GPU job ends")
        assert job["state"] == "SUCCEEDED", job
        events = " ".join(e["reason"] for e in api.get(f"/v1/jobs/{job_id}/events").json()["items"])
        assert "started on 2 node(s): g0, g1" in events
        lines = sorted(i["line"] for i in api.get(f"/v1/jobs/{job_id}/logs").json()["items"]
                       if "sees" in i["line"])
        assert [line.split("sees ", 1)[1] for line in lines] == [
            "0 local 1 world 2", "GPU-bbbb local 1 world 2"]
        # No node has two GPUs: that job waits, and says nothing ran.
        assert api.get(f"/v1/jobs/{big.json()['id']}").json()["state"] == "PENDING"
    finally:
        for n in nodes:
            n.stop()
