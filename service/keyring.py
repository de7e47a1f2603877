"""The control plane's own secret, kept outside etcd, and what is derived from or kept with it.

etcd holds no secret in the clear. Two kinds of secret pass through the
control plane:

- **Job tokens.** A job's token is derived, never stored: an HMAC-SHA256, under the
  control-plane secret, of the job's id and a random nonce kept in its record
  (`JobRecord.token_nonce`). Whoever reads etcd learns the nonce, which is worth nothing
  without the secret; every control-plane replica computes the same token from the same
  secret file. The nonce makes a token unique even if a job id is reused after retention
  deleted the first job. The token is per job, not per attempt: a stale attempt is fenced
  by the attempt number its requests carry (`StaleAttempt`).
- **Secret env values** (`JobSpec.secret_env`). They arrive with the submit and are kept
  in one 0600 file per job under `<secret dir>/env/`, never in etcd: the job record keeps
  only their names and the nonce that names the file. The heartbeat that hands a node its
  assignment reads them from there; retention deletes the file with the job. etcd has no
  encryption we could use without a new dependency, and the secret dir is already where
  the key lives, so a reader of one has the other in any design.

The secret dir (`--secret-dir`, default `.ftrain/secrets`) is 0700 and its files 0600.
Several control-plane replicas share one secret dir (the same path on shared storage, as
the log root), or at least identical copies of `key` and a shared `env/`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

KEY_BYTES = 32


class Keyring:
    """The control-plane secret and the secret env values of jobs (files under `root`)."""

    def __init__(self, key: bytes, root: Path | None):
        if len(key) < KEY_BYTES:
            raise ValueError(f"the control-plane secret must be at least {KEY_BYTES} bytes")
        self._key = key
        self.root = root
        self._in_memory: dict[str, dict[str, str]] = {}  # the secret env of an ephemeral keyring
        self._read: dict[str, dict[str, str]] = {}  # files read: they never change once written

    @classmethod
    def load(cls, root: str | Path) -> Keyring:
        """The keyring of the secret dir `root`: its `key`, made (0600, random) on first use."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        path = root / "key"
        if not path.exists():
            cls._make_key(path)
        os.chmod(path, 0o600)
        key = bytes.fromhex(path.read_text().strip())
        return cls(key, root)

    @staticmethod
    def _make_key(path: Path) -> None:
        """Make the key file `path` whole or not at all: written under a private name, then
        linked into place, so that replicas started together all read one complete key (an
        O_EXCL create would let a second replica read the first one's still empty file)."""
        draft = path.with_name(f".key.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_bytes(KEY_BYTES).hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(draft, path)
            except FileExistsError:
                pass  # another replica made it first: its key is the one
        finally:
            draft.unlink()

    @classmethod
    def ephemeral(cls) -> Keyring:
        """A keyring that lives in memory only (unit tests on an in-memory store)."""
        return cls(secrets.token_bytes(KEY_BYTES), None)

    def _mac(self, purpose: str, *parts: str) -> bytes:
        msg = "\0".join((purpose, *parts)).encode()
        return hmac.new(self._key, msg, hashlib.sha256).digest()

    def job_token(self, job_id: str, nonce: str) -> str:
        """The token of the job `job_id` with this nonce (given to its workers)."""
        return base64.urlsafe_b64encode(self._mac("job-token", job_id, nonce)).decode().rstrip("=")

    def fingerprint(self, values: dict[str, str]) -> str:
        """A keyed digest of secret values: tells two submits apart (idempotency) without
        putting an unkeyed hash of a secret, which could be guessed, into etcd."""
        return self._mac("secret-env", json.dumps(values, sort_keys=True)).hex()

    # secret env values: one 0600 file per job, named by its nonce

    def _env_path(self, nonce: str) -> Path:
        assert self.root is not None
        if not nonce.isalnum():
            raise ValueError(f"bad nonce {nonce!r}")
        return self.root / "env" / nonce

    def put_env(self, nonce: str, values: dict[str, str]) -> None:
        """Keep a job's secret env values (atomically: a reader sees all of them or none)."""
        if self.root is None:
            self._in_memory[nonce] = dict(values)
            return
        path = self._env_path(nonce)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{nonce}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(values, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def get_env(self, nonce: str) -> dict[str, str]:
        """A job's secret env values; {} where the file is gone (the job was deleted)."""
        if self.root is None:
            return dict(self._in_memory.get(nonce, {}))
        if nonce not in self._read:
            try:
                self._read[nonce] = json.loads(self._env_path(nonce).read_text())
            except FileNotFoundError:
                return {}
        return dict(self._read[nonce])

    def delete_env(self, nonce: str) -> None:
        self._read.pop(nonce, None)
        if self.root is None:
            self._in_memory.pop(nonce, None)
            return
        try:
            self._env_path(nonce).unlink()
        except FileNotFoundError:
            pass


def new_nonce() -> str:
    return secrets.token_hex(16)
