"""Every private part of torch that ftrain uses, named, checked and patched in this one module.

ftrain runs torch's own elastic agent and dynamic rendezvous handler (the design: stock
`torchrun --rdzv-backend=ftrain`) and changes a few of their internals to recover faster:
a long poll instead of a one-second sleep, a monitor woken by news, a broken group stopped
without SIGTERM's grace. Each private name, patched attribute and instance attribute it
relies on is a `Private` in `USES`, with one line on why. `require()` checks all of them
against the installed torch once per process, by their shape rather than by the version
string (the name is there, a function takes the parameters ftrain passes, a method of the
class sets the attribute ftrain reads), and raises one `TorchChanged` that names every one
that changed. The rest of ftrain reaches torch's internals only through the functions here,
so a torch upgrade breaks in this file, with one message, when a handler is made, and not
somewhere in a rendezvous while a job runs.

Tested with torch 2.11 (GPUs, CUDA, NCCL) and 2.13 (CPU, gloo); pyproject.toml's range says
the same. A torch outside that range whose internals still have the expected shape runs,
with a warning.

Patches are idempotent: `patch` marks what it puts in place with the maker that made it and
the attribute it replaced, so a second call from the same place changes nothing, and two
places may wrap one attribute (the broken-group stop, then the bench's phase marks).
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import importlib
import inspect
import logging
import re
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TESTED = ((2, 11), (2, 13))  # (major, minor), first and last
TESTED_TEXT = "torch 2.11-2.13"
TESTED_SPEC = "torch>=2.11,<2.14"  # pyproject.toml's dependency, for the error's advice

DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
MP_API = "torch.distributed.elastic.multiprocessing.api"
AGENT_API = "torch.distributed.elastic.agent.server.api"
LOCAL_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent"

_MISSING = object()
_MARK = "_ftrain_patch"  # on a replacement: (the maker's name, what it replaced)
_patch_lock = threading.Lock()


class TorchChanged(RuntimeError):
    """A private part of torch that ftrain uses is missing or changed in the installed torch."""


Shape = Callable[[Any], "str | None"]  # what is wrong with a value, or None


@dataclass(frozen=True)
class Private:
    """One private part of torch that ftrain uses: `path` in `module` (a module attribute,
    `Class.attr`, or an attribute a method of the class sets on its instances)."""

    module: str
    path: str
    why: str
    shape: Shape | None = None
    on_instances: bool = False  # set by a method of the class (`self.x = ...`), not on the class
    nccl_only: bool = False  # compiled only into torch built with NCCL (CUDA): no problem elsewhere

    @property
    def label(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.path}"

    @property
    def attr(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    def owner(self, import_module: Callable[[str], Any] = importlib.import_module) -> Any:
        """The module or class that holds the attribute (raises LookupError with what is missing)."""
        try:
            obj = import_module(self.module)
        except ImportError as exc:
            raise LookupError(f"{self.module} does not import ({exc})") from exc
        for part in self.path.split(".")[:-1]:
            obj = getattr(obj, part, _MISSING)
            if obj is _MISSING:
                raise LookupError(f"{self.module} has no {part}")
        return obj

    def applies(self, import_module: Callable[[str], Any] = importlib.import_module) -> bool:
        """Whether the installed torch has this part at all (an NCCL-only one: where torch has NCCL)."""
        return not self.nccl_only or _has_nccl(import_module)

    def problem(self, import_module: Callable[[str], Any] = importlib.import_module) -> str | None:
        """What is wrong with this part in the torch `import_module` imports, or None."""
        if not self.applies(import_module):
            return None
        try:
            owner = self.owner(import_module)
        except LookupError as exc:
            return str(exc)
        if self.on_instances:
            return None if _assigned_by(owner, self.attr) else \
                f"no method of {owner.__name__} sets self.{self.attr} any more"
        value = getattr(owner, self.attr, _MISSING)
        if value is _MISSING:
            return f"{getattr(owner, '__name__', self.module)} has no {self.attr} any more"
        return None if self.shape is None else self.shape(value)


def _has_nccl(import_module: Callable[[str], Any]) -> bool:
    try:
        return bool(import_module("torch.distributed").is_nccl_available())
    except (ImportError, AttributeError):
        return False


# ------------------------------------------------------------------ shapes
def takes(*params: str) -> Shape:
    """A callable whose parameters begin with `params` (by name)."""

    def shape(value: Any) -> str | None:
        if not callable(value):
            return f"it is a {type(value).__name__}, not a function"
        try:
            names = list(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            return "its signature cannot be read"
        if names[:len(params)] != list(params):
            return f"it takes ({', '.join(names)}), not ({', '.join(params)}, ...)"
        return None

    return shape


def refers_to(*names: str) -> Shape:
    """A function whose code uses each of `names` (a global it calls, an attribute it reads)."""

    def shape(value: Any) -> str | None:
        code = getattr(value, "__code__", None)
        if code is None:
            return "it is not a Python function any more"
        missing = [n for n in names if n not in _names_in(code)]
        return f"it no longer uses {', '.join(missing)}" if missing else None

    return shape


def class_refers_to(name: str) -> Shape:
    """A class one of whose methods uses the global `name` (so replacing that global matters)."""

    def shape(value: Any) -> str | None:
        if not inspect.isclass(value):
            return f"it is a {type(value).__name__}, not a class"
        codes = [f.__code__ for f in _functions_of(value)]
        return None if any(name in _names_in(c) for c in codes) else f"no method of it uses {name} any more"

    return shape


def dataclass_with(*fields: str) -> Shape:
    def shape(value: Any) -> str | None:
        if not dataclasses.is_dataclass(value):
            return "it is not a dataclass any more"
        have = [f.name for f in dataclasses.fields(value)]
        return None if have == list(fields) else f"its fields are {have}, not {list(fields)}"

    return shape


def instances_have(*attrs: str) -> Shape:
    """A class whose new instance has exactly the attributes `attrs`."""

    def shape(value: Any) -> str | None:
        try:
            have = set(vars(value()))
        except Exception as exc:  # noqa: BLE001 - any failure is the change being reported
            return f"a new one cannot be made ({type(exc).__name__}: {exc})"
        return None if have == set(attrs) else f"its attributes are {sorted(have)}, not {sorted(attrs)}"

    return shape


def all_of(*shapes: Shape) -> Shape:
    def shape(value: Any) -> str | None:
        return next((p for s in shapes if (p := s(value)) is not None), None)

    return shape


def _is_time_module(value: Any) -> str | None:
    import time

    return None if value is time else "it is no longer the time module"


def _is_a_property(value: Any) -> str | None:
    return None if isinstance(value, property) else "it is no longer a property"


def _store_info(value: Any) -> str | None:
    if not inspect.isclass(value):
        return "it is not a class any more"
    if not all(isinstance(getattr(value, k, None), str) for k in ("MASTER_ADDR_KEY", "MASTER_PORT_KEY")):
        return "it has no MASTER_ADDR_KEY and MASTER_PORT_KEY any more"
    return takes("rank", "store", "local_addr", "server_port")(getattr(value, "build", None))


def _names_in(code: types.CodeType) -> set[str]:
    """The names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_in(const)
    return names


