"""Named users and the control-plane keyring, without a process (MemoryStore, tmp files).

The real thing (etcd, uvicorn, an agent and a torchrun worker) is
tests/integration/test_users_and_secrets.py.
"""

from __future__ import annotations

import asyncio
import stat
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from service.context import Context
from service.errors import Conflict, UserNotFound
from service.keyring import Keyring
from service.models import JobRecord, JobSpec
from service.settings import Settings
from service.store.memory import MemoryStore
from service.users import token_digest
from tests.helpers.tasks import until


async def stored(ctx: Context) -> bytes:
    """Every key and value in the store, as one blob."""
    return b"\n".join([e.key.encode() + b"=" + e.value async for e in ctx.kv.scan_prefix("/")])


def everything_stored(ctx: Context) -> bytes:
    return asyncio.run(stored(ctx))


# ------------------------------------------------------------------ the keyring

def test_a_job_token_is_the_same_from_every_load_of_the_secret_dir_and_differs_per_job(tmp_path):
    first, again = Keyring.load(tmp_path / "s"), Keyring.load(tmp_path / "s")
    token = first.job_token("j-abc123", "n1")
    assert again.job_token("j-abc123", "n1") == token and len(token) >= 40
    assert first.job_token("j-abc123", "n2") != token  # a reused id with a new nonce
    assert first.job_token("j-abc124", "n1") != token
    assert Keyring.load(tmp_path / "other").job_token("j-abc123", "n1") != token


