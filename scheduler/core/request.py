"""One request: what it asked for, where its pages are, what it has generated.

Where it is in its lifecycle (its state, what holds its pages, an end or a retry waiting) is its
`life`, changed only by scheduler/core/lifecycle.py's transition table; the properties here read
it. A preempted request keeps its tokens and its text state (detokenizer, stop matcher): its next
attempt prefills prompt + every token generated so far, and the token that prefill samples is the
next new one, so the stream goes on where it stopped. A request whose worker was lost before it
sent a token is retried once the same way, on another pair.

No clock is read here: every time comes from the caller (the scheduler core's events).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvfence.engine.logprobs import TokenLogprobs
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.lifecycle import Event, Exit, Hold, Lifecycle, State
from kvfence.scheduler.core.output import OutputDelta, TextOutput

if TYPE_CHECKING:
    from kvfence.scheduler.core.worker_binding import Pair

CLIENT_CLOSED = "client_closed"  # the code of the error a client-initiated end carries


def client_closed() -> RequestError:
    return RequestError(499, CLIENT_CLOSED, "the client closed the request")


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    output: TextOutput
    created_s: float  # when it was admitted (the caller's monotonic clock)
    life: Lifecycle = dataclasses.field(default_factory=Lifecycle)
    pair: Pair | None = None  # where this attempt runs, from its reservation until it is requeued or ends
    attempt: int = 1  # a preemption or a retry starts the next one, with new leases
    prefill_lease: int = 0
    decode_lease: int = 0
    prefill_pages: list[int] = dataclasses.field(default_factory=list)
    decode_pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    prefill_target: int = 0  # tokens this attempt prefills: the prompt, or after a preemption tokens so far
    prefilled: int = 0  # tokens of prefill_target whose K/V are in the prefill (or colocated) pool
    decoded_context: int = 0  # tokens whose K/V are in the decode pool
    pending_token: int | None = None  # sampled by prefill, emitted once the KV has landed
    pending_logprobs: TokenLogprobs | None = None  # the pending token's, when the request asked
    # prompt logprobs (params.prompt_logprobs): of prompt tokens 1, 2, ... scored so far; sent with the first token
    prompt_logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    counted_lease: int = 0  # penalized: the lease whose worker counts its tokens (scheduler/core/policy.py)
    prefill_done_s: float = 0.0  # when the prefill sampled the first token (disaggregated)
    chunk_cut: bool = False  # its last prompt chunk was cut short (StepDone.cut): the next runs whole
    retries: int = 0
    arrival: int = 0  # admission order: the newest running request is the one preempted
    priority: bool = False  # a server-internal request (the readiness canary): ahead of the queue
    # A later sample of an n > 1 request: it waits in the queue until this first sample's prompt
    # pages are cached in both pools, then shares them (SchedulerCore.submit_samples).
    leader: Request | None = None
    tenant: str = "anonymous"  # the authenticated tenant (scheduler/core/tenants.py); its leases are its own
    share: str = "anonymous"  # its fair-share group (Tenant.share_key) and that group's weight
    weight: int = 1
    # The prefix cache (scheduler/core/prefix_cache.py): the root of its chain of keys (None: not cached),
    # the seal of its tenant, the keys of the current attempt (for `keys_for` tokens), how many pages
    # of each page table it shares from the cache, and the prompt tokens its first attempt found cached.
    cache_root: bytes | None = None
    seal: int = 0
    cache_keys: list[bytes] = dataclasses.field(default_factory=list)
    keys_for: int = -1
    shared_prefill: int = 0
    shared_decode: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    queued_s: float = 0.0  # when it last joined the queue
    first_token_s: float | None = None
    last_token_s: float | None = None
    finish_reason: str | None = None

    @property
    def who(self) -> str:
        """How log lines name it: its id and its tenant."""
        return f"request {self.request_id} (tenant {self.tenant})"

    @property
    def scores_prompt(self) -> bool:
        """It asked for prompt logprobs and some prompt token is not scored yet (every one after
        the first is, given the tokens before it)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def state(self) -> State:
        return self.life.state

    @property
    def stepping(self) -> bool:
        """Part of a step in flight to a worker."""
        return self.life.hold is Hold.STEP

    @property
    def transfer(self) -> int:
        """The key of its KV transfer while one is started (0: none)."""
        return self.life.transfer

    @property
    def pending_end(self) -> RequestError | None:
        """An end asked for that waits until nothing touches its pages."""
        return self.life.error if self.life.exit is Exit.END else None

    @property
    def pending_retry(self) -> bool:
        """A worker of its pair was lost: retried once nothing touches its pages."""
        return self.life.exit is Exit.RETRY

    def fire(self, event: Event, *, error: RequestError | None = None, transfer: int = 0) -> None:
        """The lifecycle's `event` (scheduler/core/lifecycle.py TABLE; IllegalTransition otherwise)."""
        self.life.fire(event, self.who, error=error, transfer=transfer)

    def __post_init__(self) -> None:
        self.queued_s = self.created_s
        self.step_params = self.params.for_steps()  # what its steps carry (engine/protocol.py SeqStep.sampling)

    def requeue(self, now_s: float, *, retry: bool = False) -> None:
        """Preempted, or retried after a lost worker (its pages are being released): back to
        WAITING, to prefill `tokens` again as its next attempt, on whichever pair it gets then."""
        self.fire(Event.RETRY if retry else Event.PREEMPT)
        if retry:
            self.retries += 1
        else:
            self.preemptions += 1
        self.attempt += 1
        self.pair, self.chunk_cut = None, False
        self.prefill_target = len(self.tokens)
        self.prefilled = self.decoded_context = self.shared_prefill = self.shared_decode = 0
        self.prefill_pages, self.decode_pages = [], []
        self.queued_s = now_s

    def finish(self, last: OutputDelta) -> OutputDelta | None:
        """Successful end with `last`, a delta with its finish reason ("stop" / "length"); the
        delta to send, or None (nothing to send) if already terminal."""
        if self.state.terminal or last.finish_reason is None:
            return None
        self.fire(Event.FINISH)
        self.finish_reason = last.finish_reason
        return dataclasses.replace(last, cached_tokens=self.cached_tokens)

    def fail(self, error: RequestError) -> OutputDelta | None:
        """End with an error: ABORTED for a client-initiated end (`client_closed`), else FAILED.
        The delta to send, or None if already terminal."""
        if self.state.terminal:
            return None
        self.fire(Event.ABORT if error.code == CLIENT_CLOSED else Event.FAIL)
        return OutputDelta(text="", token_ids=[], error=error)
