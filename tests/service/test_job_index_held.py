"""The job index counts the nodes each user's unfinished jobs hold as the records change, as
`decide.quotas.usage` counts them from the records (a scheduler pass reads the former)."""

from service.decide import quotas
from service.job_index import JobIndex
from service.models import JobState
from tests.service.test_decide_shares import job

S = JobState


def test_the_index_counts_the_nodes_held_by_each_user_as_jobs_change():
    index = JobIndex(None, None)  # type: ignore[arg-type]  (applying records touches no store)
    changes = [
        job("a", "ann", 1),
        job("b", "bob", 2),
        job("a", "ann", 1, S.STARTING, ["n1", "n2"], mx=2),
        job("b", "bob", 2, S.RUNNING, ["n3"]),
        job("a", "ann", 1, S.RUNNING, ["n1"], mx=2),  # n2 left
        job("c", "ann", 3, S.RUNNING, ["n4"]),
        job("b", "bob", 2, S.SUCCEEDED, ["n3"]),  # a finished job holds nothing
    ]
    for revision, record in enumerate(changes, 1):
        index._apply(record, record.id, revision)
        expected = quotas.usage(index.jobs(), {}, quotas.Tenants(), gpus=False).user_nodes
        assert index.held() == {u: n for u, n in expected.items() if n}, record
    assert index.held() == {"ann": 2}
    index._apply(None, "c", 99)  # deleted
    assert index.held() == {"ann": 1}
