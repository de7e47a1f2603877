"""Helpers for the integration tests that run real jobs on real agents."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from bench.harness import NodeAgentProc, log_items, wait_for, workers_under
from worker.procs import cmdline, descendants, is_fork_server, is_launcher, parent_of

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_steps.py"
_STEP = re.compile(r"^step=(\d+) world=(\d+)")


def job_spec(name: str = "steps", *args: str, mn: int = 1, mx: int = 2, max_restarts: int = 3,
             script: Path = SCRIPT, **extra) -> dict:
    return {"name": name, "command": ["python", str(script), *args],
            "nodes": {"min": mn, "max": mx}, "max_restarts": max_restarts, **extra}


def submit(api: httpx.Client, spec: dict) -> str:
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def job(api: httpx.Client, job_id: str) -> dict:
    resp = api.get(f"/v1/jobs/{job_id}")
    resp.raise_for_status()
    return resp.json()


def events(api: httpx.Client, job_id: str) -> list[dict]:
    return api.get(f"/v1/jobs/{job_id}/events").json()["items"]


def steps(api: httpx.Client, job_id: str, attempt: int = 0) -> list[tuple[int, int]]:
    """(step, world size) of every step rank 0 logged (in `attempt` or a later one), in order."""
    out = []
    for item in log_items(api, job_id, rank=0):
        m = _STEP.match(item["line"]) if item.get("attempt", 0) >= attempt else None
        if m:
            out.append((int(m.group(1)), int(m.group(2))))
    return out


def wait_state(api: httpx.Client, job_id: str, states: str | tuple[str, ...], timeout_s: float = 120) -> dict:
    states = (states,) if isinstance(states, str) else states
    return wait_for(lambda: (j := job(api, job_id))["state"] in states and j, timeout_s,
                    f"job {job_id} to be {'/'.join(states)} (events: see the job)")


def wait_step(api: httpx.Client, job_id: str, step: int, world: int | None = None,
              timeout_s: float = 120, after: int = 0, attempt: int = 0) -> list[tuple[int, int]]:
    """Wait until rank 0 logged a step >= `step` (with that world size, in `attempt` or a later
    one), past index `after`."""
    def reached():
        s = steps(api, job_id, attempt)
        return any(n >= step and (world is None or w == world) for n, w in s[after:]) and s
    return wait_for(reached, timeout_s, f"job {job_id} to reach step {step}"
                    + (f" at world size {world}" if world else ""))


def wait_nodes(api: httpx.Client, n: int, timeout_s: float = 60) -> None:
    wait_for(lambda: len(api.get("/v1/nodes").json()["items"]) >= n, timeout_s, f"{n} nodes to register")


def worker_pids(agent: NodeAgentProc, script: Path = SCRIPT) -> list[int]:
    """The live training processes running `script` under an agent."""
    return workers_under(agent.pid, script)


def forked(pid: int) -> bool:
    """True if `pid` is a forked worker: a child of a fork server (worker/fork_server.py)."""
    ppid = parent_of(pid)
    return ppid is not None and is_fork_server(cmdline(ppid))


def torchrun_launchers(agent: NodeAgentProc) -> list[int]:
    """Launchers (worker/launch.py) under `agent` standing in for a torchrun that the job's
    fork server started: the agent starts every torchrun of a job that way (one that opts
    out of the fork server aside)."""
    return [pid for pid in descendants(agent.pid)
            if is_launcher(argv := cmdline(pid)) and b"torch.distributed.run" in argv]


def rdzv_keys(etcd_endpoint: str, job_id: str) -> list[str]:
    """The job's rendezvous keys still in etcd (read directly, not through the API)."""
    import asyncio

    from service.keys import Keys
    from service.store.etcd import EtcdStore

    async def read() -> list[str]:
        etcd = EtcdStore(etcd_endpoint)
        try:
            return [e.key async for e in etcd.scan_prefix(Keys().rdzv_of_job(job_id), keys_only=True)]
        finally:
            await etcd.close()

    return asyncio.run(read())
