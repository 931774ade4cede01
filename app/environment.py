"""The one place that reads KVFENCE_* environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def kvfence_home(environ: Mapping[str, str] = os.environ) -> Path:
    """Cache folder for fetched models: $KVFENCE_HOME, else ~/.cache/kvfence."""
    value = environ.get("KVFENCE_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "kvfence"


def cpu_kernels_setting(environ: Mapping[str, str] = os.environ) -> str:
    """$KVFENCE_CPU_KERNELS: "auto" (default: kernels/cpu_kernels.py where they build) or "off"."""
    value = environ.get("KVFENCE_CPU_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"KVFENCE_CPU_KERNELS must be auto or off, got {value!r}")
    return value
