"""worker/handoff.py: what rank 0's end leaves to its node agent, and the agent's commits of it
(a fake link here; with real processes: tests/faults/test_job_end.py)."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from tests.helpers.processes import wait_for
from worker import handoff
from worker.links import CommitUnreachable, Fenced
from worker.protocol import CommitRequest, ProgressReport


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(handoff, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(handoff, "RETRY_MAX_S", 0.02)


class FakeLink:
    """The control plane as `AgentHandoff` sees it: away `away` tries, then answers."""

    def __init__(self, away: int = 0, refuse_from: int | None = None, prune: dict | None = None):
        self.away = away
        self.refuse_from = refuse_from  # refuse (409) commits of steps <= this
        self.prune = prune or {}
        self.calls: list = []
        self.closed = threading.Event()

    def commit_request(self, req: CommitRequest, retry_s: float | None = None) -> list[str]:
        self.calls.append(("commit", req.step))
        if self.away > 0:
            self.away -= 1
            raise CommitUnreachable(f"commit of step {req.step}: no answer")
        if self.refuse_from is not None and req.step <= self.refuse_from:
            raise Fenced(f"snapshot of step {req.step} refused: attempt 1 is over")
        return self.prune.get(req.step, [])

    def send_progress(self, body: ProgressReport) -> int:
        self.calls.append(("progress", body.step))
        return body.step

    def report_finished(self, node: str, final: bool = True) -> bool:
        self.calls.append(("finished", node))
        if self.away > 0:
            self.away -= 1
            raise handoff.LinkError("control plane unreachable")
        return True

    def close(self) -> None:
        self.closed.set()


def written(directory, step: int, size: int = 8) -> CommitRequest:
    path = directory / f"step-{step:012d}.pt"
    path.write_bytes(b"x" * size)
    checksum = "sha256:" + hashlib.sha256(b"x" * size).hexdigest()
    return CommitRequest(step=step, path=str(path), size=size, checksum=checksum, attempt=1)


def run(path, link) -> handoff.AgentHandoff:
    h = handoff.AgentHandoff(path, link).start()
    h.join(10)
    assert h.done()
    return h


def test_leave_merges_what_the_worker_leaves_and_read_gives_the_newest_first(tmp_path):
    handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 10), written(tmp_path, 20)])
    path = handoff.leave(tmp_path, "n0", 1, progress=ProgressReport(step=20, attempt=1, final=True))
    assert path == tmp_path / ".handoff-n0-a1.json" and oct(path.stat().st_mode & 0o777) == "0o600"
    commits, progress = handoff.read(path)
    assert [c.step for c in commits] == [20, 10] and progress.step == 20 and progress.final
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_the_agent_commits_newest_first_through_an_outage_then_the_progress_and_removes_the_file(tmp_path):
    old = written(tmp_path, 5)
    path = handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 10), written(tmp_path, 20)],
                         progress=ProgressReport(step=20, attempt=1, final=True))
    link = FakeLink(away=3, prune={20: [old.path, "/elsewhere/step-000000000001.pt"]})
    h = run(path, link)
    assert link.calls == [("commit", 20)] * 4 + [("commit", 10), ("progress", 20)]
    assert h.committed == [20, 10] and h.note() is None
    assert not path.exists() and not (tmp_path / "step-000000000005.pt").exists()  # pruned (its folder only)
    assert link.closed.is_set()


def test_a_refusal_or_a_file_gone_is_said_in_the_note_never_silently(tmp_path):
    a, b = written(tmp_path, 10), written(tmp_path, 20)
    c, d = written(tmp_path, 30, size=4), written(tmp_path, 40)
    (tmp_path / "step-000000000030.pt").write_bytes(b"x" * 3)  # not the size written
    (tmp_path / "step-000000000040.pt").write_bytes(b"y" * 8)  # written again since: not its checksum
    path = handoff.leave(tmp_path, "n0", 1, commits=[a, b, c, d],
                         progress=ProgressReport(step=40, attempt=1, final=True))
    link = FakeLink(refuse_from=20)
    h = run(path, link)
    assert link.calls == [("commit", 20)]  # 40, 30 not sent; a refusal holds for the rest, progress too
    assert set(h.not_committed) == {10, 20, 30, 40} and "3 bytes, 4 were written" in h.not_committed[30]
    assert "no longer has the checksum" in h.not_committed[40]
    assert "attempt 1 is over" in h.not_committed[10]
    assert h.note().startswith("snapshot(s) written and not committed") and "step 30: its file" in h.note()
    assert "steps 20, 10: refused:" in h.note()  # one reason, said once
    assert not path.exists()


def test_a_cancel_stops_the_tries_and_says_so(tmp_path):
    path = handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 10)])
    link = FakeLink(away=10**9)
    h = handoff.AgentHandoff(path, link).start()
    h.cancel()
    h.join(10)
    assert h.done() and h.not_committed == {10: "the group was stopped first"}


def test_what_the_worker_leaves_while_the_agent_commits_is_kept_for_the_next_take(tmp_path):
    """The agent takes the file as soon as it is there, while the worker may still leave its
    final progress report (its poller gave up later): that makes a new file, not one the agent
    deletes when it is done (the progress of a two-node job's end was lost that way)."""
    path = handoff.leave(tmp_path, "n0", 1, commits=[written(tmp_path, 10)])
    link = FakeLink(away=10**9)
    h = handoff.AgentHandoff(path, link).start()
    wait_for(lambda: len(link.calls) >= 2, 10, "the agent to try the commit")
    handoff.leave(tmp_path, "n0", 1, progress=ProgressReport(step=10, attempt=1, final=True))
    link.away = 0
    h.join(10)
    assert h.done() and h.committed == [10]
    commits, progress = handoff.read(path)  # the next take's
    assert commits == [] and progress.step == 10
    assert [p.name for p in tmp_path.iterdir() if "taken" in p.name] == []


def test_the_agent_reads_only_files_of_the_jobs_snapshot_folder(tmp_path):
    """What the worker leaves comes from the job's user; the agent (root under `--run-as`)
    checks only files in the job's folder, never through a link: a path elsewhere would tell
    that user the size or checksum of a file it may not read."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 5)  # its size is not told
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "step-000000000020.pt").symlink_to(secret)
    outside = written(tmp_path, 10).model_copy(update={"path": str(secret)})
    linked = written(tmp_path, 20).model_copy(update={"path": str(folder / "step-000000000020.pt")})
    path = handoff.leave(folder, "n0", 1, commits=[outside, linked])
    link = FakeLink()
    h = run(path, link)
    assert link.calls == [] and h.committed == []
    assert h.not_committed[10] == "its path is not in the job's snapshot folder"
    assert "cannot be read" in h.not_committed[20] and "bytes" not in h.not_committed[20]


def test_the_word_that_the_run_finished_is_left_kept_and_said_after_the_commits(tmp_path):
    """A node's first worker whose word that the run finished did not land leaves it too
    (`leave(finished=True)`); later leaves keep it, and the agent says it after the commits and
    the progress report, trying again while no control plane answers."""
    handoff.leave(tmp_path, "gpu-a1", 3, finished=True)
    path = handoff.leave(tmp_path, "gpu-a1", 3, commits=[written(tmp_path, 10)],
                         progress=ProgressReport(step=10, attempt=1, final=True))
    assert handoff.read_finished(path) and handoff.node_of(path) == "gpu-a1"
    link = FakeLink()
    link.away = 0
    h = handoff.AgentHandoff(path, link).start()
    h.join(10)
    assert link.calls == [("commit", 10), ("progress", 10), ("finished", "gpu-a1")]
    # no answer at first: tried again; a refused commit (the attempt is over) drops it
    path = handoff.leave(tmp_path, "gpu-a1", 3, finished=True)
    link = FakeLink()
    link.away = 2
    run(path, link)
    assert link.calls == [("finished", "gpu-a1")] * 3
    path = handoff.leave(tmp_path, "gpu-a1", 3, commits=[written(tmp_path, 20)], finished=True)
    link = FakeLink(refuse_from=20)
    run(path, link)
    assert link.calls == [("commit", 20)]


def test_the_agents_rewrites_of_a_hand_over_never_write_through_a_link_the_job_planted(tmp_path):
    """The agent rewrites a hand-over in the job's folder (after each commit, `_left`; on a
    restart, `gather`) as root under `--run-as`: a link the job's user put at the name of a
    temporary file must not have it overwrite the link's target."""
    precious = tmp_path / "precious"
    precious.write_bytes(b"root's own\n")
    folder = tmp_path / "job"
    folder.mkdir()
    name = handoff.handoff_path(folder, "n0", 1).name
    pid = os.getpid()  # the agent's (this process's): its temporary files' names end with it
    path = handoff.leave(folder, "n0", 1, commits=[written(folder, 10), written(folder, 20)])
    (folder / f"{name}.taken-{pid}.tmp-{pid}").symlink_to(precious)
    h = run(path, FakeLink())  # two commits: the taken file is rewritten after the first
    assert h.committed == [20, 10]
    assert precious.read_bytes() == b"root's own\n"
    # A restarted agent puts together what its killed predecessor had taken (`gather`).
    handoff.leave(folder, "n0", 1, commits=[written(folder, 30)])
    os.rename(path, folder / f"{name}.taken-1")
    handoff.leave(folder, "n0", 1, commits=[written(folder, 40)])
    (folder / f"{name}.tmp-{pid}").symlink_to(precious)
    assert handoff.gather(folder, "n0", 1) == path
    assert [r.step for r in handoff.read(path)[0]] == [40, 30]
    assert precious.read_bytes() == b"root's own\n"
