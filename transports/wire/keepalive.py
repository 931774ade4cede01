"""Keep-alive of a paired connection: ping while idle, drop a peer that stays silent.

Both ends of a paired connection run `keep_alive`. Each pings when it has sent nothing for a
quarter of the bound, so a live peer is never silent for long; a connection on which nothing has
arrived for `timeout_s` (a host gone without a FIN, a peer that stopped reading and writing) is
closed, and its reader then fails it like any lost peer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from kvfence.transports.wire.channel import Channel, ConnectionGone

log = logging.getLogger(__name__)


async def keep_alive(channel: Channel, ping: Callable[[], Awaitable[None]], timeout_s: float,
                     what: str = "connection") -> None:
    """Until `channel` is closed: `ping()` when idle, close it after `timeout_s` of silence (a
    ping that cannot be sent within `timeout_s` counts as silence too)."""
    interval_s = timeout_s / 4
    while not channel.closed:
        await anyio.sleep(interval_s)
        if channel.closed:
            return
        now = time.monotonic()
        if now - channel.last_recv_s > timeout_s and not channel.has_unread():
            log.warning("%s silent for %.1f s (keep-alive bound %g s): closing it", what,
                        now - channel.last_recv_s, timeout_s)
            channel.close()
            return
        if now - channel.last_send_s >= interval_s:
            with anyio.move_on_after(timeout_s) as scope:
                try:
                    await ping()
                except ConnectionGone:
                    return
            if scope.cancelled_caught:
                log.warning("%s: a keep-alive ping could not be sent in %g s: closing it", what, timeout_s)
                channel.close()
                return
