"""The `Link` seam: the same cases against `ServiceLink` (a real control plane, a submitted
job and its own token) and its local twin `LocalLink` (a directory). Where the twin differs
on purpose (it takes no progress reports, it has no attempts to fence), the two are tested
apart, below the shared cases."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from service.jobs import Change, JobStore
from service.keys import Keys
from service.models import JobRecord
from service.store.etcd import EtcdStore
from worker.links import ControlRequest, Fenced, Link, LocalLink, ServiceLink
from worker.snapshot import WrittenSnapshot

KEEP = 3
SPEC = {"name": "link", "command": ["python", "train.py"], "snapshot": {"every_steps": 10, "keep": KEEP}}

# One etcd and control plane for the module: each service case has a job of its own.
pytestmark = pytest.mark.shared_control_plane


def _job_store(etcd_endpoint: str, use):
    async def run():
        etcd = EtcdStore(etcd_endpoint)
        try:
            return await use(JobStore(etcd, Keys()))
        finally:
            await etcd.close()

    return asyncio.run(run())


def stored_job(etcd_endpoint: str, job_id: str) -> JobRecord:
    """The job as stored: its token is never shown over the API."""
    return _job_store(etcd_endpoint, lambda store: store.get(job_id))


def move_to_attempt(etcd_endpoint: str, job_id: str, attempt: int) -> None:
    """Give the job a new attempt, as the scheduler does when it restarts it."""
    _job_store(etcd_endpoint, lambda store: store.update(
        job_id, lambda job: Change(job.model_copy(update={"attempt": attempt}))))


@pytest.fixture
def service_job(request) -> dict:
    """A submitted job (PENDING: no nodes), its id, token and control plane."""
    api, etcd, control_plane = (request.getfixturevalue(n) for n in ("api", "etcd", "control_plane"))
    resp = api.post("/v1/jobs", json=SPEC)
    assert resp.status_code == 201, resp.text
    job = resp.json()
    token = control_plane.job_token(stored_job(etcd.endpoint, job["id"]))
    return {"id": job["id"], "attempt": job["attempt"], "token": token,
            "url": control_plane.url, "etcd": etcd.endpoint, "api": api,
            "snapshots": control_plane.snapshot_root / job["id"]}


@pytest.fixture(params=[pytest.param("service", marks=pytest.mark.integration), "local"])
def link(request, tmp_path) -> Iterator[Link]:
    if request.param == "service":
        job = request.getfixturevalue("service_job")
        yield ServiceLink(job["url"], job["id"], job["token"], job["attempt"])
    else:
        yield LocalLink(tmp_path / "snapshots", keep=KEEP)


@pytest.fixture
def written(request) -> Callable[[int], WrittenSnapshot]:
    """The snapshot of a step as rank 0 writes it, in the job's snapshot directory (the
    service's `<snapshot root>/<job id>`: a commit naming a file elsewhere is refused)."""
    service = "service_job" in request.fixturenames or (
        "link" in request.fixturenames and isinstance(request.getfixturevalue("link"), ServiceLink))
    directory = request.getfixturevalue("service_job")["snapshots"] if service else Path("/snapshots")

    def make(step: int) -> WrittenSnapshot:
        return WrittenSnapshot(step=step, path=str(directory / f"step-{step:012d}.pt"), size=10 + step,
                               checksum=f"sha256:{step:064x}", write_s=0.01)

    return make


def steps_and_latest(link: Link) -> tuple[list[int], int | None]:
    items, latest = link.snapshots()
    return sorted(i.step for i in items), latest


# ------------------------------------------------------------------ the same cases for both

def test_no_snapshot_is_listed_at_first(link):
    assert link.snapshots() == ([], None)


def test_a_commit_is_listed_as_committed(link, written):
    assert link.commit(written(10), stall_s=0.002, control_id=None) == []
    items, latest = link.snapshots()
    assert latest == 10
    assert [(i.step, i.path, i.size, i.checksum, i.bad) for i in items] == [
        (10, written(10).path, 20, written(10).checksum, False)]


