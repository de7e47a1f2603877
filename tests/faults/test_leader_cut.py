"""The leading control plane cut from etcd by a network namespace: no two
schedulers ever act, proven from the job events, and the job trains on.

Layout (`tests.helpers.netns.Fabric`): etcd (closed: authentication on, as the control
plane demands off loopback; one member, or three) listens on the switch's gateway address in
the root namespace; replica A runs in a namespace of its own on the switch and leads (started
first); replica B runs in the root namespace on loopback; three node agents run in the root
namespace. `ip link set <A's port> down` on the switch then cuts A from etcd: A lives on, its
etcd calls hang. Three cases:
- the whole link (one etcd member, and three): A is cut from everything; the agents are given
  `B,A` (the nodes' failover is the HA kill test's subject);
- the etcd link only (three members): A serves on a second link straight to the root
  namespace (`Fabric.add_client_link`), which stays up, and the agents are given `A,B`: A
  still hears them and the test's clients. A must stop leading, must not answer from what it
  last heard as if it were fresh (a status read of the training job, whose progress moved on
  through B, and of a job B started after the cut: 503 or etcd's answer, never A's stale
  one; a client given `A,B` gets the fresh answers), and must keep answering (its heartbeats
  503 at once, so the agents move to B before their leases lapse: the job has 0 restarts).

Every event a leader-only loop writes names the replica that wrote it and its term (the
etcd revision at which it took the lead: `EventView.leader`, `.term`). The proof:
- before the cut the job was started by A (A's term); after it, a job submitted at the cut
  is started by B under a larger term;
- ordered by time and by each job's sequence, the terms never go back: no event of A's term
  comes after one of B's;
- A's log says it stopped leading (by its own clock, its lease not confirmed for its TTL)
  before B's log says it took the lead: the gap between them is printed, and must be > 0.
The two-node job that trains through it all has 0 restarts and rank 0's steps 1..N once.
When the link comes back, A does not take the lead back.

About 60-90 s a case: marked `slow` (FTRAIN_TEST_SLOW=1 runs it; needs root and iproute2).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from datetime import datetime

import httpx
import pytest

from service.client import FtrainClient
from service.embedded import ROOT_USER, EtcdProcess, cluster_endpoints, start_cluster
from tests.helpers.elastic import submit, wait_nodes, wait_state
from tests.helpers.faults import SnapshotWatch, check_steps, events_of, train_spec, wait_latest
from tests.helpers.processes import ControlPlane, NodeAgentProc, wait_for

pytestmark = [
    pytest.mark.integration, pytest.mark.netns, pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("FTRAIN_TEST_SLOW"),
                       reason="slow (about a minute): set FTRAIN_TEST_SLOW=1 to run it"),
]

LEAD = re.compile(r"^(\S+ \S+) INFO service\.scheduler: leading \(term (\d+)\) as (\S+)$", re.M)
STOP = re.compile(r"^(\S+ \S+) WARNING service\.scheduler: stopped leading \(term (\d+)\): (.*)$", re.M)


def _log(cp: ControlPlane) -> str:
    return (cp.workdir / f"control-plane-{cp.port}.log").read_text()


def _when(stamp: str) -> float:
    """A log line's time (logging's local-time `asctime`) as time.time() gives it."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _leads(cp: ControlPlane) -> list[tuple[float, int]]:
    return [(_when(t), int(term)) for t, term, _ in LEAD.findall(_log(cp))]


def _stops(cp: ControlPlane) -> list[tuple[float, int, str]]:
    return [(_when(t), int(term), why) for t, term, why in STOP.findall(_log(cp))]


