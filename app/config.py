"""Server settings: one frozen dataclass, filled from defaults < TOML file < KVFENCE_* env < flags."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    disaggregation: str = "on"  # "on": prefill and decode workers + transport; "off": one colocated worker
    transport: str = "tcp"
    prefill_device: str = "auto"
    decode_device: str = "auto"
    page_size_tokens: int = 16
    prefill_num_pages: int | None = None  # default: from prefill_kv_memory, else 2 contexts
    decode_num_pages: int | None = None  # default: from decode_kv_memory, else 4 contexts
    prefill_kv_memory: str | None = None  # e.g. "2GiB"
    decode_kv_memory: str | None = None
    max_context: int | None = None  # default: the model's context
    clamp_context: bool = False  # True: shrink the context to what every KV pool holds, not refuse
    max_running: int = 64
    max_queue: int = 256
    max_preemptions: int = 16  # a request preempted more often than this ends with 503
    chunk_tokens: int | None = None  # default: chunk_tokens_for(the prefill device)
    shutdown_timeout_s: float = 30.0
    transfer_timeout_s: float = 30.0
    queue_timeout_s: float = 60.0  # a request that waits this long for KV pages ends with 503
    canary_interval_s: float = 30.0  # how often the readiness canary re-checks the serving path
    kv_scrub: str = "poison"  # what freed KV pages are filled with: poison | zero | off
    attention_backend: str = "auto"  # auto | torch | triton (engine/attention_backend.py)
    kv_sanitizer: bool = False  # shadow ledger of every KV slot's writer, checked on every read (tests)
    fault_inject: str = ""  # testing only: a transports.faults.FaultPlan spec for the sending side
    transport_secret_file: str | None = None  # deployment secret of the transport endpoints (default: per process)
    max_body_bytes: int = 16 << 20  # a request body longer than this gets 413 before it is read further
    stall_timeout_s: float = 30.0  # a streaming client that reads nothing for this long is aborted

    def __post_init__(self) -> None:
        if self.disaggregation not in ("on", "off"):
            raise ValueError(f"--disaggregation must be 'on' or 'off', got {self.disaggregation!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name in ("page_size_tokens", "max_running", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_num_pages", "decode_num_pages", "max_context", "chunk_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.fault_inject:
            from kvfence.transports.faults import FaultPlan

            FaultPlan.parse(self.fault_inject)  # raises ValueError naming the problem
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"--attention-backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.kv_scrub not in ("poison", "zero", "off"):
            raise ValueError(f"--kv-scrub must be poison, zero or off, got {self.kv_scrub!r}")
        if self.queue_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError(f"--queue-timeout and --transfer-timeout must be > 0 s, got "
                             f"{self.queue_timeout_s} and {self.transfer_timeout_s}")
        if self.max_preemptions < 0:
            raise ValueError(f"--max-preemptions must be >= 0, got {self.max_preemptions}")
        if self.stall_timeout_s <= 0:
            raise ValueError(f"--stall-timeout must be > 0 s, got {self.stall_timeout_s}")
        if self.canary_interval_s <= 0:
            raise ValueError(f"--canary-interval must be > 0 s, got {self.canary_interval_s}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout_s}")
        for name in ("prefill_kv_memory", "decode_kv_memory"):
            if getattr(self, name) is not None:
                parse_bytes(getattr(self, name))

    def chunk_tokens_for(self, device_type: str) -> int:
        """Prefill tokens per step: --chunk-tokens, else a default for the prefill worker's device.

        A prefill step holds up every decode step that shares its compute thread (engine/compute.py;
        colocated, every step). On a GPU 512 tokens take milliseconds; on a CPU they take about a
        second (~550 tok/s fp32 on 2 cores), so the CPU default is 128: the worst inter-token gap at
        16 streams fell from 0.80 s to 0.36 s, throughput unchanged (docs/benchmarks.md)."""
        if self.chunk_tokens is not None:
            return self.chunk_tokens
        return 128 if device_type == "cpu" else 512


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1048576' -> bytes."""
    s = text.strip().lower().replace(" ", "")
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    try:
        value = float(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 512MiB or 2GiB") from None
    if value <= 0:
        raise ValueError(f"a memory size must be > 0, got {text!r}")
    return int(value)


_FIELDS = {f.name: f for f in dataclasses.fields(ServeConfig)}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, value: Any) -> Any:
    kind = _FIELDS[name].type
    if value is None or not isinstance(value, str):
        return value
    if "bool" in str(kind):
        if value.strip().lower() in _TRUE:
            return True
        if value.strip().lower() in _FALSE:
            return False
        raise ValueError(value)
    if "int" in str(kind):
        return int(value)
    if "float" in str(kind):
        return float(value)
    return value


def load_config(flags: Mapping[str, Any], environ: Mapping[str, str], config_file: Path | None) -> ServeConfig:
    """Merge the sources; unknown keys in the file or KVFENCE_ variables that look like settings are errors."""
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"--config {config_file}: {e}") from e
        for key, value in data.items():
            name = key.replace("-", "_")
            if name not in _FIELDS:
                raise ValueError(f"--config {config_file}: unknown setting {key!r}")
            values[name] = value
    for name in _FIELDS:
        env = environ.get("KVFENCE_" + name.upper())
        if env is not None:
            try:
                values[name] = _coerce(name, env)
            except ValueError:
                raise ValueError(f"KVFENCE_{name.upper()}={env!r} is not a valid value") from None
    if "KVFENCE_FAULTS" in environ and "KVFENCE_FAULT_INJECT" not in environ:  # the short name
        values["fault_inject"] = environ["KVFENCE_FAULTS"]
    values.update({k: v for k, v in flags.items() if k in _FIELDS and v is not None})
    return ServeConfig(**values)
