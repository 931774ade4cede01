"""Page digests."""

from __future__ import annotations

import os

import pytest
import xxhash

from kvfence.transports.core.digest import new_hasher, page_digest, supported_digests


def test_supported() -> None:
    assert set(supported_digests()) == {"xxh3_64", "none"}


def test_xxh3_64_over_exactly_the_bytes() -> None:
    data = os.urandom(4096)
    d = page_digest(memoryview(data), "xxh3_64")
    assert d == xxhash.xxh3_64_hexdigest(data) and len(d) == 16
    assert page_digest(data[:-1], "xxh3_64") != d


def test_incremental_equals_one_shot() -> None:
    data = memoryview(os.urandom(10_000))
    for algorithm in supported_digests():
        h = new_hasher(algorithm)
        for start in range(0, len(data), 777):
            h.update(data[start:start + 777])
        assert h.hexdigest() == page_digest(data, algorithm)


def test_none_and_unknown() -> None:
    assert page_digest(b"abc", "none") == ""
    with pytest.raises(ValueError, match="xxh3_64"):
        page_digest(b"abc", "md5")
    with pytest.raises(ValueError):
        new_hasher("sha1")
