"""GGUF block types laid out as panels for the CPU GEMM (the layout: kernels/cpu/quant.c).

`panels(kind, raw, k)` takes a weight as the file stores it (rows of blocks) and returns its
panels: the same integers and the same f16 scales, the blocks of 16 rows interleaved so that the
GEMM decodes a chunk of 32 k for 16 output rows with a few vector loads. Nothing is rounded or
re-quantized here: decoding a panel gives the float32 values the `gguf` package's dequantizer
gives for the file (tests/kernels/cpu/test_cpu_quant.py checks it bitwise for every type).
"""

from __future__ import annotations

import numpy as np

PANEL = 16
CHUNK = 32
FORMATS = {"F32": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q8_0": 4, "Q4_K": 5, "Q6_K": 6}
# (values per block, bytes per block) of each GGUF block type kept as it ships
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
          "Q6_K": (256, 210)}


def _lanes(a: np.ndarray) -> np.ndarray:
    """(P, 16 rows, B, X...) -> (P, B, X..., 16 rows): a block's bytes with the panel's rows innermost."""
    return np.moveaxis(a, 1, -1)


def _f16_lanes(a: np.ndarray) -> np.ndarray:
    """(P, 16, B, 2) f16 bytes -> (P, B, 32): the 16 rows' values side by side."""
    return np.ascontiguousarray(np.moveaxis(a, 1, 2)).reshape(*a.shape[:1], a.shape[2], 32)


def _pairs(q: np.ndarray) -> np.ndarray:
    """(P, 16, B, 2n) 4-bit values -> (P, B, 16 n) bytes: per pair of k, the 16 rows' bytes
    (the first k in the low nibble)."""
    pairs = q[..., 0::2] | (q[..., 1::2] << 4)
    return np.ascontiguousarray(_lanes(pairs)).reshape(q.shape[0], q.shape[2], -1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A Q4_0/Q4_1/Q5_0 block's 16 bytes -> its 32 low 4-bit values (the low nibbles first)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def panels(kind: str, raw: np.ndarray, k: int) -> np.ndarray:
    """`raw`: uint8 [n, row bytes], rows of `kind` blocks over k -> uint8 [panels, panel bytes]."""
    per_block, block_bytes = BLOCKS[kind]
    n = raw.shape[0]
    if k % per_block or raw.shape[1] != k // per_block * block_bytes:
        raise ValueError(f"{kind} rows of {k} values are {k // per_block * block_bytes} bytes in whole blocks "
                         f"of {per_block}; got {raw.shape[1]} bytes")
    rows = -(-n // PANEL) * PANEL
    b = np.zeros((rows, k // per_block, block_bytes), dtype=np.uint8)
    b[:n] = raw.reshape(n, k // per_block, block_bytes)
    b = b.reshape(rows // PANEL, PANEL, k // per_block, block_bytes)  # (P, 16, blocks, bytes)
    p, blocks = b.shape[0], b.shape[2]
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        scales = [_f16_lanes(b[..., 0:2])]
        if kind == "Q4_0":
            body = [_pairs(_nibbles(b[..., 2:18]))]
        elif kind == "Q4_1":
            scales.append(_f16_lanes(b[..., 2:4]))
            body = [_pairs(_nibbles(b[..., 4:20]))]
        elif kind == "Q5_0":  # the fifth bits: the block's 32-bit mask is already 4 octets of k
            body = [_pairs(_nibbles(b[..., 6:22])),
                    np.ascontiguousarray(_lanes(b[..., 2:6])).reshape(p, blocks, 64)]
        else:
            body = [np.ascontiguousarray(_lanes(b[..., 2:34])).reshape(p, blocks, 512)]
        return np.concatenate(scales + body, axis=-1).reshape(p, -1)
    if kind == "Q4_K":
        import gguf

        sc, mins = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        sc, mins = sc.reshape(p, PANEL, blocks, 8), mins.reshape(p, PANEL, blocks, 8)
        qs = b[..., 16:144].reshape(p, PANEL, blocks, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(p, PANEL, blocks, 8, 32)  # sub-blocks 2c, 2c + 1
        header = [_f16_lanes(b[..., 0:2]), _f16_lanes(b[..., 2:4]),
                  np.ascontiguousarray(_lanes(sc)).reshape(p, blocks, 128),
                  np.ascontiguousarray(_lanes(mins)).reshape(p, blocks, 128)]
        chunks = [_pairs(q[..., j, :]) for j in range(8)]
        return np.concatenate(header + chunks, axis=-1).reshape(p, -1)
    # Q6_K: the value order of the gguf package's dequantizer
    ql = (b[..., 0:128].reshape(p, PANEL, blocks, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15
    qh = (b[..., 128:192].reshape(p, PANEL, blocks, 2, 1, 32)
          >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    q = ql.reshape(p, PANEL, blocks, 256) | (qh.reshape(p, PANEL, blocks, 256) << 4)
    header = [_f16_lanes(b[..., 208:210]), np.ascontiguousarray(_lanes(b[..., 192:208])).reshape(p, blocks, 256)]
    chunks = []
    for j in range(8):
        c = q[..., 32 * j: 32 * j + 32]
        high = (c >> 4).reshape(p, PANEL, blocks, 8, 4)
        quads = high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4) | (high[..., 3] << 6)
        chunks += [_pairs(c & 15), np.ascontiguousarray(_lanes(quads)).reshape(p, blocks, 128)]
    return np.concatenate(header + chunks, axis=-1).reshape(p, -1)
