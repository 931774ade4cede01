"""One model step over a batch of sequences: the compute core of a worker.

The caller (scheduler or offline engine) decides what runs; the runner turns that decision into
tensors, runs the model over the paged KV pool, and samples. It never allocates pages: page
tables come from the page ledger and are only read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvfence.engine.attention import build_attention_batch
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.kv_sanitizer import KvSanitizer, SlotViolation
from kvfence.engine.grammar import apply_grammars
from kvfence.engine.models.family import Model
from kvfence.engine.logprobs import TokenLogprobs, token_logprobs
from kvfence.engine.owner_check import OwnerViolation, check_owner_tags
from kvfence.engine.protocol import SeqStep
from kvfence.engine.sampling import Sampler, SamplingParams
from kvfence.engine.token_counts import TokenCounts


@dataclasses.dataclass
class SeqWork:
    """One sequence's step as the runner runs it: the step as the scheduler sent it
    (engine/protocol.py's SeqStep, not copied) and what the worker holds for its lease: its whole
    page table, the counts of the tokens it has seen and its grammar matcher."""

    seq: SeqStep
    page_table: list[int]  # pages covering context_tokens + len(token_ids), in order
    counts: TokenCounts | None = None  # where its sampling is penalized (token_counts.py)
    grammar: Any = None  # its grammar matcher, where its output must follow one (grammar.py)

    @classmethod
    def local(cls, *, page_table: list[int], lease: int, token_ids: list[int], context_tokens: int,
              sampling: SamplingParams | None, counts: TokenCounts | None = None, grammar: Any = None,
              **seq: Any) -> SeqWork:
        """A step run in this process with no scheduler (benchmarks, tests): the whole page
        table given, the SeqStep built from the rest (`seq`: its other fields)."""
        step = SeqStep(lease=lease, token_ids=token_ids, context_tokens=context_tokens, new_pages=[],
                       sampling=sampling, **seq)
        return cls(seq=step, page_table=page_table, counts=counts, grammar=grammar)

    @property
    def is_decode(self) -> bool:
        return len(self.seq.token_ids) == 1 and self.seq.context_tokens > 0


@dataclasses.dataclass
class StepResult:
    tokens: list[int | None]  # sampled token per SeqWork, in the caller's order (None if not run)
    logits: torch.Tensor | None  # [num sampled, vocab] float32 when asked for, in the same order
    violations: list[OwnerViolation | SlotViolation] = dataclasses.field(default_factory=list)  # works taken out
    # per work, in the caller's order, when any work asked for logprobs (else empty)
    logprobs: list[TokenLogprobs | None] = dataclasses.field(default_factory=list)
    # per work, in the caller's order, when any work scored tokens (else empty): one per target of
    # its `score` that is not -1
    prompt_logprobs: list[list[TokenLogprobs]] = dataclasses.field(default_factory=list)
    # works that ran but got no token because of something of their own (their grammar allows no
    # token): work index -> why, in words a client may read
    dead_ends: dict[int, str] = dataclasses.field(default_factory=dict)
    # the forward was stopped between layers when asked (`step`'s `cut`): no work got a token,
    # none of their K/V counts as written, and each is to be run again as it was
    cut: bool = False


class _Cut(Exception):
    """Raised between layers to stop a forward that was asked to stop."""


class ModelRunner:
    def __init__(self, model: Model, pool: KVPool, sampler: Sampler | None = None, *,
                 owner_check: bool = True, sanitizer: KvSanitizer | None = None) -> None:
        """`owner_check=False` (the owner-tag guard off, app/serve/guards.py) exists only so benchmarks can
        measure the check's cost. `sanitizer`: also check every slot a step reads against the lease
        that last wrote it, and record the step's writes (kv_sanitizer.py)."""
        if pool.config != model.config:
            raise ValueError("the KV pool was built for a different model config")
        self.model = model
        self.pool = pool
        self.sampler = sampler or Sampler()
        self.owner_check = owner_check
        self.sanitizer = sanitizer

    def step(self, works: list[SeqWork], return_logits: bool = False,
             cut: Callable[[], bool] | None = None) -> StepResult:
        """Run one forward over `works` (decodes are batched together; prefill chunks follow).

        `cut`: asked before each layer; once it answers True the forward stops there and the
        result says so (`StepResult.cut`): the layers that ran wrote K/V only into slots past each
        work's context, in its own pages, which running it again writes with the same bits.

        Every page a work touches must carry its lease (owner_check), and with a sanitizer every
        slot it reads must have been written by that lease; a work that fails either check is left
        out of the forward, gets no token, and is reported in `violations` (the first failure only).
        A work whose grammar allows no next token runs, gets no token, and is named in `dead_ends`;
        the other works are not touched by it."""
        page_size = self.pool.page_size_tokens
        for w in works:
            needed = -(-(w.seq.context_tokens + len(w.seq.token_ids)) // page_size)
            if not w.seq.token_ids or len(w.page_table) < needed:
                raise ValueError(f"sequence step needs {needed} pages and at least one token, "
                                 f"got {len(w.page_table)} pages and {len(w.seq.token_ids)} tokens")
            if w.seq.score is not None and len(w.seq.score) != len(w.seq.token_ids):
                raise ValueError(f"score names {len(w.seq.score)} targets for {len(w.seq.token_ids)} tokens")
        violations: list[OwnerViolation | SlotViolation] = []
        if self.owner_check:
            violations += check_owner_tags(self.pool, works)
        if self.sanitizer is not None:
            refused = {v.work_index for v in violations}
            violations += [v for v in self.sanitizer.check_reads(works) if v.work_index not in refused]
        if violations:
            excluded = {v.work_index for v in violations}
            kept = [i for i in range(len(works)) if i not in excluded]
            inner = (self.step([works[i] for i in kept], return_logits, cut) if kept
                     else StepResult(tokens=[], logits=None))
            tokens: list[int | None] = [None] * len(works)
            kept_logprobs: list[TokenLogprobs | None] = [None] * len(works) if inner.logprobs else []
            scores: list[list[TokenLogprobs]] = [[] for _ in works] if inner.prompt_logprobs else []
            for j, i in enumerate(kept):
                tokens[i] = inner.tokens[j]
                if inner.logprobs:
                    kept_logprobs[i] = inner.logprobs[j]
                if inner.prompt_logprobs:
                    scores[i] = inner.prompt_logprobs[j]
            dead_ends = {kept[j]: why for j, why in inner.dead_ends.items()}
            return StepResult(tokens=tokens, logits=inner.logits, violations=violations, logprobs=kept_logprobs,
                              prompt_logprobs=scores, dead_ends=dead_ends, cut=inner.cut)
        order = [i for i, w in enumerate(works) if w.is_decode] + \
                [i for i, w in enumerate(works) if not w.is_decode]
        num_decode = sum(1 for w in works if w.is_decode)
        ids: list[int] = []
        positions: list[int] = []
        score_rows: list[int] = []
        scored: list[int] = []  # indices into `works` that sample, in logits-row order
        params: list[SamplingParams] = []  # their sampling, in the same order
        prompt_rows: list[int] = []  # rows whose logits score a given token (prompt logprobs)
        prompt_targets: list[tuple[int, int]] = []  # (work index, token), per prompt row
        for i in order:
            w = works[i]
            if w.seq.score is not None:
                for j, target in enumerate(w.seq.score):
                    if target >= 0:
                        prompt_rows.append(len(ids) + j)
                        prompt_targets.append((i, target))
            ids.extend(w.seq.token_ids)
            positions.extend(range(w.seq.context_tokens, w.seq.context_tokens + len(w.seq.token_ids)))
            if w.seq.sampling is not None:
                score_rows.append(len(ids) - 1)
                scored.append(i)
                params.append(w.seq.sampling)
        device = self.pool.device
        batch = build_attention_batch(
            page_size,
            [(works[i].page_table, works[i].seq.context_tokens + 1) for i in order[:num_decode]],
            [(works[i].page_table, works[i].seq.context_tokens, len(works[i].seq.token_ids)) for i in order[num_decode:]],
            device,
        )
        tokens = [None] * len(works)

        def between_layers() -> None:
            if cut is not None and cut():
                raise _Cut

        try:
            all_logits = self.model.forward(torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                                            batch, self.pool,
                                            torch.tensor(score_rows + prompt_rows, dtype=torch.int64, device=device),
                                            between_layers if cut is not None else None)
        except _Cut:
            return StepResult(tokens=tokens, logits=None, cut=True)
        if self.sanitizer is not None:  # the forward stored every work's new K/V
            for w in works:
                self.sanitizer.record_write(w.seq.lease, w.page_table, w.seq.context_tokens, len(w.seq.token_ids))
        prompt_logprobs = self._prompt_logprobs(works, all_logits[len(score_rows):], prompt_targets)
        logits = all_logits[:len(score_rows)]
        if not scored:
            return StepResult(tokens=tokens, logits=None, prompt_logprobs=prompt_logprobs)
        # [N, V]; logprobs stay the model's
        allowed, dead_rows = apply_grammars(logits, [works[i].grammar for i in scored])
        sampled = self.sampler.sample(allowed, params, [works[i].seq.output_index for i in scored],
                                      [works[i].counts for i in scored])
        for i, tok in zip(scored, sampled.tolist()):
            tokens[i] = tok
        logprobs: list[TokenLogprobs | None] = []
        if any(p.logprobs is not None for p in params):
            logprobs = [None] * len(works)
            for i, lp in zip(scored, token_logprobs(logits, sampled, [p.logprobs for p in params])):
                logprobs[i] = lp
        dead_ends = {}
        for row in dead_rows:  # what was sampled there is noise: it is never sent
            i = scored[row]
            tokens[i] = None
            if logprobs:
                logprobs[i] = None
            dead_ends[i] = (f"the output's grammar allows no token after output token {works[i].seq.output_index}: "
                            "the schema cannot be satisfied from here")
        result = StepResult(tokens=tokens, logits=None, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                            dead_ends=dead_ends)
        if return_logits:
            result.logits = logits[sorted(range(len(scored)), key=lambda row: scored[row])]
        return result

    @staticmethod
    def _prompt_logprobs(works: list[SeqWork], logits: torch.Tensor,
                         targets: list[tuple[int, int]]) -> list[list[TokenLogprobs]]:
        """Per work, the log-probability of each token its `score` names, from `logits` (one row
        per target, in `targets`' order): one log_softmax and topk over every row (empty: none)."""
        if not targets:
            return []
        wanted = torch.tensor([t for _, t in targets], dtype=torch.int64, device=logits.device)
        entries = token_logprobs(logits, wanted, [works[i].seq.score_top for i, _ in targets])
        out: list[list[TokenLogprobs]] = [[] for _ in works]
        for (i, _), entry in zip(targets, entries):
            assert entry is not None
            out[i].append(entry)
        return out
