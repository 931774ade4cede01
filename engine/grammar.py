"""Structured output: a grammar per request, enforced by a token bitmask inside the batched step.

A request's grammar is a canonical JSON text (`grammar_spec`): `{"type": "json_object"}` (any JSON
object) or `{"type": "json_schema", "schema": ..., "strict": ...}`. The library is xgrammar: on
this CPU it computed the next-token mask of a JSON schema over the default model's 49,152 tokens
and advanced its matcher in 9 us per token (median; mean 10), against 16 us for llguidance (mean
52: its first tokens are slow) and over 700 us for outlines-core (`scripts/bench_grammar.py`,
docs/benchmarks.md). JSON is
generated compact (no whitespace between tokens of the syntax), which keeps a small model from
wandering into whitespace.

Compiling is where a grammar costs: a crafted schema can take seconds to minutes. So the front end
bounds a schema's shape before anything else (app/api/grammar_bounds.py), then compiles it in a
process it can kill (app/api/grammar_compiler.py: a time budget) and keeps the result per tenant.
What it compiled lives in this process as a `Compiled` (found by its `key`, which names the tenant
and the text, while any request holds it): a worker in the same process takes it from there and
never compiles. A worker in another process compiles the text the lease's first sampling step
carries (`LeaseGrammars`), once per key (LRU), in a background thread: until it is done that seq
is left out of the worker's steps (`StepDone.deferred`), never the others. The front end has
already seen that text compile within its budget.

The worker that samples a request keeps one matcher per lease (`LeaseGrammars`), built from the
lease's history on its first sampling step and advanced by the output tokens each later step
feeds, exactly like the penalty counts (engine/token_counts.py). The mask is applied to the
logits before bias, penalties and sampling; logprobs stay those of the model's own distribution.
A row whose grammar allows no token at all is a dead end the request's own schema led into: it
gets no token and its request ends with 400, alone (`apply_grammars`, engine/runner.py).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import re
import weakref
from typing import Any

import torch

from kvfence.engine.tokenizer import Tokenizer

MAX_COMPILED = 64  # grammars a worker in another process than the front end keeps compiled
_ERROR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: "


def grammar_spec(kind: str, schema: Any = None, strict: bool = False) -> str:
    """The canonical text of a grammar (what `SamplingParams.grammar` holds)."""
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    return json.dumps({"type": "json_schema", "schema": schema, "strict": bool(strict)}, sort_keys=True,
                      separators=(",", ":"))


def grammar_key(spec: str, scope: str = "") -> str:
    """The name a compiled grammar is known by: a digest of `scope` (the front end's: the tenant)
    and the text. Steps carry it instead of the text."""
    return hashlib.sha256(f"{scope}\0{spec}".encode()).hexdigest()[:32]


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of the vocabulary: every token's bytes, `vocab_size` logits wide."""
    import xgrammar as xgr

    vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids))


def new_compiler(info: Any) -> Any:
    import xgrammar as xgr

    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_spec(compiler: Any, spec: str) -> Any:
    """xgrammar's compiled grammar of `spec`, or ValueError (its message says what is wrong) when
    it cannot be compiled or admits no output at all."""
    import xgrammar as xgr

    parsed = json.loads(spec)
    try:
        if parsed["type"] == "json_object":
            compiled = compiler.compile_builtin_json_grammar()
        else:
            compiled = compiler.compile_json_schema(json.dumps(parsed["schema"]), any_whitespace=False,
                                                    separators=(",", ":"), strict_mode=parsed["strict"])
    except RuntimeError as e:
        raise ValueError(_ERROR_PREFIX.sub("", str(e)).strip() or "the schema cannot be compiled") from e
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not _allows_any(bitmask, compiled.tokenizer_info.vocab_size)[0]:
        raise ValueError("the schema admits no output at all")
    return compiled


class Compiled:
    """A grammar compiled in this process, found by `key` (`Compiled.live`) while anything holds
    it: a request's `SamplingParams.compiled_grammar` does, from admission to its end."""

    _live: weakref.WeakValueDictionary[str, Compiled] = weakref.WeakValueDictionary()

    def __init__(self, key: str, grammar: Any) -> None:
        self.key, self.grammar = key, grammar
        self.size_bytes = int(grammar.memory_size_bytes)
        self.vocab_size = int(grammar.tokenizer_info.vocab_size)
        Compiled._live[key] = self

    @classmethod
    def live(cls, key: str) -> Compiled | None:
        return cls._live.get(key)


