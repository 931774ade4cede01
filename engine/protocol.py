"""The worker protocol: every message between the scheduler and a worker, as msgspec structs (one
tagged union each way), and the channel a scheduler calls a worker through.

Both sides import this module; the engine imports nothing of the scheduler. Lease ids are 128-bit
ints on both sides; the wire codec (`encode`, `decode_request`, `decode_reply`: JSON, which carries
ints of any size) is the one place they are serialized. New fields get defaults so old and new
peers interoperate.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from kvfence.engine.logprobs import TokenLogprobs
from kvfence.engine.sampling import SamplingParams


class SeqStep(msgspec.Struct, frozen=True):
    """One sequence's share of a step. The worker keeps each lease's page table (the pages its
    tokens live in, in order); a step carries only the pages appended to it since the lease's last
    step (`new_pages`), and the worker checks every page the seq reads against the lease's tag."""

    lease: int
    token_ids: list[int]  # a prefill chunk, or the one token to decode
    context_tokens: int  # tokens of this sequence already in the worker's pool
    new_pages: list[int]  # appended to the lease's page table before the step runs
    # How its token is picked: the request's own SamplingParams, as the scheduler holds it less the
    # grammar's text (`Request.step_params`: the text comes once, with `history`; workers know a
    # grammar by its key). None: an intermediate prefill chunk.
    sampling: SamplingParams | None
    output_index: int = 0
    # The seal tag of the sequence's tenant: it may also read (never write) pages sealed with it,
    # shared read-only from the prefix cache. 0: it reads only its own pages.
    seal: int = 0
    # For penalized or grammar-bound sampling (engine/token_counts.py, engine/grammar.py): on the
    # lease's first sampling step, every
    # token of the sequence before `token_ids` (None afterwards: the worker counts what steps feed),
    # and how many of the sequence's tokens are its prompt.
    history: list[int] | None = None
    prompt_tokens: int = 0
    # Prompt logprobs: for each token fed, the prompt token that follows it whose log-probability
    # the reply carries (-1: none), with `score_top` alternatives. None: nothing is scored.
    score: list[int] | None = None
    score_top: int = 0
    # With `history`, for a grammar-bound request: the grammar's text, which a worker with no
    # compiled copy of it compiles (engine/grammar.py LeaseGrammars)
    grammar: str | None = None


class PageGrant(msgspec.Struct, frozen=True):
    """Tag `pages` with `lease`, a lease of `tenant` (named in the worker's log lines about it;
    the tag, not the name, is what every read is checked against)."""

    lease: int
    pages: list[int]
    tenant: str = ""


class Landing(msgspec.Struct, frozen=True):
    """A verified transfer wrote token positions [first_token, num_tokens) of `lease`, whose page
    table is `pages` (positions before `first_token` are pages it shares from the cache)."""

    lease: int
    pages: list[int]
    num_tokens: int
    first_token: int = 0


class Seal(msgspec.Struct, frozen=True):
    """`pages`, which `lease` filled, become sealed: read-only, tagged `seal` (its tenant's), and
    readable by every sequence carrying that seal. The sanitizer keeps a slot only if `lease` wrote it."""

    lease: int
    seal: int
    pages: list[int]


class RunStep(msgspec.Struct, frozen=True, tag="run_step"):
    """Untag `released`, tag `grants` with their leases, note `landed` transfers, seal `sealed`
    pages, forget the page tables of `ended` leases, extend the tables of `seqs`, then run one
    forward over `seqs`."""

    step_id: int
    seqs: list[SeqStep]
    grants: list[PageGrant] = []
    released: list[int] = []
    landed: list[Landing] = []
    ended: list[int] = []  # leases that will never step again
    sealed: list[Seal] = []
    # The worker incarnation this step was built for; a worker that is another incarnation refuses
    # the whole message before applying any of it. "" (not known yet): no check.
    incarnation: str = ""
    # It carries a prompt whose first token someone waits for: on a device shared by several
    # workers it runs before the steps queued ahead of it (engine/compute.py).
    urgent: bool = False
    # It carries only prompt chunks of groups already decoding: the worker stops its forward
    # between two layers when asked (WorkerChannel.cut), replying with every seq deferred, so a
    # prompt whose first token someone waits for need not wait for the rest of it.
    cuttable: bool = False


