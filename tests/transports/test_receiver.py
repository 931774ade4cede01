"""Receiver: the digests that decide a transfer are recomputed over the pool, not trusted."""

from __future__ import annotations

import pytest
import torch
from transport_harness import digests_of, make_manifest, make_record

from kvfence.transports.core.pool_bytes import PoolBytes
from kvfence.transports.core.receiver import Receiver

pytestmark = pytest.mark.anyio


def receiver() -> tuple[Receiver, torch.Tensor]:
    pool = torch.zeros(4, 1024)
    return Receiver(PoolBytes(pool, make_record())), pool


async def test_bytes_changed_after_landing_fail_the_digest_check() -> None:
    rx, pool = receiver()
    src = torch.randn(2, 1024)
    m = make_manifest(2)
    rx.expect(m, [2, 0])
    adm = rx.admit(m, [2, 0], 4096)
    for index in range(2):
        target = rx.target(adm, index)
        assert target is not None
        target[:] = src[index].numpy().tobytes()
    pool[0, 5] += 1.0  # corrupted after landing, before verification
    verdict = rx.finish(adm, 2, digests_of(src, [0, 1]))
    assert (verdict.ok, verdict.reason) == (False, "digest_mismatch")
    assert await rx.completion(m.transfer_id) == verdict


async def test_intact_bytes_pass_and_targets_close_after_finish() -> None:
    rx, pool = receiver()
    src = torch.randn(1, 1024)
    m = make_manifest(1)
    rx.expect(m, [3])
    adm = rx.admit(m, [3], 4096)
    rx.target(adm, 0)[:] = src[0].numpy().tobytes()
    assert rx.finish(adm, 1, digests_of(src, [0])).ok
    assert torch.equal(pool[3], src[0])
    assert rx.target(adm, 0) is None


def test_pool_bytes_reject_a_pool_that_does_not_match_the_record() -> None:
    with pytest.raises(ValueError, match="bytes"):
        PoolBytes(torch.zeros(4, 512), make_record())
    with pytest.raises(ValueError, match="dtype"):
        PoolBytes(torch.zeros(4, 2048, dtype=torch.float16), make_record())
    with pytest.raises(ValueError, match="contiguous"):
        PoolBytes(torch.zeros(1024, 4).t(), make_record())
    with pytest.raises(ValueError, match="digest"):
        PoolBytes(torch.zeros(4, 1024), make_record(digest="md5"))