def test_latest_moves_forward_and_never_back(link, written):
    link.commit(written(20), 0.0, None)
    assert steps_and_latest(link) == ([20], 20)
    link.commit(written(10), 0.0, None)  # an older step is recorded, latest stays
    assert steps_and_latest(link) == ([10, 20], 20)
    link.commit(written(30), 0.0, None)
    assert steps_and_latest(link) == ([10, 20, 30], 30)


def test_commits_prune_beyond_keep_and_never_the_latest(link, written):
    pruned = []
    for step in range(10, 70, 10):
        prune = link.commit(written(step), 0.0, None)
        assert written(step).path not in prune
        pruned += prune
    assert steps_and_latest(link) == ([40, 50, 60], 60)
    assert sorted(pruned) == [written(s).path for s in (10, 20, 30)]


def test_an_older_step_committed_beyond_keep_is_the_one_pruned(link, written):
    for step in (40, 50, 60):
        link.commit(written(step), 0.0, None)
    assert link.commit(written(5), 0.0, None) == [written(5).path]
    assert steps_and_latest(link) == ([40, 50, 60], 60)


def test_a_corrupt_report_moves_latest_back_to_the_newest_good_one(link, written):
    for step in (10, 20, 30):
        link.commit(written(step), 0.0, None)
    link.report_corrupt(30, "checksum mismatch")
    items, latest = link.snapshots()
    assert latest == 20 and {i.step: i.bad for i in items} == {10: False, 20: False, 30: True}
    link.report_corrupt(20, "checksum mismatch")
    assert link.snapshots()[1] == 10


def test_a_bad_snapshot_is_not_kept_in_place_of_a_good_one(link, written):
    for step in (10, 20, 30):
        link.commit(written(step), 0.0, None)
    link.report_corrupt(30, "checksum mismatch")
    prune = link.commit(written(40), 0.0, None)  # keep 3: 40 (latest), 20, 10 -- not 30
    assert written(30).path in prune and written(40).path not in prune
    assert steps_and_latest(link) == ([10, 20, 40], 40)


def test_control_says_none_when_nothing_is_asked(link):
    assert link.control() == ControlRequest(id=0, action="none", reason="")


# ------------------------------------------------------------------ where the twin differs

@pytest.mark.integration
def test_the_service_keeps_progress(service_job):
    link = ServiceLink(service_job["url"], service_job["id"], service_job["token"], service_job["attempt"])
    link.report_progress(7, 0.25, 12.5)
    progress = service_job["api"].get(f"/v1/jobs/{service_job['id']}").json()["progress"]
    assert (progress["step"], progress["loss"], progress["samples_per_s"]) == (7, 0.25, 12.5)


@pytest.mark.integration
def test_the_service_keeps_logged_scalars_as_a_metric_history(service_job):
    link = ServiceLink(service_job["url"], service_job["id"], service_job["token"], service_job["attempt"])
    api, job_id = service_job["api"], service_job["id"]
    assert api.get(f"/v1/jobs/{job_id}/metrics").json()["steps"] == []
    link.report_progress(5, 0.5, 10.0, metrics={"lr": 0.1}, total_steps=20)
    link.report_progress(10, 0.25, 11.0, final=True, metrics={"lr": 0.05})  # final: past the rate limit
    history = api.get(f"/v1/jobs/{job_id}/metrics").json()
    assert history["steps"] == [5, 10] and len(history["times"]) == 2
    assert history["series"] == {"loss": [0.5, 0.25], "samples_per_s": [10.0, 11.0], "lr": [0.1, 0.05]}
    progress = api.get(f"/v1/jobs/{job_id}").json()["progress"]
    assert (progress["total_steps"], progress["percent"], progress["metrics"]) == (20, 50.0, {"lr": 0.05})
    refused = httpx.post(f"{service_job['url']}/v1/jobs/{job_id}/progress",  # not a metric name: 422
                         json={"step": 11, "final": True, "metrics": {"bad name": 1.0}},
                         headers={"Authorization": f"Bearer {service_job['token']}"})
    assert refused.status_code == 422 and "bad name" in refused.json()["detail"]
    assert api.get(f"/v1/jobs/{job_id}/metrics").json()["steps"] == [5, 10]  # nothing lost
    assert api.get("/v1/jobs/nosuchjob/metrics").status_code == 404