class LeaseGrammars:
    """A worker's grammar matchers, one per lease whose sampling has a grammar.

    A grammar the front end compiled in this process is taken by key. Any other (a worker in
    another process) is compiled here, in a background thread, never on the compute thread:
    `ready` starts the compile and says False until it is done, and the worker leaves that seq
    out of its step meanwhile (engine/worker.py, `StepDone.deferred`), so the other seqs of the
    step never wait for it. The front end has seen the text compile within its budget."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._pending: dict[str, concurrent.futures.Future[Any]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._matchers: dict[int, tuple[Any, int]] = {}  # lease -> (matcher, tokens of the sequence seen)

    def __len__(self) -> int:
        return len(self._matchers)

    def _shared(self, key: str) -> Any:
        shared = Compiled.live(key)
        return shared.grammar if shared is not None and shared.vocab_size == self.vocab_size else None

    def ready(self, key: str, spec: str | None) -> bool:
        """Whether the grammar named `key` can be used now; when not, its compile from `spec` is
        started (or goes on) in the background. True also when nothing can be done (no text):
        `observe` then raises for that seq alone."""
        if spec is None or self._shared(key) is not None or key in self._compiled:
            return True
        future = self._pending.get(key)
        if future is None:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvfence-grammar")
            self._pending[key] = self._pool.submit(self._compile, spec)
            return False
        if not future.done():
            return False
        del self._pending[key]
        try:
            self._keep(key, future.result())
        except ValueError:
            pass  # `observe` compiles again and raises it for that seq
        return True

    def wait(self, timeout_s: float) -> None:
        """Until some background compile is done, or `timeout_s` (a worker with nothing else to
        run waits here instead of answering empty steps as fast as they come)."""
        if self._pending:
            concurrent.futures.wait(list(self._pending.values()), timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def _compile(self, spec: str) -> Any:
        if self._compiler is None:  # one compile thread: no race
            if self._tokenizer is None:
                raise ValueError("this worker has no tokenizer, so it cannot enforce a grammar")
            self._compiler = new_compiler(tokenizer_info(self._tokenizer, self.vocab_size))
        return compile_spec(self._compiler, spec)

    def _keep(self, key: str, compiled: Any) -> None:
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    def _grammar(self, key: str, spec: str | None) -> Any:
        """The compiled grammar named `key`: the front end's when it lives in this process, else
        this worker's own (compiled from `spec` here when `ready` was not asked first: offline use)."""
        shared = self._shared(key)
        if shared is not None:
            return shared
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        if spec is None:
            raise ValueError(f"grammar {key} is not compiled here and the step does not carry its text")
        compiled = self._compile(spec)
        self._keep(key, compiled)
        return compiled

    def observe(self, lease: int, spec: str | None, position: int, token_ids: list[int], history: list[int] | None,
                prompt_tokens: int, key: str | None = None) -> Any:
        """The matcher of `lease` after the output tokens among `token_ids` (at positions
        [position, ...) of its sequence, whose first `prompt_tokens` are the prompt). `history`
        (the tokens at [0, position)) starts it afresh from the grammar named `key` (default: the
        digest of `spec`), compiled from the text `spec` where this process has no compiled copy.
        Raises ValueError on a gap or a token the grammar refuses (a bug upstream: that seq fails)."""
        import xgrammar as xgr

        if history is not None:
            if len(history) != position:
                raise ValueError(f"a history of {len(history)} tokens for a step at position {position}")
            grammar = self._grammar(key or grammar_key(spec or ""), spec)
            self._matchers[lease] = (xgr.GrammarMatcher(grammar), 0)
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


def _allows_any(bitmask: torch.Tensor, vocab: int) -> list[bool]:
    """Per row of a token bitmask, whether it allows some token of the `vocab` (bits past it never count)."""
    if vocab % 32:
        bitmask = bitmask.clone()
        bitmask[:, -1] &= (1 << (vocab % 32)) - 1
    return bitmask[:, :-(-vocab // 32)].ne(0).any(dim=1).tolist()


def apply_grammars(logits: torch.Tensor, matchers: list[Any]) -> tuple[torch.Tensor, list[int]]:
    """logits: [N, V] float32; matchers[i]: row i's matcher or None. Returns (logits with every
    token the row's grammar does not allow next at -inf: a copy, the input is left as it is, when
    any row has a matcher, else the input itself; the rows whose grammar allows no token at all,
    a dead end the request's own grammar led into: nothing may be sampled for them)."""
    rows = [row for row, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits, []
    import xgrammar as xgr

    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab)  # [N, ceil(V / 32)] int32
    for row in rows:
        matchers[row].fill_next_token_bitmask(bitmask, row)
    alive = _allows_any(bitmask, vocab)
    out = logits.float().clone()
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=vocab, indices=rows)
    return out, [row for row in rows if not alive[row]]
