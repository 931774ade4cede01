"""Re-pairing a peer whose connection was lost, with backoff.

A paired connection can be lost while both ends live on (a relay or a flaky link cut it, a record
failed its check, a keep-alive ran out). The next push to that peer then dials it again — the
address it was paired through, and the same incarnation, so a peer that restarted is not paired
silently — instead of failing every later push. `Redial` keeps that from turning into a storm:
one attempt at a time (within the handshake timeout, connecting included), and after a failed one
none before a backoff that doubles up to a bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

log = logging.getLogger(__name__)
T = TypeVar("T")


class Redial:
    """Backoff state of one peer: `first_s` after the first failure, doubling up to `max_s`,
    back to nothing after a success."""

    def __init__(self, what: str, first_s: float = 0.25, max_s: float = 30.0) -> None:
        self.what, self.first_s, self.max_s = what, first_s, max_s
        self.failures = 0
        self._delay_s = 0.0
        self._not_before = 0.0
        self._lock = anyio.Lock()

    @property
    def backoff_s(self) -> float:
        """How long after the last failed dial the next may start (0: no failure since a success)."""
        return self._delay_s

    async def attempt(self, dial: Callable[[], Awaitable[T]]) -> T | None:
        """`await dial()` unless a failed attempt was too recent or one is under way; None when it
        was skipped or failed (the failure is logged with when the next try may be). A caller
        arriving during an attempt does not queue behind it (a peer that stalls the dial would
        stall every push): its push fails at once, and the next one finds the peer re-paired."""
        if self._lock.locked():
            return None
        async with self._lock:
            if time.monotonic() < self._not_before:
                return None
            try:
                result = await dial()
            except Exception as e:  # PairingRefused, AuthenticationFailed, OSError, TimeoutError
                self.failures += 1
                self._delay_s = min(self.max_s, max(self.first_s, 2 * self._delay_s))
                self._not_before = time.monotonic() + self._delay_s
                log.warning("re-pairing %s failed (%s: %s); next try in %.2g s at the earliest", self.what,
                            type(e).__name__, e, self._delay_s)
                return None
            log.info("re-paired %s: its connection had been lost (%d failed tries before)", self.what,
                     self.failures)
            self.failures, self._delay_s, self._not_before = 0, 0.0, 0.0
            return result