def _functions_of(cls: type) -> Iterable[types.FunctionType]:
    for klass in inspect.getmro(cls):
        for value in vars(klass).values():
            value = getattr(value, "__func__", value)  # staticmethod, classmethod
            if isinstance(value, property):
                value = value.fget
            if isinstance(value, types.FunctionType):
                yield value


def _stores(code: types.CodeType, attr: str) -> bool:
    """Whether a function's code (its nested functions' included) assigns an attribute `attr`."""
    if any(i.opname == "STORE_ATTR" and i.argval == attr for i in dis.get_instructions(code)):
        return True
    return any(_stores(c, attr) for c in code.co_consts if isinstance(c, types.CodeType))


def _assigned_by(cls: Any, attr: str) -> bool:
    """Whether a method of `cls` (or of a base) sets `self.<attr>`."""
    return inspect.isclass(cls) and any(_stores(f.__code__, attr) for f in _functions_of(cls))


# ------------------------------------------------------------------ the uses
# The attributes of torch's `_RendezvousState`, which merge.py converts one by one.
STATE_FIELDS = frozenset({"round", "complete", "deadline", "closed", "participants", "wait_list",
                          "redundancy_list", "last_heartbeats"})
# The rendezvous handler (worker/rendezvous/): the pickled state, the poll, the handler's parts.
NODE_DESC = Private(DYNAMIC, "_NodeDesc", "a node in the pickled state; merge.py converts it to data the "
                    "control plane merges", dataclass_with("addr", "pid", "local_id"))
