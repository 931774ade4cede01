"""Batching decisions: pure functions from the set of requests to what one step runs.

No I/O and no awaiting here; the scheduler dispatches what these return.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvfence.engine.protocol import SamplingSpec, SeqStep
from kvfence.scheduler.lease_table import LeaseTable
from kvfence.scheduler.request import Request, State
from kvfence.scheduler.worker_binding import WorkerBinding


def decode_steps(requests: list[Request], table: LeaseTable) -> list[SeqStep]:
    """One step per decoding request: feed its last token, which lands at position len(tokens) - 1.
    `table`: the decode pool's, which knows what of each page table its worker already has."""
    return [SeqStep(r.decode_lease, [r.tokens[-1]], len(r.tokens) - 1, table.new_pages(r.decode_lease, r.decode_pages),
                    SamplingSpec.of(r.params), r.num_generated, r.seal,
                    **_counting(r, r.decode_lease, len(r.tokens) - 1))
            for r in requests]


def _counting(req: Request, lease: int, position: int) -> dict[str, object]:
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


def _scoring(req: Request, start: int, n: int) -> dict[str, object]:
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


def prefill_chunks(requests: list[Request], budget_tokens: int, table: LeaseTable) -> list[tuple[Request, SeqStep]]:
    """Chunks of the tokens each request still has to prefill, first come first served, within the budget.

    A request prefills its prompt, or after a preemption its prompt plus what it generated. The
    chunk that completes it asks for a sample: the request's next output token. `table`: the
    prefill pool's."""
    out: list[tuple[Request, SeqStep]] = []
    for req in requests:
        if budget_tokens <= 0:
            break
        remaining = req.prefill_target - req.prefilled
        if remaining <= 0:
            continue
        n = min(remaining, budget_tokens)
        last = req.prefilled + n == req.prefill_target
        out.append((req, SeqStep(req.prefill_lease, req.tokens[req.prefilled: req.prefilled + n],
                                 req.prefilled, table.new_pages(req.prefill_lease, req.prefill_pages),
                                 SamplingSpec.of(req.params) if last else None, req.num_generated, req.seal,
                                 **(_counting(req, req.prefill_lease, req.prefilled) if last else {}),
                                 **_scoring(req, req.prefilled, n))))
        budget_tokens -= n
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
    decoding = {r.share for r in running[State.DECODING].values()}
    return any(r.pair is not None and r.pair.decode is w and r.decode_lease != r.prefill_lease
               and r.share not in decoding and w.table.grant_unsent(r.decode_lease)
               for state in (State.PREFILLING, State.TRANSFERRING) for r in running[state].values())


def pages_short(req: Request, page_size_tokens: int) -> int:
    """Pages a decoding request still needs before its next step: that step writes the K/V of
    its last token at position len(tokens) - 1."""
    return -(-len(req.tokens) // page_size_tokens) - len(req.decode_pages)
