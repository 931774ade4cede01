"""Server-minted identifiers: random, 128-bit, never 0 (0 marks a free page), and their text form
(32 hex digits) for log lines and for the transports' wire messages."""

from __future__ import annotations

import secrets


def mint_id() -> int:
    """A fresh 128-bit id from the OS's CSPRNG; never 0."""
    while True:
        value = secrets.randbits(128)
        if value:
            return value


def id_hex(value: int) -> str:
    return f"{value:032x}"


def id_from_hex(text: str) -> int:
    return int(text, 16)
