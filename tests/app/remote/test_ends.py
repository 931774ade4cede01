"""The transfer halves across the control connection come from their declarations alone
(app/remote/ends.py): every declared method goes through the wire to the worker's own half and
back, typed as declared; nothing undeclared runs; a failed call answers as its return type says;
and a method added to a declaration needs no other edit to cross."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import pytest

from kvfence.app.remote import ends
from kvfence.app.remote.protocol import Answer, AnswerBody, Call, EndCall, Failure, decode_answer, decode_call, frame
from kvfence.engine.protocol import WorkerLost
from kvfence.scheduler.transfer import SendingEnd, waits_on_transfer
from kvfence.transports.base import TransferManifest, TransferResult

pytestmark = pytest.mark.anyio
MANIFEST = TransferManifest(transfer_id="ab" * 16, lease="cd" * 16, nonce="ef" * 16, num_tokens=40, num_pages=3,
                            digests=["1", "2", "3"], capability="sig")


class Recording:
    """A worker's local half that records every call and answers what it is told to."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.answers = answers

    def __getattr__(self, name: str) -> Any:
        async def method(*args: Any) -> Any:
            self.calls.append((name, args))
            return self.answers[name]
        return method


def over_the_wire(local: object) -> Any:
    """An `ask` that frames the call, decodes it as a worker does, runs it on `local` and frames
    the answer back."""
    async def ask(body: EndCall) -> AnswerBody:
        call = decode_call(frame(Call(1, body))[4:])
        assert isinstance(call.body, EndCall)
        try:
            method, args = ends.decoded(call.body)
            answer: AnswerBody = (await ends.invoke(local, method, args))[0]
        except ValueError as e:
            answer = Failure(str(e))
        return decode_answer(frame(Answer(1, answer))[4:]).body
    return ask


async def test_every_declared_method_crosses_as_declared() -> None:
    verdict = TransferResult(MANIFEST.transfer_id, False, "digest_mismatch")
    local = Recording({"push": verdict, "cancel": True, "wait_quiet": False, "expect": None,
                       "completion": TransferResult(MANIFEST.transfer_id, True)})
    sender = ends.remote_sending_end(over_the_wire(local), "10.0.0.2:5000")
    receiver = ends.remote_receiving_end(over_the_wire(local))
    assert await sender.push(MANIFEST, [7, 8, 9], [1, 2, 3]) == verdict
    assert await sender.cancel("t1") is True
    assert await sender.wait_quiet("t2") is False
    assert await receiver.expect(MANIFEST, [1, 2, 3]) is None
    assert await receiver.completion("t3") == TransferResult(MANIFEST.transfer_id, True)
    assert local.calls == [("push", (MANIFEST, [7, 8, 9], [1, 2, 3])), ("cancel", ("t1",)), ("wait_quiet", ("t2",)),
                           ("expect", (MANIFEST, [1, 2, 3])), ("completion", ("t3",))]
    assert {h: set(ends.methods(h)) for h in ("sending", "receiving")} == {
        "sending": {"push", "cancel", "wait_quiet"}, "receiving": {"expect", "completion", "cancel"}}


@pytest.mark.parametrize(("method", "args"), [
    ("aclose", b"{}"),  # a Transport method, not a half's
    ("__init__", b"{}"),
    ("push", b'{"manifest": "x", "src_pages": [1], "dst_pages": [2]}'),  # not a manifest
    ("cancel", b'{"transfer_id": "t", "extra": 1}'),  # a field the declaration has not
])
async def test_nothing_undeclared_runs(method: str, args: bytes) -> None:
    local = Recording({})
    call = EndCall(end="sending", method=method, args=args)  # type: ignore[arg-type]  # raw bytes as on the wire
    with pytest.raises(ValueError):
        ends.decoded(decode_call(frame(Call(1, call))[4:]).body)  # type: ignore[arg-type]  # an EndCall
    assert local.calls == []


async def test_a_failed_call_answers_as_its_return_type_says() -> None:
    async def failing(body: EndCall) -> AnswerBody:
        return Failure("the prefill worker is not paired with a receiver at x")

    async def lost(body: EndCall) -> AnswerBody:
        raise WorkerLost("gone")

    sender, receiver = ends.remote_sending_end(failing, "x"), ends.remote_receiving_end(failing)
    assert await sender.push(MANIFEST, [1], [2]) == TransferResult(
        MANIFEST.transfer_id, False, "the prefill worker is not paired with a receiver at x")
    assert await receiver.completion("t9") == TransferResult("t9", False, "the prefill worker is not paired "
                                                             "with a receiver at x")
    assert await sender.cancel("t9") is False and await sender.wait_quiet("t9") is False
    with pytest.raises(ValueError, match="not paired"):
        await receiver.expect(MANIFEST, [2])
    gone_sender, gone_receiver = ends.remote_sending_end(lost, "x"), ends.remote_receiving_end(lost)
    assert await gone_sender.cancel("t9") is False  # a lost worker acknowledged nothing
    with pytest.raises(WorkerLost):
        await gone_sender.push(MANIFEST, [1], [2])
    with pytest.raises(WorkerLost):
        await gone_receiver.completion("t9")


def test_only_the_calls_that_wait_on_the_transfer_outlive_the_call_deadline() -> None:
    waiting = {(half, name) for half in ("sending", "receiving") for name, m in ends.methods(half).items()
               if m.waits_on_transfer}
    assert waiting == {("sending", "push"), ("sending", "wait_quiet"), ("receiving", "completion")}


class SendingEndWithProbe(SendingEnd, Protocol):
    """A declaration with one method more, as a new one would be added."""

    @waits_on_transfer
    async def probe(self, transfer_id: str, pages: list[int]) -> int: ...


@pytest.fixture
def probe_declared(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(ends.DECLARATIONS, "sending", SendingEndWithProbe)
    ends.methods.cache_clear()
    yield
    ends.methods.cache_clear()


async def test_a_new_method_is_its_declaration_and_its_implementations(probe_declared: None) -> None:
    local = Recording({"probe": 3})
    sender: Any = ends.remote_sending_end(over_the_wire(local), "x")
    assert await sender.probe("t", [4, 5]) == 3
    assert local.calls == [("probe", ("t", [4, 5]))]
    assert ends.methods("sending")["probe"].waits_on_transfer
