"""The `ftrain` command line: run the service (`up`, `serve`, `node`) and talk to it.

The commands that talk to a control plane are thin: `service.client.FtrainClient` does the
HTTP and turns failures into messages; this module reads input, picks the target
(flags, then FTRAIN_SERVER / FTRAIN_TOKEN, then the data directory) and prints tables or,
with --json, JSON for scripts.
"""

from __future__ import annotations

import collections
import functools
import ipaddress
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import click

from service.client import DEFAULT_DATA_DIR, ApiError, FtrainClient, resolve_target
from worker.env import (
    FTRAIN_ETCD_ENDPOINTS,
    FTRAIN_ETCD_PASSWORD_FILE,
    FTRAIN_ETCD_USER,
    FTRAIN_LOG_CAP_BYTES,
    FTRAIN_LOG_LEVEL,
    FTRAIN_LOG_ROOT,
    FTRAIN_NODE_TOKEN,
    FTRAIN_SECRET_DIR,
    FTRAIN_SERVER,
    FTRAIN_SNAPSHOT_ROOT,
    FTRAIN_USER_TOKEN,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """ftrain: elastic, fault-tolerant PyTorch training as a service."""


class Duration(click.ParamType):
    """A duration such as 7d, 12h, 30m, 90s (or a number of seconds), in seconds."""

    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        from service.decide.retention import parse_duration

        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def _retention_options(fn):
    """--retention and --retention-jobs, shared by `serve` and `up`."""
    fn = click.option("--retention-jobs", type=click.IntRange(min=1), default=None,
                      help="Keep at most N finished jobs, deleting the oldest finished first "
                           "[env FTRAIN_RETENTION_JOBS; default: no cap].")(fn)
    return click.option("--retention", "retention_s", type=Duration(), default=None,
                        help="Delete finished jobs (record, events, logs, snapshot records) this "
                             "long after they end: 7d, 12h, 30m, 90s [env FTRAIN_RETENTION_S; "
                             "default: 7d].")(fn)


def _remote_etcd_hosts(endpoints: str) -> list[str]:
    """The hosts among etcd `endpoints` that are not this machine's loopback."""
    from service.store.etcd import parse_endpoints

    try:
        hosts = [h for h, _port in parse_endpoints(endpoints)]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--etcd") from None
    return [h for h in hosts if not _is_loopback(h)]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@main.command()
@click.option("--etcd", "etcd_endpoints", envvar=FTRAIN_ETCD_ENDPOINTS, required=True,
              help="etcd v3 endpoints, http://HOST:PORT[,...].")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--token", envvar=FTRAIN_USER_TOKEN, help="User bearer token.")
@click.option("--node-token", envvar=FTRAIN_NODE_TOKEN, help="Node bearer token.")
@click.option("--snapshot-root", envvar=FTRAIN_SNAPSHOT_ROOT,
              help="Directory every node sees; jobs snapshot under <root>/<job id>.")
@click.option("--log-root", envvar=FTRAIN_LOG_ROOT, show_default="./.ftrain/job-logs",
              help="Directory of the workers' logs (a folder per job), shared by every control-plane "
                   "replica (NFS or similar, with POSIX locks).")
@click.option("--secret-dir", envvar=FTRAIN_SECRET_DIR, show_default="./.ftrain/secrets",
              help="Directory (0700) of the control-plane secret, from which job tokens are derived, "
                   "and of the jobs' secret env values (never in etcd); made on first start. Every "
                   "control-plane replica must use the same one (shared storage, as --log-root).")
@click.option("--log-cap-bytes", envvar=FTRAIN_LOG_CAP_BYTES, type=click.IntRange(64 * 1024),
              show_default="67108864 (64 MiB)",
              help="Bytes of log kept per job; past it the oldest are cut (the API says how much).")
@click.option("--etcd-user", envvar=FTRAIN_ETCD_USER,
              help="etcd user to authenticate as (etcd's own authentication).")
@click.option("--etcd-password-file", envvar=FTRAIN_ETCD_PASSWORD_FILE, type=click.Path(dir_okay=False),
              help="File whose first line is the etcd user's password (mode 0600).")
@click.option("--insecure-etcd", is_flag=True,
              help="Use an etcd on another host without credentials (anyone who reaches it reads "
                   "and rewrites every job).")
@_retention_options
def serve(etcd_endpoints: str, host: str, port: int, token: str | None, node_token: str | None,
          snapshot_root: str | None, log_root: str | None, secret_dir: str | None,
          log_cap_bytes: int | None,
          etcd_user: str | None, etcd_password_file: str | None, insecure_etcd: bool,
          retention_s: float | None, retention_jobs: int | None) -> None:
    """Run only the control plane, against an existing etcd."""
    import uvicorn

    from service.app import create_app
    from service.settings import Settings

    if not _is_loopback(host) and not (token and node_token):
        raise click.UsageError(f"refusing to listen on {host} without tokens: set --token and "
                               "--node-token (or FTRAIN_USER_TOKEN and FTRAIN_NODE_TOKEN)")
    remote = _remote_etcd_hosts(etcd_endpoints)
    if remote and etcd_user is None and not insecure_etcd:
        raise click.UsageError(
            f"refusing to use etcd on {', '.join(remote)} without credentials: every job's record "
            "is there. Turn on etcd's authentication and pass --etcd-user and --etcd-password-file "
            "(or FTRAIN_ETCD_USER and FTRAIN_ETCD_PASSWORD_FILE); --insecure-etcd if only the "
            "control plane can reach it")
    given = {"log_root": log_root, "secret_dir": secret_dir, "log_cap_bytes": log_cap_bytes,
             "retention_s": retention_s, "retention_jobs": retention_jobs,
             "etcd_user": etcd_user, "etcd_password_file": etcd_password_file}
    # Options given win; those not given are left to Settings (FTRAIN_LOG_ROOT, FTRAIN_RETENTION_S, ...).
    settings = Settings(etcd_endpoints=etcd_endpoints, user_token=token, node_token=node_token,
                        snapshot_root=snapshot_root, **{k: v for k, v in given.items() if v is not None})
    try:
        settings.etcd_credentials()  # a missing or unreadable password file: say so now
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=os.environ.get(FTRAIN_LOG_LEVEL, "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Each answer in one socket write, and limits on request heads, their time and connections.
    from service.http_limits import RequestLimits, limited_http

    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning",
                http=limited_http(RequestLimits.of(settings)))


# Talking to a control plane

def _client_options(fn):
    """--server, --token, --data-dir and --json, shared by every command that calls the API."""

    @click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts) instead of a table.")
    @click.option("--data-dir", default=None, type=click.Path(),
                  help="Where `ftrain up` keeps `server` and `token` (used when not given otherwise) "
                       "[default: ./.ftrain if `ftrain up` ran here, else the data directory it last "
                       "ran with, recorded in ~/.config/ftrain/local-cluster].")
    @click.option("--token", help="User token [env FTRAIN_TOKEN; else <data-dir>/token].")
    @click.option("--server", help="Control plane URL, or several comma-separated (replicas; the "
                                   "next is tried when one does not answer) [env FTRAIN_SERVER; "
                                   "else <data-dir>/server; else http://127.0.0.1:8000].")
    @functools.wraps(fn)
    def wrapper(server, token, data_dir, as_json, **kw):
        target = resolve_target(server, token, data_dir)
        try:
            with FtrainClient.from_target(target) as client:
                return fn(client, as_json, **kw)
        except ApiError as exc:
            raise click.ClickException(exc.message) from None

    return wrapper


