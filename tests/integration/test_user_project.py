"""A user's project with a `worker.py` and a `service/` of its own: its job runs under ftrain
with the runtime (`from ftrain import runtime`), and its own `import worker` and `import
service` get its own modules, in every process of the job (real control plane, agent,
torchrun and workers)."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers.processes import NodeAgentProc, wait_for

SCRIPT = textwrap.dedent("""\
    import worker                      # the project's own worker.py
    import service                     # the project's own service/
    from ftrain import runtime         # ftrain's runtime, whatever the project calls its modules

    import torch

    assert worker.WHOSE == "the project's", worker.__file__
    assert service.WHOSE == "the project's", service.__file__
    rt = runtime.init(total_steps=6)
    model = rt.wrap(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.restore(model=model, optimizer=opt)
    while rt.step < 6:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rt.step_done(loss=loss.item(), samples=8)
    if rt.is_chief:
        print(f"trained with {worker.helper()} and ftrain's {runtime.__name__}", flush=True)
    rt.finish()
""")


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "my-project"
    (root / "service").mkdir(parents=True)
    (root / "worker.py").write_text('WHOSE = "the project\'s"\n\n\ndef helper():\n    return "its own worker.py"\n')
    (root / "service" / "__init__.py").write_text('WHOSE = "the project\'s"\n')
    (root / "train.py").write_text(SCRIPT)
    root.chmod(0o755)
    return root


def test_a_project_with_its_own_worker_and_service_modules_trains_with_ftrains_runtime(
        control_plane, api, project, tmp_path):
    agents = [NodeAgentProc(control_plane, f"p{i}", tmp_path / f"node{i}").start() for i in range(2)]
    try:
        spec = {"name": "own-modules", "command": ["python", "train.py"], "working_dir": str(project),
                "nodes": {"min": 2, "max": 2}, "max_restarts": 0, "snapshot": {"every_steps": 2, "keep": 2}}
        resp = api.post("/v1/jobs", json=spec)
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["id"]
        job = wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["state"] in
                       ("SUCCEEDED", "FAILED") and j, 180, "the job to end")
        lines = [i["line"] for i in api.get(f"/v1/jobs/{job_id}/logs").json()["items"]]
        assert job["state"] == "SUCCEEDED", (job["reason"], lines[-30:])
        assert any("trained with its own worker.py and ftrain's ftrain.worker.runtime" in ln for ln in lines), lines
    finally:
        for a in agents:
            a.stop()
