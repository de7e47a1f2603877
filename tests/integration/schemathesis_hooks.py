"""Schemathesis hooks for tests/integration/test_schemathesis.py (SCHEMATHESIS_HOOKS).

A rendezvous state written whole is sealed (a mark and a checksum: `seal_state`); a generated
one is sealed here. A job spec has rules that JSON Schema cannot state: between fields,
`nodes.min <= nodes.max` and no name in both `env` and `secret_env`; over a whole field, at
most MAX_COMMAND_BYTES of command and MAX_ENV_BYTES of env and secret_env (UTF-8; the server
answers 422 for each, naming the field, and the descriptions say so). A generated spec is made
to keep them (max raised to min, the shared names dropped from secret_env, the last arguments
or entries dropped), so a spec the schema calls valid is one the server takes; every other
value and every check stays as generated. Likewise a merged rendezvous write's ops: a node
only for the kinds that change one (not `expire`, `refresh_stale`), and a `refresh_stale`'s
`was_us <= before_us <= at_us` (put in order). And a snapshot commit's `path`: a file in the
job's own snapshot directory (`FTRAIN_ST_SNAPSHOT_DIR`), which the server requires (422
otherwise) and JSON Schema cannot state; a path that is not a string stays as generated.
"""

from __future__ import annotations

import base64
import binascii
import os

import schemathesis

from service.models import MAX_COMMAND_BYTES, MAX_ENV_BYTES
from worker.protocol import seal_state
from worker.rdzv_state import NODELESS


def _seal(body: dict) -> None:
    """A rendezvous state as torch's handler would send it: sealed (`seal_state`: a mark and
    the SHA-256 of what follows, which JSON Schema cannot state). Base64 that is not valid
    stays as generated."""
    try:
        raw = base64.b64decode(body["state"], validate=True)
    except (binascii.Error, ValueError):
        return
    body["state"] = base64.b64encode(seal_state(raw)).decode()


def _mend_ops(merge) -> None:
    """Each op of a merged write as the server's rules between fields want it (the module
    docstring); an op whose fields are not of their types stays as generated."""
    ops = merge.get("ops") if isinstance(merge, dict) else None
    for op in ops if isinstance(ops, list) else []:
        if not isinstance(op, dict) or not isinstance(op.get("kind"), str):
            continue
        if op["kind"] in NODELESS:
            op.pop("node", None)
            times = [op.get(k) if op.get(k) is not None else op.get("at_us")
                     for k in ("was_us", "before_us", "at_us")]
            if op["kind"] == "refresh_stale" and all(type(t) is int for t in times):
                op["was_us"], op["before_us"], op["at_us"] = sorted(times)
        elif op.get("node") is None:
            op["node"] = ["127.0.0.1", 1, 0]


def _size(value) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


@schemathesis.hook
def map_case(context, case):
    op = context.operation
    body = case.body
    if op is not None and op.method.upper() == "PUT" and op.path == "/v1/rdzv/{rdzv_id}/state" \
            and isinstance(body, dict):
        if isinstance(body.get("state"), str):
            _seal(body)
        _mend_ops(body.get("merge"))
    if op is not None and op.method.upper() == "POST" and op.path == "/v1/jobs/{job_id}/snapshots" \
            and isinstance(body, dict) and isinstance(body.get("path"), str):
        name = os.path.basename(body["path"]).lstrip(".")[:200] or "snapshot"  # (a file name's limit)
        body["path"] = os.path.join(os.environ["FTRAIN_ST_SNAPSHOT_DIR"], name)
    if op is None or op.method.upper() != "POST" or op.path != "/v1/jobs" or not isinstance(body, dict):
        return case
    nodes = body.get("nodes")
    if isinstance(nodes, dict):
        lo, hi = nodes.get("min", 1), nodes.get("max", 1)
        # only between two valid counts (3.0 is one: JSON Schema's integer takes it); a case
        # made invalid on purpose stays invalid
        if all(type(v) in (int, float) and float(v).is_integer() and 1 <= v <= 1024
               for v in (lo, hi)) and lo > hi:
            nodes["max"] = lo
    env, secret = body.get("env"), body.get("secret_env")
    if isinstance(env, dict) and isinstance(secret, dict):
        for name in env.keys() & secret.keys():
            del secret[name]
    command = body.get("command")
    if isinstance(command, list) and all(isinstance(x, str) for x in command):
        while len(command) > 1 and sum(map(_size, command)) > MAX_COMMAND_BYTES:
            command.pop()
    envs = [e for e in (env, secret) if isinstance(e, dict)]
    if all(isinstance(k, str) and isinstance(v, str) for e in envs for k, v in e.items()):
        while sum(_size(k) + _size(v) for e in envs for k, v in e.items()) > MAX_ENV_BYTES:
            biggest = max((e for e in envs if e), key=len)
            biggest.pop(next(reversed(biggest)))
    return case
