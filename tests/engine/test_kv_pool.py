"""KVPool: owner tags for 128-bit leases, and scrubbing of freed pages."""

from __future__ import annotations

import pytest
import torch

from kvfence.engine.kv_pool import POISON_VALUE, KVPool, lease_tag, tag_lease
from kvfence.engine.model_config import ModelConfig

CONFIG = ModelConfig(architecture="llama", num_layers=2, hidden_size=32, intermediate_size=64, num_heads=4,
                     num_kv_heads=2, head_dim=8, vocab_size=100, max_context_tokens=64)


def test_lease_tags_round_trip_all_128_bits() -> None:
    for lease in (1, (1 << 63), (1 << 64) - 1, 1 << 64, (1 << 128) - 1, 0x0123456789ABCDEF_FEDCBA9876543210):
        assert tag_lease(*lease_tag(lease)) == lease
    with pytest.raises(ValueError):
        lease_tag(1 << 128)


def test_assign_clear_and_owner() -> None:
    pool = KVPool(CONFIG, 6, 4, torch.float32)
    lease = (5 << 120) | 3
    pool.assign([1, 4], lease)
    assert pool.owner(1) == lease and pool.owner(4) == lease and pool.owner(0) == 0
    pool.clear([4])
    assert pool.owner(4) == 0 and pool.owner(1) == lease
    with pytest.raises(ValueError, match="lease 0"):
        pool.assign([2], 0)


@pytest.mark.parametrize("mode, check", [
    ("poison", lambda t: bool((t == POISON_VALUE).all())),
    ("zero", lambda t: bool((t == 0).all())),
    ("off", lambda t: bool((t == 1).all())),
])
def test_scrub_modes_touch_only_freed_pages(mode: str, check) -> None:
    pool = KVPool(CONFIG, 6, 4, torch.float32)
    pool.data.fill_(1.0)
    pool.assign([2, 3], 7)
    pool.clear([2, 3], mode)
    assert check(pool.data[2]) and check(pool.data[3])
    assert bool((pool.data[[0, 1, 4, 5]] == 1).all())  # other pages untouched
    with pytest.raises(ValueError, match="--kv-scrub"):
        pool.clear([1], "shred")
