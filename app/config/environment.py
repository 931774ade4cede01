"""The one place that reads KVFENCE_* environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when asked for: reading the environment loads no torch
    from kvfence.kernels.cpu.library import Place


def kvfence_home(environ: Mapping[str, str] = os.environ) -> Path:
    """Cache folder for fetched models: $KVFENCE_HOME, else ~/.cache/kvfence."""
    value = environ.get("KVFENCE_HOME")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "kvfence"


def kernel_place(environ: Mapping[str, str] = os.environ) -> Place:
    """Where the CPU kernels build ($KVFENCE_HOME/cache/kernels) and whether they may be used
    ($KVFENCE_CPU_KERNELS): what every command tells kernels/cpu/library.py (`use`) first."""
    from kvfence.kernels.cpu.library import Place

    off = "KVFENCE_CPU_KERNELS=off" if cpu_kernels_setting(environ) == "off" else ""
    return Place(kvfence_home(environ) / "cache" / "kernels", off)


def cpu_kernels_setting(environ: Mapping[str, str] = os.environ) -> str:
    """$KVFENCE_CPU_KERNELS: "auto" (default: kernels/cpu/library.py where they build) or "off"."""
    value = environ.get("KVFENCE_CPU_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"KVFENCE_CPU_KERNELS must be auto or off, got {value!r}")
    return value
