"""EtcdStore while etcd elects a leader (its leading member lost): which calls are sent again.

Process-free: the member's answers are faked below `_call`. The real thing (etcd's leading
member SIGKILLed under a 3-member cluster, nothing noticed) is tests/faults/test_ha_cluster.py.
"""

from __future__ import annotations

import asyncio

import aetcd.exceptions
import pytest

from service.errors import StoreUnavailable
from service.store.etcd import EtcdStore


def store_answering(*answers: str | None, endpoints: str = "http://a:1,http://b:2,http://c:3"):
    """An EtcdStore whose members answer with each of `answers` in turn (None: success)."""
    store = EtcdStore(endpoints, timeout_s=3)
    sent: list[str] = []

    async def next_member(what, fn, attempt_s=None):
        said = answers[len(sent)]
        sent.append(what)
        if said is None:
            return "done"
        kind = (aetcd.exceptions.ClientError if said == "permission denied"
                else aetcd.exceptions.ConnectionFailedError)
        exc = kind(said)
        raise StoreUnavailable(f"etcd did not answer {what}") from exc

    store.calls._call_next_member = next_member
    return store, sent


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("answer", ["etcdserver: leader changed", "etcdserver: no leader",
                                    "failed to connect to all addresses; Connection refused"])
def test_a_read_is_sent_again_until_the_new_leader_answers(answer):
    store, sent = store_answering(answer, answer, None)
    assert run(store.calls.call("GET /k", None, repeatable=True)) == "done"
    assert sent == ["GET /k"] * 3


def test_a_write_is_sent_again_only_when_etcd_had_no_leader():
    store, sent = store_answering("etcdserver: no leader", None)
    assert run(store.calls.call("a transaction", None)) == "done" and len(sent) == 2
    # "leader changed" may follow a write that was applied: not sent again.
    store, sent = store_answering("etcdserver: leader changed", None)
    with pytest.raises(StoreUnavailable):
        run(store.calls.call("a transaction", None))
    assert len(sent) == 1


def test_one_member_unreachable_fails_at_once_and_others_than_elections_are_not_repeated():
    store, sent = store_answering("failed to connect to all addresses; Connection refused", None,
                                  endpoints="http://a:1")
    with pytest.raises(StoreUnavailable):
        run(store.calls.call("GET /k", None, repeatable=True))
    assert len(sent) == 1
    store, sent = store_answering("permission denied", None)
    with pytest.raises(StoreUnavailable):
        run(store.calls.call("GET /k", None, repeatable=True))
    assert len(sent) == 1


def test_the_election_is_waited_for_twice_the_timeout_by_a_read_and_the_timeout_by_a_write():
    """A read with other members to ask waits out an election that takes longer than the
    deadline (seconds on a loaded machine: the soak's 503s as a member was killed); a write,
    which may not be sent again after most failures, keeps the deadline."""
    store, sent = store_answering(*["etcdserver: no leader"] * 100)
    store.calls.timeout_s = 0.35
    with pytest.raises(StoreUnavailable):
        run(store.calls.call("GET /k", None, repeatable=True))
    assert 5 <= len(sent) <= 8  # one every ELECTION_RETRY_S (0.1 s) within 0.7 s
    store, sent = store_answering(*["etcdserver: no leader"] * 100)
    store.calls.timeout_s = 0.35
    with pytest.raises(StoreUnavailable):
        run(store.calls.call("a transaction", None))
    assert 2 <= len(sent) <= 4  # within 0.35 s


def test_a_read_whose_client_was_dropped_under_it_is_sent_again_and_a_write_is_not():
    """Another call that timed out drops the client (closing its channel cancels every call in
    flight on it): a read among those is asked of the next member (before, the soak's etcd
    member kills answered it 503); a write may have been applied and is not sent again."""

    def dropped_once():
        store = EtcdStore("http://a:1,http://b:2", timeout_s=3)
        sent: list[str] = []

        async def next_member(what, fn, attempt_s=None):
            sent.append(what)
            if len(sent) == 1:
                raise StoreUnavailable(f"etcd did not answer {what}") from asyncio.CancelledError()
            return "done"

        store.calls._call_next_member = next_member
        return store, sent

    store, sent = dropped_once()
    assert run(store.calls.call("GET /k", None, repeatable=True)) == "done" and len(sent) == 2
    store, sent = dropped_once()
    with pytest.raises(StoreUnavailable):
        run(store.calls.call("a transaction", None))
    assert len(sent) == 1
