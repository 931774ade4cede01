"""A GGUF file's metadata as plain values: what a model family reads its config from
(engine/models/), what the start-up cache keeps (engine/gguf_cache.py) and what `kvfence check`
sizes the weights from (engine/weight_size.py), without reading a weight."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from kvfence.engine.checkpoint import CheckpointError


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's key-value metadata (plain Python values) and the names of its tensors."""

    fields: dict[str, Any]
    tensor_names: list[str]
    # name -> (GGUF type name, shape as [rows, values per row] or [values])
    tensor_types: dict[str, tuple[str, list[int]]] = dataclasses.field(default_factory=dict)

    def field(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    @property
    def architecture(self) -> str | None:
        arch = self.fields.get("general.architecture")
        return None if arch is None else str(arch)

    def required(self, key: str, path: Path, default: Any = None) -> Any:
        """The value of `key`, else `default`; CheckpointError naming the file when neither is."""
        value = self.field(key, default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF is missing {key}")
        return value


def metadata_of(reader: Any) -> GGUFMetadata:
    """The metadata of an open `gguf.GGUFReader`."""
    return GGUFMetadata(fields={key: f.contents() for key, f in reader.fields.items()},
                        tensor_names=[t.name for t in reader.tensors],
                        tensor_types={t.name: (t.tensor_type.name, [int(d) for d in reversed(t.shape)])
                                      for t in reader.tensors})


def float32_value(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06): the number the converter was given, as config.json has it."""
    f = float(value)
    return float(str(np.float32(f))) if float(np.float32(f)) == f else f
