"""Named users in etcd: created by the admin, each with a token that is stored only hashed.

A token is 32 random bytes (`secrets.token_urlsafe(32)`), so an unsalted SHA-256 of it is
as good as any password hash: there is nothing to guess. Two keys per user, written and
deleted together: `users/<name>` (the record) and `user-tokens/<sha256>` (the name), so
that telling who holds a token is one read, not a scan.
"""

from __future__ import annotations

import hashlib
import secrets
import time

from service.errors import Conflict, UserNotFound
from service.keys import Keys
from service.models import UserRecord
from service.store.api import Delete, KeyValue, Put


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class UserStore:
    def __init__(self, kv: KeyValue, keys: Keys, clock=time.time):
        self.kv = kv
        self.keys = keys
        self.clock = clock

    async def add(self, name: str) -> tuple[UserRecord, str]:
        """A new user and its token (returned this once); Conflict if the name is taken."""
        token = secrets.token_urlsafe(32)
        user = UserRecord(name=name, token_sha256=token_digest(token), created_at=self.clock())
        user_key, token_key = self.keys.user(name), self.keys.user_token(user.token_sha256)
        if not await self.kv.commit({user_key: 0, token_key: 0},
                                    [Put(user_key, user.model_dump_json().encode()),
                                     Put(token_key, name.encode())]):
            raise Conflict(f"a user named {name!r} exists; remove it first to give it a new token")
        return user, token

    async def list(self) -> list[UserRecord]:
        return [UserRecord.model_validate_json(e.value)
                async for e in self.kv.scan_prefix(self.keys.users)]

    async def remove(self, name: str) -> None:
        """Delete the user and its token (its jobs stay, still owned by the name)."""
        while True:
            entry = await self.kv.get(self.keys.user(name))
            if entry is None:
                raise UserNotFound(name)
            user = UserRecord.model_validate_json(entry.value)
            if await self.kv.commit({self.keys.user(name): entry.mod_revision},
                                    [Delete(self.keys.user(name)),
                                     Delete(self.keys.user_token(user.token_sha256))]):
                return

    async def who(self, token: str) -> str | None:
        """The name of the user holding `token`, or None."""
        entry = await self.kv.get(self.keys.user_token(token_digest(token)))
        return None if entry is None else entry.value.decode()
