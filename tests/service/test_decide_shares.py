"""Fair share and quotas in the scheduler's queue: pure logic, a table of cases, a fixed `now`."""

from __future__ import annotations

from service.decide import quotas
from service.decide.quotas import Quota, Tenants
from service.decide.scheduling import SchedulerConfig, schedule, schedule_queue
from service.decide.shares import HORIZON_S, fair_key, fair_queue, share_key
from service.decide.waiting import why_waiting
from service.models import JobRecord, JobSpec, JobState, MemberStatus, NodeRecord

S = JobState
NOW = 1000.0
CFG = SchedulerConfig()


def nodes(*names: str, gpus: int = 0) -> dict[str, NodeRecord]:
    return {n: NodeRecord(name=n, registered_at=1.0, lease_id=1, gpus=gpus) for n in names}


def job(jid: str, owner: str, created: float, state=S.PENDING, members=(), mn=1, mx=1,
        priority=0) -> JobRecord:
    return JobRecord(id=jid, owner=owner, state=state, created_at=created, updated_at=created,
                     spec=JobSpec(name="j", command=["true"], nodes={"min": mn, "max": mx},
                                  priority=priority),
                     members={n: MemberStatus(state="running") for n in members},
                     attempt=1 if members else 0)


def started(plans) -> list[tuple[str, list[str]]]:
    return [(p.job.id, sorted(p.job.members)) for p in plans if p.job.state is S.STARTING]


# The share key and the order it makes

def test_share_key_counts_the_user_first_then_the_team():
    running = [job("r1", "ann", 1, S.RUNNING, ["a", "b"]), job("r2", "bob", 2, S.RUNNING, ["c"])]
    tenants = Tenants(team_of={"ann": "ml", "bob": "ml"})
    used = quotas.usage(running, nodes("a", "b", "c"), tenants)
    # bob: 1 node at priority 0 now (a minute of use already), holds 1, team ml 3
    assert share_key(job("p", "bob", 3), used) == (HORIZON_S, 1, 3)
    assert share_key(job("p", "cy", 3), used) == (0, 0, 0)  # in no team: a team of one
    # at another priority bob has had nothing yet; he holds what he holds
    assert share_key(job("p", "bob", 3, priority=5), used) == (0, 1, 3)


def test_share_key_counts_node_seconds_had_before_nodes_held_now():
    tenants = Tenants(team_of={"ann": "ml", "bob": "ml"})
    used = quotas.usage_of({"bob": 1}, tenants, held_at={("bob", 0): 1},
                           past={("ann", 0): 500.0, ("bob", 0): 100.0, ("cy", 0): 400.0})
    order = sorted([job("pa", "ann", 1), job("pb", "bob", 2), job("pc", "cy", 3)], key=lambda j: fair_key(j, used))
    assert [j.id for j in order] == ["pb", "pc", "pa"]  # bob: 100 + 60 for his node now


def test_fair_key_orders_by_priority_then_share_then_age():
    used = quotas.usage([job("r", "ann", 1, S.RUNNING, ["a"])], nodes("a"), Tenants())
    old_of_ann, new_of_bob = job("p1", "ann", 2), job("p2", "bob", 3)
    urgent_of_ann = job("p3", "ann", 4, priority=5)
    order = sorted([old_of_ann, new_of_bob, urgent_of_ann], key=lambda j: fair_key(j, used))
    assert [j.id for j in order] == ["p3", "p2", "p1"]


def test_fair_queue_alternates_owners_as_their_shares_grow():
    used = quotas.usage([], {}, Tenants())
    pending = [job(f"a{i}", "ann", i) for i in range(3)] + [job(f"b{i}", "bob", 10 + i) for i in range(2)]
    order = []
    for j in fair_queue(pending, used):
        order.append(j.id)
        used.add(j.owner, 1, 0)  # it started on one node
    assert order == ["a0", "b0", "a1", "b1", "a2"]


def test_fair_queue_is_plain_age_order_when_nothing_is_taken():
    used = quotas.usage([], {}, Tenants())
    pending = [job("b0", "bob", 2), job("a0", "ann", 1), job("a1", "ann", 3)]
    assert [j.id for j in fair_queue(pending, used)] == ["a0", "b0", "a1"]


# Fair share in a scheduling pass

def test_a_free_node_goes_to_the_user_holding_less_before_an_older_job():
    running = job("r", "ann", 1, S.RUNNING, ["a", "b"])
    older_of_ann, newer_of_bob = job("p1", "ann", 2), job("p2", "bob", 3)
    plans = schedule([running, older_of_ann, newer_of_bob], nodes("a", "b", "c"), NOW, CFG)
    assert started(plans) == [("p2", ["c"])]


def test_free_nodes_are_shared_out_one_owner_after_another():
    pending = [job(f"a{i}", "ann", i) for i in range(3)] + [job(f"b{i}", "bob", 10 + i) for i in range(3)]
    plans = schedule(pending, nodes("n1", "n2", "n3", "n4"), NOW, CFG)
    assert {j for j, _ in started(plans)} == {"a0", "a1", "b0", "b1"}