def test_replicas_that_start_together_read_one_whole_key(tmp_path):
    # Replicas of `ftrain up --replicas N` load the secret dir at the same moment: none may
    # read a key file another is still writing, and all must derive the same tokens.
    start = threading.Barrier(16)

    def load():
        start.wait()
        return Keyring.load(tmp_path).job_token("job-1", "nonce")

    with ThreadPoolExecutor(16) as pool:
        tokens = list(pool.map(lambda _: load(), range(16)))
    assert len(set(tokens)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key"]  # no draft is left behind


def test_the_secret_dir_is_0700_and_its_files_0600(tmp_path):
    ring = Keyring.load(tmp_path / "s")
    ring.put_env("n1", {"API_KEY": "v"})
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    for path in (tmp_path / "s" / "key", tmp_path / "s" / "env" / "n1"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_secret_env_values_are_kept_read_by_another_replica_and_deleted(tmp_path):
    Keyring.load(tmp_path / "s").put_env("n1", {"API_KEY": "v"})
    other = Keyring.load(tmp_path / "s")
    assert other.get_env("n1") == {"API_KEY": "v"}
    other.delete_env("n1")
    assert other.get_env("n1") == {} and Keyring.load(tmp_path / "s").get_env("n1") == {}
    with pytest.raises(ValueError):
        other.get_env("../key")


def test_the_fingerprint_of_secret_values_is_keyed():
    a, b = Keyring.ephemeral(), Keyring.ephemeral()
    assert a.fingerprint({"K": "v"}) == a.fingerprint({"K": "v"}) != a.fingerprint({"K": "w"})
    assert a.fingerprint({"K": "v"}) != b.fingerprint({"K": "v"})


# ------------------------------------------------------------------ jobs

def test_a_stored_job_holds_neither_its_token_nor_its_secret_values():
    ctx = Context.wire(Settings(), MemoryStore())
    spec = JobSpec(name="s", command=["true"], env={"LR": "1"}, secret_env={"API_KEY": "hunter2-xyz"})
    job, _ = asyncio.run(ctx.jobs.create(spec, owner="alice"))
    assert job.owner == "alice" and job.spec.secret_env == {} and job.secret_env_names == ["API_KEY"]
    stored = everything_stored(ctx)
    assert b"hunter2-xyz" not in stored and ctx.job_token(job).encode() not in stored
    assert job.view().secret_env_names == ["API_KEY"] and job.view().spec.secret_env == {}


def test_a_record_written_before_derived_tokens_keeps_its_token():
    ctx = Context.wire(Settings(), MemoryStore())
    old = JobRecord.model_validate({"id": "j-abc123", "spec": {"name": "j", "command": ["true"]},
                                    "created_at": 1, "updated_at": 1, "token": "old-token"})
    assert ctx.job_token(old) == "old-token" and old.owner == "admin"


def test_the_same_idempotency_key_with_other_secret_values_is_a_conflict():
    ctx = Context.wire(Settings(), MemoryStore())
    spec = JobSpec(name="s", command=["true"], secret_env={"K": "one-value"})

    async def main():
        fp = ctx.keyring.fingerprint
        first, created = await ctx.jobs.create(spec, "key", fingerprint=fp(spec.secret_env))
        again, replayed = await ctx.jobs.create(spec, "key", fingerprint=fp(spec.secret_env))
        assert created and not replayed and again.id == first.id
        other = spec.model_copy(update={"secret_env": {"K": "two-value"}})
        with pytest.raises(Conflict):
            await ctx.jobs.create(other, "key", fingerprint=fp(other.secret_env))

    asyncio.run(main())


@pytest.mark.parametrize("spec,error", [
    ({"env": {"K": "a"}, "secret_env": {"K": "b"}}, "K in both env and secret_env"),
    ({"secret_env": {"FTRAIN_JOB_TOKEN": "x"}}, "is set by ftrain"),
    ({"secret_env": {"1BAD": "x"}}, "not a valid variable name"),
])
def test_a_bad_secret_env_is_refused_with_a_reason(spec, error):
    with pytest.raises(ValidationError) as err:
        JobSpec(name="s", command=["true"], **spec)
    assert error in str(err.value)


# ------------------------------------------------------------------ users

def test_a_user_is_found_by_its_token_which_is_stored_only_hashed():
    ctx = Context.wire(Settings(), MemoryStore())

    async def main():
        user, token = await ctx.users.add("alice")
        assert (await ctx.users.who(token)).name == "alice" and await ctx.users.who(token + "x") is None
        blob = await stored(ctx)
        assert token.encode() not in blob and token_digest(token).encode() in blob
        with pytest.raises(Conflict):
            await ctx.users.add("alice")
        assert [u.name for u in await ctx.users.list()] == ["alice"]
        await ctx.users.remove("alice")
        assert await ctx.users.who(token) is None and await stored(ctx) == b""
        with pytest.raises(UserNotFound):
            await ctx.users.remove("alice")

    asyncio.run(main())


def test_tokens_are_answered_from_the_watch_fed_cache_and_a_removal_takes_effect_at_once():
    """`UserStore.follow`: a known token costs no etcd read; a token the cache has not yet
    (added through another replica a moment ago) is read from etcd; a removal here is
    refused at once, and one through another replica once the watch brings it."""
    kv = MemoryStore()
    ctx, other = Context.wire(Settings(), kv), Context.wire(Settings(), kv)

    async def main():
        _, alice = await ctx.users.add("alice")
        follow = asyncio.create_task(ctx.users.follow())
        try:
            await until(lambda: getattr(ctx.users.cached(token_digest(alice)), "name", None) == "alice", "alice in the cache")
            reads: list[str] = []
            get = kv.get

            async def counting_get(key):
                reads.append(key)
                return await get(key)

            kv.get = counting_get
            assert (await ctx.users.who(alice)).name == "alice" and reads == []  # from the cache
            _, bob = await other.users.add("bob")  # through another replica
            assert (await ctx.users.who(bob)).name == "bob"  # cached or read: never refused
            await until(lambda: getattr(ctx.users.cached(token_digest(bob)), "name", None) == "bob", "bob in the cache")
            await ctx.users.remove("alice")  # here: at once, no watch event waited for
            assert ctx.users.cached(token_digest(alice)) is None and await ctx.users.who(alice) is None
            await other.users.remove("bob")  # there: once the watch brings it
            await until(lambda: ctx.users.cached(token_digest(bob)) is None, "bob gone from the cache")
            assert await ctx.users.who(bob) is None
        finally:
            follow.cancel()

    asyncio.run(main())
