"""The scheduler's view of one worker: its page ledger, its channel, the page-tag changes not yet
sent, and the worker incarnation the scheduler believes in.

Every message to the worker carries that incarnation; a worker that restarted refuses a message
built for an earlier one before applying any of it, and every reply names the worker's current
incarnation, so the scheduler learns of a restart from the first reply after it (a heartbeat
makes sure that is within about a second even when nothing runs).

The worker runs its messages in the order they were built (one compute thread, first in first
out), so a reply to message n means every message up to n has been applied: `tags_applied` waits
for the message that carried a lease's grant instead of sending another one behind the queue.

Pages come back through one path: `release` (and `confirm_quiet`, which ends a quarantine) hands
them to the ledger's free queue at once and to the worker, which untags and scrubs them at the
start of its next message, before any grant in it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio

from kvfence.engine.worker import WorkerChannel
from kvfence.scheduler.messages import Landing, PageGrant, RunStep, SeqStep, WorkerReply, id_from_hex, id_hex
from kvfence.scheduler.page_ledger import PageLedger

log = logging.getLogger(__name__)


class WorkerPool:
    def __init__(self, channel: WorkerChannel, num_pages: int,
                 on_pages_returned: Callable[[], None] | None = None) -> None:
        """`on_pages_returned`: called after `confirm_quiet` gave pages back (the scheduler admits
        what now fits)."""
        self.channel = channel
        self.ledger = PageLedger(num_pages)
        self.on_pages_returned = on_pages_returned
        self.grants: list[PageGrant] = []
        self.released: list[int] = []
        self.landed: list[Landing] = []  # verified transfers, for the worker's KV sanitizer
        self.incarnation = ""  # learned from the first reply
        self._built = 0  # messages built for this worker, in the order it runs them
        self._answered = 0  # the highest of them whose reply came back
        self._answer = anyio.Event()  # set (and replaced) on every reply
        self._grant_message: dict[str, int] = {}  # lease (hex) -> the message that carried its grant

    @property
    def role(self) -> str:
        return self.channel.role

    def release(self, lease: int) -> None:
        if lease:
            self.released.extend(self.ledger.release(lease))
            self._grant_message.pop(id_hex(lease), None)

    def quarantine(self, lease: int, now_s: float | None = None) -> None:
        """Keep the lease's pages out of the free list (a write may still land in them) until
        `confirm_quiet`; `now_s`: when (monotonic; default now)."""
        now_s = time.monotonic() if now_s is None else now_s
        pages = self.ledger.quarantine(lease, now_s)
        self._grant_message.pop(id_hex(lease), None)
        if pages:
            self._log_quarantine(f"{len(pages)} pages of lease {id_hex(lease)} quarantined", now_s)

    def confirm_quiet(self, lease: int) -> list[int]:
        """End the quarantine of `lease`: its transport learned that no write can still reach its
        pages (a late notification, a terminal WRITE status, an acknowledged abort). The pages go
        back through the normal release path: free in the ledger now, untagged and scrubbed by the
        worker in its next message. Returns them ([] if `lease` was not quarantined)."""
        pages = self.ledger.confirm_quiet(lease)
        if pages:
            self.released.extend(pages)
            self._log_quarantine(f"quarantine of lease {id_hex(lease)} ended, {len(pages)} pages returned",
                                 time.monotonic())
            if self.on_pages_returned is not None:
                self.on_pages_returned()
        return pages

    def _log_quarantine(self, what: str, now_s: float) -> None:
        since = self.ledger.quarantined_since
        held = f"oldest for {now_s - since:.1f} s" if since is not None else "none left"
        log.warning("%s pool: %s; %d of %d pages quarantined (%s)", self.role, what, self.ledger.num_quarantined,
                    self.ledger.num_pages, held)

    def message(self, step_id: int, seqs: list[SeqStep]) -> RunStep:
        # A grant or landing of a lease that ended before it was sent names pages that are no
        # longer its own: drop it rather than tag free pages with a dead lease.
        live = [g for g in self.grants if self.ledger.holds(id_from_hex(g.lease))]
        landed = [x for x in self.landed if self.ledger.holds(id_from_hex(x.lease))]
        msg = RunStep(step_id, seqs, live, self.released, landed, self.incarnation)
        self.grants, self.released, self.landed = [], [], []
        self._built += 1
        for grant in live:
            self._grant_message[grant.lease] = self._built
        return msg

    async def call(self, step_id: int, seqs: list[SeqStep]) -> WorkerReply:
        """Build the next message (with every pending tag change) and send it; its reply."""
        msg, number = self.message(step_id, seqs), self._built
        try:
            return await self.channel.call(msg)
        finally:  # applied or refused: the worker is past it either way
            self._answered = max(self._answered, number)
            self._answer.set()
            self._answer = anyio.Event()

    async def tags_applied(self, lease: str) -> bool:
        """Wait until the message that carried the grant of `lease` (hex) has been answered, so the
        worker has applied it and every release before it; False at once when the grant has not
        left yet (it is still pending: the next message carries it)."""
        number = self._grant_message.get(lease)
        if number is None:
            return False
        while self._answered < number:
            await self._answer.wait()
        return True

    def restarted(self, reply: WorkerReply) -> bool:
        """Adopt the reply's incarnation; True when it replaces a known, different one."""
        if not reply.incarnation or reply.incarnation == self.incarnation:
            return False
        known, self.incarnation = self.incarnation, reply.incarnation
        return bool(known)
