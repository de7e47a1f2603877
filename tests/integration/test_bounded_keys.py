"""etcd's keys stay bounded, with a real etcd and a real control plane: a job's memory reports
go with the write that removes a member (a new attempt) and with the job's end, not with the
job's retention; the store keys of an attempt's earlier rendezvous rounds go when a later
round forms; and after many finished jobs and their retention, only the keys of live things
remain, listed here by prefix."""

from __future__ import annotations

import base64
import threading

from tests.helpers.processes import ControlPlane, wait_for
from tests.integration.test_retention import etcd_keys

RETENTION_S = 2.0
FINISHED_JOBS = 600  # more than one retention pass deletes (service.retention.MAX_DELETIONS_PER_PASS)


def by_prefix(keys: list[str]) -> dict[str, list[str]]:
    """'/ftrain/<kind>/<rest>' -> {kind: [rest, ...]} ('' for a key of one component)."""
    out: dict[str, list[str]] = {}
    for key in keys:
        kind, _, rest = key.removeprefix("/ftrain/").partition("/")
        out.setdefault(kind, []).append(rest)
    return out


class Heartbeats:
    """Keep the given nodes' leases alive from a thread until each is stopped."""

    def __init__(self, cp: ControlPlane, credentials: dict[str, str]):
        self.cp = cp
        self.alive = dict(credentials)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        clients = {name: self.cp.client(cred) for name, cred in self.alive.items()}
        try:
            while not self.done.wait(0.3):
                with self.lock:
                    names = list(self.alive)
                for name in names:
                    clients[name].post(f"/v1/nodes/{name}/heartbeat", json={})
        finally:
            for c in clients.values():
                c.close()

    def stop(self, name: str | None = None) -> None:
        if name is None:
            self.done.set()
            self.thread.join(10)
        else:
            with self.lock:
                self.alive.pop(name)


def test_memory_reports_go_with_a_member_and_with_the_job_and_finished_jobs_leave_no_key(etcd, tmp_path):
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", env={
        "FTRAIN_RETENTION_S": f"{RETENTION_S:g}", "FTRAIN_NODE_TTL_S": "2"}).start()
    beats = None
    try:
        with cp.client("user") as api:
            job = api.post("/v1/jobs", json={"name": "elastic", "command": ["python", "train.py"],
                                             "nodes": {"min": 1, "max": 2}}).json()["id"]
            credentials = cp.members_of(job, ["a", "b"])
            beats = Heartbeats(cp, credentials)
            attempt = api.get(f"/v1/jobs/{job}").json()["attempt"]
            with cp.client(cp.job_token_of(job)) as worker:
                for node in ("a", "b"):
                    assert worker.put(f"/v1/jobs/{job}/memory/{node}",
                                      json={"step": 5, "attempt": attempt}).status_code == 200
            assert sorted(by_prefix(etcd_keys(etcd.endpoint))["memory"]) == [f"{job}/a", f"{job}/b"]

            # b is drained: the job goes on on a, in a new attempt, and the reports of the
            # attempt before go in that write (a restore reads the current attempt's only).
            assert api.post("/v1/nodes/b/drain").status_code == 202
            moved = wait_for(lambda: (j := api.get(f"/v1/jobs/{job}").json())["attempt"] > attempt and j,
                             20, "the job to go on without b")
            assert sorted(moved["nodes"]) == ["a"]
            assert "memory" not in by_prefix(etcd_keys(etcd.endpoint))
            beats.stop("b")
            with cp.client(cp.job_token_of(job)) as worker:  # a's worker of the new attempt reports
                assert worker.put(f"/v1/jobs/{job}/memory/a",
                                  json={"step": 6, "attempt": moved["attempt"]}).status_code == 200
                assert worker.put(f"/v1/jobs/{job}/memory/b",  # b is no member: refused
                                  json={"step": 6, "attempt": moved["attempt"]}).status_code == 409
            assert by_prefix(etcd_keys(etcd.endpoint))["memory"] == [f"{job}/a"]

            # The job ends: every report goes with the write that ends it (not after its retention).
            assert api.post(f"/v1/jobs/{job}/cancel").status_code == 202
            with cp.client(credentials["a"]) as node:
                assert node.post("/v1/nodes/a/report", json={
                    "job_id": job, "attempt": moved["attempt"], "state": "stopped"}).status_code == 200
            wait_for(lambda: api.get(f"/v1/jobs/{job}").json()["state"] == "CANCELLED", 20,
                     "the job to be cancelled")
            assert "memory" not in by_prefix(etcd_keys(etcd.endpoint))

            # Many finished jobs (min 2: never started on the one node left), idempotency keys too.
            for i in range(FINISHED_JOBS):
                spec = {"name": f"many-{i}", "command": ["true"], "nodes": {"min": 2, "max": 2}}
                made = api.post("/v1/jobs", json=spec, headers={"Idempotency-Key": f"many-{i}"})
                assert made.status_code == 201, made.text
                assert api.post(f"/v1/jobs/{made.json()['id']}/cancel").status_code == 202
            # (retention is deleting the first ones already: they are older than RETENTION_S)
            beats.stop()

            # After the retention and the node leases: only what lives on, by prefix.
            def settled() -> dict[str, list[str]] | None:
                kinds = by_prefix(etcd_keys(etcd.endpoint))
                return kinds if kinds.keys() <= {"leader", "contact", "compacted", "drains", "goodput"} \
                    else None

            left = wait_for(settled, 60, "every finished job's keys and every node's to go")
            assert left.pop("drains") == ["b"]  # a drain outlives its node (FTRAIN_DRAIN_KEEP_S)
            # the deleted jobs' goodput, added up in one key (service.goodput)
            assert left.pop("goodput") == [""]
            assert left == {"leader": [""], "contact": [""]} or \
                left == {"leader": [""], "contact": [""], "compacted": [""]}, left
            assert api.get("/v1/jobs").json()["items"] == []
    finally:
        if beats is not None:
            beats.stop()
        cp.stop()


