"""Log-probabilities of sampled tokens and their most likely alternatives, batched per step.

They come from the model's own distribution: log_softmax of the raw logits, before logit bias,
penalties, temperature and truncation (vLLM's default, "raw logprobs"), so a greedy token's
logprob is the model's and the alternatives do not depend on how the request samples.
"""

from __future__ import annotations

import msgspec
import torch


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One sampled token's log-probability and the `len(top_ids)` most likely tokens with theirs,
    most likely first."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_counts: list[int | None]) -> list[TokenLogprobs | None]:
    """logits: [N, V] raw; tokens: [N] the tokens picked; top_counts[i]: None (row i asked for
    nothing) or how many alternatives it wants. One log_softmax and one topk over the rows that ask."""
    on = [row for row, k in enumerate(top_counts) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(top_counts)
    if not on:
        return out
    rows = torch.tensor(on, dtype=torch.int64, device=logits.device)  # [R]
    lp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens.index_select(0, rows)[:, None])[:, 0].tolist()  # [R]
    max_k = max(top_counts[row] or 0 for row in on)
    top_values: list[list[float]] = [[] for _ in on]
    top_ids: list[list[int]] = [[] for _ in on]
    if max_k:
        top = lp.topk(max_k, dim=-1)  # [R, max_k] each
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for i, row in enumerate(on):
        k = top_counts[row] or 0
        out[row] = TokenLogprobs(chosen[i], top_ids[i][:k], top_values[i][:k])
    return out
