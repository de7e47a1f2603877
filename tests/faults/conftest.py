from __future__ import annotations

import pytest

from tests.harness import NodeAgentProc


@pytest.fixture
def agents(control_plane, tmp_path):
    """Start real node agents on the control plane; every one is stopped at the end."""
    started: list[NodeAgentProc] = []

    def start(n: int = 1, nproc: int = 1) -> list[NodeAgentProc]:
        new = [NodeAgentProc(control_plane, f"n{len(started) + i}", tmp_path / "nodes",
                             nproc_per_node=nproc).start() for i in range(n)]
        started.extend(new)
        return new

    yield start
    for agent in started:
        agent.stop()
