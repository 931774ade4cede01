"""Batching decisions: pure functions from the set of requests to what one step runs.

No I/O and no awaiting here; the scheduler dispatches what these return.
"""

from __future__ import annotations

from kvfence.engine.protocol import SamplingSpec, SeqStep
from kvfence.scheduler.lease_table import LeaseTable
from kvfence.scheduler.request import Request


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


def pages_short(req: Request, page_size_tokens: int) -> int:
    """Pages a decoding request still needs before its next step: that step writes the K/V of
    its last token at position len(tokens) - 1."""
    return -(-len(req.tokens) // page_size_tokens) - len(req.decode_pages)