RENDEZVOUS_STATE = Private(DYNAMIC, "_RendezvousState", "the pickled state itself, converted by merge.py",
                           instances_have(*sorted(STATE_FIELDS)))
DELAY = Private(DYNAMIC, "_delay", "the one-second sleep after each sync; wake.py makes it a long poll",
                takes("seconds"))
EXECUTOR_RUN = Private(DYNAMIC, "_DistributedRendezvousOpExecutor.run", "must sleep through the "
                       "module's _delay, or replacing _delay changes nothing", refers_to("_delay"))
STORE_INFO = Private(DYNAMIC, "RendezvousStoreInfo", "the name the handler publishes the master address "
                     "with; store.py publishes it in one store call", _store_info)
HANDLER_USES_STORE_INFO = Private(DYNAMIC, "DynamicRendezvousHandler", "must look RendezvousStoreInfo up "
                                  "in its module, or replacing it changes nothing",
                                  class_refers_to("RendezvousStoreInfo"))
HANDLER_STATE_HOLDER = Private(DYNAMIC, "DynamicRendezvousHandler._state_holder", "the handler's cached "
                               "state: its round, members and wait list", on_instances=True)
HANDLER_SETTINGS = Private(DYNAMIC, "DynamicRendezvousHandler._settings", "min/max nodes, last call and "
                           "keep-alive, which the backend's merged writes need", on_instances=True)
HANDLER_THIS_NODE = Private(DYNAMIC, "DynamicRendezvousHandler._this_node", "this node in the state, for "
                            "the backend's one-write leave and wait", on_instances=True)
HANDLER_KEEP_ALIVE = Private(DYNAMIC, "DynamicRendezvousHandler._keep_alive", "the heartbeat; outage.py "
                             "gives it a short retry so it does not hold the monitor", takes("self"))
KEEP_ALIVE_WEAK = Private(DYNAMIC, "DynamicRendezvousHandler._keep_alive_weak", "the timer must call "
                          "_keep_alive through the instance, where outage.py replaces it",
                          refers_to("_keep_alive"))
HANDLER_STOP_HEARTBEATS = Private(DYNAMIC, "DynamicRendezvousHandler._stop_heartbeats", "an agent leaves "
                                  "without closing the rendezvous for the others", takes("self"))
HOLDER_BACKEND = Private(DYNAMIC, "_BackendRendezvousStateHolder._backend", "the backend a handler "
                         "reads through, checked before waking on change", on_instances=True)
HOLDER_LAST_SYNC = Private(DYNAMIC, "_BackendRendezvousStateHolder._last_sync_time", "set to -1 to expire "
                           "the one-second cache when a long poll saw a change", on_instances=True)
HOLDER_STATE = Private(DYNAMIC, "_BackendRendezvousStateHolder.state", "the cached state itself",
                       _is_a_property)
# torchrun's process (the agent around the handler).
TERMINATE_HANDLER = Private(MP_API, "_terminate_process_handler", "torchrun's death-signal handler; "
                            "deathsig.py acts on the first signal only", takes("signum", "frame"))
LOGS_REIFY = Private(MP_API, "DefaultLogsSpecs.reify", "deletes a restart's log folder; output.py moves "
                     "a replaced group's folder aside first", takes("self", "envs"))
LOGS_RUN_DIR = Private(MP_API, "DefaultLogsSpecs._run_log_dir", "the folder reify makes the restarts' "
                       "folders in", on_instances=True)
