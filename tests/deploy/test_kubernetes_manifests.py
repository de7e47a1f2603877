"""deploy/kubernetes/ against the Kubernetes API's schema, offline, and against ftrain itself.

No Kubernetes runs here. Each manifest is checked against the API's JSON schema of the oldest
and the newest release the manifests are meant for (kubernetes-schema.json, written by
make_kubernetes_schema.py from the `kubernetes-validate` package: strict, so an unknown or
misspelt field is refused as the API server refuses it), and against what ftrain reads: the
options of `ftrain serve` and `ftrain node`, the tokens from Secrets, the agent's grace.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import jsonschema_rs
import pytest
import yaml

from service import cli
from worker.agent import LEAVE_MARGIN_S, STOP_GRACE_S
from worker.protocol import Timeouts

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
SCHEMA = Path(__file__).resolve().parent / "kubernetes-schema.json"


def manifests() -> list[tuple[str, dict]]:
    """(file name, object) of every object of the files kustomization.yaml lists."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return [(name, doc) for name in kustomization["resources"]
            for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc is not None]


@cache
def schemas() -> dict:
    return json.loads(SCHEMA.read_text())


def schema_errors(doc: dict, version: str) -> list[str]:
    """What the Kubernetes API of `version` refuses in `doc`: none when it is valid."""
    bundle = schemas()[version]
    kind = bundle["kinds"].get(f"{doc.get('apiVersion')}/{doc.get('kind')}")
    if kind is None:
        return [f"no schema for {doc.get('apiVersion')}/{doc.get('kind')}: run "
                f"tests/deploy/make_kubernetes_schema.py (its docstring says how)"]
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **kind, "$defs": bundle["$defs"]}
    return [f"{'/'.join(map(str, e.instance_path))}: {e.message}"
            for e in jsonschema_rs.validator_for(schema).iter_errors(doc)]


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in manifests() if d["kind"] == kind]


def one(kind: str, name: str) -> dict:
    (doc,) = [d for d in by_kind(kind) if d["metadata"]["name"] == name]
    return doc


def container(kind: str, name: str) -> dict:
    (c,) = one(kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def label(doc: dict) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


VERSIONS = ("1.31.0", "1.37.0")
OBJECTS = manifests()


def test_kustomization_lists_every_manifest_of_the_folder():
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", [d for _, d in OBJECTS], ids=[label(d) for _, d in OBJECTS])
def test_each_manifest_is_valid_for_the_kubernetes_api(doc, version):
    assert schema_errors(doc, version) == []


@pytest.mark.parametrize("break_it, refused", [
    (lambda d: d["spec"].update(replica=2), "replica"),  # a misspelt field
    (lambda d: d["spec"].update(replicas="two"), "replicas"),  # a field of the wrong type
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].pop("name"), "name"),  # a required one gone
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
     .update(port=[8000]), "port"),
], ids=["unknown field", "wrong type", "missing required field", "wrong type deep down"])
def test_the_schema_check_refuses_a_broken_manifest(break_it, refused):
    doc = copy.deepcopy(one("Deployment", "ftrain-control-plane"))
    break_it(doc)
    for version in VERSIONS:
        errors = schema_errors(doc, version)
        assert errors and any(refused in e for e in errors), errors


def test_every_selector_finds_the_pods_it_is_meant_for():
    workloads = {label(w): pod_labels(w) for k in ("StatefulSet", "Deployment", "DaemonSet", "Job")
                 for w in by_kind(k)}

    def matched(selector: dict) -> set[str]:
        return {name for name, labels in workloads.items() if selector.items() <= labels.items()}

    for kind in ("StatefulSet", "Deployment", "DaemonSet"):
        for w in by_kind(kind):
            assert w["spec"]["selector"]["matchLabels"].items() <= pod_labels(w).items(), label(w)
    assert matched(one("Service", "ftrain")["spec"]["selector"]) == {"Deployment/ftrain-control-plane"}
    assert matched(one("Service", "ftrain-etcd")["spec"]["selector"]) == {"StatefulSet/ftrain-etcd"}
    assert matched(one("PodDisruptionBudget", "ftrain-control-plane")["spec"]["selector"]["matchLabels"]) \
        == {"Deployment/ftrain-control-plane"}
    assert matched(one("PodDisruptionBudget", "ftrain-etcd")["spec"]["selector"]["matchLabels"]) \
        == {"StatefulSet/ftrain-etcd"}
    policy = one("NetworkPolicy", "ftrain-etcd")["spec"]
    assert matched(policy["podSelector"]["matchLabels"]) == {"StatefulSet/ftrain-etcd"}
    client, peer = policy["ingress"]
    assert {w for s in client["from"] for w in matched(s["podSelector"]["matchLabels"])} \
        == {"Deployment/ftrain-control-plane", "Job/ftrain-etcd-auth"}  # never the node agents
    assert {w for s in peer["from"] for w in matched(s["podSelector"]["matchLabels"])} == {"StatefulSet/ftrain-etcd"}


