"""A node's health checks: the built-in ones (worker/health_probe.py, in a process of their
own) and the operator's own command (`ftrain node --health-check CMD`: exit 0 is healthy).

The agent runs them before it registers (a failing node registers QUARANTINED, so no job is
ever placed on it) and again after each job its workers ran, while it is free; it sends the
result to the control plane (service/routes/nodes.py). Each has `timeout_s`: a check that
hangs (a wedged driver, a mount that does not answer) has failed. The own check's output
(its last OUTPUT_KEEP characters, stdout and stderr together) is kept as the check's detail,
and so becomes the node's quarantine reason when it fails.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .protocol import HealthCheck, HealthReport

log = logging.getLogger(__name__)

OUTPUT_KEEP = 2000  # characters of a check's output kept as its detail
DEFAULT_TIMEOUT_S = 60.0
HOME = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class HealthChecks:
    """Which checks a node runs: the built-in ones, and the operator's command."""

    builtin: bool = True
    command: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def run(self) -> HealthReport | None:
        return run_checks(self.builtin, self.command, self.timeout_s)


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= OUTPUT_KEEP else "…" + text[-OUTPUT_KEEP:]


def builtin_checks(timeout_s: float) -> list[HealthCheck]:
    """Devices, matmul, memory and collective, as worker/health_probe.py runs them."""
    try:
        # From ftrain's own folder: the agent's working directory may hold a `worker` of its own.
        done = subprocess.run([sys.executable, "-m", "worker.health_probe"], capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=HOME)
    except subprocess.TimeoutExpired:
        return [HealthCheck(name="builtin", ok=False,
                            detail=f"the built-in checks did not end within {timeout_s:g} s")]
    checks = []
    for line in done.stdout.splitlines():
        try:
            checks.append(HealthCheck.model_validate(json.loads(line)))
        except ValueError:
            continue  # a line of torch's own
    if done.returncode != 0 and all(c.ok for c in checks):
        why = f"the checks' process exited {done.returncode}: {_tail(done.stderr)}"
        checks.append(HealthCheck(name="builtin", ok=False, detail=why))
    return checks


def own_check(command: str, timeout_s: float) -> HealthCheck:
    """The operator's check, run by the shell: healthy when it exits 0; its output is kept."""
    try:
        done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return HealthCheck(name="own", ok=False, detail=f"`{command}` did not end within {timeout_s:g} s")
    output = _tail(done.stdout + done.stderr)
    if done.returncode == 0:
        return HealthCheck(name="own", ok=True, detail=output)
    return HealthCheck(name="own", ok=False,
                       detail=f"`{command}` exited {done.returncode}" + (f": {output}" if output else ""))


def run_checks(builtin: bool, command: str | None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> HealthReport | None:
    """Every check this node runs; None when it runs none."""
    checks = builtin_checks(timeout_s) if builtin else []
    if command:
        checks.append(own_check(command, timeout_s))
    if not checks:
        return None
    report = HealthReport(ok=all(c.ok for c in checks), checks=checks)
    if not report.ok:
        log.warning("this node is sick: %s", report.reason())
    return report