def test_the_store_keys_of_an_attempts_earlier_rounds_go_when_a_later_round_forms(etcd, tmp_path):
    # A job whose workers torchrun restarted twice in one attempt: rounds 0, 1 and 2 of its
    # rendezvous each left their store keys (torch's handler prefixes them with the round).
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp").start()
    try:
        with cp.client("user") as api:
            spec = {"name": "restarts", "command": ["python", "train.py"]}
            job = api.post("/v1/jobs", json=spec).json()["id"]
            cp.member_of(job, "a")
            attempt = api.get(f"/v1/jobs/{job}").json()["attempt"]
            rdzv = f"{job}-a{attempt}"
            value = base64.b64encode(b"x").decode()
            with cp.client(cp.job_token_of(job)) as worker:
                for r in range(3):
                    items = [{"key": f"torch.rendezvous.{rdzv}.{r}/{k}", "value": value}
                             for k in ("MASTER_ADDR", "MASTER_PORT")]
                    assert worker.post(f"/v1/rdzv/{rdzv}/store/set", json={"items": items}).status_code == 204
                assert worker.get(f"/v1/rdzv/{rdzv}/store/num_keys").json() == {"count": 6}
                report = {"attempt": attempt, "node": "a", "phase": "joined", "call": 2, "group_rank": 0,
                          "group_world_size": 1, "round": 2}
                assert worker.post(f"/v1/jobs/{job}/rounds", json=report).status_code == 200
                # Rank 0 reported round 2: rounds 0 and 1 are dead, round 2's keys stay.
                wait_for(lambda: worker.get(f"/v1/rdzv/{rdzv}/store/num_keys").json() == {"count": 2}, 10,
                         "the store keys of rounds 0 and 1 to go")
                got = worker.post(f"/v1/rdzv/{rdzv}/store/get", json={
                    "keys": [f"torch.rendezvous.{rdzv}.2/MASTER_ADDR"], "wait_s": 0})
                assert got.status_code == 200 and got.json()["values"] == [value], got.text
    finally:
        cp.stop()
