"""The "ftrain" rendezvous backend and store, against a real etcd and a real control plane.

The backend and store contracts run against ftrain's implementation *and* torch's reference
(C10dRendezvousBackend, TCPStore), so they check that ftrain behaves as torch expects, not
as this file's author guessed.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import pickle
import signal
import threading
import time
import types
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import torch.distributed as dist
import torch.distributed.elastic.utils.store as store_util
from torch.distributed.elastic.rendezvous import (
    RendezvousParameters,
    RendezvousStateError,
    dynamic_rendezvous,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, _RendezvousState

import worker.rendezvous as ftrain_rdzv
from service.keys import Keys
from service.rendezvous import StateHub, delete_rendezvous, parse_rdzv_id
from service.store.api import Put
from service.store.etcd import EtcdStore
from tests.helpers.processes import free_port, wait_for
from worker.protocol import seal_state
from worker.rendezvous import (
    FtrainRendezvousBackend,
    HttpStore,
    RendezvousGoneError,
    Transport,
    create_ftrain_handler,
    endpoint_url,
    wake,
    wake_on_change,
)
from worker.torch_internals import TorchChanged

# One etcd and control plane for the module (each test has a job, and so a rendezvous, of
# its own): the tests that stop it, restart it, register a node or read every rendezvous key
# have their own.
pytestmark = pytest.mark.shared_control_plane

SPEC = {"name": "rdzv", "command": ["python", "train.py"], "nodes": {"min": 1, "max": 2}}
# Two states as they travel (sealed, base64), for the tests that speak HTTP themselves.
S1 = base64.b64encode(seal_state(b"\x00\x01")).decode()
S2 = base64.b64encode(seal_state(b"\x00\x02")).decode()


def state_of(body: dict) -> dict:
    """A state answer without the control plane's note of the last outage (it has one for a
    minute after an outage)."""
    return {k: v for k, v in body.items() if k != "outage"}


def submit(api: httpx.Client) -> dict:
    resp = api.post("/v1/jobs", json=SPEC)
    assert resp.status_code == 201, resp.text
    return resp.json()


@pytest.fixture
def job(api) -> dict:
    return submit(api)


@pytest.fixture
def rdzv_id(job) -> str:
    assert job["attempt"] == 0
    return f"{job['id']}-a{job['attempt']}"


@pytest.fixture
def token(control_plane, job) -> str:
    """The job's token, as its workers (and their torchrun) have it."""
    return control_plane.job_token_of(job["id"])


@pytest.fixture
def transports(control_plane, rdzv_id, token):
    """Make clients of the job's rendezvous (the job token), closed at the end."""
    made: list[Transport] = []
    job_token = token

    def make(token: str | None = None, rdzv: str | None = None, retry_timeout_s: float = 20):
        t = Transport(control_plane.url, rdzv or rdzv_id, token or job_token,
                      retry_timeout_s=retry_timeout_s)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


# --------------------------------------------------------------------------------------
# RendezvousBackend contract (torch's RendezvousBackendTestMixin, run on ftrain and c10d)
# --------------------------------------------------------------------------------------


@pytest.fixture(params=[pytest.param("ftrain", marks=pytest.mark.integration), "c10d"])
def backend(request):
    if request.param == "ftrain":
        return FtrainRendezvousBackend(request.getfixturevalue("transports")())
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=10))
    request.addfinalizer(lambda: tcp)  # keep the server alive for the test's duration
    return C10dRendezvousBackend(tcp, "contract")


def test_get_state_returns_none_if_there_is_no_state(backend):
    assert backend.get_state() is None


def test_set_state_without_token_creates_state(backend):
    state, token, written = backend.set_state(b"x")
    assert (state, written) == (b"x", True) and token is not None
    assert backend.get_state() == (b"x", token)


def test_set_state_without_token_returns_current_state_if_state_exists(backend):
    _, token, _ = backend.set_state(b"x")
    state, token2, written = backend.set_state(b"y")
    assert (state, token2, written) == (b"x", token, False)
    assert backend.get_state() == (b"x", token)


def test_set_state_with_current_token_writes_and_returns_new_token(backend):
    _, token, _ = backend.set_state(b"x")
    state, token2, written = backend.set_state(b"y", token)
    assert (state, written) == (b"y", True) and token2 != token
    assert backend.get_state() == (b"y", token2)
    state, token3, written = backend.set_state(b"z", token2)  # the returned token is usable
    assert (state, written) == (b"z", True)
    assert backend.get_state() == (b"z", token3)


def test_set_state_returns_current_state_if_token_is_old(backend):
    _, old, _ = backend.set_state(b"x")
    _, current, _ = backend.set_state(b"y", old)
    state, token, written = backend.set_state(b"z", old)
    assert (state, token, written) == (b"y", current, False)
    assert backend.get_state() == (b"y", current)


def test_set_state_returns_current_state_if_token_is_foreign(backend):
    _, token, _ = backend.set_state(b"x")
    state, token2, written = backend.set_state(b"y", object())  # never handed out by the backend
    assert (state, token2, written) == (b"x", token, False)


def test_set_state_with_same_token_from_many_threads_has_one_winner(backend):
    _, token, _ = backend.set_state(b"base")
    candidates = [f"n{i}".encode() for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: backend.set_state(s, token), candidates))
    winners = [r for r in results if r[2]]
    assert len(winners) == 1
    winner_state = winners[0][0]
    assert all(r[0] == winner_state for r in results)  # every loser sees what won
    assert backend.get_state()[0] == winner_state


