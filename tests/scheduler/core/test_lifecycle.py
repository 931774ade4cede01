"""The lifecycle's transition table (scheduler/core/lifecycle.py), checked over every state, hold
and pending exit: each event does exactly what its rule says and raises everywhere else, and the
properties the fence relies on hold for the table as a whole."""

from __future__ import annotations

import itertools

import pytest

from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.lifecycle import (LIVE, RUNNING, TABLE, TERMINAL, Event, Exit, Hold, IllegalTransition,
                                              Lifecycle, State)

ERROR = RequestError(503, "worker_lost", "lost")
EVERY_POINT = list(itertools.product(State, Hold, Exit))


def fired(point: tuple[State, Hold, Exit], event: Event) -> Lifecycle | None:
    """The lifecycle after `event` at `point`, or None where it raised IllegalTransition."""
    state, hold, exit_ = point
    life = Lifecycle(state=state, hold=hold, exit=exit_, error=ERROR if exit_ is Exit.END else None,
                     transfer=7 if hold is Hold.TRANSFER else 0)
    try:
        life.fire(event, "request r", error=ERROR, transfer=9)
    except IllegalTransition:
        return None
    return life


def allowed(event: Event) -> set[tuple[State, Hold, Exit]]:
    return {p for p in EVERY_POINT if fired(p, event) is not None}


def test_every_event_has_a_rule() -> None:
    assert set(TABLE) == set(Event)


@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.value)
def test_an_event_happens_exactly_where_its_rule_allows_and_leaves_what_it_says(event: Event) -> None:
    rule = TABLE[event]
    for point in EVERY_POINT:
        state, hold, exit_ = point
        after = fired(point, event)
        legal = state in rule.states and hold in rule.holds and exit_ in rule.exits
        assert (after is not None) == legal, (event, point)
        if after is not None:
            assert (after.state, after.hold, after.exit) == (rule.state or state, rule.hold or hold, rule.exit or exit_)


def test_an_ended_request_takes_no_event_but_its_step_settling() -> None:
    for event in Event:
        ended = {p for p in allowed(event) if p[0] in TERMINAL}
        assert not ended or event is Event.STEP_SETTLED, event


def test_pages_are_never_taken_back_while_something_holds_them() -> None:
    """A preemption or a retry (which release the attempt's pages for reuse) needs no step and no
    transfer on them; an end never happens under a started transfer (a write may still land)."""
    for event in (Event.PREEMPT, Event.RETRY):
        assert {hold for _, hold, _ in allowed(event)} == {Hold.NONE}, event
    for event in (Event.ABORT, Event.FAIL, Event.FINISH):
        assert Hold.TRANSFER not in {hold for _, hold, _ in allowed(event)}, event
    assert {state for state, _, _ in allowed(Event.PREEMPT)} == {State.PREFILLING, State.DECODING}


def test_a_held_request_changes_state_only_by_ending() -> None:
    """While a step or a transfer holds it, a request moves nowhere but to its end."""
    for event in Event:
        for point in allowed(event):
            after = fired(point, event)
            assert after is not None
            if point[1] is not Hold.NONE and after.state is not point[0]:
                assert event in (Event.ABORT, Event.FAIL), (event, point)


def test_the_first_end_asked_for_wins() -> None:
    life = Lifecycle(state=State.DECODING, hold=Hold.STEP)
    life.fire(Event.ASK_END, "r", error=ERROR)
    life.fire(Event.ASK_END, "r", error=RequestError(499, "client_closed", "gone"))
    assert life.exit is Exit.END and life.error is ERROR
    life.fire(Event.STEP_SETTLED, "r")
    life.fire(Event.FAIL, "r")
    assert life.ended and life.error is None and life.exit is Exit.NONE


def test_a_transfer_carries_its_key_while_it_runs() -> None:
    life = Lifecycle(state=State.TRANSFERRING)
    with pytest.raises(ValueError):
        life.fire(Event.TRANSFER_STARTED, "r")  # a transfer needs its key
    life.fire(Event.TRANSFER_STARTED, "r", transfer=3)
    assert (life.hold, life.transfer) == (Hold.TRANSFER, 3)
    with pytest.raises(IllegalTransition):
        life.fire(Event.FAIL, "r")
    life.fire(Event.TRANSFER_ENDED, "r")
    assert (life.hold, life.transfer) == (Hold.NONE, 0)


def _reachable(start: tuple[State, Hold, Exit]) -> set[tuple[State, Hold, Exit]]:
    seen, todo = {start}, [start]
    while todo:
        point = todo.pop()
        for event in Event:
            after = fired(point, event)
            if after is not None and (nxt := (after.state, after.hold, after.exit)) not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_live_state_is_reached_from_waiting_and_can_still_end() -> None:
    reached = _reachable((State.WAITING, Hold.NONE, Exit.NONE))
    assert {state for state, _, _ in reached} == set(State)
    for point in reached:
        if point[0] in LIVE:
            assert any(p[0] in TERMINAL for p in _reachable(point)), point


def test_running_is_in_path_order() -> None:
    assert RUNNING == (State.PREFILLING, State.TRANSFERRING, State.DECODING)
