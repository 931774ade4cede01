"""One request's lifecycle: its states and the only place they change.

WAITING -> PREFILLING -> TRANSFERRING -> DECODING -> FINISHED   (disaggregated)
WAITING -> PREFILLING -> DECODING -> FINISHED                   (colocated)
PREFILLING or DECODING -> WAITING                                (preempted: the pool ran out)
any non-terminal state -> ABORTED (client gone) or FAILED (server-side error)

A preempted request keeps its tokens and its text state (detokenizer, stop matcher): its next
attempt prefills prompt + every token generated so far, and the token that prefill samples is the
next new one, so the stream goes on where it stopped.

Terminal states are monotone: once ABORTED or FAILED, never FINISHED; a late "finished" after an
abort is ignored, and so is a second terminal transition.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from kvfence.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.errors import RequestError
from kvfence.scheduler.handle import OutputDelta, RequestHandle


class State(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.ABORTED, State.FAILED)


_ALLOWED = {
    State.WAITING: {State.PREFILLING},
    State.PREFILLING: {State.TRANSFERRING, State.DECODING, State.WAITING},
    State.TRANSFERRING: {State.DECODING},
    State.DECODING: {State.FINISHED, State.WAITING},
}


class IllegalTransition(RuntimeError):
    pass


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    handle: RequestHandle
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    state: State = State.WAITING
    prefill_lease: int = 0
    decode_lease: int = 0
    prefill_pages: list[int] = dataclasses.field(default_factory=list)
    decode_pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    prefill_target: int = 0  # tokens this attempt prefills: the prompt, or after a preemption tokens so far
    prefilled: int = 0  # tokens of prefill_target whose K/V are in the prefill (or colocated) pool
    decoded_context: int = 0  # tokens whose K/V are in the decode pool
    pending_token: int | None = None  # sampled by prefill, emitted once the KV has landed
    prefill_done_s: float = 0.0  # monotonic time the prefill sampled the first token (disaggregated)
    abort_requested: bool = False
    abort_error: RequestError | None = None  # why the server aborted it (None: the client went away)
    arrival: int = 0  # admission order: the newest running request is the one preempted
    priority: bool = False  # a server-internal request (the readiness canary): ahead of the queue
    preemptions: int = 0
    created_s: float = dataclasses.field(default_factory=time.monotonic)
    queued_s: float = dataclasses.field(default_factory=time.monotonic)  # when it last joined the queue
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    def advance(self, new: State) -> None:
        """Move to a non-terminal-by-error state; raises on a transition the lifecycle forbids."""
        if new not in _ALLOWED.get(self.state, set()):
            raise IllegalTransition(f"request {self.request_id}: {self.state.value} -> {new.value}")
        self.state = new

    def requeue(self) -> None:
        """Preempted (its pages are being released): back to WAITING, to prefill `tokens` again."""
        self.advance(State.WAITING)
        self.preemptions += 1
        self.prefill_target = len(self.tokens)
        self.prefilled = self.decoded_context = 0
        self.prefill_pages, self.decode_pages = [], []
        self.queued_s = time.monotonic()

    def finish(self, reason: str, tail_text: str = "", tail_ids: list[int] | None = None) -> bool:
        """Successful end ("stop" / "length"). False (and nothing sent) if already terminal."""
        if self.state.terminal:
            return False
        self.state = State.FINISHED
        self.finish_reason = reason
        self.handle.push(OutputDelta(tail_text, tail_ids or [], finish_reason=reason))
        return True

    def fail(self, error: RequestError, aborted: bool = False) -> bool:
        """End with an error (FAILED, or ABORTED for a client-initiated end). False if terminal."""
        if self.state.terminal:
            return False
        self.state = State.ABORTED if aborted else State.FAILED
        self.handle.push(OutputDelta("", [], error=error))
        return True
