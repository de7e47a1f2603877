"""Cancel as a table: every state a cancel can meet."""

from __future__ import annotations

import pytest

from service.decide.cancel import decide_cancel
from service.errors import InvalidTransition
from service.models import JobState
from tests.service.records import NOW, make_job

S = JobState


@pytest.mark.parametrize("state,after,reason", [
    (S.PENDING, S.CANCELLED, "cancelled by user"),
    (S.RUNNING, S.CANCELLING, "cancel requested by user"),
    (S.RECOVERING, S.CANCELLING, "cancel requested by user"),
])
def test_cancel_moves_a_job_that_is_not_finished(state, after, reason):
    change = decide_cancel(make_job(state), NOW)
    assert change.job.state is after and change.job.reason == reason
    assert [(e.seq, e.state, e.reason, e.time) for e in change.events] == [(6, after, reason, NOW)]
    assert change.job.finished_at == (NOW if after.is_terminal() else None)
    assert change.ops == []


def test_cancelling_a_cancelling_job_changes_nothing():
    assert decide_cancel(make_job(S.CANCELLING), NOW) is None


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_cancelling_a_finished_job_is_refused_naming_its_state(state):
    with pytest.raises(InvalidTransition) as err:
        decide_cancel(make_job(state), NOW)
    assert (err.value.state, err.value.target) == (state.value, "CANCELLED")
