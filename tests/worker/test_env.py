"""The environment names: one constant per name, used instead of string literals."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from worker import env, fork_server, launch

WORKER = Path(env.__file__).parent
NAME = re.compile(r"^(FTRAIN|TORCH|TORCHELASTIC)_[A-Z0-9_]+$")


def _constants() -> dict[str, str]:
    return {k: v for k, v in vars(env).items() if NAME.match(k) and isinstance(v, str)}


def test_every_constant_is_named_after_its_variable_and_names_differ():
    constants = _constants()
    assert constants, "worker/env.py defines no names"
    assert all(name == value for name, value in constants.items())
    assert env.FTRAIN_JOB_TOKEN != env.FTRAIN_TOKEN != env.FTRAIN_NODE_TOKEN


def test_the_stdlib_only_entry_points_repeat_the_names_of_worker_env():
    assert launch.FORK_SERVER_SOCKET_ENV == env.FTRAIN_FORK_SERVER_SOCKET
    assert launch.ROUND_ENV == env.FTRAIN_ROUND
    assert fork_server.IMPORTS_ENV == env.FTRAIN_FORK_SERVER_IMPORTS
    assert fork_server.EXIT_TIMEOUT_ENV == env.FTRAIN_EXIT_TIMEOUT_S
    assert fork_server.STANDBY_ENV == env.FTRAIN_WORKER_STANDBY


def test_worker_modules_use_the_constants_not_string_literals():
    allowed = {"env.py", "launch.py", "fork_server.py"}  # the last two: see worker/env.py
    offenders = []
    for path in sorted(WORKER.rglob("*.py")):
        if path.name in allowed and path.parent == WORKER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.match(node.value):
                offenders.append(f"{path.relative_to(WORKER.parent)}:{node.lineno}: {node.value!r}")
    assert not offenders, "use the constants of worker/env.py:\n" + "\n".join(offenders)


def test_a_job_may_set_exactly_the_job_knobs():
    from service.models import USER_FTRAIN_ENV

    assert set(USER_FTRAIN_ENV) == {"FTRAIN_LOG_LEVEL", "FTRAIN_FORK_SERVER", "FTRAIN_FORK_SERVER_IMPORTS",
                                    "FTRAIN_EXIT_TIMEOUT_S", "FTRAIN_MEMORY_EVERY",
                                    "FTRAIN_CUDA_WARMUP", "FTRAIN_WORKER_STANDBY", "FTRAIN_COMMIT_WAIT_S",
                                    "FTRAIN_LAST_WORDS"}
