"""Page tables are kept per lease on the worker: each page of a lease crosses to the worker once,
in the step after the lease gained it, and the worker forgets a lease's table when it ends."""

from __future__ import annotations

import torch

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.models.registry import build_model
from kvfence.engine.page_tables import LeasePageTables
from kvfence.engine.protocol import PageGrant, RunStep, decode_request, encode
from kvfence.engine.runner import ModelRunner
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.lease_table import LeaseTable
from kvfence.scheduler.offline import OfflineEngine

PAGE = 4
A, B = (3 << 120) | 7, (5 << 100) | 9


def test_a_step_sends_only_the_pages_a_lease_gained_and_ended_leases_are_named_once() -> None:
    table = LeaseTable(8)
    pages = table.reserve(A, 2)
    assert pages is not None and table.new_pages(A, pages) == pages
    assert table.new_pages(A, pages) == []  # nothing new: nothing sent
    more = table.reserve(A, 1)
    assert more is not None and table.new_pages(A, pages + more) == more
    b_pages = table.reserve(B, 1)
    assert b_pages is not None
    table.release(A)
    table.quarantine(B, 0.0)  # never stepped: the worker has no table of B to forget
    pending = table.take_pending()
    released, ended = pending.released, pending.ended
    assert sorted(released) == sorted(pages + more) and ended == [A]
    assert table.take_pending().ended == []


def test_every_lease_carries_its_tenant_until_its_pages_are_back() -> None:
    """The table names each lease's tenant from its opening to its last page back (quarantine
    included); grants carry the name to the worker, which forgets it with the lease, also for a
    lease it was granted pages for but never stepped."""
    table = LeaseTable(8)
    table.open(A, "acme")
    table.open(B, "globex")
    assert table.reserve(A, 2) is not None and table.reserve(B, 1) is not None
    grants = table.take_pending().grants
    assert {(g.lease, g.tenant) for g in grants} == {(A, "acme"), (B, "globex")}
    assert table.who(A).endswith("(tenant acme)") and table.num_leases == 2
    table.quarantine(B, 0.0)
    assert table.tenant_of(B) == "globex"  # quarantined: still named in the lines about it
    table.release(A)
    assert table.tenant_of(A) is None and table.take_pending().ended == [B, A]  # granted, never stepped
    assert table.confirm_quiet(B) and table.num_leases == 0

    worker_tables = LeasePageTables()
    for g in grants:
        worker_tables.name(g.lease, g.tenant)
    assert worker_tables.who(B).endswith("(tenant globex)") and len(worker_tables) == 2
    worker_tables.forget([B, A])
    assert len(worker_tables) == 0 and "tenant" not in worker_tables.who(A)


def test_the_wire_form_carries_128_bit_leases_exactly() -> None:
    step = RunStep(step_id=1, seqs=[], grants=[PageGrant(A, [1], "acme")], ended=[A, B])
    assert decode_request(encode(step)) == step


def engine(tiny: Checkpoint) -> OfflineEngine:
    model = build_model(tiny, torch.float32)
    return OfflineEngine(ModelRunner(model, KVPool(model.config, 32, PAGE, torch.float32)), tiny.tokenizer,
                         chunk_tokens=8)


def test_every_page_crosses_once_and_output_is_unchanged(tiny: Checkpoint) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)] * 2
    want = [o.generated_token_ids for o in engine(tiny).generate(prompts, params)]

    e = engine(tiny)
    sent: dict[int, list[int]] = {}  # lease -> pages sent for it, in order
    granted: dict[int, list[int]] = {}
    steps = 0
    execute = e.worker.execute_with_logits

    def recording(message: RunStep, return_logits: bool = False):  # type: ignore[no-untyped-def]
        nonlocal steps
        for grant in message.grants:
            granted.setdefault(grant.lease, []).extend(grant.pages)
        for seq in message.seqs:
            sent.setdefault(seq.lease, []).extend(seq.new_pages)
            steps += 1
        return execute(message, return_logits)

    e.worker.execute_with_logits = recording  # type: ignore[method-assign]
    got = [o.generated_token_ids for o in e.generate(prompts, params)]
    assert got == want
    # each lease's pages crossed exactly once, in the order they were granted, over many steps
    assert sent == granted and all(len(set(p)) == len(p) for p in sent.values())
    assert steps > sum(len(p) for p in sent.values())
    # the last message named both leases as ended: the worker keeps no table, and only the prefix
    # cache holds pages (the full prompt page of the first prompt)
    assert len(e.worker.page_tables) == 0 and e.ledger.num_in_use == 0 and e.ledger.num_cached == 1
    cached = [p for p in range(e.worker.pool.num_pages) if e.ledger.is_sealed(p)]
    assert all(e.worker.pool.owner(p) == 0 for p in range(e.worker.pool.num_pages) if p not in cached)
    e.core.flush_cache(0.0)  # what only the cache held comes back, untagged
    e.generate([[15]], [SamplingParams(temperature=0, max_tokens=1)])
    assert e.ledger.num_used == 0 and all(e.worker.pool.owner(p) == 0 for p in range(e.worker.pool.num_pages))