def test_the_local_twin_takes_progress_and_keeps_nothing(tmp_path):
    link = LocalLink(tmp_path, keep=KEEP)
    assert link.report_progress(7, 0.25, 12.5) is None
    assert not (tmp_path / "snapshots.json").exists() and link.snapshots() == ([], None)


@pytest.mark.integration
def test_the_service_fences_a_commit_of_an_attempt_that_is_over(service_job, written):
    job_id, url, token = service_job["id"], service_job["url"], service_job["token"]
    ServiceLink(url, job_id, token, attempt=0).commit(written(10), 0.0, None)
    move_to_attempt(service_job["etcd"], job_id, 1)
    with pytest.raises(Fenced, match="step 20 refused"):
        ServiceLink(url, job_id, token, attempt=0).commit(written(20), 0.0, None)
    assert ServiceLink(url, job_id, token, attempt=1).snapshots()[1] == 10
    ServiceLink(url, job_id, token, attempt=1).commit(written(20), 0.0, None)
    assert ServiceLink(url, job_id, token, attempt=1).snapshots()[1] == 20


def test_the_local_twin_has_no_attempts_to_fence(tmp_path, written):
    first, second = LocalLink(tmp_path, keep=KEEP), LocalLink(tmp_path, keep=KEEP)
    first.commit(written(10), 0.0, None)
    second.commit(written(20), 0.0, None)  # a second writer of the same directory is not refused
    assert first.snapshots()[1] == 20


def test_the_local_index_survives_a_new_link(tmp_path: Path, written):
    LocalLink(tmp_path, keep=KEEP).commit(written(10), 0.0, None)
    assert steps_and_latest(LocalLink(tmp_path, keep=KEEP)) == ([10], 10)


def test_the_restore_point_is_the_disk_without_a_newer_copy_in_memory(link, written):
    assert link.restore_point(None).tier == "none"
    link.commit(written(5), 0.0, None)
    point = link.restore_point(None)
    assert (point.tier, point.step) == ("disk", 5)


@pytest.mark.integration
def test_the_service_restores_from_a_members_memory_of_this_attempt_only(service_job, written):
    from service.models import MemberStatus

    _job_store(service_job["etcd"], lambda store: store.update(service_job["id"], lambda job: Change(
        job.model_copy(update={"members": {"n0": MemberStatus(state="running")}}))))
    link = ServiceLink(service_job["url"], service_job["id"], service_job["token"], service_job["attempt"])
    link.commit(written(5), 0.0, None)
    link.report_memory_held("n0", 7)
    point = link.restore_point(7)
    assert (point.tier, point.step, point.nodes) == ("memory", 7, ["n0"])
    events = service_job["api"].get(f"/v1/jobs/{service_job['id']}/events").json()["items"]
    assert any("resumes from step 7 in the memory of n0" in e["reason"] for e in events)
    # A new attempt: the old one's group gets no restore point, and n0's report of the old
    # attempt does not count (its copy may have been overwritten since).
    move_to_attempt(service_job["etcd"], service_job["id"], service_job["attempt"] + 1)
    with pytest.raises(Fenced):
        link.restore_point(7)
    after = ServiceLink(service_job["url"], service_job["id"], service_job["token"],
                        service_job["attempt"] + 1)
    point = after.restore_point(None)
    assert (point.tier, point.step) == ("disk", 5)


def test_the_local_twin_restores_from_its_memory_copy_when_at_least_the_latest(written):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        link = LocalLink(Path(d), keep=KEEP)
        link.commit(written(5), 0.0, None)
        assert (link.restore_point(5).tier, link.restore_point(4).tier) == ("memory", "disk")
