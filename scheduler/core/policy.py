"""Batching decisions: pure functions from the set of requests to what one step runs.

No I/O and no awaiting here; the scheduler dispatches what these return.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypedDict

from kvfence.engine.protocol import SeqStep
from kvfence.scheduler.core.lease_table import LeaseTable
from kvfence.scheduler.core.lifecycle import State
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.worker_binding import WorkerBinding


def decode_steps(requests: list[Request], table: LeaseTable) -> list[SeqStep]:
    """One step per decoding request: feed its last token, which lands at position len(tokens) - 1.
    `table`: the decode pool's, which knows what of each page table its worker already has."""
    return [SeqStep(lease=r.decode_lease, token_ids=[r.tokens[-1]], context_tokens=len(r.tokens) - 1,
                    new_pages=table.new_pages(r.decode_lease, r.decode_pages), sampling=r.step_params,
                    output_index=r.num_generated, seal=r.seal, **_counting(r, r.decode_lease, len(r.tokens) - 1))
            for r in requests]


class _Counting(TypedDict, total=False):
    history: list[int]
    prompt_tokens: int
    grammar: str | None


class _Scoring(TypedDict, total=False):
    score: list[int]
    score_top: int


def _counting(req: Request, lease: int, position: int) -> _Counting:
    """SeqStep's history, prompt_tokens and grammar of a sampling step of `req` on `lease` at
    `position`: the worker of a penalized or grammar-bound request keeps its state per lease
    (engine/token_counts.py, engine/grammar.py), so the first sampling step of each lease carries
    every token before it (and the grammar's text), and the request notes that it did."""
    if not req.params.tracks_history:
        return {}
    if req.counted_lease == lease:
        return {"prompt_tokens": len(req.prompt)}
    req.counted_lease = lease
    return {"history": req.tokens[:position], "prompt_tokens": len(req.prompt), "grammar": req.params.grammar}


def _scoring(req: Request, start: int, n: int) -> _Scoring:
    """SeqStep's score and score_top of a chunk of `req` feeding positions [start, start + n): position p
    scores prompt token p + 1, for the prompt tokens not scored yet (a recompute after a
    preemption scores only what the first attempt did not)."""
    if not req.scores_prompt:
        return {}
    first, end = len(req.prompt_logprobs), len(req.prompt) - 1  # positions still to score: [first, end)
    score = [req.tokens[p + 1] if first <= p < end else -1 for p in range(start, start + n)]
    if all(t < 0 for t in score):
        return {}
    return {"score": score, "score_top": req.params.prompt_logprobs or 0}


def prefill_chunks(requests: list[Request], budget_tokens: int, table: LeaseTable, *,
                   held_back: frozenset[str] = frozenset(), held_back_tokens: int = 0) -> list[tuple[Request, SeqStep]]:
    """Chunks of the tokens each request still has to prefill, in the order given, within the budget.

    A request prefills its prompt, or after a preemption its prompt plus what it generated. The
    chunk that completes it asks for a sample: the request's next output token. `table`: the
    prefill pool's. The requests of the groups in `held_back` (`RecentGroups`) take at most
    `held_back_tokens` of the budget together."""
    out: list[tuple[Request, SeqStep]] = []
    for req in requests:
        if budget_tokens <= 0:
            break
        remaining = req.prefill_target - req.prefilled
        held = req.share in held_back and not req.priority
        if remaining <= 0 or (held and held_back_tokens <= 0):
            continue
        n = min(remaining, budget_tokens, held_back_tokens if held else budget_tokens)
        last = req.prefilled + n == req.prefill_target
        counting = _counting(req, req.prefill_lease, req.prefilled) if last else _Counting()
        out.append((req, SeqStep(lease=req.prefill_lease, token_ids=req.tokens[req.prefilled: req.prefilled + n],
                                 context_tokens=req.prefilled,
                                 new_pages=table.new_pages(req.prefill_lease, req.prefill_pages),
                                 sampling=req.step_params if last else None,
                                 output_index=req.num_generated, seal=req.seal, **counting,
                                 **_scoring(req, req.prefilled, n))))
        budget_tokens -= n
        if held:
            held_back_tokens -= n
    return out


def prefill_order(prefilling: list[Request]) -> list[Request]:
    """`prefilling` (the requests prefilling on one worker, in the order they got their pages) in
    the order the chunk budget goes to them: priority ones first; then every fair-share group's
    first before any group's second (and so on), and among those the one with the least left to
    prefill, so a group's short prompt is never held up behind another group's long ones; a
    group's own requests keep their order.

    While more than one group prefills, only each group's first (and priority ones) are listed: a
    step's time is about its prefill tokens, so one group's burst of prompts never lengthens the
    step another group's prompt waits for; the burst goes on in later steps."""
    ahead: dict[str, int] = {}
    rank: dict[str, int] = {}
    for r in prefilling:
        rank[r.request_id] = ahead.get(r.share, 0)
        ahead[r.share] = rank[r.request_id] + 1
    if len(ahead) > 1:
        prefilling = [r for r in prefilling if r.priority or rank[r.request_id] == 0]
    return sorted(prefilling, key=lambda r: (not r.priority, rank[r.request_id], r.prefill_target - r.prefilled))


