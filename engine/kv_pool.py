"""The physical KV cache of one worker: a pool of fixed-size pages and their owner tags.

Layout (the "page-major" layout, recorded at pairing): one tensor
`data[num_pages, num_layers, 2, num_kv_heads, page_size_tokens, head_dim]`, so every page is one
contiguous run of `page_nbytes` bytes. A transport moves and digests a page as one region. Within a
page, each KV head's tokens are contiguous ([page_size, head_dim] tiles), which is what attention
reads.

Owner tags: `owner_tags[num_pages, 2]` int64 holds the 128-bit lease id that owns each page, split
into two signed 64-bit halves; (0, 0) means free. Which pages are free is decided by the page
ledger (scheduler/); this pool only stores what the ledger hands out.
"""

from __future__ import annotations

import torch

from kvfence.engine.model_config import ModelConfig

_MASK64 = (1 << 64) - 1
SCRUB_MODES = ("poison", "zero")  # what --kv-scrub offers: no setting lets a freed page keep its bytes
UNSCRUBBED = "off"  # freed pages keep their bytes: only with the scrub guard off (app/serve/guards.py)
# Finite on purpose: attention also touches the masked tail of a sequence's last page, and a NaN
# there would poison correct results (0 * NaN = NaN); a large finite value is harmless when masked
# and dominates the scores when read. Small enough that q.k stays finite in fp16.
POISON_VALUE = 64.0


def check_scrub(scrub: str) -> None:
    """ValueError naming --kv-scrub's modes unless `scrub` is one of them or UNSCRUBBED."""
    if scrub not in (*SCRUB_MODES, UNSCRUBBED):
        raise ValueError(f"--kv-scrub must be one of {', '.join(SCRUB_MODES)}, got {scrub!r}")


def lease_tag(lease: int) -> tuple[int, int]:
    """Split a 128-bit lease id into the two signed int64 halves stored in `owner_tags`."""
    if not 0 <= lease < 1 << 128:
        raise ValueError(f"lease id must be an unsigned 128-bit integer, got {lease}")

    def signed(x: int) -> int:
        return x - (1 << 64) if x >= 1 << 63 else x

    return signed(lease >> 64), signed(lease & _MASK64)


def tag_lease(hi: int, lo: int) -> int:
    """Inverse of `lease_tag`."""
    return ((hi & _MASK64) << 64) | (lo & _MASK64)


class KVPool:
    def __init__(self, config: ModelConfig, num_pages: int, page_size_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if num_pages <= 0:
            raise ValueError(f"a KV pool needs at least one page, got num_pages={num_pages}")
        if page_size_tokens <= 0:
            raise ValueError(f"page_size_tokens must be > 0, got {page_size_tokens}")
        self.config = config
        self.num_pages = num_pages
        self.page_size_tokens = page_size_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        self.data = torch.zeros(  # [pages, layers, K|V, kv_heads, page_size, head_dim]
            num_pages, config.num_layers, 2, config.num_kv_heads, page_size_tokens, config.head_dim,
            dtype=dtype, device=self.device)
        self.owner_tags = torch.zeros(num_pages, 2, dtype=torch.int64, device=self.device)

    @property
    def page_nbytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size_tokens

    def keys(self, layer: int) -> torch.Tensor:
        """[num_pages, kv_heads, page_size, head_dim] view of one layer's keys."""
        return self.data[:, layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[:, layer, 1]

    def assign(self, pages: list[int], lease: int) -> None:
        """Tag `pages` as owned by `lease` (called when the ledger hands them to a lease)."""
        if lease == 0:
            raise ValueError("lease 0 is reserved for free pages")
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.owner_tags[idx] = torch.tensor(lease_tag(lease), dtype=torch.int64, device=self.device)

    def seal(self, pages: list[int], lease: int, seal: int) -> list[int]:
        """Re-tag those of `pages` that `lease` owns with `seal` (read-only, shared within a
        tenant); returns the pages it refused because another lease's (or no) tag is on them: they
        keep that tag, so every read of them still fails the owner-tag check."""
        if seal == 0:
            raise ValueError("seal 0 is reserved for free pages")
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        mine = (self.owner_tags.index_select(0, idx) == torch.tensor(lease_tag(lease), device=self.device)).all(dim=1)
        self.owner_tags[idx[mine]] = torch.tensor(lease_tag(seal), dtype=torch.int64, device=self.device)
        return [p for p, ok in zip(pages, mine.tolist()) if not ok]

    def clear(self, pages: list[int], scrub: str = "off") -> None:
        """Mark `pages` free (tag 0) and scrub their contents: "poison" fills them with POISON_VALUE,
        so attention that reads a slot nobody wrote since is dominated by it and the output visibly
        breaks; "zero" zeroes them; "off" (UNSCRUBBED) leaves them."""
        check_scrub(scrub)
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        self.owner_tags[idx] = 0
        if scrub == "poison":
            self.data.index_fill_(0, idx, POISON_VALUE)
        elif scrub == "zero":
            self.data.index_fill_(0, idx, 0.0)

    def owner(self, page: int) -> int:
        hi, lo = self.owner_tags[page].tolist()
        return tag_lease(hi, lo)