def test_state_holds_arbitrary_bytes(backend):
    blob = bytes(range(256)) * 8
    state, _, written = backend.set_state(blob)
    assert written and state == blob and backend.get_state()[0] == blob


def test_a_whole_state_of_a_large_round_is_written(backend):
    """Any node may write the whole state (torch's compare-and-set): a round of 1,024 nodes'
    state is about 64 KB, which travels as about 86 KB (base64), over the control plane's
    default 64 KiB body limit for other requests; the state write takes it."""
    blob = bytes(range(256)) * 400  # 100 KB
    state, _, written = backend.set_state(blob)
    assert written and state == blob and backend.get_state()[0] == blob


# --------------------------------------------------------------------------------------
# c10d Store contract (run on HttpStore and torch's TCPStore)
# --------------------------------------------------------------------------------------


@pytest.fixture(params=[pytest.param("http", marks=pytest.mark.integration), "tcp"])
def make_store(request):
    """Make clients of one store (a blocked client must not block another's write)."""
    if request.param == "http":
        transports = request.getfixturevalue("transports")
        return lambda: HttpStore(transports(), timeout=timedelta(seconds=10))
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    request.addfinalizer(lambda: server)
    return lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                 timeout=timedelta(seconds=10))


@pytest.fixture
def store(make_store):
    return make_store()


def test_set_then_get_returns_bytes(store):
    store.set("a/b c", b"\x00\xffvalue")
    store.set("text", "hello")
    assert store.get("a/b c") == b"\x00\xffvalue"
    assert store.get("text") == b"hello"
    store.set("text", "again")  # overwrite
    assert store.get("text") == b"again"


def test_get_blocks_until_another_client_sets_the_key(make_store):
    reader, writer = make_store(), make_store()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(reader.get, "late")
        assert not pending.done()
        writer.set("late", b"here")
        assert pending.result(timeout=10) == b"here"


def test_get_raises_store_error_at_timeout(store):
    store.set_timeout(timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.get("never")
    assert 0.9 <= time.monotonic() - start < 6


def test_wait_with_timeout_raises_if_a_key_is_missing(store):
    store.set("one", b"1")
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["one", "two"], timedelta(milliseconds=500))
    assert time.monotonic() - start < 5


def test_wait_returns_once_every_key_exists(make_store):
    waiter, writer = make_store(), make_store()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(waiter.wait, ["k1", "k2"], timedelta(seconds=10))
        writer.set("k1", b"1")
        writer.set("k2", b"2")
        pending.result(timeout=10)


def test_check_says_whether_all_keys_exist(store):
    store.set("here", b"1")
    assert store.check(["here"])
    assert not store.check(["here", "missing"])


def test_add_starts_from_zero_and_returns_the_new_value(store):
    assert store.add("counter", 5) == 5
    assert store.add("counter", -2) == 3
    assert store.add("counter", 0) == 3
    assert store.get("counter") == b"3"


def test_add_is_atomic_under_concurrent_clients(make_store):
    stores = [make_store() for _ in range(8)]

    def bump(s):
        return [s.add("n", 1) for _ in range(10)]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        seen = [v for values in pool.map(bump, stores) for v in values]
    assert sorted(seen) == list(range(1, 81))  # every increment got its own value
    assert stores[0].get("n") == b"80"


def test_compare_set_follows_tcpstore_semantics(store):
    # absent key and empty expected value: set
    assert store.compare_set("cs", "", "first") == b"first"
    # matching expected value: set
    assert store.compare_set("cs", "first", "second") == b"second"
    # mismatch: nothing written, the current value returned
    assert store.compare_set("cs", "wrong", "third") == b"second"
    assert store.get("cs") == b"second"
    # absent key and non-empty expected value: the expected value back, nothing created
    assert store.compare_set("absent", "x", "y") == b"x"
    assert not store.check(["absent"])


def test_multi_set_then_multi_get(store):
    store.multi_set(["m1", "m2", "m3"], [b"1", "2", b"\x003"])
    assert store.multi_get(["m3", "m1", "m2"]) == [b"\x003", b"1", b"2"]


def test_multi_get_blocks_until_every_key_exists(make_store):
    reader, writer = make_store(), make_store()
    writer.set("x1", b"1")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(reader.multi_get, ["x1", "x2"])
        writer.set("x2", b"2")
        assert pending.result(timeout=10) == [b"1", b"2"]


def test_append_creates_then_extends(store):
    store.append("log", b"ab")
    store.append("log", "cd")
    assert store.get("log") == b"abcd"


def test_delete_key_and_num_keys(store):
    before = store.num_keys()
    store.set("d1", b"1")
    store.set("d2", b"2")
    assert store.num_keys() == before + 2
    assert store.delete_key("d1") is True
    assert store.delete_key("d1") is False
    assert store.num_keys() == before + 1
    assert not store.check(["d1"]) and store.check(["d2"])


