"""The job index keeps the running jobs' records, the nodes they hold, their live members'
nodes and those with a hang timeout as the records change; each answer is what a look at
every record gives (a scheduler pass reads the former, `service.scheduler.tick`)."""

from service.decide import quotas
from service.decide.scheduling import Settled, live_members, schedule_queue
from service.job_index import JobIndex
from service.models import JobRecord, JobState, MemberStatus
from tests.service.test_decide_shares import job
from tests.service.test_scheduler import CFG, NOW, nodes

S = JobState


def member_states(record: JobRecord, **states: str) -> JobRecord:
    """`record` with these members' states (a finished, stopped or failed member)."""
    members = {n: m.model_copy(update={"state": states.get(n, m.state)}) for n, m in record.members.items()}
    return record.model_copy(update={"members": members})


def watched(record: JobRecord, timeout_s: float = 60.0) -> JobRecord:
    return record.model_copy(update={"spec": record.spec.model_copy(update={"hang_timeout_s": timeout_s})})


def by_look(index: JobIndex) -> tuple[list[tuple[str, JobRecord]], set[str], set[str], set[str]]:
    """What a look at every record gives: the running jobs oldest first, the nodes they hold,
    their live members' nodes, and those of them with a hang timeout."""
    running = sorted((j for j in index.jobs() if j.state.is_active()), key=lambda j: (j.created_at, j.id))
    return ([(j.id, j) for j in running], {n for j in running for n in quotas.held_nodes(j)},
            {n for j in running for n in live_members(j)},
            {j.id for j in running if j.spec.hang_timeout_s is not None})


def test_the_index_keeps_the_running_jobs_and_their_nodes_in_step_with_the_records():
    index = JobIndex(None, None)  # type: ignore[arg-type]  (applying records touches no store)
    a = watched(job("a", "ann", 3, S.STARTING, ["n1", "n2"], mx=2))
    changes = [
        job("p", "bob", 1),  # waiting: holds nothing
        a,
        job("b", "bob", 2, S.RUNNING, ["n3"]),  # older than a: before it, though it started later
        member_states(a, n2="succeeded"),  # a finished member holds its node, but is not live
        job("c", "ann", 4, S.RUNNING, ["n3", "n4"], mx=2),  # n3 claimed twice (records disagree)
        job("b", "bob", 2, S.SUCCEEDED, ["n3"]),  # b ends: n3 is still c's
        job("p", "bob", 1, S.STARTING, ["n5"]),  # the oldest starts: first
        member_states(job("c", "ann", 4, S.RECOVERING, ["n3", "n4"], mx=2), n4="stopped"),
        watched(job("a", "ann", 3, S.PENDING), 60.0),  # suspended: back to the queue
        job("c", "ann", 4, S.CANCELLING, ["n3"]),
        watched(job("a", "ann", 3, S.STARTING, ["n6"])),
    ]
    for revision, record in enumerate(changes, 1):
        index._apply(record, record.id, revision)
        running, holding, members, hang = by_look(index)
        assert list(index.running().items()) == running, record
        assert (index.held_nodes(), set(index.member_nodes()), index.hang_watched()) == (holding, members, hang)
    index._apply(None, "c", 99)  # deleted
    assert (list(index.running()), index.held_nodes(), set(index.member_nodes())) == (["p", "a"], {"n5", "n6"},
                                                                                    {"n5", "n6"})
    assert index.hang_watched() == {"a"}


def test_a_pass_with_the_index_counts_plans_as_one_that_looks_at_every_job():
    index = JobIndex(None, None)  # type: ignore[arg-type]
    for revision, record in enumerate([job("a", "ann", 1, S.RUNNING, ["n1"]),
                                       job("b", "bob", 2, S.RUNNING, ["n2"], mx=2),
                                       job("w", "bob", 3)], 1):
        index._apply(record, record.id, revision)
    others, ns = list(index.running().values()), nodes("n1", "n2", "n3")
    looked = schedule_queue([index.get("w")], others, ns, NOW, CFG)
    counted = schedule_queue([index.get("w")], others, ns, NOW, CFG, holding=index.held_nodes())
    assert [(p.job.id, sorted(p.job.members)) for p in counted] == \
        [(p.job.id, sorted(p.job.members)) for p in looked] == [("w", ["n3"])]


