"""Structured output: a grammar per request, enforced by a token bitmask inside the batched step.

A request's grammar is a canonical JSON text (`grammar_spec`): `{"type": "json_object"}` (any JSON
object) or `{"type": "json_schema", "schema": ..., "strict": ...}`. The library is xgrammar: on
this CPU it computed the next-token mask of a JSON schema over the default model's 49,152 tokens
and advanced its matcher in 9 us per token (median; mean 10), against 16 us for llguidance (mean
52: its first tokens are slow) and over 700 us for outlines-core (`scripts/bench_grammar.py`,
docs/benchmarks.md). JSON is
generated compact (no whitespace between tokens of the syntax), which keeps a small model from
wandering into whitespace.

The worker that samples a request keeps one matcher per lease (`LeaseGrammars`), built from the
lease's history on its first sampling step and advanced by the output tokens each later step
feeds, exactly like the penalty counts (engine/token_counts.py); compiled grammars are cached per
worker (LRU), so a schema compiles once. The mask is applied to the logits before bias, penalties
and sampling; logprobs stay those of the model's own distribution.
"""

from __future__ import annotations

import collections
import json
import re
from typing import Any

import torch

from kvfence.engine.tokenizer import Tokenizer

MAX_COMPILED = 64  # compiled grammars a worker keeps
_ERROR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: "


def grammar_spec(kind: str, schema: Any = None, strict: bool = False) -> str:
    """The canonical text of a grammar (what `SamplingParams.grammar` holds and workers cache by)."""
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    return json.dumps({"type": "json_schema", "schema": schema, "strict": bool(strict)}, sort_keys=True,
                      separators=(",", ":"))


def check_grammar(spec: str) -> None:
    """Raise ValueError (its message says what is wrong) when `spec` cannot be compiled."""
    import xgrammar as xgr

    parsed = json.loads(spec)
    if parsed["type"] == "json_object":
        return
    try:
        xgr.Grammar.from_json_schema(json.dumps(parsed["schema"]), any_whitespace=False, separators=(",", ":"),
                                     strict_mode=parsed["strict"])
    except RuntimeError as e:
        raise ValueError(_ERROR_PREFIX.sub("", str(e)).strip() or "the schema cannot be compiled") from e


class LeaseGrammars:
    """A worker's grammar matchers, one per lease whose sampling has a grammar."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._matchers: dict[int, tuple[Any, int]] = {}  # lease -> (matcher, tokens of the sequence seen)

    def __len__(self) -> int:
        return len(self._matchers)

    def _compile(self, spec: str) -> Any:
        import xgrammar as xgr

        if spec in self._compiled:
            self._compiled.move_to_end(spec)
            return self._compiled[spec]
        if self._compiler is None:
            if self._tokenizer is None:
                raise ValueError("this worker has no tokenizer, so it cannot enforce a grammar")
            tok = self._tokenizer
            vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
            info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                     stop_token_ids=sorted(tok.eos_token_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        parsed = json.loads(spec)
        if parsed["type"] == "json_object":
            compiled = self._compiler.compile_builtin_json_grammar()
        else:
            compiled = self._compiler.compile_json_schema(json.dumps(parsed["schema"]), any_whitespace=False,
                                                          separators=(",", ":"), strict_mode=parsed["strict"])
        self._compiled[spec] = compiled
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

    def observe(self, lease: int, spec: str, position: int, token_ids: list[int], history: list[int] | None,
                prompt_tokens: int) -> Any:
        """The matcher of `lease` after the output tokens among `token_ids` (at positions
        [position, ...) of its sequence, whose first `prompt_tokens` are the prompt). `history`
        (the tokens at [0, position)) starts it afresh. Raises ValueError on a gap or a token the
        grammar refuses (a bug upstream: the step fails)."""
        import xgrammar as xgr

        if history is not None:
            if len(history) != position:
                raise ValueError(f"a history of {len(history)} tokens for a step at position {position}")
            self._matchers[lease] = (xgr.GrammarMatcher(self._compile(spec)), 0)
            self._advance(lease, history, prompt_tokens)
        entry = self._matchers.get(lease)
        if entry is None or entry[1] != position:
            raise ValueError(f"a grammar step at position {position} of a lease with no matcher at that position")
        return self._advance(lease, token_ids, prompt_tokens)

    def _advance(self, lease: int, token_ids: list[int], prompt_tokens: int) -> Any:
        matcher, seen = self._matchers[lease]
        for token in token_ids[max(0, prompt_tokens - seen):]:
            if not matcher.accept_token(token):
                raise ValueError(f"the grammar refuses output token {token}")
        self._matchers[lease] = (matcher, seen + len(token_ids))
        return matcher

    def forget(self, leases: list[int]) -> None:
        for lease in leases:
            self._matchers.pop(lease, None)

    def clear(self) -> None:
        self._matchers.clear()


def apply_grammars(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """logits: [N, V] float32; matchers[i]: row i's matcher or None. Returns logits with every
    token the row's grammar does not allow next at -inf (a copy; the input is left as it is)
    when any row has a matcher, else the input itself."""
    rows = [row for row, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[1])  # [N, ceil(V / 32)] int32
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    out = logits.float().clone()
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=logits.shape[1], indices=rows)
    return out
