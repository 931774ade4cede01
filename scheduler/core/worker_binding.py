"""The scheduler core's view of one worker: its name, its role, the lease table of its KV pool, the
worker incarnation the core believes in, and the one step it may have in flight; and of a `Pair`,
a prefill and a decode worker whose KV endpoints paired (or one colocated worker, bound to both).

A worker serves one role ("prefill", "decode") or both ("colocated": one worker bound to both
roles, one pool, one lease table). Every message to the worker carries the incarnation the core
believes in; a worker that restarted refuses a message built for an earlier one before applying
any of it, and every reply names the worker's current incarnation, so the core learns of a
restart from the first reply after it (`restarted`). Plain Python: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvfence.scheduler.core.lease_table import LeaseTable
from kvfence.engine.protocol import SeqStep, WorkerReply

if TYPE_CHECKING:
    from kvfence.scheduler.core.page_ledger import PageLedger
    from kvfence.scheduler.core.request import Request


@dataclasses.dataclass
class Step:
    """A message in flight to a worker: which requests it steps, in the order of its seqs."""

    number: int  # the lease table's message number
    decodes: list[Request]
    chunks: list[tuple[Request, SeqStep]]
    seqs: list[SeqStep]
    step_id: int = 0  # RunStep.step_id
    cuttable: bool = False  # RunStep.cuttable
    cut_asked: bool = False  # a CutStep was sent for it

    @property
    def requests(self) -> list[Request]:
        return self.decodes + [r for r, _ in self.chunks]


ROLES = ("prefill", "decode", "colocated")


class WorkerBinding:
    def __init__(self, name: str, num_pages: int, role: str | None = None, device: str = "") -> None:
        """`name`: how the core, the driver, logs and metrics name it (unique among the workers);
        `role`: one of ROLES, by default its name (the in-process workers are named by role);
        `device`: the compute queue its steps run on, shared with the workers that name the same
        one ("": one of its own; WorkerChannel.device)."""
        self.name = name
        self.device = device
        self.role = role or name
        if self.role not in ROLES:
            raise ValueError(f"worker {name!r}: role must be one of {ROLES}, got {self.role!r}")
        self.table = LeaseTable(num_pages)
        self.incarnation = ""  # learned from the first reply
        self.in_flight: Step | None = None
        self.draining = False  # it said it shuts down: nothing new starts on it
        self.last_sent_s = float("-inf")  # when the last message was built (the caller's clock)
        self.last_step = 0  # the scheduler's number of its last message with seqs (0: none yet)

    def shares_device_with(self, other: WorkerBinding) -> bool:
        return other is not self and bool(self.device) and other.device == self.device

    @property
    def stepping(self) -> bool:
        """A message with seqs in flight (a step that takes its device's time)."""
        return self.in_flight is not None and bool(self.in_flight.seqs)

    @property
    def ledger(self) -> PageLedger:
        return self.table.ledger

    @property
    def prefills(self) -> bool:
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        return self.role != "prefill"

    def restarted(self, reply: WorkerReply) -> bool:
        """Adopt the reply's incarnation; True when it replaces a known, different one."""
        if not reply.incarnation or reply.incarnation == self.incarnation:
            return False
        known, self.incarnation = self.incarnation, reply.incarnation
        return bool(known)


@dataclasses.dataclass(frozen=True, eq=False)
class Pair:
    """Where a request runs: a prefill and a decode worker that may transfer KV between them
    (`prefill is decode`: one colocated worker), and the longest request both hold."""

    prefill: WorkerBinding
    decode: WorkerBinding
    max_context_tokens: int

    @property
    def pools(self) -> list[WorkerBinding]:
        return [self.prefill] if self.prefill is self.decode else [self.prefill, self.decode]

    @property
    def name(self) -> str:
        return self.prefill.name if self.prefill is self.decode else f"{self.prefill.name} -> {self.decode.name}"
