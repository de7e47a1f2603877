"""The `ftrain` CLI against a real control plane (etcd + uvicorn), and its client's error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from click.testing import CliRunner

from service.cli import main
from service.client import FtrainClient, InvalidRequest, ServerUnreachable, resolve_target
from service.models import JobSpec, JobState, JobView, LogLine, LogPage, NodeList, NodeState, NodeView
from tests.helpers.processes import REPO, free_port

SPEC_YAML = """\
name: mnist
command: [python, train.py, --epochs, "3"]
nodes: {min: 1, max: 2}
env:
  LR: "0.01"
snapshot:
  every_steps: 50
"""


@pytest.fixture
def ftrain(control_plane, tmp_path):
    """Run `ftrain ARGS...` in-process against the control plane; returns the click Result."""
    runner = CliRunner()
    # An empty data dir, so nothing on this machine decides the target but the flags.
    isolated = {"FTRAIN_SERVER": None, "FTRAIN_TOKEN": None}

    def run(*args: str, input: str | None = None, token: str | None = None, expect_ok: bool = True):
        cmd = [*args, "--server", control_plane.url, "--token", token or control_plane.user_token,
               "--data-dir", str(tmp_path / "no-data-dir")]
        result = runner.invoke(main, cmd, input=input, env=isolated, catch_exceptions=False)
        if expect_ok:
            assert result.exit_code == 0, result.output
        return result

    return run


def test_submit_yaml_then_list_status_cancel_events(ftrain, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC_YAML)
    job = json.loads(ftrain("submit", str(spec), "--json").output)
    assert job["state"] == "PENDING" and job["spec"]["env"] == {"LR": "0.01"}
    assert job["spec"]["snapshot"]["every_steps"] == 50

    table = ftrain("list").output.splitlines()
    assert table[0].split() == ["ID", "NAME", "OWNER", "STATE", "NODES", "STEP", "RESTARTS", "DURATION",
                                "REASON"]
    assert any(line.split()[:8] == [job["id"], "mnist", "admin", "PENDING", "0", "(1-2)", "-", "0"]
               for line in table[1:])
    assert [j["id"] for j in json.loads(ftrain("list", "--json").output)] == [job["id"]]

    status = ftrain("status", job["id"]).output
    assert "id:" in status and job["id"] in status and "PENDING" in status
    assert "python train.py --epochs 3" in status
    assert json.loads(ftrain("status", job["id"], "--json").output)["id"] == job["id"]

    assert ftrain("cancel", job["id"]).output.strip() == f"{job['id']}: CANCELLED"
    events = json.loads(ftrain("events", job["id"], "--json").output)
    assert [e["state"] for e in events] == ["PENDING", "CANCELLED"]
    lines = ftrain("events", job["id"]).output.splitlines()
    assert lines[0].split() == ["TIME", "STATE", "BY", "REASON"] and "CANCELLED" in lines[-1]
    assert lines[-1].split()[2:] == ["CANCELLED", "admin", "cancelled", "by", "admin"]


def test_goodput_shows_where_a_job_s_time_went_and_metrics_count_it(ftrain, control_plane, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC_YAML.replace("min: 1", "min: 2"))  # no node: it waits for nodes
    job_id = ftrain("submit", str(spec), "-q").output.strip()
    ftrain("cancel", job_id)
    result = json.loads(ftrain("goodput", job_id, "--json").output)
    assert result["wall_s"] > 0 and all(s >= 0 for s in result["seconds"].values())
    assert sum(result["seconds"].values()) == pytest.approx(result["wall_s"], rel=0.02, abs=0.01)
    assert result["seconds"]["waiting"] == pytest.approx(result["wall_s"], abs=0.01)
    lines = ftrain("goodput", job_id).output.splitlines()
    assert lines[0].split() == ["CAUSE", "TIME", "SHARE"]
    assert [line.split()[0] for line in lines[1:]] == ["waiting", "wall"]
    assert lines[1].split()[2] == "100.0%"
    result = ftrain("goodput", "nope-123456", expect_ok=False)
    assert result.exit_code == 1 and "job nope-123456 not found" in result.output
    with control_plane.client("user") as api:
        text = api.get("/metrics").text
    waiting = [line for line in text.splitlines()
               if line.startswith('ftrain_job_seconds_total{cause="waiting"}')]
    assert len(waiting) == 1 and float(waiting[0].split()[-1]) > 0


def test_users_add_prints_the_token_once_then_list_and_remove(ftrain, tmp_path):
    added = ftrain("users", "add", "alice")
    token = added.stdout.strip()
    assert len(token) >= 40 and "alice" not in token  # stdout: the token alone, for scripts
    assert ftrain("whoami", token=token).output.strip() == "alice"
    assert ftrain("whoami").output.strip() == "admin (admin)"
    listed = ftrain("users", "list").output
    assert "alice" in listed and token not in listed
    assert [u["name"] for u in json.loads(ftrain("users", "list", "--json").output)] == ["admin", "alice"]
    refused = ftrain("users", "add", "bob", token=token, expect_ok=False)
    assert refused.exit_code != 0 and "only the admin" in refused.output
    assert ftrain("users", "remove", "alice").output.strip() == "removed user alice"
    gone = ftrain("whoami", token=token, expect_ok=False)
    assert gone.exit_code != 0 and "401" in gone.output


def test_list_filters_by_state(ftrain, tmp_path):
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "a", "command": ["true"]}))
    first = ftrain("submit", str(spec), "-q").output.strip()
    second = ftrain("submit", str(spec), "-q").output.strip()
    assert first != second  # a fresh idempotency key per invocation
    ftrain("cancel", first)
    pending = json.loads(ftrain("list", "--state", "pending", "--json").output)
    assert [j["id"] for j in pending] == [second]
    cancelled = json.loads(ftrain("list", "--state", "CANCELLED", "--json").output)
    assert [j["id"] for j in cancelled] == [first]


def test_submit_from_stdin_with_a_key_is_idempotent(ftrain):
    first = json.loads(ftrain("submit", "-", "--idempotency-key", "k1", "--json", input=SPEC_YAML).output)
    again = json.loads(ftrain("submit", "-", "--idempotency-key", "k1", "--json", input=SPEC_YAML).output)
    assert again["id"] == first["id"]
    assert len(json.loads(ftrain("list", "--json").output)) == 1


def test_client_follows_pagination(control_plane):
    with FtrainClient(control_plane.url, control_plane.user_token) as client:
        ids = [client.submit({"name": f"p{i}", "command": ["true"]})["id"] for i in range(5)]
        assert [j["id"] for j in client.list_jobs(page_size=2)] == ids


def test_invalid_spec_prints_each_field_error(ftrain, tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: Not_A_Label\ncommand: [python]\nnodes: {min: 0, max: 2}\n")
    result = ftrain("submit", str(spec), expect_ok=False)
    assert result.exit_code == 1
    assert "rejected" in result.output
    assert "  name: " in result.output and "DNS label" in result.output
    assert "  nodes.min: " in result.output
    assert "Traceback" not in result.output


def test_unparseable_or_non_mapping_file_is_a_clear_error(ftrain, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = ftrain("submit", str(bad), expect_ok=False)
    assert result.exit_code == 1 and "is not valid JSON" in result.output
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    result = ftrain("submit", str(listy), expect_ok=False)
    assert result.exit_code == 1 and "must hold one job spec" in result.output
    result = ftrain("submit", str(tmp_path / "missing.yaml"), expect_ok=False)
    assert result.exit_code == 1 and "cannot read" in result.output


def test_wrong_token_says_which_token_to_use(ftrain, control_plane):
    result = ftrain("list", token="not-the-token", expect_ok=False)
    assert result.exit_code == 1
    assert "401" in result.output and "user token" in result.output and "<data-dir>/token" in result.output
    result = ftrain("list", token=control_plane.node_token, expect_ok=False)
    assert result.exit_code == 1 and "not the node token" in result.output


def test_unknown_job_is_a_clear_error_and_cancelling_twice_is_fine(ftrain, tmp_path):
    result = ftrain("status", "nope-123456", expect_ok=False)
    assert result.exit_code == 1 and "job nope-123456 not found" in result.output
    assert "finished jobs are deleted 7 days after they end" in result.output
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC_YAML)
    job_id = ftrain("submit", str(spec), "-q").output.strip()
    ftrain("cancel", job_id)
    result = ftrain("cancel", job_id)
    assert result.exit_code == 0 and "CANCELLED" in result.output


def test_target_comes_from_the_data_dir_written_by_up(ftrain, control_plane, tmp_path):
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    (data_dir / "server").write_text(control_plane.url + "\n")
    (data_dir / "token").write_text(control_plane.user_token + "\n")
    result = CliRunner().invoke(main, ["list", "--json", "--data-dir", str(data_dir)],
                                env={"FTRAIN_SERVER": None, "FTRAIN_TOKEN": None})
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == []


def test_target_resolution_order(tmp_path):
    (tmp_path / "server").write_text("http://saved.test:9000\n")
    (tmp_path / "token").write_text("file-token\n")
    env = {"FTRAIN_SERVER": "http://env:1", "FTRAIN_TOKEN": "env-token"}
    flags = resolve_target("http://flag:2/", "flag-token", tmp_path, env)
    assert (flags.server, flags.token, flags.token_source) == ("http://flag:2", "flag-token", "--token")
    from_env = resolve_target(None, None, tmp_path, env)
    assert (from_env.server, from_env.token) == ("http://env:1", "env-token")
    target = resolve_target(None, None, tmp_path, {})
    assert (target.server, target.token) == ("http://saved.test:9000", "file-token")
    assert target.token_source == str(tmp_path / "token")
    empty = resolve_target(None, None, tmp_path / "missing", {})
    assert (empty.server, empty.token) == ("http://127.0.0.1:8000", None)


@pytest.mark.integration
def test_connection_refused_says_how_to_start_one(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("FTRAIN_SERVER", "FTRAIN_TOKEN")}
    proc = subprocess.run([sys.executable, "-m", "service.cli", "list", "--server", url,
                           "--data-dir", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"no ftrain control plane at {url}; start one with `make up`" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(ServerUnreachable):
        FtrainClient(url).get_job("x")


def _fake_server(handler) -> FtrainClient:
    return FtrainClient("http://cp.test", "t", transport=httpx.MockTransport(handler))


def test_logs_and_nodes_are_printed_from_the_documented_shapes(monkeypatch):
    """The logs and nodes endpoints' answers through the CLI's formatting. The answers are
    built from the server's own response models (dumped as the routes dump them), so a field
    renamed or added as required on the server breaks this test instead of passing on a copy."""
    lines = [LogLine(seq=1, time=1.0, node="local-0", rank=0, stream="stdout", line="step 1"),
             LogLine(seq=2, time=2.0, node="local-1", rank=1, stream="stderr", line="warn")]
    node = NodeView(name="local-0", state=NodeState.READY, nproc_per_node=2, address="127.0.0.1",
                    registered_at=1.0, job="j1")
    ended = JobView(id="j1", name="j", owner="admin", state=JobState.FAILED, reason="rank 1: ValueError: x",
                    spec=JobSpec(name="j", command=["true"]), created_at=1.0, updated_at=2.0,
                    finished_at=2.0, attempt=1, nodes=[], world_size=1, restarts=0)

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == "Bearer t"
        if request.url.path == "/v1/jobs/j1/logs" and request.url.params.get("follow") == "true":
            assert request.url.params.get("rank") == "1"
            since = int(request.url.params.get("since", 0))  # followed again until the job ended
            body = "".join(x.model_dump_json() + "\n" for x in lines[1:] if x.seq >= since)
            return httpx.Response(200, content=body.encode(),
                                  headers={"Content-Type": "application/x-ndjson"})
        if request.url.path == "/v1/jobs/j1/logs" and "tail" in request.url.params:
            tails.append(int(request.url.params["tail"]))  # the server reads the tail
            page = lines[-int(request.url.params["tail"]):]
            return httpx.Response(200, json=LogPage(
                items=page, next_seq=3, end_seq=3, first_seq=1, cut_bytes=1, cut_lines=1,
                cap_bytes=1024).model_dump(mode="json"))
        if request.url.path == "/v1/jobs/j1/logs":
            # Two pages: the CLI reads on from next_seq until it reaches end_seq.
            since = int(request.url.params.get("since", 0))
            page = [x for x in lines if x.seq >= since][:1]
            return httpx.Response(200, json=LogPage(
                items=page, next_seq=page[-1].seq + 1 if page else since, end_seq=3, first_seq=1,
                cut_bytes=1, cut_lines=1, cap_bytes=1024).model_dump(mode="json"))
        if request.url.path == "/v1/nodes":
            return httpx.Response(200, json=NodeList(items=[node]).model_dump(mode="json"))
        if request.url.path == "/v1/nodes/local-0/drain" and request.method == "POST":
            drained = node.model_copy(update={"state": NodeState.DRAINING})
            return httpx.Response(202, json=drained.model_dump(mode="json"))
        if request.url.path == "/v1/nodes/local-0/undrain" and request.method == "POST":
            return httpx.Response(200, json=node.model_dump(mode="json"))
        if request.url.path == "/v1/jobs/j1":  # logs -f ends with the job's final state
            return httpx.Response(200, json=ended.model_dump(mode="json"))
        return httpx.Response(404, json={"detail": "not found"})

    monkeypatch.setattr(FtrainClient, "from_target", classmethod(lambda cls, target: _fake_server(handler)))
    runner = CliRunner()
    result = runner.invoke(main, ["logs", "j1"], catch_exceptions=False)
    assert result.stdout.splitlines() == ["[local-0 rank 0] step 1", "[local-1 rank 1] warn"]
    assert "the first 1 lines (1 bytes) of this log were cut" in result.stderr
    out = runner.invoke(main, ["logs", "--json", "j1"], catch_exceptions=False).stdout
    assert [json.loads(x) for x in out.splitlines()] == [x.model_dump(mode="json") for x in lines]
    followed = runner.invoke(main, ["logs", "-f", "--rank", "1", "j1"], catch_exceptions=False)
    assert followed.stdout.splitlines() == ["[local-1 rank 1] warn"]
    assert followed.exit_code == 1  # the job FAILED
    assert followed.stderr.strip() == "ftrain: j1 FAILED: rank 1: ValueError: x (exit 1)"
    out = runner.invoke(main, ["logs", "-f", "--rank", "1", "--json", "j1"], catch_exceptions=False).stdout
    assert [json.loads(x) for x in out.splitlines()] == [x.model_dump(mode="json") for x in lines[1:]]
    tails: list[int] = []
    result = runner.invoke(main, ["logs", "--tail", "1", "j1"], catch_exceptions=False)
    assert result.stdout.splitlines() == ["[local-1 rank 1] warn"] and tails == [1]  # one request
    out = runner.invoke(main, ["nodes"], catch_exceptions=False).output.splitlines()
    assert out[0].split() == ["NAME", "STATE", "NPROC", "GPUS", "ADDRESS", "JOB", "UP"]
    assert out[1].split()[:6] == ["local-0", "READY", "2", "-", "127.0.0.1", "j1"]
    assert runner.invoke(main, ["drain", "local-0"]).output.strip() == "local-0: DRAINING"
    assert runner.invoke(main, ["undrain", "local-0"]).output.strip() == "local-0: READY"


def test_422_from_the_server_carries_field_errors(control_plane):
    with FtrainClient(control_plane.url, control_plane.user_token) as client:
        with pytest.raises(InvalidRequest) as info:
            client.submit({"name": "ok", "command": [], "surprise": 1})
    fields = {e["field"] for e in info.value.errors}
    assert {"command", "surprise"} <= fields
    assert "  command: " in str(info.value)


@pytest.mark.parametrize("args, env, retention_s, retention_jobs", [
    ([], {}, 7 * 86400, None),
    (["--retention", "12h", "--retention-jobs", "500"], {}, 43200, 500),
    ([], {"FTRAIN_RETENTION_S": "30m", "FTRAIN_RETENTION_JOBS": "9"}, 1800, 9),
    (["--retention", "90s"], {"FTRAIN_RETENTION_S": "30m"}, 90, None),  # an option given wins
])
def test_serve_takes_the_retention_from_its_options_or_the_environment(
        monkeypatch, args, env, retention_s, retention_jobs):
    import uvicorn

    import service.app

    built = []
    monkeypatch.setattr(service.app, "create_app", built.append)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    result = CliRunner().invoke(main, ["serve", "--etcd", "http://127.0.0.1:1", *args],
                                env={"FTRAIN_RETENTION_S": None, "FTRAIN_RETENTION_JOBS": None, **env},
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (settings,) = built
    assert (settings.retention_s, settings.retention_jobs) == (retention_s, retention_jobs)


@pytest.mark.parametrize("args, message", [
    (["--retention", "7 days"], "is not a duration"),
    (["--retention", "0s"], "longer than 0"),
    (["--retention-jobs", "0"], "0 is not in the range x>=1"),
])
def test_serve_refuses_a_retention_that_is_not_one(args, message):
    result = CliRunner().invoke(main, ["serve", "--etcd", "http://127.0.0.1:1", *args])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("endpoints, remote", [
    ("http://10.1.2.3:2379", "10.1.2.3"),
    ("http://127.0.0.1:2379,http://etcd-1:2379", "etcd-1"),
])
def test_serve_refuses_an_etcd_on_another_host_without_credentials(monkeypatch, endpoints, remote):
    import uvicorn

    import service.app

    built = []
    monkeypatch.setattr(service.app, "create_app", built.append)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    env = {"FTRAIN_ETCD_USER": None, "FTRAIN_ETCD_PASSWORD_FILE": None}
    refused = CliRunner().invoke(main, ["serve", "--etcd", endpoints], env=env)
    assert refused.exit_code == 2 and f"refusing to use etcd on {remote} without credentials" \
        in refused.output, refused.output
    assert not built
    told = CliRunner().invoke(main, ["serve", "--etcd", endpoints, "--insecure-etcd"], env=env,
                              catch_exceptions=False)
    assert told.exit_code == 0, told.output
    assert built[0].etcd_credentials() is None


def test_serve_reads_the_etcd_password_from_its_file(monkeypatch, tmp_path):
    import uvicorn

    import service.app

    built = []
    monkeypatch.setattr(service.app, "create_app", built.append)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: None)
    password = tmp_path / "etcd-password"
    password.write_text("pw-123\n")
    ok = CliRunner().invoke(main, ["serve", "--etcd", "http://etcd-1:2379", "--etcd-user", "ftrain",
                                   "--etcd-password-file", str(password)], catch_exceptions=False)
    assert ok.exit_code == 0, ok.output
    assert built[0].etcd_credentials() == ("ftrain", "pw-123")
    missing = CliRunner().invoke(main, ["serve", "--etcd", "http://etcd-1:2379", "--etcd-user", "ftrain",
                                        "--etcd-password-file", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "cannot read the etcd password file" in missing.output, missing.output
    no_file = CliRunner().invoke(main, ["serve", "--etcd", "http://etcd-1:2379", "--etcd-user", "ftrain"],
                                 env={"FTRAIN_ETCD_PASSWORD_FILE": None})
    assert no_file.exit_code == 2 and "give both an etcd user and its password file" in no_file.output


def test_status_watch_prints_a_progress_line_with_eta_and_exits_with_the_final_state(monkeypatch):
    from service import cli as cli_module

    spec = JobSpec(name="j", command=["true"])
    running = JobView(id="j1", name="j", owner="admin", state=JobState.RUNNING, reason="started",
                      spec=spec, created_at=1.0, updated_at=2.0, attempt=1, nodes=["n0", "n1"],
                      world_size=2, restarts=0,
                      progress={"step": 100, "total_steps": 400, "percent": 25.0, "eta_s": 125.0,
                                "time": 1e12, "loss": 0.5})
    seen = [running, running.model_copy(update={"state": JobState.CANCELLED, "reason": "cancelled by admin",
                                                "finished_at": 3.0})]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=(seen.pop(0) if len(seen) > 1 else seen[0]).model_dump(mode="json"))

    monkeypatch.setattr(FtrainClient, "from_target", classmethod(lambda cls, target: _fake_server(handler)))
    monkeypatch.setattr(cli_module.time, "sleep", lambda s: None)
    result = CliRunner().invoke(main, ["status", "--watch", "j1"], catch_exceptions=False)
    lines = result.stdout.splitlines()
    assert lines[0] == "RUNNING  step 100/400 (25%)  ETA 2m05s  loss 0.5  nodes 2"
    assert lines[1].startswith("CANCELLED  step 100/400")
    assert result.exit_code == 3
    assert result.stderr.strip() == "ftrain: j1 CANCELLED: cancelled by admin (exit 3)"


@pytest.mark.parametrize("state,regrouping,shown", [
    ("RECOVERING", True, True),  # a fault: what it recovers from
    ("RUNNING", True, True),  # a planned change under way: what is changing
    ("RUNNING", False, False),  # training: the reason is history
])
def test_the_progress_line_shows_the_reason_while_the_group_re_forms(state, regrouping, shown):
    from service.cli import _progress_line
    job = {"state": state, "regrouping": regrouping, "reason": "node(s) n2 joined; scaling up",
           "nodes": ["n0"], "progress": {"step": 5}}
    assert ("node(s) n2 joined" in _progress_line(job, 0.0)) is shown


def test_a_submit_goes_on_while_one_replica_is_gone_and_the_other_answers_503_for_a_moment():
    """Two replicas: one refuses connections (killed), the other answers 503 once (etcd was
    electing a leader). The client comes back to the one that answered, after a pause, with
    the same Idempotency-Key, instead of giving up on the refused connection."""
    sent: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.host, request.headers["Idempotency-Key"]))
        if request.url.host == "dead.test":
            raise httpx.ConnectError("connection refused", request=request)
        if len([h for h, _ in sent if h == "live.test"]) == 1:
            return httpx.Response(503, json={"detail": "etcd: leader changed"}, headers={"Retry-After": "0"})
        return httpx.Response(201, json={"id": "j1"})

    client = FtrainClient("http://live.test,http://dead.test", "t", transport=httpx.MockTransport(handler))
    assert client.submit({"name": "x", "command": ["true"]})["id"] == "j1"
    assert [h for h, _ in sent] == ["live.test", "dead.test", "live.test"]
    assert len({key for _, key in sent}) == 1


@pytest.mark.parametrize("args,stay", [
    (["submit", "SPEC"], None), (["submit", "SPEC", "--wait"], "to-end"), (["submit", "SPEC", "-f"], "logs"),
    (["run", "--", "true"], "logs"), (["run", "--wait", "--", "true"], "to-end"),
    (["run", "-d", "--", "true"], None),
])
def test_submit_and_run_stay_with_the_job_as_their_flags_say(monkeypatch, tmp_path, args, stay):
    """submit returns at once unless --wait or -f/--follow; run follows the logs unless --wait
    or -d/--detach; waiting exits with the job's code."""
    from service import cli as cli_module

    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC_YAML)
    submitted = JobView(id="j1", name="j", owner="admin", state=JobState.PENDING, reason="queued",
                        spec=JobSpec(name="j", command=["true"]), created_at=1.0, updated_at=1.0,
                        attempt=0, nodes=[], world_size=0, restarts=0)
    waited: list[str] = []

    def see_through(client, job_id: str, follow: bool, as_json: bool) -> int:
        waited.append("logs" if follow else "to-end")
        return 3

    monkeypatch.setattr(FtrainClient, "from_target", classmethod(lambda cls, target: _fake_server(
        lambda request: httpx.Response(201, json=submitted.model_dump(mode="json")))))
    monkeypatch.setattr(cli_module, "_see_through", see_through)
    result = CliRunner().invoke(main, [str(spec) if a == "SPEC" else a for a in args], catch_exceptions=False)
    assert waited == ([stay] if stay else [])
    assert result.exit_code == (3 if stay else 0), result.output