def test_etcd_is_three_members_that_the_control_plane_and_the_auth_job_each_name():
    etcd = one("StatefulSet", "ftrain-etcd")
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["podManagementPolicy"] == "Parallel"
    members = [f"ftrain-etcd-{i}.{etcd['spec']['serviceName']}" for i in range(3)]
    clients = ",".join(f"http://{m}:2379" for m in members)
    args = container("StatefulSet", "ftrain-etcd")["args"]
    peers = ",".join(f"{m.split('.')[0]}=https://{m}:2380" for m in members)
    assert f"--initial-cluster={peers}" in args
    env = {e["name"]: e.get("value") for e in container("Deployment", "ftrain-control-plane")["env"]}
    assert env["FTRAIN_ETCD_ENDPOINTS"] == clients
    job_env = {e["name"]: e.get("value") for e in container("Job", "ftrain-etcd-auth")["env"]}
    assert job_env["ETCDCTL_ENDPOINTS"] == clients


def command_options(args: list[str]) -> tuple[str, set[str]]:
    """The ftrain command that `args` runs and the options it gives."""
    return args[0], {a for a in args[1:] if a.startswith("--")}


@pytest.mark.parametrize("kind, name", [("Deployment", "ftrain-control-plane"), ("DaemonSet", "ftrain-node")])
def test_the_ftrain_command_lines_use_options_ftrain_has_and_no_secret(kind, name):
    c = container(kind, name)
    assert c["image"] == "ftrain:local"  # docker/Dockerfile's image (its entrypoint is `ftrain`)
    command, options = command_options(c["args"])
    known = {o for p in cli.main.commands[command].params for o in p.opts}
    assert options <= known, options - known
    assert not {"--token", "--node-token", "--etcd-password"} & options  # never a secret in args
    for e in c.get("env", []):  # a token or password only from a Secret
        if re.search(r"TOKEN|PASSWORD", e["name"]) and not e["name"].endswith("_FILE"):
            assert "secretKeyRef" in e.get("valueFrom", {}), e


def test_the_control_plane_is_replicated_non_root_and_ready_only_when_it_reaches_etcd():
    d = one("Deployment", "ftrain-control-plane")
    c = container("Deployment", "ftrain-control-plane")
    assert d["spec"]["replicas"] >= 2
    assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert one("PodDisruptionBudget", "ftrain-control-plane")["spec"]["minAvailable"] >= 1


def test_the_agent_takes_its_gpus_its_node_name_and_a_token_file_only_root_reads():
    pod = one("DaemonSet", "ftrain-node")["spec"]["template"]["spec"]
    c = container("DaemonSet", "ftrain-node")
    args = c["args"]
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    assert int(args[args.index("--nproc-per-node") + 1]) == gpus
    assert args[args.index("--name") + 1] == "$(NODE_NAME)"
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    token_file = args[args.index("--token-file") + 1]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    (item,) = volume["secret"]["items"]
    assert token_file == f"{mount['mountPath']}/{item['path']}" and volume["secret"]["defaultMode"] == 0o400
    # Root's file: the jobs' processes run as the image's unprivileged user.
    assert args[args.index("--run-as") + 1] == "ftrain" and "fsGroup" not in pod["securityContext"]


def test_the_agents_grace_outlasts_its_drain():
    """The kubelet SIGKILLs the pod after terminationGracePeriodSeconds: the drain that its
    SIGTERM starts (the control plane's ack timeout, the agent's margin, the workers' stop)
    must end before that, with room to spare for a loaded machine."""
    grace_s = one("DaemonSet", "ftrain-node")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain_s = Timeouts().control_ack_timeout_s + LEAVE_MARGIN_S + STOP_GRACE_S
    assert grace_s >= drain_s + 20, (grace_s, drain_s)
