"""Schemathesis, every check, against a real control plane (real etcd, uvicorn) and its own
/openapi.json: the description matches what the server sends. Slow: marked `slow`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).with_name("schemathesis.toml")  # 413 as a rejection (it says why)
# A job spec's rules between fields, which JSON Schema cannot state (the module says which).
HOOKS = "schemathesis_hooks"


def test_schemathesis_all_checks_find_nothing(control_plane, tmp_path):
    argv = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
            f"{control_plane.url}/openapi.json",
            "--checks", "all", "--max-examples", os.environ.get("FTRAIN_SCHEMATHESIS_EXAMPLES", "20"),
            # a follow stream is held up to its `wait_s` (30 s at most) while the job is PENDING
            "--request-timeout", "40",
            ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS,  # the tokens of its security schemes:
           "FTRAIN_ST_USER_TOKEN": control_plane.user_token,
           "FTRAIN_ST_NODE_TOKEN": control_plane.node_token,
           "PYTHONPATH": os.pathsep.join([str(CONFIG.parent), str(CONFIG.parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)
    (tmp_path / "schemathesis.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-30000:] + done.stderr[-2000:]