def test_settled_jobs_at_their_max_are_passed_over_unless_marked():
    settled = Settled()
    settled.nodes_version = 1
    full = job("f", "ann", 1, S.RUNNING, ["n1"])
    room = job("r", "bob", 2, S.RUNNING, ["n2"], mx=2)
    assert schedule_queue([], [full, room], nodes("n1", "n2"), NOW, CFG, settled=settled) == []
    assert settled.unknown([full, room], frozenset()) == [room]  # room: a free node may join it
    assert settled.unknown([full, room], frozenset(), keep={"f"}) == [full, room]  # marked
    assert settled.unknown([full.model_copy(), room], frozenset()) != [room]  # a new record
    assert settled.unknown([full], frozenset({"n9"})) == [full]  # other graced nodes
    settled.nodes_version = 2
    assert settled.unknown([full], frozenset()) == [full]  # another node view


def test_a_member_state_no_job_holds_leaves_the_counts():
    index = JobIndex(None, None)  # type: ignore[arg-type]
    record = job("a", "ann", 1, S.RUNNING, ["n1", "n2"], mx=2)
    index._apply(record, "a", 1)
    failed = record.model_copy(update={"members": {"n1": MemberStatus(state="running"),
                                                   "n2": MemberStatus(state="failed")}})
    index._apply(failed, "a", 2)
    assert (index.held_nodes(), set(index.member_nodes())) == ({"n1"}, {"n1"})


def test_a_settled_victim_at_its_max_still_has_its_mark_withdrawn_when_the_preemptor_no_longer_waits():
    """A pass passes over settled jobs at their max without a look, but not a preemption's
    victim: the job it gives nodes to may have been cancelled since, and its mark withdrawn."""
    from service.models import Preemption

    settled = Settled()
    settled.nodes_version = 1
    full = job("f", "ann", 1, S.RUNNING, ["n1"])
    assert schedule_queue([], [full], nodes("n1"), NOW, CFG, settled=settled) == []
    marked = full.model_copy(update={"preempt": Preemption(by="gone", by_priority=10, leave=["n1"],
                                                           requested_at=NOW)})
    settled._seen["f"] = (marked, *settled._seen["f"][1:])  # settled as it is, mark and all
    assert settled.unknown([marked], frozenset()) == [marked]
    plans = schedule_queue([], [marked], nodes("n1"), NOW, CFG, settled=settled, waits=lambda _: False)
    assert [p.job.preempt for p in plans] == [None]


def test_a_node_two_records_list_as_live_is_the_other_jobs_once_one_lets_it_go(caplog):
    """Records that disagree (two jobs list one node as a live member) answer the node's
    heartbeats with the later one, and say so; once that one ends, the node runs the other,
    not nothing (its assignment was lost, and the job waited without workers)."""
    index = JobIndex(None, None)  # type: ignore[arg-type]
    index._apply(job("first", "ann", 1, S.STARTING, ["n1", "n2"], mx=2), "first", 1)
    index._apply(job("second", "bob", 2, S.RUNNING, ["n2", "n3"], mx=2), "second", 2)
    assert index.job_of_node("n2").id == "second" and index.job_of_node("n1").id == "first"
    assert "node n2 is a live member of two jobs, first and second" in caplog.text
    index._apply(job("second", "bob", 2, S.SUCCEEDED, ["n2", "n3"], mx=2), "second", 3)
    assert index.job_of_node("n2").id == "first" and index.job_of_node("n3") is None
    index._apply(job("first", "ann", 1, S.RUNNING, ["n1"], mx=2), "first", 4)  # it let n2 go too
    assert index.job_of_node("n2") is None and index._shadowed == {}
    # the job shadowed there ends first: nothing is kept for the node
    index._apply(job("third", "ann", 3, S.RUNNING, ["n4"], mx=2), "third", 5)
    index._apply(job("fourth", "bob", 4, S.RUNNING, ["n4"], mx=2), "fourth", 6)
    index._apply(job("third", "ann", 3, S.SUCCEEDED, ["n4"], mx=2), "third", 7)
    assert index.job_of_node("n4").id == "fourth" and index._shadowed == {}
