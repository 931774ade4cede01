"""The scheduler's view of one worker: its page ledger, its channel, the page-tag changes not yet
sent, and the worker incarnation the scheduler believes in.

Every message to the worker carries that incarnation; a worker that restarted refuses a message
built for an earlier one before applying any of it, and every reply names the worker's current
incarnation, so the scheduler learns of a restart from the first reply after it (a heartbeat
makes sure that is within about a second even when nothing runs).
"""

from __future__ import annotations

from kvfence.engine.worker import WorkerChannel
from kvfence.scheduler.messages import Landing, PageGrant, RunStep, SeqStep, WorkerReply, id_from_hex
from kvfence.scheduler.page_ledger import PageLedger


class WorkerPool:
    def __init__(self, channel: WorkerChannel, num_pages: int) -> None:
        self.channel = channel
        self.ledger = PageLedger(num_pages)
        self.grants: list[PageGrant] = []
        self.released: list[int] = []
        self.landed: list[Landing] = []  # verified transfers, for the worker's KV sanitizer
        self.incarnation = ""  # learned from the first reply

    @property
    def role(self) -> str:
        return self.channel.role

    def release(self, lease: int) -> None:
        if lease:
            self.released.extend(self.ledger.release(lease))

    def message(self, step_id: int, seqs: list[SeqStep]) -> RunStep:
        # A grant or landing of a lease that ended before it was sent names pages that are no
        # longer its own: drop it rather than tag free pages with a dead lease.
        live = [g for g in self.grants if self.ledger.holds(id_from_hex(g.lease))]
        landed = [x for x in self.landed if self.ledger.holds(id_from_hex(x.lease))]
        msg = RunStep(step_id, seqs, live, self.released, landed, self.incarnation)
        self.grants, self.released, self.landed = [], [], []
        return msg

    def restarted(self, reply: WorkerReply) -> bool:
        """Adopt the reply's incarnation; True when it replaces a known, different one."""
        if not reply.incarnation or reply.incarnation == self.incarnation:
            return False
        known, self.incarnation = self.incarnation, reply.incarnation
        return bool(known)
