"""Reading a JSON object from a model's files, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """`path`'s JSON object; `error` naming the file when it cannot be read or holds no object."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot read JSON ({e})") from e
    if not isinstance(table, dict):
        raise error(f"{path}: holds {type(table).__name__}, not a JSON object")
    return table