AGENT_TIME = Private(AGENT_API, "time", "the module the agent's monitor loop sleeps with; monitor.py "
                     "wakes that sleep on news", _is_time_module)
AGENT_LOOP = Private(AGENT_API, "SimpleElasticAgent._invoke_run", "must sleep with the module's time",
                     refers_to("time", "sleep"))
STOP_WORKERS = Private(LOCAL_AGENT, "LocalElasticAgent._stop_workers", "monitor.py stops a broken group "
                       "with SIGKILL, not SIGTERM and a grace", takes("self", "worker_group"))
SHUTDOWN = Private(LOCAL_AGENT, "LocalElasticAgent._shutdown", "stops the workers with a given signal",
                   takes("self", "death_sig"))
PCONTEXT = Private(LOCAL_AGENT, "LocalElasticAgent._pcontext", "the workers' pids, sent SIGTERM for "
                   "their last words", on_instances=True)
# A training worker (worker/flight.py).
FR_DUMP_JSON = Private("torch._C._distributed_c10d", "_dump_fr_trace_json", "the flight recorder's "
                       "trace of a worker's collectives, dumped when its job is taken for hung")
# NCCL's groups record into a recorder of their own (with CUDA events), which the one above
# does not hold: a CPU build has no such function.
NCCL_FR_DUMP_JSON = Private("torch._C._distributed_c10d", "_dump_nccl_trace_json", "the flight "
                            "recorder's trace of a worker's NCCL collectives, dumped when its job "
                            "is taken for hung", nccl_only=True)
# Only for measuring (bench/recovery.py's phase marks, bench/rendezvous.py's keep-alive timing).
MONITOR_WORKERS = Private(LOCAL_AGENT, "LocalElasticAgent._monitor_workers", "phase mark: workers failed",
                          takes("self", "worker_group"))
START_WORKERS = Private(LOCAL_AGENT, "LocalElasticAgent._start_workers", "phase mark: workers started",
                        takes("self", "worker_group"))
SUBPROCESS_CLOSE = Private(MP_API, "SubprocessContext._close", "phase mark: workers exited",
                           takes("self", "death_sig", "timeout"))
KEEP_ALIVE_OP = Private(DYNAMIC, "_RendezvousKeepAliveOp", "bench/rendezvous.py times keep-alives",
                        lambda v: None if inspect.isclass(v) else "it is not a class any more")
HANDLER_OP_EXECUTOR = Private(DYNAMIC, "DynamicRendezvousHandler._op_executor", "bench/rendezvous.py "
                              "times the executor's runs of keep-alive ops", on_instances=True)

# Every `Private` above, in the order written: what `require` checks.
USES: tuple[Private, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Private))