CASES = {
    # etcd members, what is cut: the leader's whole link, or its link to etcd only
    "one-member-whole-link": (1, "whole"),
    "three-members-whole-link": (3, "whole"),
    "three-members-etcd-link-only": (3, "etcd"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_leader_cut_from_etcd_stops_before_another_leads_and_the_job_trains_on(fabric, tmp_path, case):
    members, cut = CASES[case]
    # etcd on an address that is not loopback is closed (the control plane refuses it open).
    password = secrets.token_urlsafe(16)
    password_file = tmp_path / "etcd-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    credentials = {"FTRAIN_ETCD_USER": ROOT_USER, "FTRAIN_ETCD_PASSWORD_FILE": str(password_file)}
    etcds = [EtcdProcess(tmp_path / f"etcd-{i}", name=f"m{i}", host=fabric.gateway,
                         log_path=tmp_path / f"etcd-{i}.log", root_password=password)
             for i in range(members)]
    for m in etcds:
        m.initial_cluster = ",".join(f"{x.name}={x.peer_url}" for x in etcds)
    started: list = []
    try:
        start_cluster(etcds)
        endpoints = cluster_endpoints(etcds)
        ns, addr = fabric.add_node(0)
        # Cut from etcd only: A serves on a second link to the root namespace, which stays up.
        host = fabric.add_client_link(0) if cut == "etcd" else addr
        a = ControlPlane(endpoints, tmp_path / "a", host=host, netns=ns, env=credentials)
        started.append(a)
        a.start()
        term_a = wait_for(lambda: _leads(a) and _leads(a)[-1][1], 30, "replica A to lead")
        b = ControlPlane(endpoints, tmp_path / "b", user_token=a.user_token, node_token=a.node_token,
                         env=credentials)
        b.secret_dir, b.snapshot_root, b.log_root = a.secret_dir, a.snapshot_root, a.log_root
        started.append(b)
        b.start()
        agents = [NodeAgentProc(b, f"n{i}", tmp_path / f"n{i}") for i in range(3)]
        started[:0] = agents  # stopped first
        # A cut from etcd alone still hears the agents: they are given A first, and must be
        # failed over by A (their heartbeats, rendezvous, progress and snapshot commits).
        servers = f"{a.url},{b.url}" if cut == "etcd" else f"{b.url},{a.url}"
        for agent in agents:
            agent.start(server=servers)

        with b.client() as api:
            wait_nodes(api, 3)
            job_id = submit(api, train_spec("cut", 200, every=5, delay_s=0.1, mn=2, mx=2))
            wait_latest(api, job_id, 10)
            with SnapshotWatch(b, job_id) as watch:
                step_at_cut = api.get(f"/v1/jobs/{job_id}").json()["progress"]["step"]
                fabric.cut(0)
                cut_at = time.time()
                at_cut = submit(api, train_spec("at-the-cut", 20, every=5, delay_s=0.05))
                wait_state(api, at_cut, ("RUNNING", "SUCCEEDED"), timeout_s=30)
                led = wait_for(lambda: _leads(b), 5, "B's log to say it leads")
                stopped = wait_for(lambda: [x for x in _stops(a) if x[1] == term_a], 15,
                                   "A's log to say it stopped leading")
                if cut == "etcd":
                    check_cut_replica_answers(a, b, job_id, step_at_cut, at_cut)

                # The link back: A reaches etcd again and serves, but does not lead again.
                fabric.restore(0)
                assert fabric.link_is_up(0)
                wait_for(lambda: httpx.get(f"{a.url}/readyz", timeout=2).status_code == 200, 30,
                         "replica A to reach etcd again")
                done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=300)
                assert done["state"] == "SUCCEEDED", events_of(api, job_id)
                assert done["restarts"] == 0 and done["attempt"] == 1, events_of(api, job_id)
                trace = check_steps(api, job_id, watch=watch)
                assert trace.resumes == [] and trace.steps == list(range(1, 201)), trace.resumes
                assert wait_state(api, at_cut, ("SUCCEEDED", "FAILED"), timeout_s=120)["state"] == "SUCCEEDED"
            events = {j: events_of(api, j) for j in (job_id, at_cut)}

        # Who wrote what, from the events alone.
        term_b = led[0][1]
        stamped = sorted(((e["time"], e["term"], e["leader"], j, e["seq"], e["reason"])
                          for j, evs in events.items() for e in evs if e.get("term") is not None))
        holders: dict[int, set[str]] = {}
        for _, term, leader, *_ in stamped:
            holders.setdefault(term, set()).add(leader)
        # One holder a term; A's term before the cut, B's after it. (B may lead under more
        # than one term: on a starved machine its own 2 s lease can lapse and be taken again.)
        assert all(len(h) == 1 for h in holders.values()), holders
        b_terms = sorted(holders.keys() - {term_a})
        assert term_a in holders and b_terms and b_terms[0] == term_b and term_a < term_b, stamped
        (leader_a,), (leader_b,) = holders[term_a], holders[term_b]
        assert f":{a.proc.pid}:" in leader_a and f":{b.proc.pid}:" in leader_b, holders
        assert all(holders[t] == {leader_b} for t in b_terms), holders
        first_of_job = [e for e in events[job_id] if e["state"] == "STARTING"][0]
        assert first_of_job["term"] == term_a  # A started the job before the cut
        started_at_cut = [e for e in events[at_cut] if e["state"] == "STARTING"][0]
        assert started_at_cut["term"] in b_terms  # B started the job submitted at the cut
        terms_in_time = [term for _, term, *_ in stamped]
        assert terms_in_time == sorted(terms_in_time), stamped  # no event of A's after one of B's
        for evs in events.values():
            terms_in_seq = [e["term"] for e in sorted(evs, key=lambda e: e["seq"]) if e.get("term")]
            assert terms_in_seq == sorted(terms_in_seq), evs
        last_a = max(t for t, term, *_ in stamped if term == term_a)
        first_b = min(t for t, term, *_ in stamped if term != term_a)
        assert last_a < cut_at < first_b

        # And from the logs: A stopped before B took the lead, and never led again.
        stop_a, _, why = stopped[0]
        lead_b = led[0][0]
        print(f"\n{case}: A cut at 0; A stopped leading at {stop_a - cut_at:+.2f} s ({why}); B led at "
              f"{lead_b - cut_at:+.2f} s (term {term_a} -> {term_b}); gap {lead_b - stop_a:+.2f} s "
              f"(negative: an overlap); B's first event {first_b - cut_at:+.2f} s; A's last event "
              f"{last_a - cut_at:+.2f} s; B's terms in the events: {b_terms}; B stopped leading: "
              f"{[(round(t - cut_at, 2), term, why) for t, term, why in _stops(b)]}")
        assert stop_a < lead_b, (stopped, led)
        # A may stop on a lease it could not confirm in time (a loaded machine) and lead again
        # in the same term when the lease turns out alive: no term of A's but its first.
        assert {term for _, term in _leads(a)} == {term_a}
    finally:
        for proc in started:
            proc.stop()
        for m in etcds:
            m.kill()
            shutil.rmtree(m.data_dir, ignore_errors=True)


def check_cut_replica_answers(a: ControlPlane, b: ControlPlane, training: str, step_at_cut: int,
                              started_by_b: str) -> None:
    """A, cut from etcd but not from its clients, keeps answering and serves nothing stale as
    fresh: the training job's progress moved on through B since the cut, and B started a job
    after the cut, neither of which A can have heard of. A says so (503, which a client fails
    over on) or answers what etcd has. A client given A first gets the fresh answers."""
    assert httpx.get(f"{a.url}/healthz", timeout=2).status_code == 200  # A is alive and answers
    with b.client() as on_b:
        fresh = wait_for(lambda: (j := on_b.get(f"/v1/jobs/{training}").json())["progress"]["step"]
                         > step_at_cut and j, 30, "the training job's progress to move on through B")
    with a.client() as on_a:
        resp = on_a.get(f"/v1/jobs/{training}")
        assert resp.status_code in (200, 503), (resp.status_code, resp.text)
        if resp.status_code == 200:  # read through to etcd (only if it answered after all)
            assert resp.json()["progress"]["step"] >= fresh["progress"]["step"], (resp.text, fresh)
        resp = on_a.get(f"/v1/jobs/{started_by_b}")
        assert resp.status_code in (200, 503), (resp.status_code, resp.text)
        assert resp.status_code == 503 or resp.json()["state"] != "PENDING", resp.text
    with FtrainClient(f"{a.url},{b.url}", a.user_token) as client:
        assert client.get_job(training)["progress"]["step"] >= fresh["progress"]["step"]
        assert client.get_job(started_by_b)["state"] != "PENDING"
