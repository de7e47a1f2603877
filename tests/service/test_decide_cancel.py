"""Cancel as a table: every state a cancel can meet, and who may cancel."""

from __future__ import annotations

import pytest

from service.decide.cancel import decide_cancel
from service.errors import Forbidden, InvalidTransition
from service.models import JobState
from tests.service.records import NOW, make_job

S = JobState


@pytest.mark.parametrize("state,after,reason", [
    (S.PENDING, S.CANCELLED, "cancelled by alice"),
    (S.RUNNING, S.CANCELLING, "cancel requested by alice"),
    (S.RECOVERING, S.CANCELLING, "cancel requested by alice"),
])
def test_cancel_moves_a_job_that_is_not_finished(state, after, reason):
    change = decide_cancel(make_job(state, owner="alice"), NOW, "alice", is_admin=False)
    assert change.job.state is after and change.job.reason == reason
    assert [(e.seq, e.state, e.reason, e.time, e.by) for e in change.events] == [
        (6, after, reason, NOW, "alice")]
    assert change.job.finished_at == (NOW if after.is_terminal() else None)
    assert change.ops == []


@pytest.mark.parametrize("state", [S.CANCELLING, S.CANCELLED])
def test_cancelling_a_cancelled_job_again_changes_nothing(state):
    assert decide_cancel(make_job(state), NOW) is None


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.FAILED])
def test_cancelling_a_finished_job_is_refused_naming_its_state(state):
    with pytest.raises(InvalidTransition) as err:
        decide_cancel(make_job(state), NOW)
    assert (err.value.state, err.value.target) == (state.value, "CANCELLED")


@pytest.mark.parametrize("state", [S.PENDING, S.RUNNING, S.CANCELLING, S.SUCCEEDED])
def test_a_user_cannot_cancel_another_users_job(state):
    with pytest.raises(Forbidden) as err:
        decide_cancel(make_job(state, owner="alice"), NOW, "bob", is_admin=False)
    assert "belongs to 'alice'" in err.value.message and "'bob'" in err.value.message


def test_the_admin_cancels_anyones_job_and_the_event_names_the_admin():
    change = decide_cancel(make_job(S.RUNNING, owner="alice"), NOW, "admin", is_admin=True)
    assert change.job.state is S.CANCELLING
    assert [(e.reason, e.by) for e in change.events] == [("cancel requested by admin", "admin")]