def test_prefix_store_reaches_every_operation(store):
    """torch wraps the store in a C++ PrefixStore, which calls the trampoline's names."""
    p = dist.PrefixStore("torch.rendezvous.x.0", store)
    p.set("k", b"v")
    assert p.get("k") == b"v"
    assert p.add("c", 2) == 2
    assert p.compare_set("k", b"v", b"w") == b"w"
    assert p.check(["k"])
    p.wait(["k"])
    p.wait(["k"], timedelta(seconds=1))
    p.multi_set(["a", "b"], [b"1", b"2"])
    assert p.multi_get(["a", "b"]) == [b"1", b"2"]
    p.append("a", b"+")
    assert p.get("a") == b"1+"
    n = p.num_keys()
    assert p.delete_key("b") is True and p.num_keys() == n - 1
    p.set_timeout(timedelta(seconds=1))
    assert p.timeout == timedelta(seconds=1)
    with pytest.raises(dist.DistStoreError):
        p.get("never")
    assert store.get("torch.rendezvous.x.0/k") == b"w"


def test_torch_barrier_releases_all_members_and_times_out_without_them(make_store):
    stores = [make_store() for _ in range(3)]

    def enter(s):
        store_util.barrier(s, world_size=3, key_prefix="exit", barrier_timeout=10)
        return True

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert all(pool.map(enter, stores))
    assert stores[0].timeout == timedelta(seconds=10)  # store_timeout restored it
    with pytest.raises(dist.DistStoreError):
        store_util.barrier(stores[0], world_size=2, key_prefix="alone", barrier_timeout=1)


# --------------------------------------------------------------------------------------
# ftrain specifics: auth, attempts, retries, cleanup, the handler
# --------------------------------------------------------------------------------------


def test_user_token_is_forbidden_and_no_token_is_unauthorized(control_plane, rdzv_id):
    for token, status in (("user", 403), (None, 401), ("not-a-token", 401)):
        with control_plane.client(token) as client:
            assert client.get(f"/v1/rdzv/{rdzv_id}/state").status_code == status, token
            resp = client.post(f"/v1/rdzv/{rdzv_id}/store/set",
                               json={"items": [{"key": "k", "value": "dg=="}]})
            assert resp.status_code == status, token


def test_job_token_is_accepted_only_for_its_own_job(control_plane, api, job, rdzv_id, etcd):
    token = control_plane.job_token_of(job["id"])
    with control_plane.client(token) as client:
        assert client.get(f"/v1/rdzv/{rdzv_id}/state").status_code == 200
        other = submit(api)
        # Another job's rendezvous is 403, and so is one that does not exist: no job oracle.
        assert client.get(f"/v1/rdzv/{other['id']}-a0/state").status_code == 403
        assert client.get("/v1/rdzv/nope-zzzzzz-a0/state").status_code == 403
    with control_plane.client("not-a-token") as stranger:
        assert stranger.get(f"/v1/rdzv/{other['id']}-a0/state").status_code == 401
        assert stranger.get("/v1/rdzv/nope-zzzzzz-a0/state").status_code == 401


@pytest.mark.own_control_plane
def test_unknown_job_or_malformed_id_is_404_to_a_node(control_plane):
    with control_plane.client(control_plane.enrol("n0")) as client:
        assert client.get("/v1/rdzv/nope-zzzzzz-a0/state").status_code == 404
        assert client.get("/v1/rdzv/no-attempt/state").status_code == 404


def test_state_travels_base64_with_revision_token(control_plane, rdzv_id, token):
    sealed = S1
    with control_plane.client(token) as client:
        assert state_of(client.get(f"/v1/rdzv/{rdzv_id}/state").json()) == {"state": None, "token": None}
        resp = client.put(f"/v1/rdzv/{rdzv_id}/state", json={"state": sealed, "token": None})
        body = resp.json()
        assert resp.status_code == 200 and body["written"] is True and body["state"] == sealed
        assert body["token"].isdigit()
        bad = client.put(f"/v1/rdzv/{rdzv_id}/state", json={"state": "not base64!", "token": None})
        assert bad.status_code == 422


def _put_raw_state(etcd_endpoint: str, rdzv_id: str, value: bytes) -> None:
    """Write the state key in etcd behind the control plane's back (damage at rest)."""

    async def put():
        client = EtcdStore(etcd_endpoint)
        try:
            await client.put(Keys().rdzv_state(rdzv_id), value)
        finally:
            await client.close()

    asyncio.run(put())


