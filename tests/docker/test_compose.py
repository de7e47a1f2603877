"""docker/ for real: build the images, bring the compose cluster up (etcd, a control
plane, two nodes), run the example job through it, SIGKILL one node's container mid-run and
see the job train on and finish, `final.pt` saved in the job's working directory.

Slow (minutes: a base image, the images, the job) and needs a Docker daemon, BuildKit (the
`docker` CLI with it: Debian's docker.io; FTRAIN_DOCKER names another) and docker-compose, so
it is marked `docker` and left out of the default run: `pytest -m docker tests/docker`.
No image registry is needed: the base image is Debian bookworm made with debootstrap from the
mirror apt uses (docker/base-image.sh; FTRAIN_DOCKER_BASE_IMAGE names one already there), pip
trusts the CA bundle PIP_CERT names (a build secret), and the wheels in PIP_FIND_LINKS (the
torch CPU wheel) reach the build as an image of their own (docker/Dockerfile's WHEELS_IMAGE).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers.elastic import log_items
from tests.helpers.processes import REPO, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.docker]

DOCKER = os.environ.get("FTRAIN_DOCKER", "docker")
BASE_TAG = "ftrain-base:bookworm"
IMAGE, ETCD_IMAGE, WHEELS_IMAGE = "ftrain:test", "ftrain-etcd:test", "ftrain-wheels:test"
BUILD_TIMEOUT_S = 1800


def run(*cmd: str, env: dict | None = None, input: str | None = None, check: bool = True,
        timeout_s: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), cwd=cwd, env={**os.environ, **(env or {})}, input=input,
                         capture_output=True, text=True, timeout=timeout_s)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n"
                             f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def apt_mirror() -> str:
    """The Debian mirror apt uses here (its bookworm main entry)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        text = path.read_text() if path.is_file() else ""
        uris = re.findall(r"^URIs:\s*(\S+)", text, re.M)
        uris += re.findall(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", text, re.M)
        for uri in uris:
            if uri.rstrip("/").endswith("/debian"):
                return uri
    pytest.fail("no Debian bookworm mirror in apt's sources; set FTRAIN_DOCKER_BASE_IMAGE", pytrace=False)


@pytest.fixture(scope="module")
def images() -> None:
    if shutil.which(DOCKER) is None or shutil.which("docker-compose") is None:
        pytest.skip("needs docker (with BuildKit) and docker-compose")
    if run(DOCKER, "info", check=False).returncode != 0:
        pytest.skip("no Docker daemon answers")
    base = os.environ.get("FTRAIN_DOCKER_BASE_IMAGE")
    if base is None:
        base = BASE_TAG
        if run(DOCKER, "image", "inspect", base, check=False).returncode != 0:
            run(str(REPO / "docker/base-image.sh"), base, apt_mirror(), timeout_s=BUILD_TIMEOUT_S)
    build = [DOCKER, "build", "--progress=plain", "--build-arg", f"BASE_IMAGE={base}"]
    env = {"DOCKER_BUILDKIT": "1"}
    args = []
    if os.environ.get("PIP_CERT"):
        args += ["--secret", f"id=pip-cert,src={os.environ['PIP_CERT']}"]
    links = os.environ.get("PIP_FIND_LINKS")
    if links and Path(links).is_dir():
        run(*build[:3], "-t", WHEELS_IMAGE, "-f", "-", links, env=env,
            input="FROM scratch\nCOPY . /wheels/\n", timeout_s=BUILD_TIMEOUT_S)
        args += ["--build-arg", f"WHEELS_IMAGE={WHEELS_IMAGE}"]
    for dockerfile, tag in (("docker/Dockerfile", IMAGE), ("docker/Dockerfile.etcd", ETCD_IMAGE)):
        cmd = [*build, *args, "-f", dockerfile, "-t", tag, "."]
        out = run(*cmd, env=env, timeout_s=BUILD_TIMEOUT_S, check=False)
        if out.returncode != 0 and "no active session" in out.stdout + out.stderr:
            # docker 20.10's BuildKit can lose the CLI's session (which serves the secret) after a
            # long step on a loaded machine; the finished layers are cached, so once more.
            out = run(*cmd, env=env, timeout_s=BUILD_TIMEOUT_S, check=False)
        assert out.returncode == 0, f"{' '.join(cmd)}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


@pytest.fixture
def cluster(images):
    project = f"ftraintest{os.getpid()}"
    port = free_port()
    env = {"FTRAIN_IMAGE": IMAGE, "FTRAIN_ETCD_IMAGE": ETCD_IMAGE, "FTRAIN_PORT": str(port),
           "FTRAIN_USER_TOKEN": secrets.token_urlsafe(32), "FTRAIN_NODE_TOKEN": secrets.token_urlsafe(32)}

    def compose(*args: str, check: bool = True, timeout_s: float = 300) -> subprocess.CompletedProcess:
        return run("docker-compose", "-p", project, "-f", "docker/compose.yaml", *args, env=env,
                   check=check, timeout_s=timeout_s)

    try:
        compose("up", "-d")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10,
                          headers={"Authorization": f"Bearer {env['FTRAIN_USER_TOKEN']}"}) as api:
            yield api, compose, project
    finally:
        logs = compose("logs", "--no-color", "--tail", "40", check=False)
        print(logs.stdout[-8000:])
        compose("down", "-v", "--remove-orphans", check=False)


