"""The KV transfers of requests whose prefill and decode pools differ: when one starts, what it
moves, and what its end means for the pages on both sides; part of the scheduler core (no I/O, no
clock: the time is passed in).

A transfer starts once the decode worker has applied its destination lease's grant (its pages are
tagged, any earlier owner's release and scrub done). It moves only what the decode pool does not
already hold, by an explicit plan (`StartTransfer`: page `src_pages[i]` into `dst_pages[i]`). At
its end, source pages a write may still read and destination pages a write may still reach stay
quarantined until the transport says every write is terminal (`quiet`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvfence.engine.logprobs import TokenLogprobs
from kvfence.scheduler.core.actions import Action, MoveResult, StartTransfer, WatchQuiet
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.core.errors import RequestError
from kvfence.scheduler.core.fleet import Fleet
from kvfence.scheduler.core.lifecycle import Event, State
from kvfence.scheduler.core.pages import Pages
from kvfence.scheduler.core.registry import Registry
from kvfence.scheduler.core.request import Request
from kvfence.scheduler.core.worker_binding import WorkerBinding
from kvfence.scheduler.metrics import SchedulerMetrics

log = logging.getLogger(__name__)


class Transfers:
    def __init__(self, config: SchedulerConfig, metrics: SchedulerMetrics, registry: Registry, fleet: Fleet,
                 pages: Pages, actions: list[Action], *, end: Callable[[Request, RequestError, float], None],
                 retry: Callable[[Request, float], None],
                 start_decoding: Callable[[Request, int | None, TokenLogprobs | None, float], None]) -> None:
        """`actions`: the core's list, appended to. `end`, `retry`, `start_decoding`: the core's
        end of a request, its retry as a new attempt, and its first decode step."""
        self.config = config
        self.metrics = metrics
        self.registry = registry
        self.fleet = fleet
        self.pages = pages
        self._actions = actions
        self._end, self._retry, self._start_decoding = end, retry, start_decoding
        self._keys = 0

    def start_ready(self) -> None:
        """Start the transfer of every request whose destination grant its decode worker applied."""
        for req in self.registry.in_state(State.TRANSFERRING):
            assert req.pair is not None
            if not req.transfer and req.pair.decode.table.grant_applied(req.decode_lease):
                self._keys += 1
                req.fire(Event.TRANSFER_STARTED, transfer=self._keys)
                self._actions.append(self.plan(req))

    def plan(self, req: Request) -> StartTransfer:
        """Move what the decode pool does not already hold: from the first page past its cache hit
        to the last page of the prompt, page i of one page table into page i of the other."""
        assert req.pair is not None
        first, end = req.shared_decode, self.config.pages_for(req.prefill_target)
        return StartTransfer(key=req.transfer, request_id=req.request_id, num_tokens=req.prefill_target,
                             src_lease=req.prefill_lease, src_pages=req.prefill_pages[first:end],
                             dst_lease=req.decode_lease, dst_pages=req.decode_pages[first:end],
                             first_token=first * self.config.page_size_tokens, tenant=req.tenant,
                             sender=req.pair.prefill.name, receiver=req.pair.decode.name)

    def finished(self, key: int, result: MoveResult, now: float, *, crashed: bool) -> None:
        """Transfer `key` ended (`crashed`: its task failed; what the transport did is unknown):
        its pages are released or quarantined, and its request decodes, retries or ends."""
        req = self.registry.transferring(key)
        assert req.pair is not None
        prefill, decode = req.pair.prefill, req.pair.decode
        req.fire(Event.TRANSFER_ENDED)
        self.metrics.transfer(result.ok, result.nbytes, now - req.prefill_done_s)
        held: list[tuple[WorkerBinding, int]] = []
        if result.source_quiet:
            prefill.table.release(req.prefill_lease)
        else:  # a posted one-sided write may still read them
            held.append((prefill, req.prefill_lease))
        if not result.quiet:  # a write may still land: the destination pages stay out of the free list
            held.append((decode, req.decode_lease))
            req.decode_lease = 0
        req.prefill_lease = 0
        for w, lease in held:
            self.pages.quarantine(w, lease, now)
        if held and result.until_quiet is not None:
            self.pages.held_until_quiet[key] = held
            self._actions.append(WatchQuiet(key, result.until_quiet))
        if req.pending_retry and result.ok and decode in self.fleet.workers:
            req.fire(Event.KEEP)  # its prefill worker was lost after the KV left it: decoding goes on
        if req.pending_retry and req.pending_end is None and not crashed:
            self._retry(req, now)
        elif crashed:
            self._end(req, RequestError(500, "kv_transfer_failed", "the KV transfer failed on the server"), now)
        elif req.pending_end is not None:
            self._end(req, req.pending_end, now)
        elif not result.ok:
            log.warning("%s: KV transfer failed (%s)", req.who, result.reason)
            self._end(req, RequestError(502, "kv_transfer_failed", f"the KV transfer failed: {result.reason}"), now)
        else:
            first = req.shared_decode * self.config.page_size_tokens
            decode.table.land(req.decode_lease, req.decode_pages, first, req.prefill_target)
            self.pages.seal(decode, req, req.decode_lease, req.decode_pages, req.shared_decode)
            self._start_decoding(req, req.pending_token, req.pending_logprobs, now)

    def quiet(self, key: int, now: float) -> None:
        """Every write transfer `key` posted is terminal: its quarantined pages come back."""
        for w, lease in self.pages.held_until_quiet.pop(key, []):
            self.pages.confirm_quiet(w, lease, now)