def test_the_cli_finds_the_cluster_up_last_ran_from_any_directory(tmp_path, monkeypatch):
    from service.client import local_cluster_record, remember_local_cluster, resolve_target

    data = tmp_path / "project" / ".ftrain"
    data.mkdir(parents=True)
    (data / "server").write_text("http://127.0.0.1:8123\n")
    (data / "token").write_text("t0k\n")
    remember_local_cluster(data)
    assert local_cluster_record().stat().st_mode & 0o777 == 0o600
    assert "t0k" not in local_cluster_record().read_text()  # a path, never the token

    elsewhere = tmp_path / "my-own-project"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    target = resolve_target(environ={"XDG_CONFIG_HOME": str(tmp_path / "user-config")})
    assert (target.server, target.token) == ("http://127.0.0.1:8123", "t0k")
    assert target.token_source == str(data / "token")


def test_a_data_dir_here_comes_before_the_recorded_one(tmp_path, monkeypatch):
    from service.client import remember_local_cluster, resolve_target

    recorded, here = tmp_path / "a" / ".ftrain", tmp_path / "b" / ".ftrain"
    for d, port in ((recorded, 1), (here, 2)):
        d.mkdir(parents=True)
        (d / "server").write_text(f"http://127.0.0.1:900{port}\n")
    remember_local_cluster(recorded)
    monkeypatch.chdir(here.parent)
    assert resolve_target(environ={"XDG_CONFIG_HOME": str(tmp_path / "user-config")}).server == \
        "http://127.0.0.1:9002"
