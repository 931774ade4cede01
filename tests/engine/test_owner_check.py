"""The owner-tag check in the runner: a sequence never reads a page tagged with another lease."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.owner_check import check_owner_tags
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.engine.sampling import SamplingParams

A, B = (7 << 100) | 1, (9 << 90) | 5  # two 128-bit leases
GREEDY = SamplingParams(temperature=0)


def runner(tiny: Checkpoint) -> ModelRunner:
    model = build_model(tiny, torch.float32)
    return ModelRunner(model, KVPool(model.config, 16, 4, torch.float32))


def test_foreign_page_is_never_read_and_others_are_unaffected(tiny: Checkpoint) -> None:
    r = runner(tiny)
    r.pool.assign([0, 1], A)
    r.pool.assign([2, 3], B)
    prompt_a, prompt_b = [5, 6, 7, 8, 9], [10, 11, 12]
    alone = r.step([SeqWork.local(token_ids=prompt_a, context_tokens=0, page_table=[0, 1], lease=A,
                            sampling=GREEDY)]).tokens[0]
    before = r.pool.data[1].clone()
    # B's table names A's page 1: B is taken out before anything is read or written.
    out = r.step([SeqWork.local(token_ids=prompt_a, context_tokens=0, page_table=[0, 1], lease=A, sampling=GREEDY),
                  SeqWork.local(token_ids=prompt_b, context_tokens=0, page_table=[1], lease=B, sampling=GREEDY)])
    assert out.tokens == [alone, None]
    (v,) = out.violations
    assert (v.work_index, v.page, v.lease, v.owner) == (1, 1, B, A)
    torch.testing.assert_close(r.pool.data[1], before)  # B wrote nothing into A's page


def test_free_pages_and_new_token_pages_are_checked(tiny: Checkpoint) -> None:
    r = runner(tiny)
    r.pool.assign([0], A)
    # Context of 4 tokens fills page 0; the new token lands in page 5, which nobody owns.
    (v,) = check_owner_tags(r.pool, [SeqWork.local(token_ids=[3], context_tokens=4, page_table=[0, 5], lease=A,
                                             sampling=GREEDY)])
    assert (v.page, v.owner) == (5, 0)
    assert check_owner_tags(r.pool, [SeqWork.local(token_ids=[3], context_tokens=3, page_table=[0, 5], lease=A,
                                             sampling=GREEDY)]) == []  # page 5 not touched yet
    r.pool.clear([0])
    (v,) = check_owner_tags(r.pool, [SeqWork.local(token_ids=[3], context_tokens=3, page_table=[0], lease=A,
                                             sampling=GREEDY)])
    assert v.owner == 0


def test_only_the_first_bad_page_per_sequence_is_reported(tiny: Checkpoint) -> None:
    r = runner(tiny)
    r.pool.assign([0, 1, 2], B)
    violations = check_owner_tags(r.pool, [SeqWork.local(token_ids=[1] * 10, context_tokens=0, page_table=[0, 1, 2],
                                                   lease=A, sampling=GREEDY)])
    assert [(v.page, v.owner) for v in violations] == [(0, B)]


@pytest.mark.parametrize("scrub", ["off", "poison"])
def test_stale_read_after_release_is_visible_only_when_poisoned(tiny: Checkpoint, scrub: str) -> None:
    """The incident's mechanism: a later lease decodes from pages it never wrote. With scrubbing off it
    silently continues the previous owner's sequence; poisoned, its output no longer matches it."""
    r = runner(tiny)
    r.pool.assign([0, 1], A)
    prompt = [5, 6, 7, 8, 9, 10]
    first = r.step([SeqWork.local(token_ids=prompt, context_tokens=0, page_table=[0, 1], lease=A,
                            sampling=GREEDY)]).tokens[0]
    want = r.step([SeqWork.local(token_ids=[first], context_tokens=6, page_table=[0, 1], lease=A,
                           sampling=GREEDY)], return_logits=True)
    r.pool.clear([0, 1], scrub)
    r.pool.assign([0, 1], B)  # handed to B, which never prefilled them (a placeholder "transfer")
    stale = r.step([SeqWork.local(token_ids=[first], context_tokens=6, page_table=[0, 1], lease=B,
                            sampling=GREEDY)], return_logits=True)
    assert want.logits is not None and stale.logits is not None
    if scrub == "off":
        torch.testing.assert_close(stale.logits, want.logits)  # B reads A's KV: the leak
    else:
        assert (stale.logits - want.logits).abs().max() > 1.0
