"""A request through its lifecycle: legal transitions only (scheduler/core/lifecycle.py), terminal
states that never change (monotone), and what a preemption keeps."""

from __future__ import annotations

import pytest

from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.output import OutputDelta
from kvfence.scheduler.core.lifecycle import Event, IllegalTransition, State
from kvfence.scheduler.core.request import Request


class _Output:  # the lifecycle never touches text
    pass


def make_request() -> Request:
    return Request(request_id="r1", prompt=[1, 2], params=SamplingParams(), max_tokens=4,
                   output=_Output(), created_s=0.0, tokens=[1, 2])  # type: ignore[arg-type]


def sent(*deltas: OutputDelta | None) -> list[OutputDelta]:
    """What the request's reader gets: the deltas its transitions returned."""
    return [d for d in deltas if d is not None]


def test_legal_path_and_illegal_jumps() -> None:
    req = make_request()
    with pytest.raises(IllegalTransition):
        req.fire(Event.DECODE)  # waiting cannot skip prefill
    req.fire(Event.RESERVE)
    req.fire(Event.PREFILLED)
    with pytest.raises(IllegalTransition):
        req.fire(Event.RESERVE)  # no going back
    req.fire(Event.DECODE)
    finished = req.finish(OutputDelta(text="", token_ids=[], finish_reason="length"))
    assert finished is not None
    assert req.state is State.FINISHED
    assert [d.finish_reason for d in sent(finished)] == ["length"]


def test_abort_then_late_finish_stays_aborted() -> None:
    req = make_request()
    req.fire(Event.RESERVE)
    aborted = req.fail(RequestError(499, "client_closed", "gone"))
    assert aborted is not None
    late_finish = req.finish(OutputDelta(text="", token_ids=[], finish_reason="length"))
    assert late_finish is None  # a late "finished" is ignored
    late_fail = req.fail(RequestError(500, "worker_error", "late"))
    assert late_fail is None
    assert req.state is State.ABORTED
    deltas = sent(aborted, late_finish, late_fail)
    assert len(deltas) == 1 and deltas[0].error is not None and deltas[0].finish_reason is None


def test_finish_then_late_abort_stays_finished() -> None:
    req = make_request()
    req.fire(Event.RESERVE)
    req.fire(Event.DECODE)
    finished = req.finish(OutputDelta(text="tail", token_ids=[7], finish_reason="stop"))
    late_abort = req.fail(RequestError(499, "client_closed", "gone"))
    assert finished is not None and late_abort is None
    assert req.state is State.FINISHED
    (delta,) = sent(finished, late_abort)
    assert (delta.text, delta.token_ids, delta.finish_reason, delta.error) == ("tail", [7], "stop", None)


def test_preempted_request_goes_back_to_waiting_to_prefill_what_it_has() -> None:
    req = make_request()
    req.fire(Event.RESERVE)
    req.fire(Event.DECODE)
    req.tokens += [7, 8]  # generated
    req.decode_pages, req.prefilled = [3, 4], 2
    req.requeue(1.0)
    assert req.state is State.WAITING and req.preemptions == 1
    assert req.prefill_target == 4 and req.prefilled == 0 and req.decode_pages == []
    assert req.num_generated == 2  # what was sent stays sent
    req.fire(Event.RESERVE)
    req.fire(Event.PREFILLED)
    with pytest.raises(IllegalTransition):
        req.requeue(2.0)  # a transfer's pages are never taken back
