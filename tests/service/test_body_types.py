"""Every request body the API takes refuses `true` for a number (and a number for a boolean),
naming the field, as JSON Schema's types do (pydantic's lax mode would take them as 1/0), and
takes an integral float for an integer, as JSON Schema does (pydantic's strict mode would not).

The bodies are found in the app's own OpenAPI, so a new one without a case here fails."""

from __future__ import annotations

import copy

import pytest
from pydantic import BaseModel, ValidationError

import service.models
import worker.protocol
from service.app import create_app
from service.settings import Settings

# A valid body of each, with every optional number and boolean given.
VALID = {
    "JobSpec": {"name": "a", "command": ["python"], "nodes": {"min": 1, "max": 2}, "nproc_per_node": 1,
                "gpus_per_node": 1, "max_restarts": 0, "snapshot": {"every_steps": 5, "keep": 2},
                "global_batch_size": 8, "hang_timeout_s": 60.0, "priority": 5,
                "preempt_grace_s": 10.0, "straggler_factor": 1.5, "straggler_window_s": 30.0},
    "NewUser": {"name": "ann", "team": "ml"},
    "QuotaPatch": {"max_nodes": 2, "max_gpus": 8},
    "HealthReport": {"ok": False, "checks": [{"name": "own", "ok": False, "detail": "disk full"}]},
    "RegisterRequest": {"name": "n0", "nproc_per_node": 1, "gpus": 0,
                        "running": {"job_id": "j", "attempt": 1}},
    "HeartbeatRequest": {"lease_id": 7, "known": {"job_id": "j", "attempt": 1, "action": "run"},
                         "wait_s": 1.5},
    "ReportRequest": {"job_id": "j", "attempt": 1, "state": "failed", "exit_code": 1},
    "RoundReport": {"attempt": 1, "node": "n0", "phase": "joined", "call": 0, "group_rank": 0,
                    "group_world_size": 2, "round": 3},
    "SetStateRequest": {"merge": {"ops": [{"kind": "join", "node": ["h", 10, 0], "at_us": 5, "was_us": 4,
                                           "deadline_us": 9}], "min_nodes": 1, "max_nodes": 2}},
    "GetRequest": {"keys": ["k"], "wait_s": 0.5, "values": False},
    "SetRequest": {"items": [{"key": "k", "value": "AA=="}]},
    "AddRequest": {"key": "k", "amount": 3},
    "AppendRequest": {"key": "k", "value": "AA=="},
    "CompareSetRequest": {"key": "k", "expected": "AA==", "desired": "AA=="},
    "DeleteRequest": {"key": "k"},
    "CommitRequest": {"step": 3, "path": "p", "size": 1, "checksum": "c", "attempt": 1, "control_id": 2,
                      "stall_s": 0.5, "write_s": 0.5},
    "CorruptReport": {"reason": "bad"},
    "MemoryReport": {"step": 3, "attempt": 1},
    "MemoryCorrupt": {"attempt": 1, "step": 3},
    "RestoreRequest": {"attempt": 1},
    "BrokenPeer": {"attempt": 1, "node": "n0"},
    "RunFinished": {"attempt": 1, "node": "n0"},
    "ProgressReport": {"step": 3, "loss": 0.5, "samples_per_s": 2.0, "total_steps": 9,
                       "metrics": {"lr": 0.1}, "attempt": 1, "final": False,
                       "ranks": [{"rank": 0, "node": "n0", "steps": 4, "compute_s": 0.5, "wait_s": 0.25}]},
    "StacksReport": {"job_id": "j", "attempt": 1, "ranks": [{"rank": 0, "text": "x"}]},
    "LogShipment": {"node": "n0", "attempt": 1, "lines": [{"rank": 0, "line": "x", "time": 1.5, "round": 2}]},
}


def body_models(tmp_path) -> dict[str, type[BaseModel]]:
    app = create_app(Settings(log_root=str(tmp_path / "logs"), secret_dir=str(tmp_path / "s"),
                              user_token="t"))
    names = set()
    for ops in app.openapi()["paths"].values():
        for op in ops.values():
            for media in op.get("requestBody", {}).get("content", {}).values():
                schema = media["schema"]
                for ref in [schema, *schema.get("anyOf", [])]:
                    if "$ref" in ref:
                        names.add(ref["$ref"].rsplit("/", 1)[-1])
    return {n: getattr(worker.protocol, n, None) or getattr(service.models, n) for n in names}


def leaves(body, path=()):
    """(path, value) of every number and boolean in `body`."""
    if isinstance(body, dict):
        for k, v in body.items():
            yield from leaves(v, (*path, k))
    elif isinstance(body, list):
        for i, v in enumerate(body):
            yield from leaves(v, (*path, i))
    elif isinstance(body, (bool, int, float)):
        yield path, body


def replaced(body, path, value):
    out = copy.deepcopy(body)
    at = out
    for p in path[:-1]:
        at = at[p]
    at[path[-1]] = value
    return out


def test_every_request_body_has_a_case(tmp_path):
    assert set(body_models(tmp_path)) == set(VALID)


@pytest.mark.parametrize("name", sorted(VALID))
def test_a_boolean_for_a_number_and_a_number_for_a_boolean_are_refused_naming_the_field(name, tmp_path):
    model = getattr(worker.protocol, name, None) or getattr(service.models, name)
    model.model_validate(VALID[name])
    for path, value in leaves(VALID[name]):
        for wrong in ([1, "true"] if isinstance(value, bool) else [True, False]):
            with pytest.raises(ValidationError) as got:
                model.model_validate(replaced(VALID[name], path, wrong))
            assert [e["loc"] for e in got.value.errors()] == [path], (name, path, wrong)
        if type(value) is int:
            model.model_validate(replaced(VALID[name], path, float(value)))  # 3.0 is an integer


def test_the_openapi_states_number_rules_in_json_schema_words(tmp_path):
    """minimum/maximum, never pydantic's own ge/le (which Schemathesis, and any other client,
    would not know: it took -1 for a valid rank)."""
    app = create_app(Settings(log_root=str(tmp_path / "logs"), secret_dir=str(tmp_path / "s"),
                              user_token="t"))

    def keys(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                if k != "properties":  # a property may be named anything
                    yield from keys(v)
                else:
                    for sub in v.values():
                        yield from keys(sub)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)
    assert not {"ge", "le", "gt", "lt"} & set(keys(app.openapi()))


def test_a_lease_id_past_int64_is_set_aside_not_refused():
    """No maximum in the description (see HeartbeatRequest): one past int64 is no etcd lease."""
    assert worker.protocol.HeartbeatRequest.model_validate({"lease_id": 2**63}).lease_id is None
    assert worker.protocol.HeartbeatRequest.model_validate({"lease_id": 2**63 - 1}).lease_id == 2**63 - 1
