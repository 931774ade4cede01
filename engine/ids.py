"""Server-minted identifiers: random, 128-bit, never 0 (0 marks a free page)."""

from __future__ import annotations

import secrets


def mint_id() -> int:
    """A fresh 128-bit id from the OS's CSPRNG; never 0."""
    while True:
        value = secrets.randbits(128)
        if value:
            return value
