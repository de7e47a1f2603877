"""Schemathesis hooks for tests/integration/test_schemathesis.py (SCHEMATHESIS_HOOKS).

A job spec has two rules between fields that JSON Schema cannot state: `nodes.min <= nodes.max`
and no name in both `env` and `secret_env` (the server answers 422 for either, naming the
field). A generated spec is made to keep them (max raised to min, the shared names dropped
from secret_env), so a spec the schema calls valid is one the server takes; every other
value and every check stays as generated.
"""

from __future__ import annotations

import schemathesis


@schemathesis.hook
def map_case(context, case):
    op = context.operation
    body = case.body
    if op is None or op.method.upper() != "POST" or op.path != "/v1/jobs" or not isinstance(body, dict):
        return case
    nodes = body.get("nodes")
    if isinstance(nodes, dict):
        lo, hi = nodes.get("min", 1), nodes.get("max", 1)
        # only between two valid counts: a case made invalid on purpose stays invalid
        if all(type(v) is int and 1 <= v <= 1024 for v in (lo, hi)) and lo > hi:
            nodes["max"] = lo
    env, secret = body.get("env"), body.get("secret_env")
    if isinstance(env, dict) and isinstance(secret, dict):
        for name in env.keys() & secret.keys():
            del secret[name]
    return case
