"""Argument checks shared by the kernel launchers: every mismatch is a ValueError naming the tensor.

Kernels index with explicit strides, so a tensor may be a strided view (the KV pool's per-layer
`keys(layer)` / `values(layer)` views are); only the last dimension must be contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, t: torch.Tensor, shape: Sequence[int | None], dtypes: Sequence[torch.dtype],
                 device: torch.device, *, contiguous: bool = False) -> None:
    """`shape`: one entry per dimension, None for "any". `contiguous`: the whole tensor, else only
    its last dimension (stride 1), must be contiguous."""
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        dims = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{dims}], got {list(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be {names}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the KV cache on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_cache(keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int, int, int]:
    """keys, values: [num_pages, kv_heads, page_size, head_dim] views of one layer of the pool, with
    the same shape, dtype and strides -> (num_pages, kv_heads, page_size, head_dim)."""
    if keys.dim() != 4:
        raise ValueError(f"keys must be [num_pages, kv_heads, page_size, head_dim], got {list(keys.shape)}")
    check_tensor("keys", keys, list(keys.shape), ATTENTION_DTYPES, keys.device)
    if values.shape != keys.shape or values.dtype != keys.dtype or values.stride() != keys.stride():
        raise ValueError(f"values must match keys in shape, dtype and strides: keys {list(keys.shape)} "
                         f"{keys.dtype} {keys.stride()}, values {list(values.shape)} {values.dtype} {values.stride()}")
    if values.device != keys.device:
        raise ValueError(f"values are on {values.device}, keys on {keys.device}")
    num_pages, kv_heads, page_size, head_dim = keys.shape
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16 for the Triton kernels, got {head_dim}")
    return num_pages, kv_heads, page_size, head_dim


def check_owner_args(owner_tags: torch.Tensor | None, leases: torch.Tensor | None, num_pages: int,
                     num_seqs: int, device: torch.device) -> bool:
    """Both given (the check runs) or both None (it does not); returns whether it runs."""
    if (owner_tags is None) != (leases is None):
        raise ValueError("owner_tags and leases go together: pass both to check ownership, or neither")
    if owner_tags is None or leases is None:
        return False
    check_tensor("owner_tags", owner_tags, [num_pages, 2], [torch.int64], device, contiguous=True)
    check_tensor("leases", leases, [num_seqs, 2], [torch.int64], device, contiguous=True)
    return True


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