# ------------------------------------------------------------------ the check
def torch_version(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def problems(import_module: Callable[[str], Any] = importlib.import_module,
             uses: Iterable[Private] = USES) -> list[tuple[Private, str]]:
    """Each use that the torch `import_module` imports does not have as expected, with what is wrong."""
    return [(use, p) for use in uses if (p := use.problem(import_module)) is not None]


def message(found: list[tuple[Private, str]], version: str) -> str:
    lines = [f"ftrain uses torch's private {use.label} ({use.why}; tested with {TESTED_TEXT}); "
             f"torch {version} changed it: {p}." for use, p in found]
    lines.append(f"Install a tested torch ('{TESTED_SPEC}', pyproject.toml) or adapt "
                 "worker/torch_internals.py and the modules that use these parts to this torch.")
    return "\n".join(lines)


def check(import_module: Callable[[str], Any] = importlib.import_module, version: str | None = None) -> None:
    """Raise TorchChanged naming every use this torch changed; warn once for an untested version."""
    if version is None:
        import torch

        version = torch.__version__
    found = problems(import_module)
    if found:
        raise TorchChanged(message(found, version))
    v = torch_version(version)
    if v is None or not TESTED[0] <= v <= TESTED[1]:
        log.warning("torch %s is outside the versions ftrain is tested with (%s); the private parts "
                    "of torch that it uses look unchanged (worker/torch_internals.py)", version, TESTED_TEXT)


@functools.cache
def require() -> None:
    """`check` against the installed torch, once per process (raises TorchChanged)."""
    check()


# ------------------------------------------------------------------ access
def get_one(use: Private) -> Any:
    """The attribute `use`, checked alone: for a training worker, which must not import the
    elastic agent's modules that `require` checks (a thread dumping for a hung worker)."""
    if (problem := use.problem()) is not None:
        import torch

        raise TorchChanged(message([(use, problem)], torch.__version__))
    return getattr(use.owner(), use.attr)


def get(use: Private) -> Any:
    """The checked attribute itself (a private class or function of torch)."""
    require()
    return getattr(use.owner(), use.attr)


def of(obj: Any, use: Private) -> Any:
    """The instance attribute `use` of `obj`, a handler, holder, agent or logs spec of torch's."""
    require()
    value = getattr(obj, use.attr, _MISSING)
    if value is _MISSING:
        raise TorchChanged(f"ftrain uses torch's private {use.label} ({use.why}); this "
                           f"{type(obj).__name__} has no {use.attr}: it is not the object torch's "
                           f"{use.path.split('.')[0]} makes in {TESTED_TEXT}")
    return value


def patch(use: Private, make: Callable[[Any], Any]) -> Any:
    """Put `make(current)` where `use` is (a module's or class's attribute), once per process
    and maker; returns what it replaced (torch's own, or another maker's replacement of it)."""
    require()
    owner = use.owner()
    maker = f"{make.__module__}.{make.__qualname__}"
    with _patch_lock:
        current = link = getattr(owner, use.attr)
        while (mark := getattr(link, _MARK, None)) is not None:
            if mark[0] == maker:
                return mark[1]
            link = mark[1]
        replacement = make(current)
        setattr(replacement, _MARK, (maker, current))
        setattr(owner, use.attr, replacement)
    return current


# The handler's parts, named for what they are.
def rendezvous_state_types() -> tuple[type, type]:
    """torch's `_RendezvousState` and `_NodeDesc` classes."""
    return get(RENDEZVOUS_STATE), get(NODE_DESC)


def state_holder(handler: Any) -> Any:
    return of(handler, HANDLER_STATE_HOLDER)


def cached_state(handler: Any) -> Any:
    """The handler's cached `_RendezvousState` (round, participants, wait list)."""
    return state_holder(handler).state


def expire_cached_state(handler: Any) -> None:
    """The handler's next look at the state reads it from the backend, not from its cache."""
    holder = state_holder(handler)
    of(holder, HOLDER_LAST_SYNC)
    holder._last_sync_time = -1


def settings(handler: Any) -> Any:
    """The handler's `RendezvousSettings` (min/max nodes, timeouts, keep-alive)."""
    return of(handler, HANDLER_SETTINGS)


def this_node(handler: Any) -> tuple[str, int, int]:
    node = of(handler, HANDLER_THIS_NODE)
    return node.addr, node.pid, node.local_id


def backend_of(handler: Any) -> Any:
    return of(state_holder(handler), HOLDER_BACKEND)


def replace_keep_alive(handler: Any, make: Callable[[Callable[[], None]], Callable[[], None]]) -> None:
    """The handler's keep-alive becomes `make(its own keep-alive)` (this handler only)."""
    handler._keep_alive = make(of(handler, HANDLER_KEEP_ALIVE))


def stop_heartbeats(handler: Any) -> None:
    of(handler, HANDLER_STOP_HEARTBEATS)()


def op_executor(handler: Any) -> Any:
    return of(handler, HANDLER_OP_EXECUTOR)


# The agent's parts.
def worker_pids(agent: Any) -> dict[int, int]:
    """local rank -> pid of the agent's workers ({} before it started any)."""
    context = of(agent, PCONTEXT)
    return {} if context is None else context.pids()


def shutdown_workers(agent: Any, death_sig: int) -> None:
    of(agent, SHUTDOWN)(death_sig=death_sig)


def run_log_dir(logs_specs: Any) -> str | None:
    """The folder torch's `DefaultLogsSpecs` makes each restart's folder in (None before its first)."""
    return of(logs_specs, LOGS_RUN_DIR)
