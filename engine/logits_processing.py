"""Batched logit processing before a token is picked: bias, penalties, min-p.

Each function takes [M, V] float32 logits of M rows and returns logits of the same shape, touching
only the rows that ask for the processing (one gather, the ops, one scatter back); rows that do not
ask pay nothing. Definitions follow OpenAI (presence, frequency, logit_bias) and vLLM
(repetition_penalty, min_p); `tests/engine/test_logits_processing.py` checks them against a slow
per-row reference.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvfence.engine.token_counts import TokenCounts

if TYPE_CHECKING:  # sampling.py imports this module
    from kvfence.engine.sampling import SamplingParams


def apply_logit_bias(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x: [M, V]. Adds each row's (token id, bias) pairs; ids past the vocabulary are ignored
    (the API refuses them first)."""
    rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return x
    vocab = x.shape[1]
    ids = [t for p in params for t, _ in p.logit_bias]
    bias = [b for p in params for _, b in p.logit_bias]
    keep = [i for i, t in enumerate(ids) if t < vocab]
    index = (torch.tensor([rows[i] for i in keep], dtype=torch.int64, device=x.device),
             torch.tensor([ids[i] for i in keep], dtype=torch.int64, device=x.device))
    return x.index_put(index, torch.tensor([bias[i] for i in keep], dtype=x.dtype, device=x.device),
                       accumulate=True)


def apply_penalties(x: torch.Tensor, params: list[SamplingParams], counts: list[TokenCounts | None]) -> torch.Tensor:
    """x: [M, V]. For every penalized row (its counts given): the repetition penalty on the
    tokens of its prompt and output, then frequency and presence penalties on its output's."""
    on = [row for row, p in enumerate(params) if p.penalized]
    if not on:
        return x
    present = [c for c in (counts[row] for row in on) if c is not None]
    if len(present) < len(on):
        raise ValueError("a penalized row has no token counts")
    device = x.device
    on_rows = torch.tensor(on, dtype=torch.int64, device=device)  # [R]
    output = torch.stack([c.output for c in present])  # [R, V]
    seen = torch.stack([c.seen for c in present])  # [R, V]
    rep = torch.tensor([params[row].repetition_penalty for row in on], dtype=x.dtype, device=device)[:, None]
    freq = torch.tensor([params[row].frequency_penalty for row in on], dtype=x.dtype, device=device)[:, None]
    pres = torch.tensor([params[row].presence_penalty for row in on], dtype=x.dtype, device=device)[:, None]
    sub = x.index_select(0, on_rows)  # [R, V]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * output - pres * (output > 0).to(x.dtype)
    return x.index_copy(0, on_rows, sub)


def apply_min_p(x: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """x: [M, V] temperature-scaled logits. Rows with min_p > 0 drop (-inf) every token whose
    probability is below min_p times the most likely token's."""
    on = [row for row, p in enumerate(min_ps) if p > 0]
    if not on:
        return x
    device = x.device
    on_rows = torch.tensor(on, dtype=torch.int64, device=device)  # [R]
    ps = torch.tensor([min_ps[row] for row in on], dtype=x.dtype, device=device)[:, None]  # [R, 1]
    sub = x.index_select(0, on_rows)  # [R, V]
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
    drop = sub < sub.max(dim=-1, keepdim=True).values + torch.log(ps)
    return x.index_copy(0, on_rows, sub.masked_fill(drop, -math.inf))
