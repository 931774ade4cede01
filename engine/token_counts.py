"""What a penalized sequence has seen so far, kept by the worker that samples it, per lease.

Presence and frequency penalties need how often each token occurs in a sequence's output, and the
repetition penalty which tokens its prompt or output holds. A worker keeps both per lease as two
[V] tensors, built once from the history the scheduler sends with the lease's first sampling step
(`SeqStep.history`: every token before that step's) and extended by the tokens each later step
feeds, so nothing is resent per token and no Python loop runs over the vocabulary. Only leases whose
sampling is penalized have counts; they are forgotten with their page tables.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class TokenCounts:
    output: torch.Tensor  # [V] float32: occurrences of each token id in the output so far
    seen: torch.Tensor  # [V] bool: token ids present in the prompt or the output
    num_tokens: int  # tokens of the sequence counted (prompt included)


class LeaseTokenCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._counts: dict[int, TokenCounts] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def observe(self, lease: int, position: int, token_ids: list[int], history: list[int] | None,
                prompt_tokens: int) -> TokenCounts:
        """Count `token_ids`, which sit at positions [position, position + len) of `lease`'s
        sequence, whose first `prompt_tokens` tokens are its prompt. `history` (the tokens at
        [0, position)) starts the lease's counts afresh; without it the lease must have counts
        that end exactly at `position`. Raises ValueError on a gap (a scheduler bug: the step fails)."""
        if history is not None:
            if len(history) != position:
                raise ValueError(f"a history of {len(history)} tokens for a step at position {position}")
            fresh = TokenCounts(torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device),
                                torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device), 0)
            self._counts[lease] = fresh
            self._add(fresh, history, prompt_tokens)
        counts = self._counts.get(lease)
        if counts is None or counts.num_tokens != position:
            have = "none" if counts is None else f"{counts.num_tokens} tokens"
            raise ValueError(f"a penalized step at position {position} of a lease with {have} counted and no history")
        self._add(counts, token_ids, prompt_tokens)
        return counts

    def _add(self, counts: TokenCounts, token_ids: list[int], prompt_tokens: int) -> None:
        if not token_ids:
            return
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)  # [T]
        if bad := [t for t in token_ids if not 0 <= t < self.vocab_size]:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary of {self.vocab_size}")
        counts.seen[ids] = True
        outputs = ids[max(0, prompt_tokens - counts.num_tokens):]  # [T'] the ones past the prompt
        if outputs.numel():
            counts.output += torch.bincount(outputs, minlength=self.vocab_size).to(torch.float32)
        counts.num_tokens += len(token_ids)

    def forget(self, leases: list[int]) -> None:
        for lease in leases:
            self._counts.pop(lease, None)

    def clear(self) -> None:
        self._counts.clear()