def _print_json(value) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False))


def _table(rows: list[list[str]], header: list[str]) -> None:
    """Columns padded to their widest cell; the last column is not padded."""
    cells = [header] + [[("" if c is None else str(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        line = "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths[:-1]))
        click.echo((line + "  " + row[-1]).rstrip() if len(row) > 1 else row[0])


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return "-"
    s = max(0, int((now or time.time()) - ts))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"


def _load_spec(path: str) -> dict:
    """A job spec from a YAML or JSON file, or from stdin for `-`."""
    import yaml

    if path == "-":
        text, where = sys.stdin.read(), "stdin"
    else:
        try:
            text, where = Path(path).read_text(), path
        except OSError as exc:
            raise click.ClickException(f"cannot read {path}: {exc.strerror}") from None
    try:
        # YAML is a superset of JSON, but a .json file is parsed as JSON for exact errors.
        spec = json.loads(text) if where.endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise click.ClickException(f"{where} is not valid {'JSON' if where.endswith('.json') else 'YAML'}: "
                                   f"{exc}") from None
    if not isinstance(spec, dict):
        raise click.ClickException(f"{where} must hold one job spec (a mapping with name, command, ...), "
                                   f"not {type(spec).__name__}")
    return spec


def _progress(job: dict) -> str:
    p = job.get("progress") or {}
    return "-" if p.get("step") is None else str(p["step"])


_STAYS = {  # how long `submit` and `run` stay with the job they submitted: its flags, its help
    "no": (("-d", "--detach"), "Print the job id and return at once."),
    "to-end": (("--wait",), "Wait until the job ends, without its logs; print its final state and "
                            "exit with its code (SUCCEEDED 0, FAILED 1, CANCELLED 3)."),
    "logs": (("-f", "--follow"), "Like --wait, printing the job's logs as they come."),
}


def _staying_options(default: str):
    """The flags of `_STAYS` but `default`'s (what the command does without one: `submit`
    returns at once, `run` follows), as one parameter `stay`, shared by `submit` and `run`."""
    def decorate(fn):
        for value, (decls, help_) in reversed(_STAYS.items()):
            if value != default:
                fn = click.option(*decls, "stay", flag_value=value, default=default, help=help_)(fn)
        return fn

    return decorate


def _stay_with(client: FtrainClient, job_id: str, stay: str, as_json: bool) -> None:
    """Follow or wait for the submitted job as `stay` says, then exit with its code."""
    if stay != "no":
        sys.exit(_see_through(client, job_id, stay == "logs", as_json))


@main.command()
@click.argument("file")
@click.option("--idempotency-key", help="Makes a retried submit return the first job. "
                                        "[default: a fresh random key per invocation]")
@click.option("-q", "--quiet", is_flag=True, help="Print only the job id.")
@_staying_options(default="no")
@_client_options
def submit(client: FtrainClient, as_json: bool, file: str, idempotency_key: str | None, quiet: bool,
           stay: str) -> None:
    """Submit the job spec in FILE (YAML or JSON; `-` reads stdin)."""
    job = client.submit(_load_spec(file), idempotency_key)
    if as_json:
        _print_json(job)
    elif quiet:
        click.echo(job["id"])
    else:
        click.echo(f"submitted {job['id']} ({job['name']}): {job['state']}", err=stay != "no")
    _stay_with(client, job["id"], stay, as_json)


@main.command("list")
@click.option("--state", "states", multiple=True, metavar="STATE",
              type=click.Choice(["PENDING", "STARTING", "RUNNING", "RECOVERING", "CANCELLING", "SUCCEEDED",
                                 "FAILED", "CANCELLED"], case_sensitive=False),
              help="Only jobs in this state (repeatable).")
@_client_options
def list_jobs(client: FtrainClient, as_json: bool, states: tuple[str, ...]) -> None:
    """Jobs, oldest first."""
    jobs = list(client.list_jobs([s.upper() for s in states] or None))
    if as_json:
        _print_json(jobs)
        return
    now = time.time()
    _table([[j["id"], j["name"], j.get("owner", "-"), j["state"], _nodes_in_use(j),
             _progress(j), _restarts(j), _duration(j, now), _one_line(_why(j))]
            for j in jobs],
           ["ID", "NAME", "OWNER", "STATE", "NODES", "STEP", "RESTARTS", "DURATION", "REASON"])


# How `ftrain list` names each cause of restarts (service.models.RestartCounts), in this order.
RESTART_CAUSES = {"failure": "fail", "lost_node": "lost", "preemption": "preempt", "resize": "resize"}


def _restarts(job: dict) -> str:
    """Restarts in all, and by cause where any: `3 (1 fail, 2 preempt)`."""
    by = job.get("restarts_by_cause") or {"failure": job.get("restarts", 0)}
    parts = [f"{by[c]} {word}" for c, word in RESTART_CAUSES.items() if by.get(c)]
    return f"{sum(by.get(c, 0) for c in RESTART_CAUSES)} ({', '.join(parts)})" if parts else "0"


def _nodes_in_use(job: dict) -> str:
    """The nodes a job holds now, and the range it asked for: `2 (1-4)`."""
    wanted = job["spec"]["nodes"]
    return f"{len(job.get('nodes') or [])} ({wanted['min']}-{wanted['max']})"


def _duration(job: dict, now: float) -> str:
    """How long a job has existed: until it finished, or until now."""
    end = job.get("finished_at") or now
    return _span(max(0.0, end - job["created_at"]))


def _span(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def _one_line(text: str, width: int = 100) -> str:
    """A table cell: the first line, cut to `width` characters."""
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


@main.command()
@click.argument("job_id")
@click.option("-w", "--watch", is_flag=True, help="Show a progress line (step, total, ETA) until the job "
                                                  "ends; exit with its code (SUCCEEDED 0, FAILED 1, "
                                                  "CANCELLED 3).")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(0.2, 3600),
              help="Seconds between two looks, with --watch.")
@_client_options
def status(client: FtrainClient, as_json: bool, job_id: str, watch: bool, interval: float) -> None:
    """One job: state, nodes, progress, latest snapshot."""
    if watch:
        sys.exit(_watch(client, job_id, interval, as_json))
    job = client.get_job(job_id)
    if as_json:
        _print_json(job)
        return
    spec = job["spec"]
    progress = job.get("progress") or {}
    snap = job.get("latest_snapshot")
    rows = [
        ("id", job["id"]), ("name", job["name"]), ("owner", job.get("owner", "-")),
        ("state", job["state"]), ("reason", _one_line(job["reason"], 300)),
        *([("waiting", _one_line(job["waiting"], 300))] if job.get("waiting") else []),
        ("command", " ".join(spec["command"])),
        ("nodes", f"{', '.join(job['nodes']) or '-'} (wants {spec['nodes']['min']}-{spec['nodes']['max']})"),
        ("world size", str(job["world_size"])), ("attempt", str(job["attempt"])),
        ("restarts", f"{_restarts(job)}; failures {job['restarts']} of {spec['max_restarts']}"),
        ("step", _progress(job)
         + (f", loss {progress['loss']:.4g}" if progress.get("loss") is not None else "")
         + (f", {progress['samples_per_s']:.1f} samples/s" if progress.get("samples_per_s") else "")),
        ("snapshot", f"step {snap['step']} ({snap['path']})" if snap else "-"),
        ("created", _when(job["created_at"])), ("updated", _when(job["updated_at"])),
    ]
    if job.get("secret_env_names"):
        rows.append(("secret env", ", ".join(job["secret_env_names"]) + " (values never shown)"))
    if job.get("finished_at"):
        rows.append(("finished", _when(job["finished_at"])))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key + ':':<{width + 1}} {value}")


@main.command()
@click.argument("job_id")
@_client_options
def cancel(client: FtrainClient, as_json: bool, job_id: str) -> None:
    """Ask a job to stop (its workers get a grace period)."""
    result = client.cancel_job(job_id)
    if as_json:
        _print_json(result)
    else:
        click.echo(f"{result['id']}: {result['state']}")


@main.command()
@click.argument("job_id")
@_client_options
def events(client: FtrainClient, as_json: bool, job_id: str) -> None:
    """Every state change of a job, with time and reason."""
    items = client.events(job_id)
    if as_json:
        _print_json(items)
        return
    _table([[_when(e["time"]), e["state"], e.get("by") or "-", e["reason"]] for e in items],
           ["TIME", "STATE", "BY", "REASON"])


@main.command()
@click.argument("job_id")
@click.option("--all", "show_all", is_flag=True, help="Every cause, those at 0 s too.")
@_client_options
def goodput(client: FtrainClient, as_json: bool, job_id: str, show_all: bool) -> None:
    """Where a job's wall time went: waiting for nodes, starting, training, steps replayed after a
    fault, snapshot stalls, recovering, hung... (docs/goodput.md)."""
    result = client.goodput(job_id)
    if as_json:
        _print_json(result)
        return
    wall = result["wall_s"]
    rows = [[cause, _span_precise(s), f"{100 * s / wall:.1f}%" if wall > 0 else "-"]
            for cause, s in result["seconds"].items() if show_all or s > 0]
    rows.append(["wall", _span_precise(wall), "100.0%" if wall > 0 else "-"])
    _table(rows, ["CAUSE", "TIME", "SHARE"])


def _span_precise(seconds: float) -> str:
    """A duration to a tenth of a second under a minute (a recovery, a stall), else `_span`'s."""
    return f"{seconds:.1f}s" if seconds < 60 else _span(seconds)


def _log_line(item: dict) -> str:
    return f"[{item.get('node', '?')} rank {item.get('rank', '?')}] {item.get('line', '')}"


@main.command()
@click.argument("job_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines until the job ends, then print "
                                                   "its final state and exit with its code (SUCCEEDED 0, "
                                                   "FAILED 1, CANCELLED 3).")
@click.option("--rank", type=int, help="Only this global rank.")
@click.option("-n", "--tail", type=click.IntRange(min=0), default=None, help="Only the last N lines "
                                                                            "(then new ones, with -f).")
@click.option("--since", "since_s", type=Duration(), default=None,
              help="Only lines of the last 10m, 2h, 90s... (by the time the node read them).")
@_client_options
def logs(client: FtrainClient, as_json: bool, job_id: str, follow: bool, rank: int | None,
         tail: int | None, since_s: float | None) -> None:
    """A job's worker output (stdout and stderr of every rank); --json: one line of JSON each."""
    oldest = time.time() - since_s if since_s is not None else None
    try:
        kept: collections.deque = collections.deque(maxlen=tail)  # maxlen None: every line
        cursor = 0
        # --tail: the server reads the last N lines from the end of the log (`?tail=N`)
        pages = [client.logs(job_id, rank, tail=tail)] if tail is not None else \
            client.log_pages(job_id, rank) if not follow else []
        for i, page in enumerate(pages):
            if i == 0 and tail is None and page.get("cut_lines"):
                click.echo(f"ftrain: the first {page['cut_lines']} lines ({page['cut_bytes']} bytes) "
                           f"of this log were cut: a job keeps its newest {page['cap_bytes']} bytes",
                           err=True)
            for item in page.get("items", []):
                if oldest is None or (item.get("time") or 0) >= oldest:
                    kept.append(item)
            while tail is None and kept:
                _echo_line(kept.popleft(), as_json)
            cursor = max(cursor, page.get("next_seq") or 0)
        for item in kept:
            _echo_line(item, as_json)
        if follow:
            sys.exit(_see_through(client, job_id, True, as_json, rank, cursor, oldest))
    except KeyboardInterrupt:
        return


def _echo_line(item: dict, as_json: bool) -> None:
    click.echo(json.dumps(item) if as_json else _log_line(item))


# Waiting for a job: submit --wait/--follow, run, logs -f, status --watch

EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 3}  # the exit codes docs/api.md gives
WAIT_POLL_S = 1.0


def _see_through(client: FtrainClient, job_id: str, follow: bool, as_json: bool, rank: int | None = None,
                 since: int = 0, oldest: float | None = None) -> int:
    """Wait for the job to end (printing its logs as they come if `follow`), print its final
    state on stderr, and return the exit code of that state. Ctrl-C stops waiting, not the job."""
    try:
        if follow:
            job = client.get_job(job_id)
            if job["state"] == "PENDING":
                click.echo(f"ftrain: {job_id} is PENDING: {_one_line(_why(job))}", err=True)
            for item in client.follow_logs(job_id, rank, since):
                if oldest is None or (item.get("time") or 0) >= oldest:
                    _echo_line(item, as_json)
        job = _final(client, job_id)
    except KeyboardInterrupt:
        click.echo(f"\nftrain: stopped waiting; {job_id} goes on (`ftrain cancel {job_id}` stops it)",
                   err=True)
        return 130
    _say_final(job)
    return EXIT_CODES[job["state"]]


def _final(client: FtrainClient, job_id: str) -> dict:
    """The job once it has ended (its record is terminal)."""
    while True:
        job = client.get_job(job_id)
        if job["state"] in EXIT_CODES:
            return job
        time.sleep(WAIT_POLL_S)


def _say_final(job: dict) -> None:
    reason = _one_line(job.get("reason", ""), 300)
    click.echo(f"ftrain: {job['id']} {job['state']}" + (f": {reason}" if reason else "")
               + f" (exit {EXIT_CODES[job['state']]})", err=True)


def _progress_line(job: dict, now: float) -> str:
    """`RUNNING  step 120/400 (30%)  ETA 2m05s  loss 0.531  12.0 samples/s  nodes 2`."""
    return "  ".join([job["state"], _progress_details(job, now)])


def _progress_details(job: dict, now: float) -> str:
    """The progress line after the state."""
    p = job.get("progress") or {}
    parts = []
    if p.get("step") is not None:
        total = p.get("total_steps")
        parts.append(f"step {p['step']}" + (f"/{total}" if total else "")
                     + (f" ({p['percent']:.0f}%)" if p.get("percent") is not None else ""))
    if p.get("eta_s") is not None and job["state"] == "RUNNING":
        # counted down from the report's time (never up: the server's clock may be ahead)
        left = max(0.0, p["eta_s"] - max(0.0, now - (p.get("time") or now)))
        parts.append(f"ETA {_span(left)}")
    if p.get("loss") is not None:
        parts.append(f"loss {p['loss']:.4g}")
    if p.get("samples_per_s"):
        parts.append(f"{p['samples_per_s']:.1f} samples/s")
    parts.append(f"nodes {len(job.get('nodes') or [])}")
    if (job["state"] in ("PENDING", "RECOVERING") or job.get("regrouping")) and _why(job):
        parts.append(_one_line(_why(job), 120))
    return "  ".join(parts)


def _why(job: dict) -> str:
    """What a waiting job waits for (the server's `waiting`), else its last reason."""
    return job.get("waiting") or job.get("reason", "")


def _watch(client: FtrainClient, job_id: str, interval_s: float, as_json: bool) -> int:
    """`status --watch`: on a terminal a progress bar redrawn in place (rich:
    `service.progress_view`); otherwise the progress line (the job as JSON, with --json), once
    per change; the final state's exit code."""
    try:
        if sys.stdout.isatty() and not as_json:
            from service.progress_view import watch_with_bar

            job = watch_with_bar(lambda: client.get_job(job_id), interval_s, _progress_details,
                                 EXIT_CODES)
            _say_final(job)
            return EXIT_CODES[job["state"]]
        last = None
        while True:
            job = client.get_job(job_id)
            line = json.dumps(job) if as_json else _progress_line(job, time.time())
            if line != last:
                click.echo(line)
            last = line
            if job["state"] in EXIT_CODES:
                _say_final(job)
                return EXIT_CODES[job["state"]]
            time.sleep(interval_s)
    except KeyboardInterrupt:
        click.echo()
        return 130


def _env_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--env")
        env[name] = value
    return env


def _node_range(text: str) -> dict[str, int]:
    lo, _, hi = text.partition(":")
    try:
        nodes = {"min": int(lo), "max": int(hi or lo)}
    except ValueError:
        raise click.BadParameter(f"{text!r} is not N or MIN:MAX", param_hint="--nodes") from None
    return nodes


def _name_from(command: tuple[str, ...]) -> str:
    """A job name from the command: `python train.py` -> `train`."""
    import re

    words = [w for w in command if not w.startswith("-")]
    script = next((w for w in words[1:] if w.endswith(".py")), words[0] if words else "job")
    stem = Path(script).stem.lower()
    name = re.sub(r"[^a-z0-9-]+", "-", stem).strip("-")[:40].strip("-")
    return name if name and name[0].isalpha() else f"job-{name}".strip("-")[:40]


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("--name", help="Job name (a DNS label) [default: from the script, `train.py` -> train].")
@click.option("--nodes", "node_range", default="1", show_default=True, metavar="N|MIN:MAX",
              help="Nodes: exactly N, or MIN to start and up to MAX.")
@click.option("--nproc-per-node", "nproc", default=None, metavar="N|auto",
              help="Workers per node [default: 1].")
@click.option("-e", "--env", "env_pairs", multiple=True, metavar="NAME=VALUE",
              help="Environment for the workers (repeatable).")
@click.option("--working-dir", default=None, type=click.Path(file_okay=False),
              help="Where the workers run, a path every node sees [default: this directory].")
@click.option("--snapshot-every", type=click.IntRange(min=1), default=None, help="Snapshot every N steps.")
@click.option("--snapshot-keep", type=click.IntRange(min=1), default=None, help="Snapshots kept.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None, help="Worker failures tolerated.")
@_staying_options(default="logs")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_client_options
def run(client: FtrainClient, as_json: bool, name: str | None, node_range: str, nproc: str | None,
        env_pairs: tuple[str, ...], working_dir: str | None, snapshot_every: int | None,
        snapshot_keep: int | None, max_restarts: int | None, stay: str,
        command: tuple[str, ...]) -> None:
    """Run COMMAND as a job and follow its logs: `ftrain run --nodes 2 -- python train.py --lr 0.1`.

    Exits with the job's code (SUCCEEDED 0, FAILED 1, CANCELLED 3); Ctrl-C stops following,
    not the job."""
    spec: dict = {"name": name or _name_from(command), "command": list(command),
                  "nodes": _node_range(node_range), "env": _env_pairs(env_pairs),
                  "working_dir": str(Path(working_dir or os.getcwd()).resolve())}
    if nproc is not None:
        spec["nproc_per_node"] = nproc if nproc == "auto" else _int_option(nproc, "--nproc-per-node")
    snapshot = {k: v for k, v in (("every_steps", snapshot_every), ("keep", snapshot_keep)) if v}
    if snapshot:
        spec["snapshot"] = snapshot
    if max_restarts is not None:
        spec["max_restarts"] = max_restarts
    job = client.submit(spec)
    if stay == "no":
        _print_json(job) if as_json else click.echo(job["id"])
    else:
        click.echo(f"ftrain: submitted {job['id']} ({job['name']}); Ctrl-C stops following, "
                   f"`ftrain cancel {job['id']}` stops the job", err=True)
    _stay_with(client, job["id"], stay, as_json)


def _int_option(text: str, hint: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number or 'auto'", param_hint=hint) from None


@main.command()
@_client_options
def nodes(client: FtrainClient, as_json: bool) -> None:
    """Registered nodes and the job each works on."""
    items = client.nodes()
    if as_json:
        _print_json(items)
        return
    now = time.time()
    _table([[n["name"], n["state"], str(n["nproc_per_node"]), _gpus_cell(n), n.get("address") or "-",
             (n.get("job") or "-") + (" (its part done)" if n.get("member_state") == "succeeded" else ""),
             _ago(n.get("registered_at"), now)] for n in items],
           ["NAME", "STATE", "NPROC", "GPUS", "ADDRESS", "JOB", "UP"])
    for n in items:  # why a node takes no work: its own line, the reason may be long
        if n.get("reason"):
            click.echo(f"{n['name']} {n['state']}: {n['reason']}")


def _gpus_cell(node: dict) -> str:
    """A node's GPUs for the nodes table: '2 x NVIDIA H100 80GB HBM3', or '-'."""
    count = node.get("gpus") or 0
    return f"{count} x {node.get('gpu_model') or 'GPU'}" if count else "-"


@main.command()
@click.argument("name")
@_client_options
def drain(client: FtrainClient, as_json: bool, name: str) -> None:
    """Take a node out of service: its job snapshots and moves on, no new work comes to it.

    The drain holds until `ftrain undrain` (across the node's re-registration and control-plane
    restarts); the node shows DRAINING while it still has work, DRAINED once idle."""
    result = client.drain(name)
    if as_json:
        _print_json(result)
    else:
        click.echo(f"{name}: {result.get('state', 'DRAINING')}")


@main.command()
@click.argument("name")
@_client_options
def undrain(client: FtrainClient, as_json: bool, name: str) -> None:
    """Put a drained node back in service (READY: it may be given work again)."""
    result = client.undrain(name)
    if as_json:
        _print_json(result)
    else:
        click.echo(f"{name}: {result.get('state', 'READY')}")


# Users (the admin's)

@main.group()
def users() -> None:
    """Named users of the control plane (the admin's token: the server's user token)."""


@users.command("add")
@click.argument("name")
@click.option("--team", default=None, help="The team NAME belongs to (its quota and its share of "
                                             "the cluster count NAME's jobs).")
@_client_options
def users_add(client: FtrainClient, as_json: bool, name: str, team: str | None) -> None:
    """Create user NAME and print its token, once (only its hash is kept)."""
    user = client.add_user(name, team)
    if as_json:
        _print_json(user)
        return
    click.echo(user["token"])
    click.echo(f"ftrain: created user {user['name']}; the line above is its token, shown only now. "
               "Give it to them to put in FTRAIN_TOKEN or <data-dir>/token.", err=True)


@users.command("list")
@_client_options
def users_list(client: FtrainClient, as_json: bool) -> None:
    """The users (tokens are never shown again)."""
    items = client.users()
    if as_json:
        _print_json(items)
        return
    _table([[u["name"], "admin" if u.get("admin") else "user", u.get("team") or "-",
             _when(u.get("created_at"))] for u in items], ["NAME", "ROLE", "TEAM", "CREATED"])


@users.command("remove")
@click.argument("name")
@_client_options
def users_remove(client: FtrainClient, as_json: bool, name: str) -> None:
    """Delete user NAME: its token stops working at once; its jobs run on."""
    client.remove_user(name)
    if as_json:
        _print_json({"name": name, "removed": True})
    else:
        click.echo(f"removed user {name}")


# Quotas and the queue

def _quota_value(text: str, hint: str) -> int | None:
    """A quota option: a count, or 'none' to clear it."""
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number or 'none'", param_hint=hint) from None


@main.group()
def quota() -> None:
    """Quotas: the most nodes (and GPUs) the running jobs of a user or a team may hold at once."""


@quota.command("set")
@click.option("--user", default=None, help="The user whose quota to set.")
@click.option("--team", default=None, help="The team whose quota to set (all its users' jobs together).")
@click.option("--max-nodes", default=None, metavar="N|none", help="Most nodes at once; 'none' clears it.")
@click.option("--max-gpus", default=None, metavar="M|none", help="Most GPUs at once; 'none' clears it.")
@_client_options
def quota_set(client: FtrainClient, as_json: bool, user: str | None, team: str | None,
              max_nodes: str | None, max_gpus: str | None) -> None:
    """Set a user's or a team's quota (the admin's). A job that would exceed it waits."""
    if (user is None) == (team is None):
        raise click.UsageError("give one of --user U or --team T")
    change = {k: _quota_value(v, f"--{k.replace('_', '-')}")
              for k, v in (("max_nodes", max_nodes), ("max_gpus", max_gpus)) if v is not None}
    if not change:
        raise click.UsageError("give --max-nodes N and/or --max-gpus M (a number, or 'none' to clear it)")
    result = client.set_quota(user=user, team=team, **change)
    if as_json:
        _print_json(result)
    else:
        click.echo(f"{'user' if user else 'team'} {result['name']}: {_quota_cell(result)}")


def _quota_cell(item: dict) -> str:
    """'2 nodes, 16 GPUs', 'no limit'."""
    parts = [f"{item[k]} {what}" for k, what in (("max_nodes", "nodes"), ("max_gpus", "GPUs"))
             if item.get(k) is not None]
    return ", ".join(parts) or "no limit"


def _in_use_cell(item: dict) -> str:
    return f"{item.get('nodes_in_use') or 0} nodes, {item.get('gpus_in_use') or 0} GPUs"


@quota.command("show")
@_client_options
def quota_show(client: FtrainClient, as_json: bool) -> None:
    """Every user's and team's quota, and what their unfinished jobs hold now."""
    users, teams = client.users(), client.teams()
    if as_json:
        _print_json({"users": users, "teams": teams})
        return
    _table([["user", u["name"], u.get("team") or "-", _quota_cell(u), _in_use_cell(u)] for u in users]
           + [["team", t["name"], ", ".join(t.get("members") or []) or "-", _quota_cell(t),
               _in_use_cell(t)] for t in teams],
           ["KIND", "NAME", "TEAM/MEMBERS", "QUOTA", "IN USE"])


@main.command("queue")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 1000),
              help="Show the first this many waiting jobs.")
@_client_options
def queue_cmd(client: FtrainClient, as_json: bool, limit: int) -> None:
    """Waiting jobs in the order they will start (priority, fair share, age), and why each waits."""
    items = client.queue(limit)
    if as_json:
        _print_json(items)
        return
    if not items:
        click.echo("no job is waiting")
        return
    _table([[str(q["position"]), q["id"], q["name"], q["owner"], q.get("team") or "-", str(q["priority"]),
             f"{q['nodes_min']}-{q['nodes_max']}", _preempts_cell(q.get("would_preempt") or []),
             _one_line(q.get("waiting") or "")] for q in items],
           ["#", "ID", "NAME", "OWNER", "TEAM", "PRIO", "NODES", "WOULD PREEMPT", "WAITING"])


def _preempts_cell(takes: list[dict]) -> str:
    """'JOB shrink n1,n2; JOB2 suspend n3' (what a waiting job takes if it is next), or '-'."""
    return "; ".join(f"{t['job_id']} {t['how']} {','.join(t['nodes'])}" for t in takes) or "-"


@main.command()
@_client_options
def whoami(client: FtrainClient, as_json: bool) -> None:
    """Who the control plane takes you for (the user of your token)."""
    me = client.whoami()
    if as_json:
        _print_json(me)
    else:
        click.echo(f"{me['name']}{' (admin)' if me.get('admin') else ''}")


# Running the service

@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the control plane listens on.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--data-dir", default=DEFAULT_DATA_DIR, show_default=True, type=click.Path(file_okay=False),
              help="Tokens, etcd data, snapshots and logs; reused by the next `ftrain up`.")
@click.option("--nodes", "node_count", default=2, show_default=True, type=click.IntRange(0, 64),
              help="Local node agents to start.")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1, 16),
              help="Control planes to run, on ports --port, --port+1, ...; clients get them all.")