def container(project: str, service: str) -> str:
    return f"{project}_{service}_1"


def in_container(project: str, service: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(DOCKER, "exec", container(project, service), *cmd, check=check)


def job(api: httpx.Client, job_id: str) -> dict:
    resp = api.get(f"/v1/jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_the_compose_cluster_runs_the_example_and_survives_a_killed_node(cluster):
    api, compose, project = cluster
    wait_for(lambda: _answers(api), 120, "the control plane to answer")
    wait_for(lambda: len(api.get("/v1/nodes").json()["items"]) == 2, 120, "both nodes to register")

    # The image's torch is the CPU build; the containers' PID 1 is tini; the job's working
    # directory is the image user's.
    torch = in_container(project, "node-0", "python", "-c",
                         "import torch; print(torch.__version__, torch.version.cuda)").stdout.split()
    assert torch[0].endswith("+cpu") and torch[1] == "None", torch
    assert "nvidia" not in in_container(project, "node-0", "pip", "list").stdout
    for service in ("etcd", "control-plane", "node-0", "node-1"):
        pid1 = in_container(project, service, "cat", "/proc/1/cmdline").stdout.split("\0")
        assert Path(pid1[0]).name == "tini", (service, pid1)
    assert in_container(project, "node-0", "stat", "-c", "%U", "/work").stdout.strip() == "ftrain"

    # etcd: out of the nodes' reach, and closed to anyone without its password.
    probe = "import socket; socket.create_connection(('etcd', 2379), timeout=3)"
    assert in_container(project, "node-0", "python", "-c", probe, check=False).returncode != 0
    assert in_container(project, "control-plane", "python", "-c", probe).returncode == 0
    assert in_container(project, "node-0", "test", "-e", "/etcd-auth/password", check=False).returncode != 0
    refused = in_container(project, "control-plane", "python", "-c", (
        "import urllib.request, urllib.error\n"
        "body = b'{\"key\": \"Lw==\"}'\n"
        "try: print(urllib.request.urlopen('http://etcd:2379/v3/kv/range', data=body).read())\n"
        "except urllib.error.HTTPError as e: print(e.code, e.read().decode())"), check=False)
    assert "user name is empty" in refused.stdout, refused.stdout

    spec = json.loads((REPO / "examples/job.json").read_text())
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code in (200, 201), resp.text
    job_id = resp.json()["id"]

    def on_both_nodes_and_snapshotted():
        j = job(api, job_id)
        assert j["state"] not in ("FAILED", "CANCELLED"), j
        step = (j.get("progress") or {}).get("step") or 0
        return (j["state"] == "RUNNING" and j["world_size"] == 2 and j["latest_snapshot"]
                and step >= 60 and j)
    before = wait_for(on_both_nodes_and_snapshotted, 300, "the job to train on both nodes")
    killed_at = before["progress"]["step"]
    run(DOCKER, "kill", container(project, "node-1"))

    done = wait_for(lambda: (j := job(api, job_id))["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") and j,
                    600, "the job to finish")
    events = api.get(f"/v1/jobs/{job_id}/events").json()["items"]
    assert done["state"] == "SUCCEEDED", (done, events)
    assert killed_at < 400 and done["progress"]["step"] == 400, done
    reasons = " ".join(e["reason"] for e in events)
    assert "node node-1 lost" in reasons, reasons
    assert "training again: world size 1" in reasons, reasons  # on the node that is left
    lines = [item["line"] for item in log_items(api, job_id)]
    assert any("saved final.pt" in line for line in lines), lines[-20:]
    saved = [s for s in ("node-0", "node-1")
             if in_container(project, s, "test", "-s", "/work/final.pt", check=False).returncode == 0]
    assert saved, "final.pt is in no node's /work"
    print(f"node-1 killed at step {killed_at}; {done['state']} at step {done['progress']['step']} "
          f"after {done['finished_at'] - done['created_at']:.1f} s, {done['restarts']} restarts, "
          f"final.pt on {saved}; events: {[e['reason'] for e in events]}")


def _answers(api: httpx.Client) -> bool:
    try:
        return api.get("/readyz").status_code == 200
    except httpx.HTTPError:
        return False
