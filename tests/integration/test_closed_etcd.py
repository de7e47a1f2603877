"""etcd is closed: its own authentication, a control plane that keeps its token fresh.

A closed etcd refuses every request without credentials (another local user who finds the
port reads nothing); `EtcdStore` authenticates when it connects and again when etcd has
forgotten its token (after --auth-token-ttl seconds unused, or a restart); `ftrain serve`
connects with --etcd-user/--etcd-password-file.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import time
import urllib.error
import urllib.request

import pytest

from service.embedded import EtcdProcess
from service.errors import StoreUnavailable
from service.store.etcd import EtcdStore
from tests.helpers.elastic import job_spec, submit, wait_state
from tests.helpers.processes import ControlPlane, wait_for

TOKEN_TTL_S = 1
# etcd checks its simple tokens' TTL once a second; idle this long and every token is gone.
PAST_TOKEN_TTL_S = TOKEN_TTL_S + 1.5


@pytest.fixture
def closed_etcd(tmp_path):
    """A real etcd with authentication on (user root) and auth tokens that live 1 s unused."""
    server = EtcdProcess(tmp_path / "etcd-data", log_path=tmp_path / "etcd.log",
                         root_password="s3cret-pw", auth_token_ttl_s=TOKEN_TTL_S).start()
    yield server
    server.kill()
    shutil.rmtree(server.data_dir, ignore_errors=True)


def post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_closed_etcd_refuses_anyone_without_the_password(closed_etcd):
    e = closed_etcd
    status, body = post(f"{e.endpoint}/v3/kv/range", {"key": "Lw==", "range_end": "MA=="})
    assert status == 400 and "user name is empty" in body, (status, body)
    status, body = post(f"{e.endpoint}/v3/kv/put", {"key": "Lw==", "value": "eA=="})
    assert status == 400 and "user name is empty" in body, (status, body)
    status, body = post(f"{e.endpoint}/v3/auth/authenticate", {"name": "root", "password": "guess"})
    assert status == 400 and "authentication failed" in body, (status, body)

    async def main() -> None:
        anonymous = EtcdStore(e.endpoint, timeout_s=2)
        with pytest.raises(StoreUnavailable, match="requires authentication.*--etcd-user"):
            await anonymous.get("/ftrain/x")
        with pytest.raises(StoreUnavailable, match="requires authentication"):
            async for _ in anonymous.watch_prefix("/ftrain/", 1):
                pass
        wrong = EtcdStore(e.endpoint, timeout_s=2, user="root", password="guess")
        with pytest.raises(StoreUnavailable, match="refused the user 'root'.*--etcd-password-file"):
            await wrong.get("/ftrain/x")
        right = EtcdStore(e.endpoint, timeout_s=2, user=e.user, password=e.root_password)
        await right.put("/ftrain/x", b"1")
        assert (await right.get("/ftrain/x")).value == b"1"
        for client in (anonymous, wrong, right):
            await client.close()

    asyncio.run(main())


def test_a_restart_finds_auth_on_and_refuses_another_password(closed_etcd):
    e = closed_etcd
    e.stop()
    e.start()  # the same password: auth is on already, nothing to do
    assert post(f"{e.endpoint}/v3/auth/authenticate", {"name": "root", "password": e.root_password})[0] == 200
    e.stop()
    other = EtcdProcess(e.data_dir, client_port=e.client_port, peer_port=e.peer_port,
                        log_path=e.log_path, root_password="another")
    with pytest.raises(RuntimeError, match="refuses the root password"):
        other.start()
    assert other.proc is not None and other.proc.poll() is not None  # stopped, not left running


def test_the_store_authenticates_again_once_etcd_forgot_its_token(closed_etcd):
    """Idle past the token's TTL: a read, a range read and a new watch all work again."""
    e = closed_etcd

    async def main() -> None:
        store = EtcdStore(e.endpoint, timeout_s=2, user=e.user, password=e.root_password)
        start = await store.revision() + 1
        await store.put("/t/a", b"1")
        await asyncio.sleep(PAST_TOKEN_TTL_S)  # the idle period under test
        assert (await store.get("/t/a")).value == b"1"
        await asyncio.sleep(PAST_TOKEN_TTL_S)
        assert [x.key for x in await store.get_range("/t/", limit=10)] == ["/t/a"]
        await asyncio.sleep(PAST_TOKEN_TTL_S)
        # A watch created on a stream whose token expired is refused (watch id -1), silently
        # in aetcd; the store must notice, authenticate again and really watch.
        seen = []
        async for ev in store.watch_prefix("/t/", start, max_session_s=10):
            seen.append(ev.key)
            if ev.key == "/t/a":
                await store.put("/t/b", b"2")  # a change after the watch began
            else:
                break
        assert seen == ["/t/a", "/t/b"], seen
        e.stop()  # a restarted etcd knows no token at all
        e.start()
        assert (await store.get("/t/b")).value == b"2"
        await store.close()

    asyncio.run(main())


