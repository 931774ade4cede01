"""Page digests: what a sender attaches to every page and a receiver recomputes over what landed.

Algorithms: "xxh3_64" (16 lowercase hex digits) and "none" (always ""). The paired algorithm is
`PairingRecord.digest`; both ends must support it.
"""

from __future__ import annotations

from typing import Protocol

import xxhash

Buffer = bytes | bytearray | memoryview

_SUPPORTED = ("xxh3_64", "none")


class Hasher(Protocol):
    """Incremental digest: `update` with consecutive chunks, then `hexdigest()` equals
    `page_digest` over their concatenation."""

    def update(self, data: Buffer) -> None: ...

    def hexdigest(self) -> str: ...


class _NoDigest:
    def update(self, data: Buffer) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


def supported_digests() -> tuple[str, ...]:
    """The algorithm names `page_digest` accepts."""
    return _SUPPORTED


def check_digest(algorithm: str) -> None:
    """Raise ValueError naming the supported algorithms when `algorithm` is not one of them."""
    if algorithm not in _SUPPORTED:
        raise ValueError(f"unknown page digest {algorithm!r}; supported: {', '.join(_SUPPORTED)}")


def new_hasher(algorithm: str) -> Hasher:
    """A fresh incremental hasher for `algorithm` (ValueError when unsupported)."""
    check_digest(algorithm)
    return xxhash.xxh3_64() if algorithm == "xxh3_64" else _NoDigest()


def page_digest(buf: Buffer, algorithm: str) -> str:
    """The digest of exactly the bytes in `buf` (ValueError when `algorithm` is unsupported)."""
    check_digest(algorithm)
    return xxhash.xxh3_64_hexdigest(buf) if algorithm == "xxh3_64" else ""
