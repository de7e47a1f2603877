"""Size limits of a job spec, checked at submit (`JobSpec.size_errors`): each names its field."""

from __future__ import annotations

from service.models import MAX_COMMAND_BYTES, MAX_ENV_BYTES, MAX_SPEC_BYTES, JobSpec


def fields(spec: JobSpec) -> list[str]:
    return [e["loc"][-1] for e in spec.size_errors()]


def test_a_spec_at_the_limits_is_accepted():
    env = {f"V{i}": "x" * 4094 for i in range(8)}  # names count too
    command = ["python", "a" * 4090, *["b" * 4096] * 3]
    assert sum(len(k) + len(v) for k, v in env.items()) == MAX_ENV_BYTES
    assert sum(len(part) for part in command) == MAX_COMMAND_BYTES
    assert fields(JobSpec(name="ok", command=command, env=env)) == []


def test_env_and_command_over_their_limits_are_named():
    env = {f"V{i}": "x" * 4000 for i in range(9)}
    spec = JobSpec(name="big", command=["python", *["a" * 4000] * 5], env=env)
    assert fields(spec) == ["command", "env"]
    assert f"at most {MAX_ENV_BYTES} bytes" in spec.size_errors()[1]["msg"]


def test_bytes_are_counted_not_characters():
    spec = JobSpec(name="utf8", command=["python"], env={f"V{i}": "é" * 2100 for i in range(8)})
    assert fields(spec) == ["env"]  # 16,800 characters, 33,616 bytes


def test_a_spec_whose_stored_form_is_too_large_is_refused_as_a_whole():
    # Control characters are stored escaped (\u0001: 6 bytes each): within the env limit,
    # over the record's.
    spec = JobSpec(name="escaped", command=["python"], env={f"V{i}": "\x01" * 4000 for i in range(3)})
    assert fields(spec) == ["spec"]
    assert f"more than {MAX_SPEC_BYTES}" in spec.size_errors()[0]["msg"]
