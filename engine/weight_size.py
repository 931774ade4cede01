"""How many bytes a model's weights take once a worker holds them, from a GGUF file's tensor
table alone (no weight is read): what `kvfence check` prints beside the KV pools.

With `--weights native` on the CPU in float32, a matrix of a kept block type is held as its
panels (kernels/cpu/quant.py: the file's own bits per weight, rows padded to panels of 16);
anything else is held as floats of the worker's dtype. With the CPU kernels a float matrix is
packed into float32 panels, and a tied embedding is held twice (the lookup table and the LM
head's panels); a kept embedding serves both as one.
"""

from __future__ import annotations

import dataclasses

from kvfence.engine.gguf_metadata import GGUFMetadata
from kvfence.engine.models.registry import family_of
from kvfence.kernels.cpu import quant as cpu_quant

_PANEL_BYTES = {"Q4_0": 288, "Q4_1": 320, "Q5_0": 352, "Q8_0": 544}  # per 32 values of a panel's 16 rows
_SUPER_BYTES = {"Q4_K": 2368, "Q6_K": 3360}  # per 256


def panel_bytes(kind: str, rows: int, values: int) -> int:
    """Bytes of a [rows, values] matrix of `kind` as panels (as kernels/cpu_quant.panels lays it out)."""
    panels = -(-rows // cpu_quant.PANEL)
    if kind in _SUPER_BYTES:
        return panels * values // 256 * _SUPER_BYTES[kind]
    return panels * values // cpu_quant.CHUNK * _PANEL_BYTES[kind]


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    total: int
    by_kind: dict[str, int]  # held as: "Q4_1", ..., or "float32"/"bfloat16"... for float tensors
    file_kinds: dict[str, int]  # the file's own types: tensors of each


def weight_bytes(meta: GGUFMetadata, keep_blocks: bool, dtype_name: str, element_size: int) -> WeightBytes:
    """The bytes of every tensor the model uses, as a CPU worker in `dtype_name` holds them."""
    by_kind: dict[str, int] = {}
    file_kinds: dict[str, int] = {}
    tied = "output.weight" not in meta.tensor_types
    family = family_of(str(meta.architecture))
    for name, (kind, shape) in meta.tensor_types.items():
        if family.canonical_name(name) is None:
            continue
        file_kinds[kind] = file_kinds.get(kind, 0) + 1
        count = 1
        for d in shape:
            count *= d
        if keep_blocks and dtype_name == "float32" and kind in cpu_quant.BLOCKS and len(shape) == 2:
            held, size = kind, panel_bytes(kind, shape[0], shape[1])
        else:
            held, size = dtype_name, count * element_size
            if tied and name == "token_embd.weight":
                size *= 2  # the lookup table and the LM head's own copy
        by_kind[held] = by_kind.get(held, 0) + size
    return WeightBytes(sum(by_kind.values()), by_kind, file_kinds)
