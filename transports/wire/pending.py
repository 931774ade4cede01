"""The budget of a listening socket for connections that have not authenticated yet.

Anyone who reaches a listening port can open connections and say nothing. Each costs the
listener a socket and a task until the handshake timeout, and nothing more (a channel allocates
its sealed-record buffers only once it is sealed, after the handshake). `Unauthenticated` caps
how many such connections are open at once; one more evicts the oldest, so a flood of silent
connections never fills the listener for long and a member's handshake, which takes
milliseconds, gets through. Connections that did authenticate are counted apart (the listener's
own cap on paired links), so a flood cannot crowd them out either.
"""

from __future__ import annotations

import logging

from kvfence.transports.wire.channel import Channel

log = logging.getLogger(__name__)

DEFAULT_MAX_UNAUTHENTICATED = 64


class Unauthenticated:
    """Channels accepted and not yet authenticated, oldest first, at most `cap`."""

    def __init__(self, what: str, cap: int = DEFAULT_MAX_UNAUTHENTICATED) -> None:
        if cap < 1:
            raise ValueError(f"the cap on unauthenticated connections must be positive, got {cap!r}")
        self.what, self.cap = what, cap
        self.evicted = 0  # connections closed to make room (a flood shows here and in the log)
        self._open: dict[Channel, None] = {}

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, channel: Channel) -> None:
        """Count `channel` in, closing the oldest unauthenticated one when the cap is reached."""
        if len(self._open) >= self.cap:
            oldest = next(iter(self._open))
            del self._open[oldest]
            self.evicted += 1
            if self.evicted == 1 or self.evicted % 1000 == 0:  # a flood logs a line per thousand
                log.warning("%s: %d connections have not authenticated (the cap): closing the oldest, from %s "
                            "(%d closed so far)", self.what, self.cap, oldest.peer, self.evicted)
            oldest.close()
        self._open[channel] = None

    def authenticated(self, channel: Channel) -> None:
        """`channel` proved the secret (or ended): it no longer counts here."""
        self._open.pop(channel, None)

    def close_all(self) -> None:
        """The listener stops: close every connection still waiting (its task may never run)."""
        for channel in list(self._open):
            channel.close()
        self._open.clear()
