"""A c10d `Store` kept by the control plane, for torch's agents: the master address, the
rank assignment, barriers. Workers never use it: with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
rank 0's agent publishes a free port and the workers build their own TCPStore on it.

A blocking read long-polls the server at most its `long_poll_s` per request (the control
plane's, `Transport.long_poll_s`), so a lost
connection is noticed within seconds, not at the store timeout; `read_timeout` (the store
timeout, like the c10d backend's) defaults to 60 s, and torch's barriers set their own
through `store.set_timeout`.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
from pydantic import BaseModel, ValidationError

from .. import torch_internals
from ..protocol import (
    AddRequest,
    AddResult,
    AppendRequest,
    CompareSetRequest,
    DeleteRequest,
    DeleteResult,
    GetRequest,
    GetResult,
    NumKeysResult,
    SetRequest,
    StoreItem,
    ValueResult,
)
from . import marks
from .transport import ControlPlaneUnreachable, Transport

Reply = TypeVar("Reply", bound=BaseModel)

DEFAULT_READ_TIMEOUT_S = 60


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):  # a std::vector<uint8_t> from C++
        return bytes(value)
    raise TypeError(f"store values are bytes or str, not {type(value).__name__}")



class HttpStore(dist.Store):
    """A c10d `Store` kept by the control plane, for torch's agents (not for workers).

    Blocking reads long-poll the server `long_poll_s` at a time until the store timeout,
    then raise `DistStoreError` as TCPStore does. Keep a reference to this object for as long
    as a `PrefixStore` wraps it: the C++ side does not keep the Python object alive.
    """

    def __init__(self, transport: Transport,
                 timeout: timedelta = timedelta(seconds=DEFAULT_READ_TIMEOUT_S)):
        super().__init__()
        self._transport = transport
        self.set_timeout(timeout)

    # -- writes --------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values")
        items = [StoreItem(key=k, value=_bytes(v)) for k, v in zip(keys, values)]
        self._call("POST", "/store/set", SetRequest(items=items))

    def add(self, key: str, amount: int) -> int:
        body = AddRequest(key=key, amount=int(amount), op_id=secrets.token_hex(12))
        return self._read(AddResult, self._call("POST", "/store/add", body)).value

    def append(self, key: str, value: Any) -> None:
        body = AppendRequest(key=key, value=_bytes(value), op_id=secrets.token_hex(12))
        self._call("POST", "/store/append", body)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        body = CompareSetRequest(key=key, expected=_bytes(expected_value), desired=_bytes(desired_value))
        return self._read(ValueResult, self._call("POST", "/store/compare_set", body)).value

    def delete_key(self, key: str) -> bool:
        return self._read(DeleteResult, self._call("POST", "/store/delete", DeleteRequest(key=key))).deleted

    deleteKey = delete_key  # noqa: N815 - the name torch's C++ trampoline calls

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._wait(list(keys), self.timeout, values=True)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait(list(keys), self.timeout if timeout is None else timeout, values=False)

    def check(self, keys: Sequence[str]) -> bool:
        body = GetRequest(keys=list(keys), wait_s=0, values=False)
        return self._read(GetResult, self._call("POST", "/store/get", body)).found

    def num_keys(self) -> int:
        return self._read(NumKeysResult, self._call("GET", "/store/num_keys")).count

    getNumKeys = num_keys  # noqa: N815 - the name torch's C++ trampoline calls

    def has_extended_api(self) -> bool:
        return True  # append, multi_get and multi_set are real operations here

    # -- helpers -------------------------------------------------------------------------

    def _wait(self, keys: list[str], timeout: timedelta, values: bool) -> list[bytes]:
        if not keys:
            return []
        timeout_s = timeout.total_seconds()
        clock = time.monotonic
        deadline = clock() + timeout_s
        while True:
            wait_s = max(0.0, min(self._transport.long_poll_s, deadline - clock()))
            # A connection problem is retried until the read's own deadline: it is the
            # caller's timeout that decides how long to wait, not retry_timeout.
            body = GetRequest(keys=keys, wait_s=wait_s, values=values)
            result = self._read(GetResult, self._call("POST", "/store/get", body,
                                                      deadline=max(deadline, clock() + 1.0), wait_s=wait_s))
            if result.found:
                return result.values or []
            if clock() >= deadline:
                raise dist.DistStoreError(
                    f"wait timeout after {int(timeout_s * 1000)}ms, keys: {', '.join(keys)} "
                    f"(rendezvous {self._transport.rdzv_id} on {self._transport.base_url})")

    def _call(self, method: str, path: str, body: Any = None, **kwargs) -> dict:
        try:
            return self._transport.call(method, path, body, **kwargs)
        except ControlPlaneUnreachable as exc:
            raise dist.DistNetworkError(str(exc)) from exc
        finally:
            marks.mark("store", path=path)

    @staticmethod
    def _read(model: type[Reply], result: dict) -> Reply:
        try:
            return model.model_validate(result)
        except ValidationError as exc:
            raise dist.DistStoreError(f"the control plane sent a malformed {model.__name__}: {exc}") from exc


def publish_master_in_one_call() -> None:
    """After each round torch's handler publishes the workers' master address and port through
    the agents' store (`RendezvousStoreInfo.build`): rank 0 sets the two keys one by one and
    reads both back, every other node reads them one by one; four and two round trips to the
    control plane, between the round's completion and the workers' start. Here rank 0 sets both
    in one `multi_set` (and keeps what it set), the others read both in one `multi_get`: the same
    keys and values, one round trip each. Process-wide (dynamic_rendezvous's module-level name),
    for stores with the extended API only; others keep torch's `build`."""
    torch_internals.patch(torch_internals.STORE_INFO, _one_call_store_info)


def _one_call_store_info(stock: type) -> type:
    """torch's `RendezvousStoreInfo` (`stock`) with a `build` of one store call per node."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    keys = [stock.MASTER_ADDR_KEY, stock.MASTER_PORT_KEY]

    class OneCallStoreInfo(stock):
        @staticmethod
        def build(rank: int, store: dist.Store, local_addr: str | None,
                  server_port: int | None = None) -> Any:
            if not store.has_extended_api():
                return stock.build(rank, store, local_addr, server_port)
            if rank == 0:
                addr = local_addr or socket.getfqdn()
                port = server_port or get_free_port()
                store.multi_set(keys, [addr.encode(), str(port).encode()])
                return stock(master_addr=addr, master_port=port)
            addr_b, port_b = store.multi_get(keys)
            return stock(master_addr=_bytes(addr_b).decode(), master_port=int(_bytes(port_b).decode()))

    return OneCallStoreInfo