def add_prefix_user(e: EtcdProcess, name: str, password: str, prefix: str) -> None:
    """What docs/operations.md tells an operator to do: a user whose one role may
    read and write ftrain's key prefix, nothing else."""
    def b64(s: str) -> str:
        return base64.b64encode(s.encode()).decode()

    status, body = post(f"{e.endpoint}/v3/auth/authenticate", {"name": "root", "password": e.root_password})
    assert status == 200, body
    token = json.loads(body)["token"]
    for path, req in [("auth/user/add", {"name": name, "password": password}),
                      ("auth/role/add", {"name": name}),
                      ("auth/role/grant", {"name": name, "perm": {
                          "permType": "READWRITE", "key": b64(prefix),
                          "range_end": b64(prefix[:-1] + chr(ord(prefix[-1]) + 1))}}),
                      ("auth/user/grant", {"user": name, "role": name})]:
        request = urllib.request.Request(f"{e.endpoint}/v3/{path}", data=json.dumps(req).encode(),
                                         method="POST", headers={"Authorization": token})
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.status == 200


def test_a_control_plane_idle_past_the_token_ttl_keeps_serving(closed_etcd, tmp_path):
    """As a user that may use only ftrain's key prefix (not root)."""
    e = closed_etcd
    add_prefix_user(e, "ftrain", "ftrain-pw", "/ftrain/")
    password_file = tmp_path / "etcd-password"
    password_file.write_text("ftrain-pw\n")
    password_file.chmod(0o600)
    cp = ControlPlane(e.endpoint, tmp_path / "cp", env={
        "FTRAIN_ETCD_USER": "ftrain", "FTRAIN_ETCD_PASSWORD_FILE": str(password_file),
        # idle for real: no scheduler pass, and the leader's lease renewed only every 5 s
        # (a quarter of its TTL), to keep the token in use meanwhile
        "FTRAIN_SCHEDULER_INTERVAL_S": "60", "FTRAIN_LEADER_TTL_S": "20"}).start()
    try:
        with cp.client() as api:
            first = submit(api, job_spec("before"))
            log_path = cp.workdir / f"control-plane-{cp.port}.log"
            time.sleep(PAST_TOKEN_TTL_S)  # the idle period under test
            assert api.get("/readyz").status_code == 200
            second = submit(api, job_spec("after"))
            assert {j["id"] for j in api.get("/v1/jobs").json()["items"]} >= {first, second}
            wait_state(api, second, "PENDING", timeout_s=10)
            api.post(f"/v1/jobs/{second}/cancel").raise_for_status()
            wait_state(api, second, "CANCELLED", timeout_s=10)
            wait_for(lambda: "authenticating again" in log_path.read_text(), 10,
                     "the control plane to say it authenticated again")
    finally:
        cp.stop()