def test_a_corrupt_state_in_etcd_raises_rendezvous_state_error(control_plane, etcd, transports, rdzv_id):
    backend = FtrainRendezvousBackend(transports())
    state = pickle.dumps(_RendezvousState())
    _, token, _ = backend.set_state(state)
    sealed = seal_state(state)
    flipped = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for damaged in (flipped, sealed[: len(sealed) // 2], state, b"garbage"):
        _put_raw_state(etcd.endpoint, rdzv_id, damaged)
        with pytest.raises(RendezvousStateError, match="corrupt"):
            backend.get_state()
        with pytest.raises(RendezvousStateError, match="corrupt"):  # the state that won a lost race
            backend.set_state(state, token)
    # torch's handler gets the error from its backend, as with its own backends
    holder = dynamic_rendezvous._BackendRendezvousStateHolder(backend, types.SimpleNamespace(), 0)
    with pytest.raises(RendezvousStateError):
        holder.sync()


def test_the_control_plane_refuses_to_store_a_state_that_is_not_sealed(control_plane, rdzv_id, token):
    sealed = seal_state(b"state")
    with control_plane.client(token) as client:
        for bad in (b"state", sealed[:-1], sealed[:10], b""):
            resp = client.put(f"/v1/rdzv/{rdzv_id}/state",
                              json={"state": base64.b64encode(bad).decode(), "token": None})
            assert resp.status_code == 422 and "seal" in resp.text, resp.text
        assert state_of(client.get(f"/v1/rdzv/{rdzv_id}/state").json()) == {"state": None, "token": None}


def test_stale_attempt_is_gone_and_never_written(control_plane, transports, job, etcd, token):
    stale = transports(rdzv=f"{job['id']}-a1")
    with pytest.raises(RendezvousGoneError, match="attempt"):
        FtrainRendezvousBackend(stale).set_state(b"x")
    start = time.monotonic()
    with pytest.raises(RendezvousGoneError):
        HttpStore(stale).set("k", b"v")
    assert time.monotonic() - start < 2  # a 410 is not retried
    with control_plane.client(token) as client:
        assert client.get(f"/v1/rdzv/{job['id']}-a1/state").status_code == 410

    async def leftovers():
        client = EtcdStore(etcd.endpoint)
        try:
            return [e async for e in client.scan_prefix(Keys().rdzv(f"{job['id']}-a1"))]
        finally:
            await client.close()

    assert asyncio.run(leftovers()) == []


def test_finished_job_rendezvous_is_gone(api, transports, job):
    backend = FtrainRendezvousBackend(transports())
    assert backend.set_state(b"x")[2]
    assert api.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").json()["state"] == "CANCELLED", 10,
             "the job to be cancelled")
    with pytest.raises(RendezvousGoneError, match="CANCELLED"):
        backend.get_state()


def test_retried_add_with_the_same_op_id_applies_once(control_plane, rdzv_id, token):
    with control_plane.client(token) as client:
        url = f"/v1/rdzv/{rdzv_id}/store/add"
        first = client.post(url, json={"key": "c", "amount": 1, "op_id": "op1"}).json()
        again = client.post(url, json={"key": "c", "amount": 1, "op_id": "op1"}).json()
        other = client.post(url, json={"key": "c", "amount": 1, "op_id": "op2"}).json()
    assert (first, again, other) == ({"value": 1}, {"value": 1}, {"value": 2})


def test_add_to_a_non_integer_is_an_error(control_plane, transports):
    store = HttpStore(transports())
    store.set("s", b"text")
    with pytest.raises(Exception, match="not an integer"):
        store.add("s", 1)


@pytest.mark.own_control_plane
def test_blocking_get_survives_a_control_plane_restart(control_plane, transports):
    reader = HttpStore(transports(retry_timeout_s=30), timeout=timedelta(seconds=40))
    backend = FtrainRendezvousBackend(transports(retry_timeout_s=30))
    backend.set_state(b"before")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = pool.submit(reader.get, "after-restart")
        wait_for(lambda: not pending.done(), 5, "the reader to block")
        control_plane.stop(signal.SIGKILL)
        # While the control plane is down, a state read retries instead of failing.
        read_state = pool.submit(backend.get_state)
        control_plane.start()
        HttpStore(transports()).set("after-restart", b"ok")
        assert pending.result(timeout=30) == b"ok"
        assert read_state.result(timeout=30)[0] == b"before"


def test_unreachable_control_plane_raises_connection_error_after_retry_timeout():
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    transport = Transport(f"http://127.0.0.1:{free_port()}", "job-abcdef-a0", "t", retry_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="did not answer"):
        FtrainRendezvousBackend(transport).get_state()
    with pytest.raises(dist.DistNetworkError):
        HttpStore(transport).set("k", b"v")
    assert time.monotonic() - start < 10
    transport.close()


@pytest.mark.own_control_plane
def test_delete_rendezvous_removes_every_attempt_of_that_job_only(etcd):
    keys = Keys()
    neighbour = "train-abc123-a1-zzzzzz"  # a job whose id starts like "train-abc123-a"

    async def run():
        client = EtcdStore(etcd.endpoint)
        try:
            for rdzv in ("train-abc123-a0", "train-abc123-a1", f"{neighbour}-a0"):
                await client.commit({}, [Put(keys.rdzv_state(rdzv), b"s"),
                                         Put(keys.rdzv_store(rdzv) + "azE", b"v")])
            deleted = await delete_rendezvous(client, keys, "train-abc123")
            left = [e.key async for e in client.scan_prefix(keys.prefix + "/rdzv/")]
            return deleted, left
        finally:
            await client.close()

    deleted, left = asyncio.run(run())
    assert deleted == 4
    assert sorted(left) == sorted([keys.rdzv_state(f"{neighbour}-a0"),
                                   keys.rdzv_store(f"{neighbour}-a0") + "azE"])


@pytest.mark.own_control_plane
def test_a_newer_attempt_seen_deletes_the_keys_of_the_earlier_ones_of_that_job_only(etcd):
    """A job that restarts for months: the first request of its attempt N that a control plane
    sees deletes the keys of its attempts before N (dead: refused 410), not N's, not another
    job's; an attempt seen before starts no second sweep."""
    keys = Keys()
    neighbour = "train-abc123-a1-zzzzzz"  # a job whose id starts like "train-abc123-a"

    async def run():
        client = EtcdStore(etcd.endpoint)
        hub = StateHub()
        try:
            for rdzv in ("train-abc123-a0", "train-abc123-a1", "train-abc123-a2", f"{neighbour}-a0"):
                await client.commit({}, [Put(keys.rdzv_state(rdzv), b"s"),
                                         Put(keys.rdzv_store(rdzv) + "azE", b"v")])
            hub.attempt_seen(client, keys, "train-abc123", 2)
            await asyncio.gather(*hub._sweeps)
            left = sorted([e.key async for e in client.scan_prefix(keys.prefix + "/rdzv/")])
            hub.attempt_seen(client, keys, "train-abc123", 2)
            hub.attempt_seen(client, keys, "train-abc123", 1)
            return left, len(hub._sweeps)
        finally:
            await client.close()

    left, sweeps = asyncio.run(run())
    assert left == sorted([keys.rdzv_state("train-abc123-a2"), keys.rdzv_store("train-abc123-a2") + "azE",
                           keys.rdzv_state(f"{neighbour}-a0"), keys.rdzv_store(f"{neighbour}-a0") + "azE"])
    assert sweeps == 0


def test_parse_rdzv_id():
    assert parse_rdzv_id("train-x1y2z3-a4") == ("train-x1y2z3", 4)
    assert parse_rdzv_id("a-b-a1-c-a0") == ("a-b-a1-c", 0)


def test_endpoint_url_accepts_host_port_and_urls():
    assert endpoint_url("127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert endpoint_url("http://cp:8123/") == "http://cp:8123"
    assert endpoint_url("cp") == "http://cp:8000"


def test_registered_handler_runs_a_one_node_rendezvous(control_plane, rdzv_id, monkeypatch, token):
    monkeypatch.setenv("FTRAIN_JOB_TOKEN", token)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters(backend="ftrain", endpoint=control_plane.url, run_id=rdzv_id,
                                  min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
                                  last_call_timeout=1, join_timeout=30, read_timeout=7,
                                  keep_alive_interval=1)
    handler = rendezvous_handler_registry.create_handler(params)
    assert isinstance(handler, DynamicRendezvousHandler)
    assert handler.get_backend() == "ftrain"
    assert handler.settings.keep_alive_interval == timedelta(seconds=1)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert info.store.timeout == timedelta(seconds=7)
    assert handler.num_nodes_waiting() == 0
    assert handler.shutdown()
    assert handler.is_closed()


def test_store_values_are_base64_on_the_wire(control_plane, rdzv_id, token):
    with control_plane.client(token) as client:
        raw = bytes(range(256))
        value = base64.b64encode(raw).decode()
        assert client.post(f"/v1/rdzv/{rdzv_id}/store/set",
                           json={"items": [{"key": "raw", "value": value}]}).status_code == 204
        got = client.post(f"/v1/rdzv/{rdzv_id}/store/get", json={"keys": ["raw"]}).json()
        assert got == {"found": True, "values": [value]}
        missing = client.post(f"/v1/rdzv/{rdzv_id}/store/get",
                              json={"keys": ["raw", "nope"], "wait_s": 0.2}).json()
        assert missing == {"found": False}


def test_long_poll_wakes_on_write_well_before_its_wait_ends(control_plane, rdzv_id, token):
    """The server's wait is an etcd watch: a write ends it at once, not at the next poll."""
    with control_plane.client(token) as reader, control_plane.client(token) as writer:
        def long_poll():
            start = time.monotonic()
            body = reader.post(f"/v1/rdzv/{rdzv_id}/store/get",
                               json={"keys": ["wake"], "wait_s": 5}).json()
            return body, time.monotonic() - start

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(long_poll)
            threading.Event().wait(0.3)  # let the request reach its watch (not a correctness wait)
            writer.post(f"/v1/rdzv/{rdzv_id}/store/set",
                        json={"items": [{"key": "wake", "value": "MQ=="}]})
            body, took = pending.result(timeout=10)
    assert body == {"found": True, "values": ["MQ=="]}
    assert took < 2.5


# --------------------------------------------------------------------------------------
# Waking torch's rendezvous on a state change (long poll on the state)
# --------------------------------------------------------------------------------------


def test_state_long_poll_answers_soon_after_a_change(control_plane, rdzv_id, token):
    url = f"/v1/rdzv/{rdzv_id}/state"
    with control_plane.client(token) as reader, control_plane.client(token) as writer:
        token = writer.put(url, json={"state": S1, "token": None}).json()["token"]

        def long_poll():
            start = time.monotonic()
            body = state_of(reader.get(url, params={"after": token, "wait_s": 10}).json())
            return body, time.monotonic() - start

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(long_poll)
            threading.Event().wait(0.3)  # let the request reach its watch (not a correctness wait)
            new_token = writer.put(url, json={"state": S2, "token": token}).json()["token"]
            body, took = pending.result(timeout=15)
    assert body == {"state": S2, "token": new_token, "changed": True}
    assert took < 2.5  # the server caps a wait at 5 s: this one ended on the write


def test_state_long_poll_times_out_with_the_unchanged_state(control_plane, rdzv_id, token):
    url = f"/v1/rdzv/{rdzv_id}/state"
    with control_plane.client(token) as client:
        start = time.monotonic()
        none_yet = state_of(client.get(url, params={"after": "0", "wait_s": 0.3}).json())
        assert time.monotonic() - start >= 0.25
        assert none_yet == {"state": None, "token": None, "changed": False}
        token = client.put(url, json={"state": S1, "token": None}).json()["token"]
        same = state_of(client.get(url, params={"after": token, "wait_s": 0.3}).json())
        assert same == {"state": S1, "token": token, "changed": False}
        # A token that is not the current one is answered at once, without waiting.
        start = time.monotonic()
        stale = state_of(client.get(url, params={"after": "1", "wait_s": 10}).json())
        assert stale == {"state": S1, "token": token, "changed": True}
        assert time.monotonic() - start < 2.5
        # Without `after` it is the plain read it always was.
        assert state_of(client.get(url).json()) == {"state": S1, "token": token}
        assert client.get(url, params={"after": "x"}).status_code == 422


def test_state_long_poll_is_guarded_like_the_other_routes(control_plane, job, rdzv_id, token):
    params = {"after": "0", "wait_s": 1}
    with control_plane.client("user") as user, control_plane.client(None) as nobody:
        assert user.get(f"/v1/rdzv/{rdzv_id}/state", params=params).status_code == 403
        assert nobody.get(f"/v1/rdzv/{rdzv_id}/state", params=params).status_code == 401
    with control_plane.client(token) as node:
        resp = node.get(f"/v1/rdzv/{job['id']}-a1/state", params=params)
    assert resp.status_code == 410


def test_wait_for_change_hands_the_new_state_to_the_next_get_state(transports):
    waiter, writer = FtrainRendezvousBackend(transports()), FtrainRendezvousBackend(transports())
    _, token, _ = writer.set_state(b"one")
    assert waiter.get_state() == (b"one", token)
    assert waiter.wait_for_change(0.2) is False  # nothing changed: the wait ends
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        def wait_then_read():
            changed = waiter.wait_for_change(10)
            calls = []
            waiter._transport.call = lambda *a, **kw: calls.append(a)  # no request from here on
            return changed, waiter.get_state(), calls

        pending = pool.submit(wait_then_read)
        threading.Event().wait(0.3)  # let the wait start (not a correctness wait)
        _, new_token, _ = writer.set_state(b"two", token)
        changed, state, calls = pending.result(timeout=15)
    assert (changed, state, calls) == (True, (b"two", new_token), [])


def test_waits_that_end_at_once_are_spaced_out(transports):
    """A state that changes all the time must not turn the waits into a busy loop."""
    backend = FtrainRendezvousBackend(transports())
    backend.set_state(b"x")
    start = time.monotonic()
    for _ in range(3):
        backend.wait_instead_of_poll(1, after="1")  # never the current token: answered at once
    took = time.monotonic() - start
    assert 2 * ftrain_rdzv.MIN_WAKE_INTERVAL_S <= took < 1


def test_a_failed_wait_falls_back_to_the_one_second_poll():
    transport = Transport(f"http://127.0.0.1:{free_port()}", "job-abcdef-a0", "t", retry_timeout_s=1)
    backend = FtrainRendezvousBackend(transport)
    start = time.monotonic()
    backend.wait_instead_of_poll(0.4, "7")  # connection refused: sleeps out the delay instead
    assert 0.35 <= time.monotonic() - start < 3
    transport.close()


def test_a_handler_without_torchs_state_holder_is_refused_with_the_name_it_lacks(transports):
    backend = FtrainRendezvousBackend(transports())
    with pytest.raises(TorchChanged, match=r"private dynamic_rendezvous\.DynamicRendezvousHandler\._state_holder"):
        wake_on_change(types.SimpleNamespace(), backend)
    assert backend._wakes_on_change is False


def test_waiting_handler_wakes_on_the_second_join_without_a_one_second_poll(
        control_plane, rdzv_id, monkeypatch, token):
    """Two handlers in threads (as torchrun's on two nodes): the first waits for the second;
    its wait must be the long poll of its own state, never torch's one-second sleep."""
    monkeypatch.setenv("FTRAIN_JOB_TOKEN", token)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters(backend="ftrain", endpoint=control_plane.url, run_id=rdzv_id,
                                  min_nodes=2, max_nodes=2, local_addr="127.0.0.1",
                                  last_call_timeout=1, join_timeout=30, keep_alive_interval=1)
    first, second = create_ftrain_handler(params), create_ftrain_handler(params)
    for handler in (first, second):
        assert isinstance(handler, DynamicRendezvousHandler)
        assert handler._state_holder._cache_duration == 1  # torch's cache stays (monitor reads)

    stock_delays: list[tuple[str, object]] = []
    stock_delay = wake._stock_delay

    def count_stock_delay(seconds):
        stock_delays.append((threading.current_thread().name, seconds))
        stock_delay(seconds=seconds)

    monkeypatch.setattr(wake, "_stock_delay", count_stock_delay)
    entered: list[FtrainRendezvousBackend] = []
    waits: list[tuple[str, FtrainRendezvousBackend, bool]] = []
    wait = FtrainRendezvousBackend._wait  # wait_for_change's, and the handler's wait's

    def record_wait(self, timeout_s, after):
        entered.append(self)
        changed, kept = wait(self, timeout_s, after)
        waits.append((threading.current_thread().name, self, changed))
        return changed, kept

    monkeypatch.setattr(FtrainRendezvousBackend, "_wait", record_wait)
    backend_of_thread: dict[str, FtrainRendezvousBackend] = {}

    def join(handler):
        backend_of_thread[threading.current_thread().name] = handler._state_holder._backend
        return handler.next_rendezvous()

    first_backend = first._state_holder._backend
    try:
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="node") as pool:
            pending_first = pool.submit(join, first)
            wait_for(lambda: first_backend in entered or pending_first.done(), 20,
                     "the first handler to wait for the second")
            pending_second = pool.submit(join, second)
            infos = [pending_first.result(timeout=30), pending_second.result(timeout=30)]
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
        # Every wait was a long poll of the waiting thread's own handler's state; one of the
        # first handler's ended on the second's join; no handler slept torch's 1 s poll.
        assert waits and all(backend is backend_of_thread[thread] for thread, backend, _ in waits)
        assert True in [changed for _, backend, changed in waits if backend is first_backend]
        assert [s for _, s in stock_delays if s == ftrain_rdzv.SYNC_DELAY_S] == []
    finally:
        for handler in (first, second):
            handler.shutdown()


def test_monitor_checks_read_the_state_at_most_once_a_second_yet_see_a_waiting_node_at_once(
        control_plane, rdzv_id, monkeypatch, token):
    """torchrun's monitor asks num_nodes_waiting() every 0.1 s; waking on a change must not
    turn each of those into a request (torch's one-second state cache stays). Yet a node that
    joins the wait list is seen at once (worker/rendezvous/follow.py), not up to a second
    later: on GPUs (a survivor stuck in NCCL) that second is the whole wait for the restart."""
    monkeypatch.setenv("FTRAIN_JOB_TOKEN", token)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters(backend="ftrain", endpoint=control_plane.url, run_id=rdzv_id,
                                  min_nodes=1, max_nodes=2, local_addr="127.0.0.1",
                                  last_call_timeout=1, keep_alive_interval=60)
    first, second = (create_ftrain_handler(params) for _ in range(2))
    reads: list[float] = []
    get_state = FtrainRendezvousBackend.get_state

    def count(self):
        reads.append(time.monotonic())
        return get_state(self)

    try:
        assert first.next_rendezvous().world_size == 1
        monkeypatch.setattr(FtrainRendezvousBackend, "get_state", count)
        start = time.monotonic()
        checks = 0
        while time.monotonic() - start < 0.8:
            first.num_nodes_waiting()
            checks += 1
            time.sleep(0.05)
        assert checks >= 10 and len(reads) <= 1
        # torch's copy is now kept for a minute, and no keep-alive refreshes it: only the
        # follower can expire it (a behaviour, not a speed: ~0.1 s here; torch's copy is 1 s).
        holder = first._inner._state_holder if hasattr(first, "_inner") else first._state_holder
        holder._cache_duration = 60
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(second.next_rendezvous)
            try:
                wait_for(lambda: first.num_nodes_waiting() == 1, 10, "the first node to see the second")
            finally:
                second.set_closed()  # (ends the second's wait: the test is over)
                with contextlib.suppress(Exception):
                    pending.result(timeout=30)
    finally:
        for handler in (first, second):
            handler.shutdown()


@pytest.mark.own_control_plane
def test_after_a_control_plane_outage_the_group_stays_and_a_joining_node_is_seen(
        control_plane, rdzv_id, token, monkeypatch):
    """Two nodes formed a group; the control plane is stopped for longer than the keep-alive
    window. Meanwhile the monitor's question is answered at once; afterwards both nodes are
    still in the rendezvous (keeping it alive), and a third node that joins is seen waiting,
    as without the outage. (Every heartbeat was stale after it: torch drops such nodes from
    its view, stops their keep-alives, and a joiner then started a round of its own.)"""
    monkeypatch.setenv("FTRAIN_JOB_TOKEN", token)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    params = RendezvousParameters(backend="ftrain", endpoint=control_plane.url, run_id=rdzv_id,
                                  min_nodes=2, max_nodes=3, local_addr="127.0.0.1",
                                  last_call_timeout=1, join_timeout=60, keep_alive_interval=1,
                                  keep_alive_max_attempt=3)
    first, second, third = (create_ftrain_handler(params) for _ in range(3))
    reader = FtrainRendezvousBackend(Transport(control_plane.url, rdzv_id, token))

    def participants() -> set:
        return set(pickle.loads(reader.get_state()[0]).participants)

    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            formed = [pool.submit(h.next_rendezvous) for h in (first, second)]
            assert {f.result(timeout=60).world_size for f in formed} == {2}
            members = participants()
            control_plane.proc.send_signal(signal.SIGSTOP)
            try:
                stopped = time.monotonic()
                while time.monotonic() - stopped < 8:  # the fault itself: > the 3 s window
                    asked = time.monotonic()
                    assert first.num_nodes_waiting() == 0
                    assert time.monotonic() - asked < 10  # short tries, not retry_timeout (60 s)
            finally:
                control_plane.proc.send_signal(signal.SIGCONT)
            # A node joins as soon as the control plane answers again, before the others'
            # keep-alives landed: it saw no outage itself, the control plane tells it of one.
            stopped_for = time.monotonic() - stopped
            wait_for(lambda: first.num_nodes_waiting() == 0, 30, "the control plane to answer again")
            with control_plane.client(token) as client:
                # (its scheduler loop reads the leader's note of contact a moment after it resumes)
                outage = wait_for(lambda: client.get(f"/v1/rdzv/{rdzv_id}/state").json()["outage"], 10,
                                  "the control plane to report its outage")
            assert outage["ended"] - outage["started"] >= stopped_for - 1, outage
            joining = pool.submit(third.next_rendezvous)
            wait_for(lambda: first.num_nodes_waiting() == 1, 20, "the first node to see the third waiting")
            # (each handler reads the state through its own cache: the second may see it a moment later)
            wait_for(lambda: second.num_nodes_waiting() == 1, 20, "the second node to see the third waiting")
            assert participants() == members
            beats = pickle.loads(reader.get_state()[0]).last_heartbeats
            assert set(beats) >= members and min(beats.values()) > datetime.now(UTC) - timedelta(seconds=3)
            # the group restarts with the third node, as torch's agent does on a waiting node
            again = [pool.submit(h.next_rendezvous) for h in (first, second)]
            assert {f.result(timeout=60).world_size for f in [*again, joining]} == {3}
    finally:
        for handler in (first, second, third):
            handler._stop_heartbeats()


# --------------------------------------------------------------------------------------
# Joins merged on the control plane (worker.rdzv_state, service.rendezvous.StateWrites)
# --------------------------------------------------------------------------------------


def test_joins_written_on_one_stale_token_are_all_merged(transports):
    """Eight nodes join from the same (empty) state at once: as compare-and-sets, seven would
    lose and try again; merged, all eight land and the last completes the round."""
    n = 8
    backends = []
    for _ in range(n):
        backend = FtrainRendezvousBackend(transports())
        backend.merge_settings = (n, n, timedelta(seconds=30))
        backends.append(backend)
    nodes = [dynamic_rendezvous._NodeDesc("127.0.0.1", 1000 + i, 0) for i in range(n)]

    def join(i: int):
        state = _RendezvousState()
        state.participants = {nodes[i]: 0}
        state.last_heartbeats = {nodes[i]: datetime.now(UTC)}
        return backends[i].set_state(pickle.dumps(state), None)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(join, range(n)))
    assert all(written for _, _, written in results)
    final = pickle.loads(backends[0].get_state()[0])
    assert final.complete and final.participants == {node: rank for rank, node in enumerate(sorted(nodes))}
    # Every answer holds its own join (and the last ones the complete round).
    assert all(nodes[i] in pickle.loads(results[i][0]).participants for i in range(n))


