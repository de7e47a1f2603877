"""A group that torchrun restarts in the same attempt while the node agent still makes the
commits its predecessor's rank 0 left it (worker/handoff.py): the new group's rank 0 waits for
them before it asks where to resume, so it cannot resume from an older snapshot (in-process
runtime, a real control plane)."""

from __future__ import annotations

import shutil
import threading
import time

from tests.worker.test_runtime import _job_env, _snapshot_dir, _train
from worker import handoff, runtime
from worker import snapshot as snap
from worker.links import ServiceLink
from worker.protocol import CommitRequest


class LateLink:
    """The agent's link, its first commit held `delay_s` (the control plane slow to answer)."""

    def __init__(self, link: ServiceLink, delay_s: float):
        self.link, self.delay_s = link, delay_s
        self.committed_at: float | None = None

    def commit_request(self, req: CommitRequest, retry_s: float | None = None) -> list[str]:
        time.sleep(self.delay_s)
        got = self.link.commit_request(req, retry_s=retry_s)
        self.committed_at = time.monotonic()
        return got

    def close(self) -> None:
        self.link.close()


def test_a_restarted_groups_restore_waits_for_the_commits_its_predecessor_left(control_plane, api):
    job_id = api.post("/v1/jobs", json={"name": "handrestore", "command": ["x"]}).json()["id"]
    scratch = api.post("/v1/jobs", json={"name": "scratch", "command": ["x"]}).json()["id"]
    folder, other = _snapshot_dir(control_plane, job_id), _snapshot_dir(control_plane, scratch)
    env = {**_job_env(control_plane, job_id), "FTRAIN_NODE": "n0"}
    _train(runtime.init(env=env), 5)  # the first group: step 5 committed
    _train(runtime.init(env=_job_env(control_plane, scratch)), 10)
    # ... and step 10 written, its commit left to the agent when rank 0 ended (with an error)
    last = folder / "step-000000000010.pt"
    shutil.copy(other / last.name, last)
    req = CommitRequest(step=10, path=str(last), size=last.stat().st_size,
                        checksum=snap.file_checksum(last), attempt=0)
    left = handoff.leave(folder, "n0", 0, commits=[req])
    assert api.get(f"/v1/jobs/{job_id}/snapshots").json()["latest"] == 5
    link = LateLink(ServiceLink(control_plane.url, job_id, control_plane.job_token_of(job_id), 0), 3.0)
    agent = handoff.AgentHandoff(left, link).start()
    resumed: list[float] = []
    rt = runtime.init(env=env)  # torchrun's new group, while the agent commits
    assert rt.disk is not None
    original = rt.disk.load

    def load(found):
        resumed.append(time.monotonic())
        return original(found)

    rt.disk.load = load
    assert _train(rt, 12) == 10  # not 5
    assert link.committed_at is not None and resumed[0] >= link.committed_at
    agent.join(10)
    assert agent.done() and agent.committed == [10] and not handoff.pending(folder, 0)


def test_wait_pending_gives_up_on_a_file_no_agent_takes(tmp_path):
    handoff.leave(tmp_path, "n0", 1, commits=[])
    assert [p.name for p in handoff.pending(tmp_path, 1)] == [".handoff-n0-a1.json"]
    assert handoff.pending(tmp_path, 2) == []
    assert handoff.wait_pending(tmp_path, 1, timeout_s=0.2, poll_s=0.05) is False
    threading.Timer(0.1, lambda: (tmp_path / ".handoff-n0-a1.json").unlink()).start()
    assert handoff.wait_pending(tmp_path, 1, timeout_s=5, poll_s=0.02) is True