class OwnerMismatch(msgspec.Struct, frozen=True):
    """A seq was taken out of a step before anything was read: one of its pages carries another
    lease's tag (`check="owner_tag"`), or, with the KV sanitizer on, a slot it would read was last
    written by another lease or by nobody (`check="sanitizer"`, `detail` says which slot)."""

    seq_index: int
    page: int
    owner: int  # the lease the page (owner_tag) or slot (sanitizer) belongs to; 0 = nobody
    check: str = "owner_tag"
    detail: str = ""


class SeqFailure(msgspec.Struct, frozen=True):
    """A seq of a step failed on its own: its request ends, the step's other seqs carry on.
    `request_fault`: the request itself led there (its grammar allows no next token), and
    `message` is worded for its client; otherwise the worker failed on it (`message` is the
    exception, for the log)."""

    seq_index: int
    message: str
    request_fault: bool = False


class StepDone(msgspec.Struct, frozen=True, tag="step_done"):
    step_id: int
    tokens: list[int | None]  # sampled token per seq, in order; None for a seq that did not run
    violations: list[OwnerMismatch] = []
    incarnation: str = ""  # the worker's current incarnation
    draining: bool = False  # the worker is shutting down: route nothing new to it
    # per seq, in order, when any seq asked for logprobs (else empty): its sampled token's
    logprobs: list[TokenLogprobs | None] = []
    # per seq, in order, when any seq scored its prompt (else empty): one per target of its
    # `score` that is not -1, in order
    prompt_logprobs: list[list[TokenLogprobs]] = []
    failed: list[SeqFailure] = []  # seqs that failed alone (their token is None)
    # seqs left out of this step (their page tables extended, nothing read, no K/V counted as
    # written): their grammar is compiling on this worker in the background, or the step was cut
    # short (`cut`). Send them again as they were.
    deferred: list[int] = []
    cut: bool = False  # a cuttable step stopped between layers when asked: every seq that ran is deferred


class StepFailed(msgspec.Struct, frozen=True, tag="step_failed"):
    step_id: int
    message: str
    incarnation: str = ""  # the worker's current incarnation
    stale_incarnation: bool = False  # refused unapplied: the step was built for an earlier incarnation
    draining: bool = False


WorkerRequest = RunStep
WorkerReply = StepDone | StepFailed

_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(WorkerRequest)
_reply_decoder = msgspec.json.Decoder(WorkerReply)


def encode(message: WorkerRequest | WorkerReply) -> bytes:
    """A message in its wire form."""
    return _encoder.encode(message)


def decode_request(payload: bytes) -> WorkerRequest:
    return _request_decoder.decode(payload)


def decode_reply(payload: bytes) -> WorkerReply:
    return _reply_decoder.decode(payload)


class WorkerLost(ConnectionError):
    """The worker behind a channel is gone (its connection dropped, or was never made): raised by
    every call on the channel from then on, and by every call waiting when it went."""


class WorkerChannel(Protocol):
    """The scheduler's end of the connection to one worker (engine/worker.py has the in-process
    one). Contract: the worker runs messages in the order `call` was entered, one at a time, and a
    reply to one message means every earlier one was applied (the scheduler relies on it:
    LeaseTable.grant_applied); a channel to a worker elsewhere must keep one ordered stream, and
    raises WorkerLost once that worker is gone.

    `name`: how the scheduler names the worker (unique among its workers: an in-process worker by
    its role, a remote one by role and address); `role`: "prefill", "decode" or "colocated";
    `device`: the compute queue its steps run on, shared by the workers that name the same one
    ("": a queue of its own)."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def device(self) -> str: ...

    async def call(self, request: WorkerRequest) -> WorkerReply: ...

    async def cut(self, step_id: int) -> None:
        """Ask the worker to stop step `step_id` between two layers if it is still running and
        was sent cuttable (RunStep.cuttable); a no-op otherwise. Its reply says whether it was."""
        ...