def test_team_share_counts_every_member_of_the_team():
    running = [job("r1", "ann", 1, S.RUNNING, ["a"]), job("r2", "bob", 2, S.RUNNING, ["b"])]
    of_cy_in_ml, of_dee_alone = job("p1", "cy", 3), job("p2", "dee", 4)
    tenants = Tenants(team_of={"ann": "ml", "bob": "ml", "cy": "ml"})
    plans = schedule([*running, of_cy_in_ml, of_dee_alone], nodes("a", "b", "c"), NOW, CFG,
                     tenants=tenants)
    assert started(plans) == [("p2", ["c"])]  # team ml holds 2, dee none (cy itself holds none)


def test_a_free_node_goes_to_the_user_holding_less_though_its_team_holds_more():
    # users of a team of two get as much as a user alone: bob, holding none, before carol,
    # holding 1, though bob's team (ann's 2) holds more than carol's
    running = [job("r1", "ann", 1, S.RUNNING, ["a", "b"]), job("r2", "carol", 2, S.RUNNING, ["c"])]
    of_carol, of_bob = job("p1", "carol", 3), job("p2", "bob", 4)
    tenants = Tenants(team_of={"ann": "ml", "bob": "ml", "carol": "nlp"})
    plans = schedule([*running, of_carol, of_bob], nodes("a", "b", "c", "d"), NOW, CFG, tenants=tenants)
    assert started(plans) == [("p2", ["d"])]


def test_priority_comes_before_share():
    running = job("r", "ann", 1, S.RUNNING, ["a", "b"])
    plans = schedule([running, job("p1", "ann", 2, priority=1), job("p2", "bob", 3)],
                     nodes("a", "b", "c"), NOW, CFG)
    assert started(plans) == [("p1", ["c"])]


# Quotas

def test_a_user_quota_holds_a_job_back():
    tenants = Tenants(users={"ann": Quota(max_nodes=2)})
    running = job("r", "ann", 1, S.RUNNING, ["a", "b"])
    plans = schedule([running, job("p", "ann", 2)], nodes("a", "b", "c"), NOW, CFG, tenants=tenants)
    assert started(plans) == []


def test_a_quota_caps_an_elastic_jobs_max_but_never_its_min():
    tenants = Tenants(users={"ann": Quota(max_nodes=3)})
    ns = nodes("a", "b", "c", "d", "e")
    plans = schedule([job("p", "ann", 1, mn=2, mx=5)], ns, NOW, CFG, tenants=tenants)
    assert started(plans) == [("p", ["a", "b", "c"])]
    too_big = schedule([job("p", "ann", 1, mn=4, mx=5)], ns, NOW, CFG, tenants=tenants)
    assert started(too_big) == []


def test_a_quota_caps_a_running_jobs_scale_up():
    tenants = Tenants(users={"ann": Quota(max_nodes=2)})
    running = job("r", "ann", 1, S.RUNNING, ["a"], mn=1, mx=4)
    plans = schedule([running], nodes("a", "b", "c"), NOW, CFG, tenants=tenants)
    assert [sorted(p.job.members) for p in plans] == [["a", "b"]]


def test_a_team_quota_counts_the_jobs_of_all_its_users():
    tenants = Tenants(team_of={"ann": "ml", "bob": "ml"}, teams={"ml": Quota(max_nodes=2)})
    running = job("r", "ann", 1, S.RUNNING, ["a"])
    pending = [job("p1", "bob", 2), job("p2", "bob", 3), job("p3", "cy", 4)]
    plans = schedule([running, *pending], nodes("a", "b", "c", "d"), NOW, CFG, tenants=tenants)
    assert sorted(j for j, _ in started(plans)) == ["p1", "p3"]


def test_a_gpu_quota_counts_the_gpus_of_the_nodes_held():
    tenants = Tenants(users={"ann": Quota(max_gpus=8)})
    ns = nodes("a", "b", "c", gpus=4)
    plans = schedule([job("p", "ann", 1, mn=1, mx=3)], ns, NOW, CFG, tenants=tenants)
    assert started(plans) == [("p", ["a", "b"])]


def test_jobs_started_in_one_pass_count_against_the_quota_of_the_next():
    tenants = Tenants(users={"ann": Quota(max_nodes=2)})
    pending = [job(f"p{i}", "ann", i) for i in range(4)]
    plans = schedule_queue(iter(pending), [], nodes("a", "b", "c", "d"), NOW, CFG, tenants=tenants)
    assert [j for j, _ in started(plans)] == ["p0", "p1"]


def test_waiting_reason_names_the_quota():
    tenants = Tenants(users={"ann": Quota(max_nodes=2)})
    running = job("r", "ann", 1, S.RUNNING, ["a", "b"])
    ns = nodes("a", "b", "c")
    used = quotas.usage([running], ns, tenants)
    why = why_waiting(job("p", "ann", 2), ns, {"a": running, "b": running}, quotas.limits("ann", used))
    assert "user ann's quota: 2 of 2 nodes in use" in why


def test_waiting_reason_names_the_team_gpu_quota():
    tenants = Tenants(team_of={"ann": "ml"}, teams={"ml": Quota(max_gpus=4)})
    running = job("r", "ann", 1, S.RUNNING, ["a"])
    ns = nodes("a", "b", gpus=4)
    used = quotas.usage([running], ns, tenants)
    why = why_waiting(job("p", "ann", 2), ns, {"a": running}, quotas.limits("ann", used))
    assert "team ml's quota: 4 of 4 GPUs in use" in why