def test_keep_alives_of_a_formed_round_go_to_etcd_together(transports):
    """Once a round is complete, every node's keep-alive timer reads the state and writes its
    heartbeat (N/5 writes a second, each of the whole N-node state). The control plane sends
    them together, the writes 1 ms a node apart (here 0.2 s): 60 keep-alives over ~0.6 s went to
    etcd in about one write each before; now at most 10. Each is answered with the write that
    carries it; the node that sent none keeps its old heartbeat (it expires by torch's rules)."""
    n, beats, spacing_s = 201, 60, 0.01
    backends = []
    for _ in range(2 + beats):
        backend = FtrainRendezvousBackend(transports())
        backend.merge_settings = (n, n, timedelta(seconds=30))
        backends.append(backend)
    nodes = [dynamic_rendezvous._NodeDesc("127.0.0.1", 2000 + i, 0) for i in range(n)]
    formed = _RendezvousState()
    formed.complete = True
    formed.participants = {node: rank for rank, node in enumerate(nodes)}
    old = datetime.now(UTC) - timedelta(seconds=2)
    formed.last_heartbeats = dict.fromkeys(nodes, old)
    assert backends[0].set_state(pickle.dumps(formed), None)[2]

    def keep_alive(i: int) -> tuple[str, bool, bool]:
        """torch's keep-alive of node i: read, refresh its own heartbeat, write on that token."""
        bits, token = backends[i].get_state()
        state = pickle.loads(bits)
        state.last_heartbeats[nodes[i]] = datetime.now(UTC)
        answer, new_token, written = backends[i].set_state(pickle.dumps(state), token)
        return new_token, written, pickle.loads(answer).last_heartbeats[nodes[i]] > old

    assert keep_alive(1)[1]  # (the control plane now watches the state and knows it is formed)
    with concurrent.futures.ThreadPoolExecutor(beats) as pool:
        pending = []
        for i in range(2, 2 + beats):  # node 0 is dead: it sends none
            pending.append(pool.submit(keep_alive, i))
            time.sleep(spacing_s)  # the timers of a real round fire spread out
        answers = [f.result(timeout=30) for f in pending]
    assert all(written and carried for _, written, carried in answers)
    assert len({token for token, _, _ in answers}) <= 10, answers
    after = pickle.loads(backends[0].get_state()[0]).last_heartbeats
    assert after[nodes[0]] == old and all(after[node] > old for node in nodes[1:2 + beats])


def test_a_round_of_torch_handlers_completes_with_every_rank_once(control_plane, rdzv_id, monkeypatch, token):
    monkeypatch.setenv("FTRAIN_JOB_TOKEN", token)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    n = 12
    params = RendezvousParameters(backend="ftrain", endpoint=control_plane.url, run_id=rdzv_id,
                                  min_nodes=n, max_nodes=n, local_addr="127.0.0.1", join_timeout=60)
    handlers = [ftrain_rdzv.dynamic_handler(params) for _ in range(n)]
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
        assert sorted(i.rank for i in infos) == list(range(n)) and {i.world_size for i in infos} == {n}
    finally:
        for handler in handlers:
            handler._stop_heartbeats()
