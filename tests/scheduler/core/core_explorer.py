"""An exhaustive, bounded explorer of the real scheduler core (scheduler/core/scheduler.py), its lease tables
and the transport receiver's state machine (transports/core/receiver_state.py).

A `World` is the core plus what stands around it, kept as small models of what they do to pages:
each worker applies a message's releases, then its grants, keeps each lease's page table from the
pages its steps send, then checks and writes the pages of every sequence it runs; the transport arms the real `ReceiverState`, and a transfer lands, fails
quietly, or fails loud (its cancellation unacknowledged) and may then write late until it is
reported quiet. `explore` runs a breadth-first search over every interleaving of the events a
state enables (submit, abort, step reply, failed step, step cut, worker restart, transfer success, quiet
failure, loud failure, late write, quiet, tick, and — with a second decode worker — the loss of
a worker), within budgets of each, deduplicating states, and checks the invariants of BRIEF.md
after every event:

- the ledgers account for every page, and no page is held by two leases;
- no step reads or writes a page whose tag is not the reader's lease, nor reads a slot its lease
  did not write (a decode before its KV landed);
- nothing is freed while a write may land or a posted write may read it: every page a transfer can
  still touch is held by its lease, owned or quarantined;
- terminal states are monotone: one terminal delta per request, nothing after it, and no token of a
  disaggregated request before its KV landed;
- once no event is enabled, every request is terminal, every page of a live worker is free and
  untagged (but for pages quarantined by a transfer whose sender was lost: nothing can ever say
  its writes are over), and no live worker keeps a page table.

A lost worker drops its step in flight; a transfer touching it fails as the transfer link would
see it (the lost end acknowledges nothing); its pool goes with it.

`explorer_search.explore` runs the breadth-first search over a World; the shortest event trace that
breaks an invariant comes back in its `Violation`.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable

from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.actions import Emit, MoveResult, SendStep, StartTransfer, WatchQuiet
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.scheduler import SchedulerCore
from kvfence.scheduler.core.errors import AdmissionRejected
from kvfence.engine.ids import id_hex
from kvfence.scheduler.metrics import SchedulerMetrics
from kvfence.scheduler.core.worker_binding import WorkerBinding
from kvfence.transports.base import TransferManifest
from kvfence.transports.core.receiver_state import ReceiverState
from sim_worker import Broken, SimWorker


@dataclasses.dataclass
class Budget:
    """How many of each event one path may contain."""

    requests: int = 2
    aborts: int = 1
    restarts: int = 1
    failed_steps: int = 0
    failed_seqs: int = 0  # one seq of a step fails alone (engine/worker.py: its request ends, the rest go on)
    deferred_seqs: int = 0  # one sampling seq is left out untouched, to be sent again (its grammar compiles)
    cuts: int = 0  # a cuttable step stops between layers: every seq deferred (RunStep.cuttable)
    ticks: int = 1
    transfer_faults: int = 1  # quiet or loud failures, in all
    flushes: int = 0  # POST /admin/flush_cache
    losses: int = 0  # workers lost (control connection dropped)


@dataclasses.dataclass
class Transfer:
    start: StartTransfer
    manifest: TransferManifest
    loud: bool = False  # failed with its cancellation unacknowledged: a write may still land
    watched: bool = False
    orphaned: bool = False  # its sender was lost: it is never reported quiet
    source_done: bool = False  # its sender acknowledged the cancel: it reads no source page any more


class World:
    """The core and its surroundings; `events()` lists what may happen next."""

    def __init__(self, tokenizer: Tokenizer, config: SchedulerConfig, pages: int, prompts: list[list[int]],
                 params: SamplingParams, budget: Budget, decodes: int = 1, samples: int = 1, device: str = "") -> None:
        """`decodes`: decode workers, each paired with the one prefill worker (disaggregated);
        `samples` > 1: the first submit admits that many samples of the first prompt at once
        (`submit_samples`, OpenAI's `n`), standing for that many of `prompts`; `device`: every worker's."""
        ids = itertools.count(1)
        self.config = config
        self.prefill = WorkerBinding("prefill" if config.disaggregated else "colocated", pages, device=device)
        self.decode = WorkerBinding("decode", pages, device=device) if config.disaggregated else self.prefill
        self.core = SchedulerCore(config, tokenizer, self.prefill, self.decode, SchedulerMetrics(),
                                  mint=lambda: next(ids) << 64 | 0xABC)
        for i in range(2, decodes + 1):
            self.core.add_pair(self.prefill, WorkerBinding(f"decode-{i}", pages, "decode", device))
        self.bindings = {w.name: w for w in self.core.workers}  # the lost ones too
        self.sims = {w.name: SimWorker(w.name, config.page_size_tokens) for w in self.core.workers}
        self.receivers = {w.name: ReceiverState(pages, 1, "none") for w in self.core.workers if w.role == "decode"}
        self.lost: set[str] = set()
        self.prompts, self.params, self.budget = prompts, params, dataclasses.replace(budget)
        self.samples = samples
        self.now = 0.0
        self.submitted: list[str | None] = []  # request ids, in submission order (None: refused)
        self.deltas: dict[str, list[Emit]] = {}
        self.landed: set[str] = set()  # requests whose KV transfer succeeded
        self.transfers: dict[int, Transfer] = {}
        self._transfer_ids = itertools.count(1)

    # ---- events ----

    def events(self) -> list[tuple[str, Callable[[], None]]]:
        out: list[tuple[str, Callable[[], None]]] = []
        if len(self.submitted) < len(self.prompts):
            out.append((f"submit r{len(self.submitted)}", self.submit))
        if self.budget.aborts:
            for i, rid in enumerate(self.submitted):
                if rid is not None and self.core.request(rid) is not None:
                    out.append((f"abort r{i}", lambda rid=rid: self.abort(rid)))
        for name, sim in self.sims.items():
            if name in self.lost:
                continue
            if self.budget.losses:
                out.append((f"lose {name}", lambda name=name: self.lose(name)))
            if sim.message is not None:
                out.append((f"reply {name}", lambda name=name: self.reply(name)))
                if self.budget.failed_steps:
                    out.append((f"fail step {name}", lambda name=name: self.reply(name, fail=True)))
                if self.budget.failed_seqs:
                    for i in range(len(sim.message.seqs)):
                        out.append((f"seq {i} of the step on {name} fails alone",
                                    lambda name=name, i=i: self.reply(name, fail_seq=i)))
                if self.budget.cuts and sim.message.cuttable:
                    out.append((f"the step on {name} is cut", lambda name=name: self.reply(name, cut=True)))
                if self.budget.deferred_seqs:
                    for i, seq in enumerate(sim.message.seqs):
                        if seq.sampling is not None:  # only a sampling step waits for a grammar
                            out.append((f"seq {i} of the step on {name} is deferred",
                                        lambda name=name, i=i: self.reply(name, defer_seq=i)))
            if self.budget.restarts:
                out.append((f"restart {name}", lambda name=name: self.restart(name)))
        for key, t in self.transfers.items():
            if t.orphaned and t.start.receiver in self.lost:
                continue  # both ends gone: nothing of it is left to happen
            if not t.loud:
                out.append((f"transfer {key} lands", lambda key=key: self.land(key)))
                if self.budget.transfer_faults:
                    out.append((f"transfer {key} fails quietly", lambda key=key: self.fail(key, loud=False)))
                    out.append((f"transfer {key} times out, cancel unacknowledged",
                                lambda key=key: self.fail(key, loud=True)))
            else:
                if t.start.receiver not in self.lost:
                    out.append((f"transfer {key} writes late", lambda key=key: self.late_write(key)))
                if t.watched and not t.orphaned:
                    out.append((f"transfer {key} is quiet", lambda key=key: self.quiet(key)))
        if self.budget.ticks and self.core.queue:
            out.append(("tick past the queue deadline", self.tick))
        if self.budget.flushes and any(w.ledger.num_cached for w in self.core.workers):
            out.append(("flush the prefix cache", self.flush))
        return out

    def flush(self) -> None:
        self.budget.flushes -= 1
        self.core.flush_cache(self.now)

    def submit(self) -> None:
        prompt, count = self.prompts[len(self.submitted)], 1 if self.submitted else self.samples
        try:
            if count > 1:
                reqs = self.core.submit_samples(prompt, [self.params.for_sample(i) for i in range(count)], self.now)
                self.submitted += [r.request_id for r in reqs]
            else:
                self.submitted.append(self.core.submit(prompt, self.params, self.now).request_id)
        except AdmissionRejected:
            self.submitted += [None] * count

    def abort(self, request_id: str) -> None:
        self.budget.aborts -= 1
        self.core.abort(request_id, self.now)

    def reply(self, name: str, fail: bool = False, fail_seq: int | None = None, defer_seq: int | None = None,
              cut: bool = False) -> None:
        sim = self.sims[name]
        msg, sim.message = sim.message, None
        assert msg is not None
        if cut:
            self.budget.cuts -= 1
        if fail:
            self.budget.failed_steps -= 1
        if fail_seq is not None:
            self.budget.failed_seqs -= 1
        if defer_seq is not None:
            self.budget.deferred_seqs -= 1
        self.core.step_replied(name, sim.run(msg, fail, fail_seq, defer_seq, cut), self.now)

    def restart(self, name: str) -> None:
        self.budget.restarts -= 1
        sim = self.sims[name]
        sim.incarnation += 1
        sim.tags.clear()
        sim.slots.clear()
        sim.page_tables.clear()
        sim.tenants.clear()

    def lose(self, name: str) -> None:
        """Worker `name` is gone: its step in flight never replies, and every transfer touching it
        fails as the link sees it (the lost end acknowledges no cancel; a lost sender can never
        say its writes are over)."""
        self.budget.losses -= 1
        self.lost.add(name)
        self.sims[name].message = None
        self.core.worker_lost(name, self.now)
        for key, t in list(self.transfers.items()):
            if name not in (t.start.sender, t.start.receiver):
                continue
            sender_lost = t.start.sender in self.lost
            t.orphaned = sender_lost
            if t.loud:
                continue  # it failed already; a lost sender now never reports it quiet
            self.receivers[t.start.receiver].cancel(t.manifest.transfer_id)
            t.loud, t.source_done = True, not sender_lost

            async def until_quiet() -> bool:  # never awaited: `quiet` is the event that says so
                return True

            self.core.transfer_finished(key, MoveResult(ok=False, reason="a worker was lost", quiet=False,
                                                        source_quiet=not sender_lost, until_quiet=until_quiet),
                                        self.now)

    def land(self, key: int) -> None:
        t = self.transfers.pop(key)
        receiver = self.receivers[t.start.receiver]
        adm = receiver.admit(t.manifest, t.start.dst_pages, 1)
        if adm.reject_reason:
            raise Broken(f"transfer {key}: the receiver refused the planned push ({adm.reject_reason})")
        self._write(t, why="lands")
        receiver.finish(adm, adm.num_pages, [], [])
        self.landed.add(t.start.request_id)
        self.core.transfer_finished(key, MoveResult(ok=True, nbytes=adm.num_pages), self.now)

    def fail(self, key: int, loud: bool) -> None:
        self.budget.transfer_faults -= 1
        t = self.transfers[key]
        self.receivers[t.start.receiver].cancel(t.manifest.transfer_id)
        if not loud:
            del self.transfers[key]
            self.core.transfer_finished(key, MoveResult(ok=False, reason="injected"), self.now)
            return
        t.loud = True

        async def until_quiet() -> bool:  # never awaited: `quiet` is the event that says so
            return True

        self.core.transfer_finished(key, MoveResult(ok=False, reason="timed out", quiet=False, source_quiet=False,
                                                    until_quiet=until_quiet), self.now)

    def late_write(self, key: int) -> None:
        self._write(self.transfers[key], why="writes late")

    def quiet(self, key: int) -> None:
        del self.transfers[key]
        self.core.transfer_quiet(key, self.now)

    def tick(self) -> None:
        self.budget.ticks -= 1
        self.now += self.config.queue_timeout_s + 1
        self.core.tick(self.now)

    def _write(self, t: Transfer, why: str) -> None:
        """The bytes of a transfer land in its destination pages (one-sided: the receiver cannot
        stop them): each must still be its lease's, owned or quarantined."""
        lease = t.start.dst_lease
        ledger = self.bindings[t.start.receiver].ledger
        for page in t.start.dst_pages[:t.manifest.num_pages]:
            if page not in ledger.pages(lease) and page not in ledger.quarantined_pages(lease):
                raise Broken(f"transfer of lease {id_hex(lease)[-6:]} {why} into page {page}, which it no longer holds")
        # the plan's pages in order: positions relative to its first page (which starts a page)
        self.sims[t.start.receiver].write(lease, t.start.dst_pages, 0, t.start.num_tokens - t.start.first_token)

    # ---- actions ----

    def carry_out(self) -> None:
        for action in self.core.take_actions():
            if isinstance(action, SendStep):
                sim = self.sims[action.worker]
                if sim.message is not None:
                    raise Broken(f"a second step sent to the {action.worker} worker while one is in flight")
                sim.message = action.message
            elif isinstance(action, Emit):
                seen = self.deltas.setdefault(action.request_id, [])
                if seen and seen[-1].delta.terminal:
                    raise Broken(f"request {action.request_id[-6:]} got output after its terminal delta")
                if (action.delta.token_ids and self.config.disaggregated
                        and action.request_id not in self.landed):
                    raise Broken(f"request {action.request_id[-6:]} emitted a token before its KV landed")
                seen.append(action)
            elif isinstance(action, StartTransfer):
                key = next(self._transfer_ids)
                if (error := action.plan_error(self.config.page_size_tokens)) is not None:
                    raise Broken(error)
                num_pages = len(action.dst_pages)
                manifest = TransferManifest(transfer_id=f"t{key}", lease=id_hex(action.dst_lease), nonce=f"n{key}",
                                            num_tokens=action.num_tokens - action.first_token, num_pages=num_pages)
                self.receivers[action.receiver].expect(manifest, action.dst_pages[:num_pages])
                self.transfers[action.key] = Transfer(action, manifest)
            elif isinstance(action, WatchQuiet):
                self.transfers[action.key].watched = True

    # ---- invariants ----

    def check(self) -> None:
        held: dict[tuple[str, int], int] = {}
        for w in self.core.workers:
            w.ledger.check_integrity()
        for t in self.transfers.values():  # every page a transfer may still touch is its lease's
            num_pages = t.manifest.num_pages
            for name, lease, pages, side in (
                    (t.start.receiver, t.start.dst_lease, t.start.dst_pages[:num_pages], "destination"),
                    (t.start.sender, t.start.src_lease, t.start.src_pages[:num_pages], "source")):
                if name in self.lost or (side == "source" and t.source_done):  # its pool went with it
                    continue
                ledger = self.bindings[name].ledger
                mine = ledger.pages(lease) + ledger.quarantined_pages(lease)
                if side == "source":  # a push reads sealed pages its lease shares; it never writes one
                    mine += ledger.shared_pages(lease)
                gone = [p for p in pages if p not in mine]
                if gone:
                    raise Broken(f"pages {gone} a transfer may still touch ({side}) were freed or given away")
        for rid in filter(None, self.submitted):
            req = self.core.request(rid)
            if req is None:
                continue
            if req.pair is None:
                if req.prefill_lease or req.decode_lease:
                    raise Broken(f"request {rid[-6:]} holds leases without a pair")
                continue
            for w, lease, pages in ((req.pair.prefill, req.prefill_lease, req.prefill_pages),
                                    (req.pair.decode, req.decode_lease, req.decode_pages)):
                if w.name in self.lost:
                    continue
                if lease and w.table.tenant_of(lease) != req.tenant:
                    raise Broken(f"lease {id_hex(lease)[-6:]} of tenant {req.tenant} is carried as "
                                 f"{w.table.tenant_of(lease)!r}'s")
                for page in pages if lease else []:
                    if w.ledger.is_sealed(page):  # shared read-only: each reader must hold a reference
                        if page not in w.ledger.shared_pages(lease):
                            raise Broken(f"lease {id_hex(lease)[-6:]} reads sealed page {page} without a reference")
                        continue
                    other = held.setdefault((w.name, page), lease)
                    if other != lease:
                        raise Broken(f"page {page} of the {w.name} pool is held by two leases")

    def check_quiescent(self) -> None:
        for i, rid in enumerate(self.submitted):
            if rid is None:
                continue
            deltas = self.deltas.get(rid, [])
            if self.core.request(rid) is not None or not deltas or not deltas[-1].delta.terminal:
                raise Broken(f"r{i} is not terminal once no event is left")
        for w in self.core.workers:
            ledger, sim = w.ledger, self.sims[w.name]
            if ledger.num_in_use != self._orphaned_pages(w):
                raise Broken(f"{ledger.num_in_use} pages of the {w.name} pool are held once no event is left")
            cached = {p for p in range(ledger.num_pages) if ledger.is_sealed(p)}
            seals = set(self.core.pages.seals.values())
            unseen_restart = w.incarnation and w.incarnation != sim.inc()  # its blank pool is learned at the next reply
            if not unseen_restart and (set(sim.tags) != cached or any(sim.tags[p] not in seals for p in cached)):
                raise Broken(f"pages {sorted(sim.tags)} of the {w.name} pool are tagged, but only the cached "
                             f"pages {sorted(cached)} should be, with a seal")
            if self._orphaned_pages(w):
                continue  # its orphaned quarantine keeps a lease (and its tags) for good
            if sim.page_tables or sim.tenants:
                raise Broken(f"the {w.name} worker still keeps the page tables or tenants of ended leases")
            if w.table.num_leases:
                raise Broken(f"the {w.name} pool's table still names {w.table.num_leases} ended leases")
        self._check_flush_returns_every_page()

    def _check_flush_returns_every_page(self) -> None:
        """Flushing the cache of a quiescent world frees and untags every page."""
        world = copy.deepcopy(self, memo=shared_memo(self))
        world.core.flush_cache(world.now)
        world.carry_out()
        while busy := [name for name, sim in world.sims.items() if sim.message is not None]:
            world.reply(busy[0])
            world.carry_out()
        for w in world.core.workers:
            if world._orphaned_pages(w):  # noqa: SLF001
                continue
            if w.ledger.num_used or world.sims[w.name].tags:
                raise Broken(f"after a flush, {w.ledger.num_used} pages of the {w.name} pool are not free "
                             f"(tagged: {sorted(world.sims[w.name].tags)})")

    def _orphaned_pages(self, w: WorkerBinding) -> int:
        """Pages of `w`'s pool quarantined for good: by transfers whose sender was lost."""
        return sum(len(w.ledger.quarantined_pages(t.start.dst_lease)) for t in self.transfers.values()
                   if t.orphaned and t.start.receiver == w.name)

    def sharing(self) -> bool:
        """Some live request reads a page it shares from a pool's prefix cache."""
        return any(r.shared_prefill or r.shared_decode for r in map(self.core.request, filter(None, self.submitted))
                   if r is not None)

    def fingerprint(self) -> str:
        reqs = []
        for rid in self.submitted:
            req = self.core.request(rid) if rid else None
            reqs.append(None if req is None else (req.state.value, len(req.tokens), req.prefilled, req.pending_end
                                                  is not None, req.prefill_lease, req.decode_lease,
                                                  tuple(req.decode_pages), req.stepping, req.transfer,
                                                  req.pending_retry, req.attempt))
        tables = [(list(w.ledger._free), sorted(w.ledger._owned.items()), sorted(w.ledger._quarantined.items()),  # noqa: SLF001
                   sorted(w.ledger._refs.items()), list(w.ledger._idle), sorted(w.ledger._key_of.items()),  # noqa: SLF001
                   sorted(w.table._sealing.items()), sorted(w.table._tenant.items()),  # noqa: SLF001
                   w.table.has_pending, sorted(w.table._sent.items()), list(w.table._ended),  # noqa: SLF001
                   w.incarnation, w.in_flight is not None) for w in self.core.workers]
        sims = [(sorted(s.tags.items()), sorted(s.slots.items()), sorted(s.page_tables.items()),
                 sorted(s.tenants.items()), s.incarnation, s.message) for s in self.sims.values()]
        outs = {rid: [(d.delta.token_ids, d.delta.finish_reason, d.delta.error and d.delta.error.code)
                      for d in ds] for rid, ds in self.deltas.items()}
        transfers = sorted((k, t.loud, t.watched, t.orphaned) for k, t in self.transfers.items())
        return repr((reqs, tables, sims, outs, transfers, self.submitted, dataclasses.astuple(self.budget),
                     self.core.queue and [r.request_id for r in self.core.queue], sorted(self.lost),
                     [(r.pair.name if r and r.pair else None) for r in map(self.core.request, filter(None, self.submitted))]))


def shared_memo(world: World) -> dict[int, object]:
    """What a copy of the world shares with the original: the tokenizer, the metrics and the
    config (frozen: no event changes it)."""
    core = world.core
    return {id(core.tokenizer): core.tokenizer, id(core.metrics): core.metrics, id(core.config): core.config}

