"""A start-up cache for GGUF files: their metadata as JSON and their dequantized weights as raw
float32, so that a second process loading the same file reads them in well under a second
instead of parsing the file's metadata (the tokenizer's ~100k strings: seconds) and
dequantizing every tensor again (seconds more).

An entry is keyed by the file's resolved path, size and modification time: a file changed in
place, or replaced, is a new entry, and the old one is simply never read again. Each file of an
entry is written under a temporary name and renamed into place, so concurrent loaders (a prefill
and a decode worker starting together) never see half an entry; the weights are trusted only
when their index names exactly the bytes on disk. Anything unreadable is a miss, never an error.
Weights are cached only while their float32 form stays under `MAX_CACHED_WEIGHT_BYTES` (small
models, where start-up is dominated by this work); a larger model's entry holds its metadata only.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfence.engine.gguf_metadata import GGUFMetadata


FORMAT = 2  # bump when what an entry holds changes meaning
MAX_CACHED_WEIGHT_BYTES = 2 << 30


def _dequantizer_version() -> str:
    """The `gguf` package dequantizes: weights it dequantized differently are another entry."""
    from importlib.metadata import version

    return version("gguf")


class GGUFCache:
    """The cache entry of one GGUF file under `directory`."""

    def __init__(self, directory: Path, source: Path) -> None:
        st = source.stat()
        key = f"{source.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{FORMAT}\0{_dequantizer_version()}"
        self.entry = Path(directory) / f"gguf-{hashlib.sha256(key.encode()).hexdigest()[:32]}"
        self.source = str(source)

    def metadata(self) -> GGUFMetadata | None:
        raw = self._read_json("metadata.json")
        if raw is None or raw.get("source") != self.source or not isinstance(raw.get("tensor_types"), dict):
            return None
        return GGUFMetadata(fields=raw["fields"], tensor_names=raw["tensor_names"],
                            tensor_types={name: (kind, shape) for name, (kind, shape) in raw["tensor_types"].items()})

    def store_metadata(self, meta: GGUFMetadata) -> None:
        try:
            text = json.dumps({"source": self.source, "fields": meta.fields, "tensor_names": meta.tensor_names,
                               "tensor_types": meta.tensor_types})
        except (TypeError, ValueError):  # a value JSON cannot carry: no entry, the file is read each time
            return
        self._write("metadata.json", text.encode())

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """The cached weights (float32, copy-on-write views of one mapping), or None."""
        index = self._read_json("tensors.json")
        data = self.entry / "tensors.f32"
        try:
            if index is None or not index["bytes"] or data.stat().st_size != index["bytes"]:
                return None
            mapped = np.memmap(data, dtype=np.float32, mode="c")
        except (OSError, KeyError, ValueError):
            return None
        out: dict[str, torch.Tensor] = {}
        for name, shape, offset in index["tensors"]:
            count = int(np.prod(shape, dtype=np.int64))
            out[name] = torch.from_numpy(mapped[offset: offset + count].reshape(shape))
        return out

    def store_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        total = sum(t.numel() for t in tensors.values()) * 4
        if total > MAX_CACHED_WEIGHT_BYTES or any(t.dtype != torch.float32 for t in tensors.values()):
            return
        listing, offset = [], 0
        for name, t in tensors.items():
            listing.append([name, list(t.shape), offset])
            offset += t.numel()
        self._write_parts("tensors.f32", (t.contiguous().numpy().tobytes() for t in tensors.values()))
        self._write("tensors.json", json.dumps({"bytes": total, "tensors": listing}).encode())

    def _read_json(self, name: str) -> Any:
        try:
            return json.loads((self.entry / name).read_bytes())
        except (OSError, ValueError):
            return None

    def _write(self, name: str, data: bytes) -> None:
        self._write_parts(name, (data,))

    def _write_parts(self, name: str, parts: Any) -> None:
        try:
            self.entry.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=self.entry, prefix=f".{name}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    for part in parts:
                        f.write(part)
                os.replace(tmp, self.entry / name)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:  # a read-only or full disk: no entry, loading still works
            return