class RecentGroups:
    """The fair-share groups that sent a request lately: while two or more did, the server is
    contended, and a step sized and queued for one group's throughput is a wait for another's
    first token.

    A step cannot be interrupted, and on a CPU both workers' steps take turns on the same cores
    (engine/compute.py): a request that comes while a step of another group's prompts runs waits
    for all of it (a full chunk of 128 tokens: 0.12-0.19 s on the development machine, twice a
    short prompt's whole time to first token alone), and for any step queued behind it. So while
    contended, the groups that already have something decoding prefill at most
    `contended_chunk_tokens` a step (`prefill_chunks`' held_back) and every step waits for the
    device to be free (`waits_for_device`), while a prompt whose first token someone waits for goes
    at once, ahead of the queue (RunStep.urgent). Uncontended, one group's steps keep the whole
    chunk and the queue (`--contention-window 0`: always)."""

    def __init__(self, window_s: float) -> None:
        """`window_s`: how long a group counts as active after its last request came (0: never)."""
        self.window_s = window_s
        self._last: dict[str, float] = {}

    def arrived(self, share: str, now: float) -> None:
        if self.window_s > 0:
            self._last[share] = now

    def contended(self, now: float) -> bool:
        """Whether two or more groups sent a request in the last `window_s` (forgets older ones)."""
        if len(self._last) > 1:
            self._last = {s: t for s, t in self._last.items() if now - t <= self.window_s}
        return len(self._last) > 1


def decoding_groups(running: Mapping[State, Mapping[str, Request]]) -> frozenset[str]:
    """The groups with a request decoding: their first tokens came. A request of any other group
    (or a priority one) waits for its first token (`waits_for_first_token`)."""
    return frozenset(r.share for r in running[State.DECODING].values())


def waits_for_first_token(req: Request, decoding: frozenset[str]) -> bool:
    return req.priority or req.share not in decoding


def prefilling_on(w: WorkerBinding, running: Mapping[State, Mapping[str, Request]]) -> list[Request]:
    return [r for r in running[State.PREFILLING].values() if r.pair is not None and r.pair.prefill is w]


def first_token_on(w: WorkerBinding, running: Mapping[State, Mapping[str, Request]]) -> bool:
    """Whether a prompt waiting for its first token waits for a step of `w`."""
    decoding = decoding_groups(running)
    return w.prefills and any(waits_for_first_token(r, decoding) and not r.stepping for r in prefilling_on(w, running))


def contended_chunks(prefilling: list[Request], running: Mapping[State, Mapping[str, Request]], budget_tokens: int,
                     table: LeaseTable, contended: bool, held_back_tokens: int
                     ) -> tuple[list[tuple[Request, SeqStep]], bool]:
    """The prefill chunks of a step (`prefill_chunks` in `prefill_order`) and whether it is urgent:
    while `contended`, the groups already decoding take at most `held_back_tokens`, and none when
    a prompt waits for its first token, which the step then carries alone, urgent."""
    decoding = decoding_groups(running)
    first_tokens = any(waits_for_first_token(r, decoding) for r in prefilling)
    chunks = prefill_chunks(prefill_order(prefilling), budget_tokens, table,
                            held_back=decoding if contended else frozenset(),
                            held_back_tokens=0 if first_tokens else held_back_tokens)
    return chunks, any(waits_for_first_token(r, decoding) for r, _ in chunks)


def turn_order(workers: list[WorkerBinding], contended: bool, first_token_on: Callable[[WorkerBinding], bool]
               ) -> list[WorkerBinding]:
    """The order the idle workers plan their next step in (`first_token_on`: whether a worker has
    a prompt waiting for its first token). Uncontended, decode workers first: their step is queued
    first on a device they share. Contended, the workers with a prompt waiting for its first token
    first, then the one whose last step is the oldest (the device goes round, `waits_for_device`)."""
    if not contended:
        return sorted(workers, key=lambda o: not o.decodes)
    return sorted(workers, key=lambda o: (not first_token_on(o), o.last_step))


def waits_for_device(w: WorkerBinding, workers: list[WorkerBinding], contended: bool) -> bool:
    """Whether worker `w`'s next step, unless urgent, waits: while contended, until no other worker
    on its device has a step in flight. So a prompt that comes finds at most one step ahead of it,
    the one the device runs, and its own step (urgent) passes any queued (RunStep.urgent). Its
    cost: the device is idle while the scheduler hears of one step and sends the next."""
    return contended and any(o.stepping for o in workers if w.shares_device_with(o))


def grant_goes_ahead(w: WorkerBinding, running: Mapping[State, Mapping[str, Request]]) -> bool:
    """Whether decode worker `w` gets a message of tag changes alone before its next decode step:
    a request of a group with nothing decoding will move its KV into `w`'s pool and has pages
    there whose grant is unsent (`running`: the running requests by state).

    A transfer into `w` starts only once its pages' grant was answered, and that grant would
    otherwise ride the next decode step of everyone already running: sent alone, it is answered at
    once, and that group's first token waits for its own prefill only (on one device the two
    workers' steps take turns, so the decode step then runs after that prefill). Only for such a
    group: done for every new request, the decode steps of a busy server would wait behind a
    prefill step at every admission (ITL p99 doubled at 16 streams, docs/benchmarks.md)."""
    decoding = decoding_groups(running)
    return any(r.pair is not None and r.pair.decode is w and r.decode_lease != r.prefill_lease
               and r.share not in decoding and w.table.grant_unsent(r.decode_lease)
               for state in (State.PREFILLING, State.TRANSFERRING) for r in running[state].values())


def pages_short(req: Request, page_size_tokens: int) -> int:
    """Pages a decoding request still needs before its next step: that step writes the K/V of
    its last token at position len(tokens) - 1."""
    return -(-len(req.tokens) // page_size_tokens) - len(req.decode_pages)
