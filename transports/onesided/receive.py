"""The receiving half of a one-sided transport: admissions, verdicts.

Nothing here writes the pool: the sender's plane does, and only after this half said "go" to an
admitted push (`Receiver.admit`: what was not expected, or does not match, is refused and
never gets a "go"). A push is `Incoming` from its "go" until its writes are known terminal: its
notification or "landed" arrived (then `Receiver.finish` recomputes the digests over the
landed pages and the verdict goes back), or the sender reported them terminal with a PushAbort. A
lost link or a shutdown ends the transfer ("peer_lost", "protocol_error", "transport_closed")
without that proof: a write already posted may still land in its dst pages.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from kvfence.transports.core.receiver import Receiver
from kvfence.transports.onesided.data_plane import DataPlane
from kvfence.transports.onesided.link import Incoming, Link
from kvfence.transports.onesided.wire import Message
from kvfence.transports.wire.framing import ProtocolError
from kvfence.transports.wire.messages import Cancel, Go, Landed, Ping, PushAbort, PushHeader, Stop, Verdict

log = logging.getLogger(__name__)

UNPROVEN_KEPT = 4096


class ReceiverHalf:
    """The pushes into one endpoint's pool that were told "go" (`incoming`, for the poller)."""

    def __init__(self, receiver: Receiver, kick: Callable[[], None], plane: DataPlane, linger_s: float = 60.0) -> None:
        self.receiver = receiver
        self.plane = plane  # exposes a push's dst pages from its "go" until it ends
        self.kick = kick  # wakes the poller: a write may now land
        self.incoming: dict[str, Incoming] = {}  # "go" sent, writes not known terminal
        # pushes that ended without proof that their writes are terminal (a lost link, a shutdown):
        # this end can never learn it, so its `cancel` of them stays unacknowledged (the latest
        # `UNPROVEN_KEPT`; an older one is long past any write's life)
        self.unproven: OrderedDict[str, Incoming] = OrderedDict()
        # of those, the ones whose writes may still be completing, until when (monotonic): the
        # plane is kept progressing for them (see OneSidedTransport._poll_loop)
        self.lingering: dict[str, float] = {}
        self.linger_s = linger_s

    def on_message(self, link: Link, message: Message) -> None:
        """A message from the sender at the other end of `link`."""
        match message:
            case Ping():
                pass
            case PushHeader():
                self._admit(link, message)
            case Landed(transfer_id=tid):
                if (inc := self._on(link, tid)) is not None:
                    self._landed(inc)
            case PushAbort(transfer_id=tid, reason=reason):
                if (inc := self._on(link, tid)) is not None:
                    self._end(inc, reason or "cancelled", proven=True)
            case Cancel(transfer_id=tid):
                if tid not in self.incoming:  # only ever sent before its push was announced
                    self.receiver.cancel(tid)
            case _:
                raise ProtocolError(f"unexpected {type(message).__name__} from a sender")

    def _admit(self, link: Link, header: PushHeader) -> None:
        manifest = header.manifest
        if header.page_nbytes < 1 or manifest.num_pages < 1:
            raise ProtocolError(f"bad announcement of {manifest.transfer_id}")
        adm = self.receiver.admit(manifest, header.dst_pages, header.page_nbytes)
        if not adm.live:  # refused: the verdict is the refusal, and no "go"
            link.send(Verdict(self.receiver.finish(adm, 0, [])))
            return
        size = header.page_nbytes
        try:
            exposure = self.plane.expose([(page * size, size) for page in adm.dst_pages])
        except Exception as e:  # nothing was exposed, so nothing can land: refuse
            log.error("transfer %s refused: the %s plane could not expose its pages: %s", adm.transfer_id,
                      self.plane.name, e)
            link.send(Verdict(self.receiver.abort(adm, "plane_refused")))
            return
        self.incoming[adm.transfer_id] = Incoming(adm, link, list(header.digests), exposure)
        link.send(Go(adm.transfer_id))
        self.kick()

    def _on(self, link: Link, tid: str) -> Incoming | None:
        inc = self.incoming.get(tid)
        return inc if inc is not None and inc.link is link else None

    def _landed(self, inc: Incoming) -> None:
        """Every byte of the push is in its dst pages: verify, settle, answer."""
        del self.incoming[inc.adm.transfer_id]
        self.plane.conceal(inc.exposure)  # before the digests: no write starts after them
        inc.settle(proven=True)
        verdict = self.receiver.finish(inc.adm, inc.adm.num_pages, inc.digests)
        inc.link.send(Verdict(verdict))

    def _end(self, inc: Incoming, reason: str, proven: bool) -> None:
        self.incoming.pop(inc.adm.transfer_id, None)
        self.plane.conceal(inc.exposure)
        inc.settle(proven)
        if not proven:
            tid = inc.adm.transfer_id
            self.unproven[tid] = inc
            self.lingering[tid] = time.monotonic() + self.linger_s
            while len(self.unproven) > UNPROVEN_KEPT:
                self.lingering.pop(self.unproven.popitem(last=False)[0], None)
        self.receiver.abort(inc.adm, reason)  # no-op when it was cancelled already

    def on_notifications(self, notes: list[tuple[str, bytes]]) -> None:
        """Notifications from the plane: each names a transfer whose writes all landed. Ones
        for transfers not in flight here (ended, or never said "go" to) are ignored."""
        for _peer, note in notes:
            tid = note.decode("ascii", "replace")
            if (inc := self.incoming.get(tid)) is not None:
                self._landed(inc)
            elif tid in self.unproven:  # the last write of a push that had lost its link landed after all
                self.lingering.pop(tid, None)
                self.unproven.pop(tid).proven = True

    def linger(self, now_s: float) -> bool:
        """Forget lingering pushes past their time; True while any is left."""
        for tid in [t for t, until in self.lingering.items() if until <= now_s]:
            del self.lingering[tid]
        return bool(self.lingering)

    def cancel(self, transfer_id: str) -> Incoming | None:
        """Un-expect the transfer (nothing of it is accepted any more); when it is in flight, ask
        its sender to stop and return it (its `settled` / `proven` tell when that is known)."""
        self.receiver.cancel(transfer_id)
        inc = self.incoming.get(transfer_id)
        if inc is not None:
            inc.link.send(Stop(transfer_id, "cancelled"))
        return inc or self.unproven.get(transfer_id)

    def stop_all(self) -> None:
        """Closing: ask every sender writing into the pool to stop (to them, the peer is lost)."""
        for tid, inc in self.incoming.items():
            inc.link.send(Stop(tid, "peer_lost"))

    def drop_link(self, link: Link, reason: str) -> None:
        for inc in [i for i in self.incoming.values() if i.link is link]:
            self._end(inc, reason, proven=False)

    def abandon(self) -> None:
        for inc in list(self.incoming.values()):
            self._end(inc, "transport_closed", proven=False)
