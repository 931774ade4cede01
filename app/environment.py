"""The one place that reads KVFENCE_* environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def kvfence_home(environ: Mapping[str, str] = os.environ) -> Path:
    """Cache folder for fetched models: $KVFENCE_HOME, else ~/.cache/kvfence."""
    value = environ.get("KVFENCE_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "kvfence"