@click.option("--etcd-members", default=1, show_default=True, type=click.IntRange(1, 7),
              help="Members of the local etcd cluster (3 survives one lost member).")
@_retention_options
def up(host: str, port: int, data_dir: str, node_count: int, replicas: int, etcd_members: int,
       retention_s: float | None, retention_jobs: int | None) -> None:
    """Run a one-machine cluster in the foreground: etcd, control plane(s), N node agents."""
    from service.up import UpOptions, run

    sys.exit(run(UpOptions(data_dir=Path(data_dir), host=host, port=port, nodes=node_count,
                           retention_s=retention_s, retention_jobs=retention_jobs,
                           replicas=replicas, etcd_members=etcd_members)))


@main.command()
@click.option("--server", envvar=FTRAIN_SERVER, default=None,
              help="Control plane URL, or several comma-separated (replicas: the node fails over "
                   "between them). Default: <data-dir>/server, written by `ftrain up`.")
@click.option("--token-file", type=click.Path(dir_okay=False, exists=True),
              help="File that holds the node token (read at start). Default: FTRAIN_NODE_TOKEN, "
                   "else <data-dir>/node-token, written by `ftrain up`.")
@click.option("--name", default=lambda: default_node_name(), show_default="SLURMD_NODENAME, else hostname",
              help="Unique node name.")
