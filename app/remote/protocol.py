"""The control channel between a scheduler and a worker in another process (or on another host).

One TCP connection per worker, opened by the scheduler and authenticated first with the deployment
secret (transports/wire/handshake.py, labelled "control"); nothing is decoded before that, and
everything after it is sealed (transports/wire/seal.py). Inside the seal each side sends
length-prefixed frames (4-byte big-endian length, a JSON body: lease ids are 128-bit, which JSON
carries exactly): the scheduler a `Call`, the worker an `Answer` with the same `call_id`. The body
of a call is either a worker step (engine/protocol.py's `RunStep`: the same message the in-process
channel carries) or one of the control messages below.

Ordering (the contract of engine/protocol.py's `WorkerChannel`): the worker runs the steps in the
order they arrived, one at a time; every other call runs beside them (a transfer waits for the
network, never for a step) and is answered when it is done, so answers may come out of order.

Transfer calls are the halves of scheduler/transfer.py's move, run where the endpoint lives: one
message (`EndCall`) carries any method of the two halves' declarations (scheduler/transfer.py's
SendingEnd and ReceivingEnd), built from those declarations (app/remote/ends.py): the decode
worker arms its receiver and reports the verdict, the prefill worker pushes to one of the
receivers it paired with and waits for quiet, both cancel. The capability of each push is minted
by the scheduler, as in one process.

Liveness: the scheduler sends `Ping` whenever it has heard nothing for a quarter of its worker
timeout and declares the worker lost when it hears nothing for the whole of it, or when a step or
a control call (not a transfer's: those wait on the network) stays unanswered past
`CALL_DEADLINE_S`; the worker drops a scheduler it has heard nothing from for
`SCHEDULER_SILENCE_S`.
"""

from __future__ import annotations

import struct
from typing import Literal, TypeAlias

import msgspec

from kvfence.app.config.config import MAX_WORKER_TIMEOUT_S
from kvfence.engine.protocol import RunStep, StepDone, StepFailed
from kvfence.transports.base import EndpointInfo, PairingRecord

HANDSHAKE_LABEL = "control"  # the handshake's transport label: a control proof is not a KV transport's
# The control protocol's version, in every `Description`: raised whenever a call or an answer is
# added or changes, because a worker drops the connection on a frame it cannot decode. A front end
# drives workers of its own version only (app/remote/front.py: check_worker). 2: `Cut`; 3: every
# transfer call is an `EndCall`.
PROTOCOL_VERSION = 3
MAX_CONTROL_FRAME = 64 << 20  # bytes of one frame's body (a prefill chunk, its grants and pages)
_LEN = struct.Struct(">I")
CALL_DEADLINE_S = 120.0  # a call unanswered this long, while pings are answered: a stuck device
SCHEDULER_SILENCE_S = MAX_WORKER_TIMEOUT_S  # a worker drops a scheduler silent this long: the longest --worker-timeout


class Describe(msgspec.Struct, frozen=True, tag="describe"):
    """Who are you? Answered with `Description`."""


class Description(msgspec.Struct, frozen=True, tag="description"):
    """A worker as the scheduler needs to know it. `incarnation` changes on every restart (and
    when the scheduler it served went away); `endpoint` is its KV transport endpoint (None: a
    colocated worker, which moves no KV)."""

    role: str  # "prefill" or "decode"
    incarnation: str
    device: str
    model: str  # the model identity both roles of a pair must share
    num_pages: int
    page_size_tokens: int
    max_context_tokens: int  # the longest request its pool holds
    endpoint: EndpointInfo | None
    protocol: int = 0  # the worker's PROTOCOL_VERSION (0: a worker from before versions were sent)


class PairWith(msgspec.Struct, frozen=True, tag="pair_with"):
    """Prefill worker: pair this worker's sender with the decode worker's `endpoint` (its
    transport endpoint, from that worker's `Description`), beside any receiver it paired with
    before (a new pairing with the same address replaces the old). `Paired` or `Failure`."""

    endpoint: EndpointInfo


class Paired(msgspec.Struct, frozen=True, tag="paired"):
    record: PairingRecord  # the receiver's record, as the sender saw it at pairing


class EndCall(msgspec.Struct, frozen=True, tag="end_call"):
    """A method of one half of a transfer (scheduler/transfer.py's SendingEnd or ReceivingEnd),
    run on the worker against its own half: `method` names a method the half's declaration has,
    `args` are its arguments as that declaration types them (app/remote/ends.py); `receiver`: the
    endpoint address of the receiver a sending half pushes to (one the worker paired with).
    `EndReturn`, or `Failure`."""

    end: Literal["sending", "receiving"]
    method: str
    args: msgspec.Raw
    receiver: str = ""


class Cut(msgspec.Struct, frozen=True, tag="cut"):
    """Stop step `step_id` between two layers if it is running and cuttable (WorkerChannel.cut),
    answered `Done` at once, beside the step it names (whose own answer says whether it was cut)."""

    step_id: int


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Keep-alive: answered `Done` at once, beside any step or transfer that is running (so a
    worker that stops answering it is stopped, partitioned or gone, not busy)."""


class Reference(msgspec.Struct, frozen=True, tag="reference"):
    """The greedy continuation of `prompt` on this worker's model alone, in a scratch pool (no
    transport, no serving pages): the readiness canary's known answer. `Tokens`."""

    prompt: list[int]
    max_tokens: int


class EndReturn(msgspec.Struct, frozen=True, tag="end_return"):
    """What an `EndCall`'s method returned, as its declaration types it."""

    value: msgspec.Raw


class Done(msgspec.Struct, frozen=True, tag="done"):
    ok: bool = True


class Tokens(msgspec.Struct, frozen=True, tag="tokens"):
    token_ids: list[int]


class Failure(msgspec.Struct, frozen=True, tag="failure"):
    """The call could not be carried out; `message` says why (the connection stays up)."""

    message: str


def failure_message(answer: object) -> str:
    """What went wrong, from an answer that is not the one a call expects."""
    return answer.message if isinstance(answer, Failure) else f"unexpected answer {type(answer).__name__}"


CallBody: TypeAlias = RunStep | Describe | PairWith | EndCall | Reference | Ping | Cut
AnswerBody: TypeAlias = StepDone | StepFailed | Description | Paired | EndReturn | Done | Tokens | Failure


class Call(msgspec.Struct, frozen=True):
    call_id: int
    body: CallBody


class Answer(msgspec.Struct, frozen=True):
    call_id: int
    body: AnswerBody


_encoder = msgspec.json.Encoder()
_call_decoder = msgspec.json.Decoder(Call)
_answer_decoder = msgspec.json.Decoder(Answer)


def frame(message: Call | Answer) -> bytes:
    """`message` as one frame: length prefix and JSON body."""
    body = _encoder.encode(message)
    if len(body) > MAX_CONTROL_FRAME:
        raise ValueError(f"control frame of {len(body)} bytes exceeds {MAX_CONTROL_FRAME}")
    return _LEN.pack(len(body)) + body


def body_length(prefix: bytes) -> int:
    """The length a frame's prefix announces; ValueError past the limit (the connection is dropped)."""
    n: int = _LEN.unpack(prefix)[0]
    if n > MAX_CONTROL_FRAME:
        raise ValueError(f"control frame of {n} bytes exceeds {MAX_CONTROL_FRAME}")
    return n


PREFIX_BYTES = _LEN.size


def decode_call(body: bytes) -> Call:
    return _call_decoder.decode(body)


def decode_answer(body: bytes) -> Answer:
    return _answer_decoder.decode(body)
