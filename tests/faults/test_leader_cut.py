"""The leading control plane cut from etcd by a network namespace (issue 12): no two
schedulers ever act, proven from the job events, and the job trains on.

Layout (`tests.helpers.netns.Fabric`): etcd (closed: authentication on, as the control
plane demands off loopback) listens on the switch's gateway address in the root namespace;
replica A runs in a namespace of its own on the switch and leads (started first); replica
B runs in the root namespace on loopback; three node agents run in the root namespace and
are given `B,A` (the nodes' failover is the HA kill test's subject; here the cut is
between the leader and etcd). `ip link set <A's port> down` on the switch then cuts A from
etcd (and from everything else): A lives on, its etcd calls hang.

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

About 60 s: marked `slow` (FTRAIN_TEST_SLOW=1 runs it; needs root and iproute2).
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

from service.embedded import ROOT_USER, EtcdProcess
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


def test_a_leader_cut_from_etcd_stops_before_another_leads_and_the_job_trains_on(fabric, tmp_path):
    # etcd on an address that is not loopback is closed (the control plane refuses it open).
    password = secrets.token_urlsafe(16)
    password_file = tmp_path / "etcd-password"
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    credentials = {"FTRAIN_ETCD_USER": ROOT_USER, "FTRAIN_ETCD_PASSWORD_FILE": str(password_file)}
    etcd = EtcdProcess(tmp_path / "etcd-data", host=fabric.gateway, log_path=tmp_path / "etcd.log",
                       root_password=password)
    started: list = []
    try:
        etcd.start()
        ns, addr = fabric.add_node(0)
        a = ControlPlane(etcd.endpoint, tmp_path / "a", host=addr, netns=ns, env=credentials)
        started.append(a)
        a.start()
        term_a = wait_for(lambda: _leads(a) and _leads(a)[-1][1], 30, "replica A to lead")
        b = ControlPlane(etcd.endpoint, tmp_path / "b", user_token=a.user_token, node_token=a.node_token,
                         env=credentials)
        b.secret_dir, b.snapshot_root, b.log_root = a.secret_dir, a.snapshot_root, a.log_root
        started.append(b)
        b.start()
        agents = [NodeAgentProc(b, f"n{i}", tmp_path / f"n{i}") for i in range(3)]
        started[:0] = agents  # stopped first
        for agent in agents:
            agent.start(server=f"{b.url},{a.url}")

        with b.client() as api:
            wait_nodes(api, 3)
            job_id = submit(api, train_spec("cut", 200, every=5, delay_s=0.1, mn=2, mx=2))
            wait_latest(api, job_id, 10)
            with SnapshotWatch(b, job_id) as watch:
                fabric.cut(0)
                cut_at = time.time()
                at_cut = submit(api, train_spec("at-the-cut", 20, every=5, delay_s=0.05))
                wait_state(api, at_cut, ("RUNNING", "SUCCEEDED"), timeout_s=30)
                led = wait_for(lambda: _leads(b), 5, "B's log to say it leads")
                stopped = wait_for(lambda: [x for x in _stops(a) if x[1] == term_a], 15,
                                   "A's log to say it stopped leading")

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
        (term_b,) = {term for _, term in led}
        stamped = sorted(((e["time"], e["term"], e["leader"], j, e["seq"], e["reason"])
                          for j, evs in events.items() for e in evs if e.get("term") is not None))
        holders: dict[int, set[str]] = {}
        for _, term, leader, *_ in stamped:
            holders.setdefault(term, set()).add(leader)
        assert holders.keys() == {term_a, term_b} and term_a < term_b, stamped
        (leader_a,), (leader_b,) = holders[term_a], holders[term_b]
        assert f":{a.proc.pid}:" in leader_a and f":{b.proc.pid}:" in leader_b, holders
        first_of_job = [e for e in events[job_id] if e["state"] == "STARTING"][0]
        assert first_of_job["term"] == term_a  # A started the job before the cut
        started_at_cut = [e for e in events[at_cut] if e["state"] == "STARTING"][0]
        assert started_at_cut["term"] == term_b  # B started the job submitted at the cut
        terms_in_time = [term for _, term, *_ in stamped]
        assert terms_in_time == sorted(terms_in_time), stamped  # no event of A's after one of B's
        for evs in events.values():
            terms_in_seq = [e["term"] for e in sorted(evs, key=lambda e: e["seq"]) if e.get("term")]
            assert terms_in_seq == sorted(terms_in_seq), evs
        last_a = max(t for t, term, *_ in stamped if term == term_a)
        first_b = min(t for t, term, *_ in stamped if term == term_b)
        assert last_a < cut_at < first_b

        # And from the logs: A stopped before B took the lead, and never led again.
        stop_a, _, why = stopped[0]
        lead_b = led[0][0]
        print(f"\nA cut at 0; A stopped leading at {stop_a - cut_at:+.2f} s ({why}); B led at "
              f"{lead_b - cut_at:+.2f} s (term {term_a} -> {term_b}); gap {lead_b - stop_a:+.2f} s "
              f"(negative: an overlap); B's first event {first_b - cut_at:+.2f} s; A's last event "
              f"{last_a - cut_at:+.2f} s")
        assert stop_a < lead_b, (stopped, led)
        assert [term for _, term in _leads(a)] == [term_a]
    finally:
        for proc in started:
            proc.stop()
        etcd.kill()
        shutil.rmtree(etcd.data_dir, ignore_errors=True)