@click.option("--nproc-per-node", default=1, show_default=True, type=click.IntRange(1, 1024))
@click.option("--data-dir", default=DEFAULT_DATA_DIR, show_default=True, type=click.Path(file_okay=False),
              help="Where the agent keeps its local state.")
@click.option("--gpus", default=None, metavar="IDS",
              help="The GPUs this node's workers may use (indices or UUIDs, e.g. 0,1; 'none': no "
                   "GPU): their CUDA_VISIBLE_DEVICES. Default: the agent's CUDA_VISIBLE_DEVICES, "
                   "else every GPU nvidia-smi lists.")
@click.option("--address", default=None,
              help="Address other nodes reach this one at (torchrun's --local-addr); default: hostname.")
@click.option("--run-as", "run_as", metavar="USER", default=None,
              help="Run the jobs' processes (fork server, torchrun, workers) as this unprivileged "
                   "user, who cannot read the agent's files; the agent must run as root.")
@click.option("--keep-logs-jobs", default=20, show_default=True, type=click.IntRange(0, 1_000_000),
              help="Keep the local torchrun output (<data-dir>/logs/<job>) of this many jobs, the "
                   "latest; older folders of jobs this node no longer runs are deleted.")
@click.option("--keep-logs-days", default=7.0, show_default=True, type=click.FloatRange(0, 36500),
              help="Delete the local torchrun output of a job no longer run here once it is this old.")
