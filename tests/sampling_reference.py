"""Slow references for sampling controls: one row, one vocabulary entry at a time, from the
definitions (OpenAI: presence, frequency, logit_bias; vLLM: repetition_penalty, its order)."""

from __future__ import annotations

import torch

from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.offline import OfflineEngine


def slow_processed(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """The logits of one row after bias, then repetition, frequency and presence penalties."""
    out = list(logits)
    for token, bias in p.logit_bias:
        out[token] += bias
    for v in range(len(out)):
        if v in prompt or v in output:
            out[v] = out[v] / p.repetition_penalty if out[v] > 0 else out[v] * p.repetition_penalty
        n = output.count(v)
        out[v] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return out


def slow_greedy(engine: OfflineEngine, prompt: list[int], p: SamplingParams, max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding of `prompt` with `p`'s bias and penalties applied by `slow_processed` to the
    model's raw logits, recomputing the whole sequence for every token. Returns the tokens and the
    raw logits row [V] each was picked from."""
    output: list[int] = []
    rows: list[torch.Tensor] = []
    for _ in range(max_tokens):
        raw = engine.generate([prompt + output], [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)],
                              return_logits=True)[0].logits[0]  # type: ignore[index]
        processed = slow_processed(raw.tolist(), p, prompt, output)
        output.append(max(range(len(processed)), key=processed.__getitem__))
        rows.append(raw)
    return output, rows


def slow_prompt_logprobs(engine: OfflineEngine, prompt: list[int]) -> list[torch.Tensor]:
    """The model's log-softmax [V] (float64) after each prefix prompt[:k + 1], k = 0 .. len - 2:
    what prompt token k + 1 is scored against, one whole forward per prefix."""
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return [torch.log_softmax(engine.generate([prompt[:k + 1]], [one], return_logits=True)[0].logits[0].double(), -1)  # type: ignore[index]
            for k in range(len(prompt) - 1)]
