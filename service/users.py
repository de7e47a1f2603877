"""Named users in etcd: created by the admin, each with a token that is stored only hashed.

A token is 32 random bytes (`secrets.token_urlsafe(32)`), so an unsalted SHA-256 of it is
as good as any password hash: there is nothing to guess. Two keys per user, written and
deleted together: `users/<name>` (the record) and `user-tokens/<sha256>` (the user's name and
id, JSON), so that telling who holds a token is one read, not a scan.

A user's id is minted when it is created and never given again: jobs store it
(`JobRecord.owner_id`), so a user removed and added again under the same name is a new
user, who cannot cancel the old one's jobs nor replay its idempotency keys.

A control plane keeps the `user-tokens/` keys in memory, fed by a watch (`follow`), so a
named user's request is not an etcd read each: a token the cache has is answered from it;
one it has not (a user added through another replica a moment ago, or no user at all) is
read from etcd, so no valid token is ever refused for the cache's sake. A removed user's
token goes from this replica's cache when `remove` commits (refused at once here), and from
every other replica's when the watch brings the deletion (milliseconds later).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass

from service.errors import Conflict, HistoryCompacted, StoreUnavailable, UserNotFound
from service.keys import Keys
from service.models import UserRecord
from service.store.api import Delete, KeyValue, Put

log = logging.getLogger(__name__)

_GONE = 2**63  # the revision noted for a token this replica deleted: no older event brings it back


def new_user_id() -> str:
    """A user's id: 96 random bits, never given twice."""
    return "u-" + secrets.token_hex(12)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class UserRef:
    """Who holds a token: the user's name, and its id (None: a user stored before ids)."""

    name: str
    id: str | None = None

    def encode(self) -> bytes:
        return json.dumps({"name": self.name, "id": self.id}).encode()

    @classmethod
    def decode(cls, value: bytes) -> UserRef:
        if not value.startswith(b"{"):  # written before ids: the name alone
            return cls(value.decode())
        data = json.loads(value)
        return cls(data["name"], data.get("id"))


class UserStore:
    def __init__(self, kv: KeyValue, keys: Keys, clock=time.time):
        self.kv = kv
        self.keys = keys
        self.clock = clock
        self._names: dict[str, UserRef] = {}  # token digest -> its user, as the watch has them
        self._revs: dict[str, int] = {}  # token digest -> the revision its entry came at
        self._ready = False  # loaded and followed: `_names` may answer

    async def add(self, name: str, team: str | None = None) -> tuple[UserRecord, str]:
        """A new user (in `team`, if given) and its token (returned this once); Conflict if
        the name is taken."""
        token = secrets.token_urlsafe(32)
        user = UserRecord(name=name, id=new_user_id(), token_sha256=token_digest(token),
                          created_at=self.clock(), team=team)
        user_key, token_key = self.keys.user(name), self.keys.user_token(user.token_sha256)
        if not await self.kv.commit({user_key: 0, token_key: 0},
                                    [Put(user_key, user.model_dump_json().encode()),
                                     Put(token_key, UserRef(name, user.id).encode())]):
            raise Conflict(f"a user named {name!r} exists; remove it first to give it a new token")
        return user, token

    async def list(self) -> list[UserRecord]:
        return [UserRecord.model_validate_json(e.value)
                async for e in self.kv.scan_prefix(self.keys.users)]

    async def remove(self, name: str) -> None:
        """Delete the user and its token (its jobs stay, owned by its id: a user added
        again under the name is another user)."""
        while True:
            entry = await self.kv.get(self.keys.user(name))
            if entry is None:
                raise UserNotFound(name)
            user = UserRecord.model_validate_json(entry.value)
            if await self.kv.commit({self.keys.user(name): entry.mod_revision},
                                    [Delete(self.keys.user(name)),
                                     Delete(self.keys.user_token(user.token_sha256))]):
                # Refused here at once; a watch event of before the deletion, still on its way,
                # does not bring it back (a token is never given again).
                self._names.pop(user.token_sha256, None)
                self._revs[user.token_sha256] = _GONE
                return

    async def who(self, token: str) -> UserRef | None:
        """The user holding `token`, or None: from the cache when it has the token, else
        from etcd."""
        digest = token_digest(token)
        if (user := self.cached(digest)) is not None:
            return user
        entry = await self.kv.get(self.keys.user_token(digest))
        return None if entry is None else UserRef.decode(entry.value)

    def cached(self, digest: str) -> UserRef | None:
        """The user whose token has this digest, if the cache has it (no I/O)."""
        return self._names.get(digest) if self._ready else None

    async def follow(self) -> None:
        """Keep the cache of tokens: load them, then apply the watch's changes; load again
        after a broken or compacted watch (meanwhile `who` reads etcd). Runs until cancelled."""
        prefix = self.keys.user_token("")
        revision: int | None = None  # every change up to it is applied
        while True:
            try:
                if revision is None:
                    revision = await self.kv.revision()
                    entries = [e async for e in self.kv.scan_prefix(prefix)]
                    gone = {d for d, r in self._revs.items() if r == _GONE}
                    self._names = {e.key[len(prefix):]: UserRef.decode(e.value) for e in entries
                                   if e.key[len(prefix):] not in gone}
                    self._revs = {**{e.key[len(prefix):]: e.mod_revision for e in entries},
                                  **dict.fromkeys(gone, _GONE)}
                    self._ready = True
                async for ev in self.kv.watch_prefix(prefix, revision + 1):
                    self._apply(ev.key[len(prefix):], ev.value, ev.mod_revision)
                    revision = ev.mod_revision
                continue  # the session ended quietly: watch on from where it was
            except HistoryCompacted:
                revision = None
                continue
            except StoreUnavailable as exc:
                log.debug("user tokens: %s", exc.message)
            revision, self._ready = None, False  # meanwhile `who` reads etcd
            await asyncio.sleep(0.5)

    def _apply(self, digest: str, value: bytes | None, revision: int) -> None:
        if revision < self._revs.get(digest, 0):
            return
        self._revs[digest] = revision
        if value is None:
            self._names.pop(digest, None)
        else:
            self._names[digest] = UserRef.decode(value)
