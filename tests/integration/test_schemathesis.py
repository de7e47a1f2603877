"""Schemathesis, every check, against a real control plane (real etcd, uvicorn) and its own
/openapi.json: the description matches what the server sends. Slow: marked `slow`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_schemathesis_all_checks_find_nothing(control_plane, tmp_path):
    argv = [sys.executable, "-m", "schemathesis.cli", "run", f"{control_plane.url}/openapi.json",
            "--checks", "all", "--max-examples", os.environ.get("FTRAIN_SCHEMATHESIS_EXAMPLES", "20"),
            "-H", f"Authorization: Bearer {control_plane.user_token}",
            ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    (tmp_path / "schemathesis.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout[-30000:] + done.stderr[-2000:]
