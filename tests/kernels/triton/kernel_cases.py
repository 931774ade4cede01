"""Random paged KV setups for the kernel tests: a pool with scattered, out-of-order page tables."""

from __future__ import annotations

import dataclasses
import random

import torch

from kvfence.engine.kv_pool import POISON_VALUE

# Against the float32-softmax references; the engine's torch path also rounds scores and
# probabilities to the dtype, so comparisons with it in bfloat16 take ENGINE_TOLERANCE.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
ENGINE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 5e-3}


@dataclasses.dataclass
class PagedCase:
    data: torch.Tensor  # [num_pages, 2 layers, K|V, kv_heads, page_size, head_dim], the whole pool
    keys: torch.Tensor  # [num_pages, kv_heads, page_size, head_dim], layer 1's strided view
    values: torch.Tensor
    owner_tags: torch.Tensor  # [num_pages, 2] int64
    leases: torch.Tensor  # [num_seqs, 2] int64
    tables: list[list[int]]  # pages of each sequence, in token order
    page_table: torch.Tensor  # [num_seqs, max_pages] int32, padded with a free poisoned page
    free_page: int  # tag 0, filled with POISON_VALUE: reading it breaks outputs and flags
    heads: int

    def retag(self, seq: int, index: int) -> int:
        """Give page `index` of sequence `seq` another lease's tag; returns the page."""
        page = self.tables[seq][index]
        self.owner_tags[page] = self.leases[seq] ^ torch.tensor([0, 1], device=self.leases.device)
        return page


def make_case(seed: int, lens: list[int], kv_heads: int, group: int, head_dim: int, page_size: int,
              dtype: torch.dtype, device: torch.device, spare_columns: int = 1) -> PagedCase:
    """One sequence per entry of `lens` (tokens its pages cover); pages drawn shuffled from a pool
    with spare pages, so tables are scattered and out of order."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // page_size) for n in lens]
    num_pages = sum(needed) + 3
    order = list(range(num_pages))
    rng.shuffle(order)
    free_page = order.pop()
    data = torch.randn(num_pages, 2, 2, kv_heads, page_size, head_dim, generator=gen).to(dtype)
    data[free_page] = POISON_VALUE
    owner_tags = torch.zeros(num_pages, 2, dtype=torch.int64)
    leases = torch.tensor([[rng.randrange(-2**63, 2**63), rng.randrange(-2**63, 2**63)] for _ in lens])
    tables = []
    for i, n in enumerate(needed):
        tables.append([order.pop() for _ in range(n)])
        owner_tags[tables[-1]] = leases[i]
    max_pages = max(needed) + spare_columns
    page_table = torch.full((len(lens), max_pages), free_page, dtype=torch.int32)
    for i, t in enumerate(tables):
        page_table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    data = data.to(device)
    return PagedCase(data, data[:, 1, 0], data[:, 1, 1], owner_tags.to(device), leases.to(device), tables,
                     page_table.to(device), free_page, kv_heads * group)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, engine: bool = False) -> None:
    tol = (ENGINE_TOLERANCE if engine else TOLERANCE)[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)
