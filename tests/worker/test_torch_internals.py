"""worker/torch_internals.py: every private part of torch that ftrain uses is checked against
the installed torch, and a torch that changed one is refused with one message naming it."""

from __future__ import annotations

import importlib
import types

import pytest

from worker import torch_internals as ti

ALL_MODULES = {use.module for use in ti.USES}


def without(module: str, *paths: str):
    """An importer whose `module` is a copy of torch's own less `paths` (`name` or `Class.attr`)."""
    real = importlib.import_module(module)
    fake = types.ModuleType(module)
    fake.__dict__.update(vars(real))
    for path in paths:
        owner_name, _, attr = path.rpartition(".")
        if owner_name:
            owner = getattr(fake, owner_name)
            setattr(fake, owner_name, type(owner.__name__, (),
                                           {k: v for k, v in vars(owner).items() if k != attr}))
        else:
            delattr(fake, attr)
    return lambda name: fake if name == module else importlib.import_module(name)


def test_the_installed_torch_has_every_private_part_ftrain_uses():
    assert ti.problems() == []
    ti.check()  # no error
    assert {"_NodeDesc", "_RendezvousState", "_delay", "_terminate_process_handler",
            "LocalElasticAgent._stop_workers", "DefaultLogsSpecs.reify", "time",
            "RendezvousStoreInfo"} <= {use.path for use in ti.USES}


def test_every_use_says_why_and_lives_in_a_torch_distributed_module():
    for use in ti.USES:  # the elastic agent's, or c10d's bindings (the flight recorder's dump)
        assert use.why and use.module.startswith(("torch.distributed.elastic.", "torch._C._distributed_c10d")), use


def test_one_use_is_checked_alone_with_the_same_message():
    assert callable(ti.get_one(ti.FR_DUMP_JSON))
    gone = ti.Private("torch._C._distributed_c10d", "_no_such_dump", "a worker's trace")
    with pytest.raises(ti.TorchChanged, match="_distributed_c10d._no_such_dump .a worker's trace"):
        ti.get_one(gone)


def test_a_torch_without_delay_is_refused_with_one_message_naming_it():
    with pytest.raises(ti.TorchChanged) as raised:
        ti.check(without(ti.DYNAMIC, "_delay"), version="2.99.0")
    text = str(raised.value)
    assert "ftrain uses torch's private dynamic_rendezvous._delay" in text
    assert "tested with torch 2.11-2.13" in text and "torch 2.99.0 changed it" in text
    assert "has no _delay" in text and "torch>=2.11,<2.14" in text


def test_a_method_gone_from_a_class_is_named_with_its_class():
    with pytest.raises(ti.TorchChanged, match=r"local_elastic_agent\.LocalElasticAgent\._shutdown .*"
                                              r"torch 2\.14\.0 changed it: LocalElasticAgent has no _shutdown"):
        ti.check(without(ti.LOCAL_AGENT, "LocalElasticAgent._shutdown"), version="2.14.0")


def test_a_function_whose_parameters_changed_is_refused_saying_how():
    def renamed(sig, frame):  # torch's handler with its first parameter renamed
        raise AssertionError

    real = importlib.import_module(ti.MP_API)
    fake = types.ModuleType(ti.MP_API)
    fake.__dict__.update(vars(real))
    fake._terminate_process_handler = renamed
    with pytest.raises(ti.TorchChanged, match=r"it takes \(sig, frame\), not \(signum, frame, \.\.\.\)"):
        ti.check(lambda name: fake if name == ti.MP_API else importlib.import_module(name), version="2.13.0")


def test_an_attribute_no_method_sets_any_more_is_refused():
    # the two methods that set it; others still read it
    found = ti.problems(without(ti.LOCAL_AGENT, "LocalElasticAgent.__init__", "LocalElasticAgent._start_workers"),
                        [ti.PCONTEXT])
    assert [(use, p) for use, p in found] == [(ti.PCONTEXT, "no method of LocalElasticAgent sets "
                                                            "self._pcontext any more")]


def test_a_torch_outside_the_tested_range_with_the_same_internals_runs_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="worker.torch_internals"):
        ti.check(version="2.14.0")
    assert "torch 2.14.0 is outside the versions ftrain is tested with (torch 2.11-2.13)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="worker.torch_internals"):
        ti.check(version="2.13.0+cpu")
    assert caplog.text == ""


def test_a_patch_is_applied_once_per_maker_and_gives_back_what_it_replaced():
    owner = types.SimpleNamespace(f=lambda: "torch")
    use = ti.Private(__name__, "OWNER.f", "a test")
    globals()["OWNER"] = owner
    try:
        stock = owner.f

        def first(inner):
            return lambda: "first+" + inner()

        def second(inner):
            return lambda: "second+" + inner()

        assert ti.patch(use, first) is stock
        assert ti.patch(use, first) is stock  # again: nothing changes
        assert ti.patch(use, second)() == "first+torch"
        assert ti.patch(use, first) is stock and owner.f() == "second+first+torch"
    finally:
        del globals()["OWNER"]


def test_pyproject_asks_for_the_torch_versions_that_are_tested():
    import tomllib
    from pathlib import Path

    import torch

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if d.startswith("torch")]
    (first, last) = ti.TESTED
    assert spec == ti.TESTED_SPEC == f"torch>={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}"
    assert first <= ti.torch_version(torch.__version__) <= last  # the Makefile's pinned build is in it


def test_the_phase_marks_wrap_torchs_agent_once_however_often_they_are_asked(tmp_path, monkeypatch):
    import json

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    from worker.env import FTRAIN_PHASE_LOG
    from worker.rendezvous import marks

    calls = []
    for name in ("_monitor_workers", "_stop_workers", "_start_workers"):  # undone after the test
        monkeypatch.setattr(LocalElasticAgent, name, lambda self, group, _n=name: calls.append(_n))
    monkeypatch.setattr(SubprocessContext, "_close", SubprocessContext._close)  # restored after
    log_path = tmp_path / "phases.jsonl"
    monkeypatch.setenv(FTRAIN_PHASE_LOG, str(log_path))
    marks.watch_agent()
    marks.watch_agent()
    LocalElasticAgent._start_workers(None, None)
    LocalElasticAgent._stop_workers(None, None)
    assert calls == ["_start_workers", "_stop_workers"]
    phases = [json.loads(line)["phase"] for line in log_path.read_text().splitlines()]
    assert phases == ["workers_started", "stop_workers", "workers_stopped"]


@pytest.mark.parametrize("nccl", [False, True])
def test_a_part_that_only_nccl_builds_have_is_missed_only_where_torch_has_nccl(nccl):
    modules = {"torch.distributed": types.SimpleNamespace(is_nccl_available=lambda: nccl),
               "torch._C._distributed_c10d": types.SimpleNamespace()}
    use = ti.Private("torch._C._distributed_c10d", "_dump_nccl_trace_json", "a test", nccl_only=True)
    problem = use.problem(modules.__getitem__)
    assert (problem is not None) is nccl
    if nccl:
        assert "_dump_nccl_trace_json" in problem
