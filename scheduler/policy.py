"""Batching decisions: pure functions from the set of requests to what one step runs.

No I/O and no awaiting here; the scheduler dispatches what these return.
"""

from __future__ import annotations

from kvfence.scheduler.messages import SamplingSpec, SeqStep, id_hex
from kvfence.scheduler.request import Request


def decode_steps(requests: list[Request]) -> list[SeqStep]:
    """One step per decoding request: feed its last token, which lands at position len(tokens) - 1."""
    return [SeqStep(id_hex(r.decode_lease), [r.tokens[-1]], len(r.tokens) - 1, r.decode_pages,
                    SamplingSpec.of(r.params), r.num_generated) for r in requests]


def prefill_chunks(requests: list[Request], budget_tokens: int) -> list[tuple[Request, SeqStep]]:
    """Chunks of prompt for requests still prefilling, first come first served, within the budget.

    The chunk that completes a prompt asks for a sample (the request's first output token)."""
    out: list[tuple[Request, SeqStep]] = []
    for req in requests:
        if budget_tokens <= 0:
            break
        remaining = len(req.prompt) - req.prefilled
        if remaining <= 0:
            continue
        n = min(remaining, budget_tokens)
        last = req.prefilled + n == len(req.prompt)
        out.append((req, SeqStep(id_hex(req.prefill_lease), req.prompt[req.prefilled: req.prefilled + n],
                                 req.prefilled, req.prefill_pages,
                                 SamplingSpec.of(req.params) if last else None, 0)))
        budget_tokens -= n
    return out