@click.option("--health-check", "health_check", metavar="CMD", default=None,
              help="The operator's own health check, a shell command run when the node registers and "
                   "between jobs: exit 0 is healthy; otherwise the node is QUARANTINED, its output "
                   "the reason (docs/health.md).")
@click.option("--health-check-timeout", default=60.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds each health check may take; one that takes longer has failed.")
@click.option("--builtin-checks/--no-builtin-checks", default=True, show_default=True,
              help="Run the built-in checks too (devices, matmul, memory, a collective self-test).")
def node(server: str | None, token_file: str | None, name: str, nproc_per_node: int, data_dir: str,
         gpus: str | None, address: str | None, run_as: str | None, keep_logs_jobs: int,
         keep_logs_days: float, health_check: str | None, health_check_timeout: float,
         builtin_checks: bool) -> None:
    """Run a node agent: register with the control plane and run the work it is given.

    The node token comes from --token-file or FTRAIN_NODE_TOKEN, never the command line
    (`ps` shows that to every local user); the agent removes it from its own environment
    at once, so nothing it starts inherits it and /proc/<pid>/environ no longer shows it.
    """
    try:
        from worker import agent
    except ImportError as exc:
        if getattr(exc, "name", None) not in ("worker.agent", "worker"):
            raise
        raise click.ClickException("the node agent (worker/agent.py) is not part of this build") from None
    token = agent.take_from_environ(FTRAIN_NODE_TOKEN)
    server, up_token_file = _node_defaults(Path(data_dir), server)
    if token_file is None and token is None:
        token_file = up_token_file
    if token_file is not None:
        token = Path(token_file).read_text().strip()
        if not token:
            raise click.ClickException(f"{token_file} is empty; it should hold the node token")
    from worker.health import HealthChecks
    from worker.run_as import RunAs, RunAsError

    try:
        job_user = RunAs.lookup(run_as) if run_as is not None else None
        if job_user is not None:
            job_user.check_can_run(sys.executable)
    except RunAsError as exc:
        raise click.UsageError(str(exc)) from None
    if gpus is not None:
        _use_gpus(gpus)
    # The agent sets up its own logging (with the node's name in every line).
    checks = HealthChecks(builtin_checks, health_check, health_check_timeout)
    result = agent.main(server, token, name, nproc_per_node, data_dir, address, job_user,
                        keep_logs_jobs, keep_logs_days * 86400, checks)
    sys.exit(result if isinstance(result, int) else 0)


def default_node_name() -> str:
    """A node agent's name: in a SLURM allocation (srun) the node's SLURM name, which
    `squeue`, `scontrol` and `scancel -w` use, else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _node_defaults(data_dir: Path, server: str | None) -> tuple[str, str | None]:
    """The control plane (unless given) and the node token file of the `ftrain up` on
    `data_dir`, if it has one: one more local node needs no other flag than --name.
    The agent then runs on up's data directory, and up's Ctrl-C stops it with up's own."""
    if server is None:
        try:
            server = (data_dir / "server").read_text().strip()
        except OSError:
            server = ""
        if not server:
            raise click.UsageError(f"no --server given (nor {FTRAIN_SERVER}), and no {data_dir}/server "
                                   "(written by `ftrain up`); pass the control plane's URL")
    token_file = data_dir / "node-token"
    return server, str(token_file) if token_file.is_file() else None


def _use_gpus(value: str) -> None:
    """`ftrain node --gpus`: the agent's CUDA_VISIBLE_DEVICES, so its workers inherit it and its
    registration reports those GPUs alone."""
    from worker import gpus

    try:
        ids = gpus.parse_gpus(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--gpus") from None
    missing = gpus.unknown(ids, gpus.list_gpus())
    if missing:
        raise click.BadParameter(f"no GPU {', '.join(missing)} on this host (nvidia-smi -L lists them)",
                                 param_hint="--gpus")
    os.environ[gpus.CUDA_VISIBLE_DEVICES] = ",".join(ids)


# SLURM supplies nodes (service/slurm.py)

@main.group()
def slurm() -> None:
    """Nodes from SLURM allocations: agents that join a control plane, or a whole run in one."""


@slurm.command("nodes", context_settings={"ignore_unknown_options": True})
@click.option("--nodes", "node_count", required=True, type=click.IntRange(1, 100_000),
              help="Nodes of the allocation; each runs one node agent.")
@click.option("--server", envvar=FTRAIN_SERVER, default=None,
              help="The control plane the agents join (a URL every node reaches; several "
                   "comma-separated) [env FTRAIN_SERVER; else <data-dir>/server].")
@click.option("--token-file", default=None, type=click.Path(dir_okay=False),
              help="File (mode 0600, on a filesystem the nodes share) holding the node token "
                   f"[default: <data-dir>/node-token; else {FTRAIN_NODE_TOKEN}, written to "
                   "<data-dir>/slurm/node-token].")
@click.option("--nproc-per-node", default=1, show_default=True, type=click.IntRange(1, 1024))
@click.option("--data-dir", default=DEFAULT_DATA_DIR, show_default=True, type=click.Path(file_okay=False),
              help="Where the agents keep their state (each its own, by node name).")
@click.option("--print-script", is_flag=True, help="Print the batch script instead of submitting it.")
@click.argument("sbatch_options", nargs=-1, type=click.UNPROCESSED)
def slurm_nodes(node_count: int, server: str | None, token_file: str | None, nproc_per_node: int,
                data_dir: str, print_script: bool, sbatch_options: tuple[str, ...]) -> None:
    """Submit an allocation whose every node runs a node agent: `ftrain slurm nodes --nodes 4
    --server http://cp:8000 -p gpu --time 12:00:00`. Other options go to sbatch.

    Prints the SLURM job id. `scancel` (or the allocation's end or preemption) drains its
    nodes: their jobs stop at a step boundary and go on elsewhere or when nodes come back."""
    from service import slurm as slurm_mod

    server, _ = _node_defaults(Path(data_dir), server)
    try:
        token_path = slurm_mod.node_token_file(token_file, dict(os.environ), Path(data_dir))
        argv = slurm_mod.agent_argv(server, token_path, Path(data_dir).resolve(), nproc_per_node)
        script = slurm_mod.nodes_script(node_count, argv)
        if print_script:
            click.echo(script, nl=False)
            return
        click.echo(slurm_mod.submit_nodes(script, list(sbatch_options)))
    except slurm_mod.SlurmError as exc:
        raise click.ClickException(str(exc)) from None


@slurm.command("run", context_settings={"ignore_unknown_options": True})
@click.option("--nodes", "node_range", default="1", show_default=True, metavar="N|MIN:MAX",
              help="Nodes of the job: exactly N, or MIN to start and up to MAX (the allocation asks "
                   "SLURM for MIN-MAX).")
@click.option("--nproc-per-node", default=1, show_default=True, type=click.IntRange(1, 1024))
@click.option("--data-dir", default=None, type=click.Path(file_okay=False),
              help="etcd's data, tokens, snapshots, logs: a directory the nodes share "
                   "[default: ./.ftrain/slurm-<SLURM job id>].")
@click.option("--sbatch", "sbatch_options", multiple=True, metavar="OPTION",
              help="An sbatch option for the allocation, outside one (repeatable): --sbatch=-pgpu.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def slurm_run(node_range: str, nproc_per_node: int, data_dir: str | None, sbatch_options: tuple[str, ...],
              command: tuple[str, ...]) -> None:
    """Run COMMAND as an elastic job on one allocation: `ftrain slurm run --nodes 2:4 -- python train.py`.

    Inside an allocation: etcd and the control plane on its first node, an agent on each,
    then the job; exits with its code (SUCCEEDED 0, FAILED 1, CANCELLED 3). Outside one: submits
    one that does so (sbatch --wait) and exits with its code."""
    from service import slurm as slurm_mod

    nodes = _node_range(node_range)
    try:
        if "SLURM_JOB_ID" not in os.environ:
            inner = [sys.executable, "-m", "service.cli", "slurm", "run", "--nodes", node_range,
                     "--nproc-per-node", str(nproc_per_node),
                     *(["--data-dir", str(Path(data_dir).resolve())] if data_dir else []), "--", *command]
            done = slurm_mod.sbatch(slurm_mod.run_script(nodes, inner), list(sbatch_options), wait=True)
            sys.exit(done.returncode)
        directory = Path(data_dir or Path(DEFAULT_DATA_DIR) / f"slurm-{os.environ['SLURM_JOB_ID']}").resolve()
        nodes_here = slurm_mod.allocation_nodes(dict(os.environ))
        run_ = slurm_mod.AllocationRun(list(command), node_range, nproc_per_node, directory, nodes_here)
        sys.exit(run_.run())
    except slurm_mod.SlurmError as exc:
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
