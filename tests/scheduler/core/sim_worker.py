"""The core explorer's model of a worker (tests/scheduler/core/core_explorer.py): what a worker does to
its pool's pages as engine/worker.py does it — releases, grants, landings, seals, ended leases,
page tables — and the checks of every sequence a step runs: each page it touches carries its
lease's tag (or, read-only, its tenant's seal), and each token slot it reads was written by its
lease (or sealed for its tenant). A broken rule raises `Broken`."""

from __future__ import annotations

import dataclasses

from kvfence.engine.ids import id_hex
from kvfence.engine.protocol import RunStep, SeqFailure, StepDone, StepFailed, WorkerReply

TOKEN = 7  # the token every step samples (never an EOS id of the tiny tokenizer)


class Broken(Exception):
    """An invariant broke inside an event (the explorer adds the trace)."""


@dataclasses.dataclass
class SimWorker:
    """What a worker does to its pool's pages: owner tags and who last wrote each token slot."""

    name: str
    page_size: int
    incarnation: int = 1
    tags: dict[int, int] = dataclasses.field(default_factory=dict)  # page -> lease (absent: free)
    slots: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (page, slot) -> writer lease
    page_tables: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # lease -> its pages, in order
    tenants: dict[int, str] = dataclasses.field(default_factory=dict)  # lease -> the tenant its grant named
    message: RunStep | None = None  # the step in flight

    def inc(self) -> str:
        return f"{self.name}-{self.incarnation}"

    def run(self, msg: RunStep, fail: bool = False, fail_seq: int | None = None,
            defer_seq: int | None = None, cut: bool = False) -> WorkerReply:
        """Apply `msg` as engine/worker.py does; `fail`: its forward fails after the tag changes
        were applied (a worker that cannot apply them restarts instead); `fail_seq`: that seq
        fails alone after its forward ran (it gets no token, the others carry on); `defer_seq`:
        that seq is left out untouched, its page table extended (its grammar is compiling); `cut`:
        the step (sent cuttable) stops between layers, every seq deferred, no write counted."""
        if msg.incarnation and msg.incarnation != self.inc():
            return StepFailed(step_id=msg.step_id, message="restarted", incarnation=self.inc(), stale_incarnation=True)
        for page in msg.released:
            self.tags.pop(page, None)
            for slot in range(self.page_size):
                self.slots.pop((page, slot), None)
        for grant in msg.grants:
            if not grant.tenant:
                raise Broken(f"a grant of lease {id_hex(grant.lease)[-6:]} does not name its tenant")
            self.tenants[grant.lease] = grant.tenant
            for page in grant.pages:
                self.tags[page] = grant.lease
        for landing in msg.landed:  # the sanitizer learns who wrote a landed transfer
            self.write(landing.lease, landing.pages, landing.first_token, landing.num_tokens)
        for seal in msg.sealed:  # read-only from now on, readable by the tenant's seal
            for page in seal.pages:
                self.tags[page] = seal.seal
                for slot in range(self.page_size):
                    if self.slots.get((page, slot)) == seal.lease:
                        self.slots[(page, slot)] = seal.seal
                    else:
                        self.slots.pop((page, slot), None)
        for lease in msg.ended:
            self.page_tables.pop(lease, None)
            self.tenants.pop(lease, None)
        for seq in msg.seqs:
            self.page_tables.setdefault(seq.lease, []).extend(seq.new_pages)
        if fail:
            return StepFailed(step_id=msg.step_id, message="injected", incarnation=self.inc())
        if cut:
            if not msg.cuttable:
                raise Broken(f"{self.name} worker: step {msg.step_id} cut, but not sent cuttable")
            return StepDone(step_id=msg.step_id, tokens=[None] * len(msg.seqs), incarnation=self.inc(),
                            deferred=list(range(len(msg.seqs))), cut=True)
        tokens: list[int | None] = []
        for i, seq in enumerate(msg.seqs):
            if i == defer_seq:
                tokens.append(None)
                continue
            lease, table = seq.lease, self.page_tables[seq.lease]
            end = seq.context_tokens + len(seq.token_ids)
            if len(table) * self.page_size < end:
                raise Broken(f"{self.name} worker: the page table of lease {id_hex(lease)[-6:]} holds {len(table)} "
                             f"pages, too few for {end} tokens")
            read_only = seq.context_tokens // self.page_size  # pages before the first one it writes
            for pos in range(end):
                page = table[pos // self.page_size]
                allowed = (lease, seq.seal) if seq.seal and pos // self.page_size < read_only else (lease,)
                if self.tags.get(page) not in allowed:
                    raise Broken(f"{self.name} worker: seq of lease {id_hex(lease)[-6:]} touches page {page} tagged "
                                 f"{id_hex(self.tags.get(page, 0))[-6:]}")
                if pos < seq.context_tokens and self.slots.get((page, pos % self.page_size)) not in (lease, seq.seal or lease):
                    raise Broken(f"{self.name} worker: lease {seq.lease[-6:]} reads token {pos} (page {page}) "
                                 f"that it did not write")
            self.write(lease, table, seq.context_tokens, end)
            tokens.append(TOKEN if seq.sampling is not None else None)
        if defer_seq is not None:
            return StepDone(step_id=msg.step_id, tokens=tokens, incarnation=self.inc(), deferred=[defer_seq])
        if fail_seq is None:
            return StepDone(step_id=msg.step_id, tokens=tokens, incarnation=self.inc())
        tokens[fail_seq] = None
        return StepDone(step_id=msg.step_id, tokens=tokens, incarnation=self.inc(),
                        failed=[SeqFailure(fail_seq, "injected")])

    def write(self, lease: int, pages: list[int], start: int, end: int) -> None:
        for pos in range(start, end):
            self.slots[(pages[pos // self.page_size], pos % self.page_size)] = lease
