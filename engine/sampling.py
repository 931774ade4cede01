"""Per-request sampling parameters and the batched sampler that picks one token per logits row.

Contract of `Sampler.sample`: every row is processed by the same batched tensor ops, in vLLM's
order: the logits first get the row's `logit_bias`, then its repetition, frequency and presence
penalties (engine/logits_processing.py, over the counts a worker keeps per lease:
engine/token_counts.py). Greedy rows (temperature 0) take the argmax of those logits. The other
rows are divided by their temperature, cut to their min-p, top-k, then top-p nucleus, and sampled
with the exponential race:
`token = argmax(probs / q)` with `q ~ Exp(1)` drawn independently per vocabulary entry, which picks
token i with probability probs[i].

Seeds: the noise of a row whose request has a seed is a pure function of
(seed, output_index, vocab size), so a seeded request reproduces its tokens whatever else shares
the batch, whichever row it sits in, and whichever worker samples it (on the same device type and
torch version: CPU and CUDA generators produce different streams). Rows without a seed draw from
one generator owned by the `Sampler`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from kvfence.engine.grammar import grammar_key
from kvfence.engine.logits_processing import apply_logit_bias, apply_min_p, apply_penalties

if TYPE_CHECKING:
    from kvfence.engine.token_counts import TokenCounts

# Temperatures below this are greedy: the distribution is a point mass for any practical logits,
# and dividing by a vanishing temperature would overflow float32.
MIN_SAMPLING_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_REPETITION_PENALTY = 2.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature: >= 0; 0 (or below MIN_SAMPLING_TEMPERATURE) is greedy.
    top_p: in (0, 1]; 1 keeps the whole distribution.
    top_k: 0 or -1 is off (every token kept); k >= 1 keeps the k most likely tokens.
    seed: any int makes the sampled tokens reproducible; None draws from the sampler's generator.
    max_tokens: >= 1, or None for "until the context is full".
    stop: non-empty strings that end generation; the matched string is not part of the output.
    stop_token_ids: token ids (>= 0) that end generation, in addition to the model's EOS ids.
    ignore_eos: keep generating past the model's EOS ids.
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token the
      output holds, once (presence) or once per occurrence (frequency), as OpenAI defines them.
    repetition_penalty: > 0; the logit of every token in the prompt or the output is divided by it
      when positive, multiplied when negative (1 = off), as vLLM and transformers define it.
    min_p: in [0, 1]; tokens less likely than min_p times the most likely one are dropped (0 = off).
    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before anything else.
    logprobs: None (off) or 0..MAX_LOGPROBS: return the sampled token's log-probability and that
      many of the most likely alternatives, from the model's own distribution (before bias,
      penalties and temperature: what vLLM returns by default).
    grammar: None, or the canonical text of a grammar the output must follow (engine/grammar.py).
    grammar_key: the name workers know its compiled grammar by (engine/grammar.py `grammar_key`;
      the front end's names the tenant too); left empty, the digest of `grammar`.
    compiled_grammar: the front end's `Compiled` grammar (engine/grammar.py), held for as long as
      the request lives so an in-process worker finds it by key and never compiles; None: a
      worker compiles `grammar` itself (offline use). Not part of equality.
    prompt_logprobs: None (off) or 0..MAX_LOGPROBS: also return the log-probability of every
      prompt token after the first, given the tokens before it, with that many alternatives
      (completions' `echo` with `logprobs`; vLLM's `prompt_logprobs`).
    Lists given for `stop` / `stop_token_ids` are stored as tuples, so the params stay hashable.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None
    grammar_key: str = ""
    compiled_grammar: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 for off, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            raise ValueError(f"stop must be a tuple of strings, got the string {self.stop!r}; "
                             f"wrap it: stop=({self.stop!r},)")
        stop = tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        stop_token_ids = tuple(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in stop_token_ids):
            raise ValueError(f"stop_token_ids must hold ints >= 0, got {stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._check_processing()
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_token_ids)

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
            object.__setattr__(self, name, float(value))
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), "
                             f"got {self.repetition_penalty!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        bias = tuple((t, b) for t, b in self.logit_bias)
        if any(not _is_int(t) or t < 0 or not _is_real(b) or not -100 <= b <= 100 for t, b in bias):
            raise ValueError(f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {bias!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"grammar must be None or a grammar's text, got {self.grammar!r}")
        if self.grammar is not None and not self.grammar_key:
            object.__setattr__(self, "grammar_key", grammar_key(self.grammar))
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))

    def __deepcopy__(self, memo: dict[int, Any]) -> SamplingParams:
        """Immutable once made (its grammar's compiled form is shared by design): a copy is itself.
        The core explorer copies the whole scheduler per transition (tests/scheduler/core/)."""
        return self

    def for_steps(self) -> SamplingParams:
        """What every step of the request carries to its worker (engine/protocol.py's
        SeqStep.sampling): these params less the grammar's text and compiled form, which workers
        know by `grammar_key` (the text travels once, with the lease's history)."""
        if self.grammar is None and self.compiled_grammar is None:
            return self
        return replace(self, grammar=None, compiled_grammar=None)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def tracks_history(self) -> bool:
        """Whether the worker that samples it keeps state of its sequence per lease (penalty
        counts or a grammar matcher), built from the history its lease's first step carries."""
        return self.penalized or bool(self.grammar_key)

    @property
    def penalized(self) -> bool:
        """Whether picking a token needs the counts of the tokens before it (engine/token_counts.py)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample `index` (0-based) of a request asking for several (OpenAI's
        `n`): a seeded request's sample i is seeded `seed + i` (as vLLM does), so each sample is
        reproducible and no two draw the same noise; unseeded ones each draw their own."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=self.seed + index)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, output_index: int) -> int:
    """The 64-bit generator seed for the noise of output token `output_index` of a seeded request."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64))


def _apply_top_k(x: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """x: [M, V] scaled logits. Rows with k in 1..V-1 keep exactly their k largest entries (others
    -inf); rows with k off (0 / -1) or k >= V are returned untouched."""
    vocab = x.shape[1]
    on = [row for row, k in enumerate(top_ks) if 0 < k < vocab]
    if not on:
        return x
    device = x.device
    on_rows = torch.tensor(on, dtype=torch.int64, device=device)  # [R]
    ks = torch.tensor([top_ks[row] for row in on], dtype=torch.int64, device=device)  # [R]
    max_k = max(top_ks[row] for row in on)
    sub = x.index_select(0, on_rows)  # [R, V]
    top_ids = sub.topk(max_k, dim=-1).indices  # [R, max_k]
    rank_kept = torch.arange(max_k, device=device)[None, :] < ks[:, None]  # [R, max_k]
    keep = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, top_ids, rank_kept)  # [R, V]
    return x.index_copy(0, on_rows, sub.masked_fill(~keep, -math.inf))


def _apply_top_p(x: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """x: [M, V] scaled logits. Rows with p < 1 keep their nucleus: the most likely tokens whose
    probabilities sum to >= p (a token is kept when the mass strictly above it is < p; the most
    likely token is always kept). Rows with p == 1 are returned untouched; no sort without p < 1."""
    on = [row for row, p in enumerate(top_ps) if p < 1.0]
    if not on:
        return x
    device = x.device
    on_rows = torch.tensor(on, dtype=torch.int64, device=device)  # [R]
    ps = torch.tensor([top_ps[row] for row in on], dtype=torch.float32, device=device)  # [R]
    sub = x.index_select(0, on_rows)  # [R, V]
    sorted_logits, order = sub.sort(dim=-1, descending=True)  # [R, V] each
    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [R, V]
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [R, V]
    drop_sorted = mass_above >= ps[:, None]  # [R, V]
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)  # [R, V], vocab order
    return x.index_copy(0, on_rows, sub.masked_fill(drop, -math.inf))


class Sampler:
    """Samples one token per logits row (see the module docstring for the contract).

    `seed` seeds the generator shared by rows without a seed (None: seeded from OS entropy).
    That generator is per device and lives in this object; seeded rows never touch it.
    """

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None and not _is_int(seed):
            raise ValueError(f"Sampler seed must be an int or None, got {seed!r}")
        self._base_seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._base_seed is None:
                gen.seed()
            else:
                gen.manual_seed(_splitmix64(self._base_seed & _MASK64))
            self._generators[device] = gen
        return gen

    def _exponential_noise(self, params: list[SamplingParams], output_index: list[int], vocab: int,
                           device: torch.device) -> torch.Tensor:
        """[M, V] float32 Exp(1) noise, clamped away from 0 so `probs / q` is never 0/0."""
        noise = torch.empty((len(params), vocab), dtype=torch.float32, device=device)  # [M, V]
        unseeded = [row for row, p in enumerate(params) if p.seed is None]
        if unseeded:
            shared = self._shared_generator(device)
            if len(unseeded) == len(params):
                noise.exponential_(generator=shared)
            else:
                rows = torch.tensor(unseeded, dtype=torch.int64, device=device)
                drawn = torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device)
                noise.index_copy_(0, rows, drawn.exponential_(generator=shared))
        for row, p in enumerate(params):
            if p.seed is None:
                continue
            gen = torch.Generator(device=device)
            gen.manual_seed(noise_seed(p.seed, output_index[row]))
            # A fresh [V] tensor, so the draw cannot depend on the row's place in the batch.
            noise[row] = torch.empty(vocab, dtype=torch.float32, device=device).exponential_(generator=gen)
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], output_index: list[int],
               counts: list[TokenCounts | None] | None = None) -> torch.Tensor:
        """logits: [N, V] (float32; other float dtypes are upcast). params[i] and output_index[i]
        (>= 0, the position of the token being sampled within request i's output) belong to row i;
        counts[i] is what row i's sequence has seen (needed where params[i].penalized).
        Returns [N] int64 token ids on the logits' device."""
        if logits.dim() != 2 or logits.shape[1] == 0:
            raise ValueError(f"logits must be [num_rows, vocab] with vocab >= 1, got shape {tuple(logits.shape)}")
        num_rows, vocab = logits.shape
        if len(params) != num_rows or len(output_index) != num_rows:
            raise ValueError(f"one SamplingParams and one output_index per logits row: {num_rows} rows, "
                             f"{len(params)} params, {len(output_index)} output indices")
        if any(not _is_int(i) or i < 0 for i in output_index):
            raise ValueError(f"output_index must hold ints >= 0, got {output_index!r}")
        if any(p.logit_bias or p.penalized for p in params):
            logits = apply_logit_bias(logits.float(), params)
            logits = apply_penalties(logits, params, counts or [None] * num_rows)
        tokens = logits.argmax(dim=-1)  # [N] int64
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        if not sampled:
            return tokens
        device = logits.device
        rows = torch.tensor(sampled, dtype=torch.int64, device=device)  # [M]
        sub_params = [params[row] for row in sampled]
        temperatures = torch.tensor([p.temperature for p in sub_params], dtype=torch.float32,
                                    device=device)  # [M]
        scaled = logits.index_select(0, rows).float() / temperatures[:, None]  # [M, V]
        scaled = apply_min_p(scaled, [p.min_p for p in sub_params])
        scaled = _apply_top_k(scaled, [p.top_k for p in sub_params])
        scaled = _apply_top_p(scaled, [p.top_p for p in sub_params])
        probs = torch.softmax(scaled, dim=-1)  # [M, V]
        noise = self._exponential_noise(sub_params, [output_index[row] for row in sampled], vocab, device)
        chosen = (probs / noise).argmax(dim=-1)  # [M]
        return tokens.index_copy_(0, rows, chosen)
