"""Colocated generation without a server: the `kvfence generate` path and the engine's tests.

Each request gets a lease and every page it can ever need (prompt + max_tokens) before it runs, so
a running request never stalls for pages. Each step batches every decoding sequence with chunks of
prefill from the others, up to a token budget (continuous batching).
"""

from __future__ import annotations

import dataclasses
from collections import deque

import torch

from kvfence.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.ids import mint_id
from kvfence.scheduler.page_ledger import PageLedger


@dataclasses.dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    # Logits of every sampled token, [generated, vocab] float32, when asked for.
    logits: torch.Tensor | None = None


@dataclasses.dataclass
class _Sequence:
    index: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    lease: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)  # prompt + generated
    num_cached: int = 0  # tokens whose K/V are in the pool
    text: str = ""
    finish_reason: str | None = None
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    detok: IncrementalDetokenizer | None = None
    stops: StopStringMatcher | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)


class OfflineEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, chunk_tokens: int = 512,
                 max_running: int = 64) -> None:
        if chunk_tokens <= 0 or max_running <= 0:
            raise ValueError("chunk_tokens and max_running must be > 0")
        self.runner = runner
        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.ledger = PageLedger(runner.pool.num_pages)

    @property
    def max_context_tokens(self) -> int:
        return min(self.runner.model.config.max_context_tokens, self.runner.pool.capacity_tokens)

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.runner.pool.page_size_tokens)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 return_logits: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt; outputs in input order. Raises ValueError for a request that
        can never fit (empty prompt, prompt + max_tokens over the context) before anything runs."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not prompt:
                raise ValueError(f"request {i}: the prompt is empty")
            room = self.max_context_tokens - len(prompt)
            max_tokens = p.max_tokens if p.max_tokens is not None else room
            if max_tokens < 1 or len(prompt) + max_tokens > self.max_context_tokens:
                raise ValueError(f"request {i}: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                                 f"exceeds the context of {self.max_context_tokens} tokens")
            seqs.append(_Sequence(i, list(prompt), p, max_tokens, tokens=list(prompt)))
        waiting = deque(seqs)
        running: list[_Sequence] = []
        try:
            while waiting or running:
                while waiting and len(running) < self.max_running and self._admit(waiting[0]):
                    running.append(waiting.popleft())
                self._step(running, return_logits)
                for s in [s for s in running if s.finish_reason is not None]:
                    self._release(s)
                    running.remove(s)
        finally:
            for s in running:
                self._release(s)
        return [GenerationOutput(s.prompt, s.tokens[len(s.prompt):], s.text, s.finish_reason or "length",
                                 torch.stack(s.logits) if s.logits else None) for s in seqs]

    def _admit(self, s: _Sequence) -> bool:
        lease = mint_id()
        pages = self.ledger.reserve(lease, self._pages_for(len(s.prompt) + s.max_tokens))
        if pages is None:
            return False
        self.runner.pool.assign(pages, lease)
        s.lease, s.pages = lease, pages
        s.detok = IncrementalDetokenizer(self.tokenizer, s.prompt)
        s.stops = StopStringMatcher(s.params.stop)
        return True

    def _release(self, s: _Sequence) -> None:
        if s.lease:
            self.runner.pool.clear(s.pages)
            self.ledger.release(s.lease)
            s.lease, s.pages = 0, []

    def _step(self, running: list[_Sequence], return_logits: bool) -> None:
        works: list[SeqWork] = []
        owners: list[_Sequence] = []
        budget = self.chunk_tokens
        decoding = [s for s in running if s.num_cached == len(s.tokens) - 1 and s.num_cached > 0]
        prefilling = [s for s in running if s not in decoding]
        for s in decoding + prefilling:
            if budget <= 0:
                break
            chunk = s.tokens[s.num_cached: s.num_cached + budget]
            done = s.num_cached + len(chunk) == len(s.tokens)
            works.append(SeqWork(chunk, s.num_cached, s.pages, s.lease, s.params if done else None,
                                 s.num_generated))
            owners.append(s)
            budget -= len(chunk)
        result = self.runner.step(works, return_logits=return_logits)
        if result.violations:  # pages are handed out by this engine's own ledger: a bug if it happens
            v = result.violations[0]
            raise RuntimeError(f"KV integrity violation: page {v.page} owned by lease {v.owner:032x}, "
                               f"read by {v.lease:032x}")
        row = 0
        for s, w, tok in zip(owners, works, result.tokens):
            s.num_cached += len(w.token_ids)
            if tok is None:
                continue
            if result.logits is not None:
                s.logits.append(result.logits[row])
                row += 1
            self._accept(s, tok)

    def _accept(self, s: _Sequence, token: int) -> None:
        assert s.detok is not None and s.stops is not None  # set at admission
        s.tokens.append(token)
        p = s.params
        if (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids:
            s.text += s.stops.push(s.detok.flush())[0] + s.stops.flush()
            s.finish_reason = "stop"
            return
        safe, matched = s.stops.push(s.detok.push(token))
        s.text += safe
        if matched:
            s.finish_reason = "stop"
        elif s.num_generated >= s.max_tokens:
            s.text += s.stops.push(s.detok.flush())[0]
            s.text += "" if s.stops.matched else s.stops.flush()
            s.finish_reason = "stop" if s.stops.matched else "length"
