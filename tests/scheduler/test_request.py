"""Request lifecycle: legal transitions only, and terminal states that never change (monotone)."""

from __future__ import annotations

import anyio
import pytest

from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.errors import RequestError
from kvfence.scheduler.handle import OutputDelta, RequestHandle
from kvfence.scheduler.request import IllegalTransition, Request, State


class _Detok:  # the lifecycle never touches text
    pass


def make_request() -> Request:
    handle = RequestHandle("r1", [1, 2], on_abort=lambda: None)
    return Request("r1", [1, 2], SamplingParams(), 4, handle, detok=_Detok(), stops=_Detok(),  # type: ignore[arg-type]
                   tokens=[1, 2])


def drain(req: Request) -> list[OutputDelta]:
    async def run() -> list[OutputDelta]:
        return [d async for d in req.handle.deltas()]
    return anyio.run(run)


def test_legal_path_and_illegal_jumps() -> None:
    req = make_request()
    with pytest.raises(IllegalTransition):
        req.advance(State.DECODING)  # waiting cannot skip prefill
    req.advance(State.PREFILLING)
    req.advance(State.TRANSFERRING)
    with pytest.raises(IllegalTransition):
        req.advance(State.PREFILLING)  # no going back
    req.advance(State.DECODING)
    assert req.finish("length")
    assert req.state is State.FINISHED
    assert [d.finish_reason for d in drain(req)] == ["length"]


def test_abort_then_late_finish_stays_aborted() -> None:
    req = make_request()
    req.advance(State.PREFILLING)
    assert req.fail(RequestError(499, "client_closed", "gone"), aborted=True)
    assert not req.finish("length")  # a late "finished" is ignored
    assert not req.fail(RequestError(500, "worker_error", "late"))
    assert req.state is State.ABORTED
    deltas = drain(req)
    assert len(deltas) == 1 and deltas[0].error is not None and deltas[0].finish_reason is None


def test_finish_then_late_abort_stays_finished() -> None:
    req = make_request()
    req.advance(State.PREFILLING)
    req.advance(State.DECODING)
    assert req.finish("stop", "tail", [7])
    assert not req.fail(RequestError(499, "client_closed", "gone"), aborted=True)
    assert req.state is State.FINISHED
    (delta,) = drain(req)
    assert (delta.text, delta.token_ids, delta.finish_reason, delta.error) == ("tail", [7], "stop", None)


def test_preempted_request_goes_back_to_waiting_to_prefill_what_it_has() -> None:
    req = make_request()
    req.advance(State.PREFILLING)
    req.advance(State.DECODING)
    req.tokens += [7, 8]  # generated
    req.decode_pages, req.prefilled = [3, 4], 2
    req.requeue()
    assert req.state is State.WAITING and req.preemptions == 1
    assert req.prefill_target == 4 and req.prefilled == 0 and req.decode_pages == []
    assert req.num_generated == 2  # what was sent stays sent
    req.advance(State.PREFILLING)
    req.advance(State.TRANSFERRING)
    with pytest.raises(IllegalTransition):
        req.requeue()  # a transfer's pages are never taken back
