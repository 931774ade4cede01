"""Scheduler settings: the `[scheduler]` table a user sets, and the config the scheduler runs with.

`SchedulerSettings` declares what a user sets, each a `knob`: its default, meaning and bounds as
plain field metadata, from which app/config/settings.py makes its flag, KVFENCE_* variable and TOML key
and checks a value (this package imports nothing of the app). `SchedulerConfig` adds what the
server binds at start (`SchedulerSettings.bind`): the pools' page size, the served context, the
mode and the prefill chunk for the prefill device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Prefill tokens per step by the prefill worker's device type, when --chunk-tokens is not given.
# A prefill step holds up every decode step that shares its compute thread (engine/compute.py;
# colocated, every step). On a GPU 512 tokens take milliseconds; on a CPU they take about a second
# (~550 tok/s fp32 on 2 cores), so the CPU default is 128: the worst inter-token gap at 16 streams
# fell from 0.80 s to 0.36 s, throughput unchanged (docs/benchmarks.md).
CHUNK_TOKENS_BY_DEVICE = {"cpu": 128}
CHUNK_TOKENS_ELSEWHERE = 512
# While several fair-share groups are active, a group already decoding prefills at most this many
# tokens a step (scheduler/core/policy.py RecentGroups): on a CPU, another group's new request then
# waits behind a step of ~0.05 s, not ~0.19 s. On a GPU the whole chunk takes milliseconds.
CONTENDED_CHUNK_TOKENS_BY_DEVICE = {"cpu": 32}


def knob(default: Any, help: str, **bounds: float) -> Any:
    """A field a user sets: `default`, `help` (its meaning) and `bounds` (`above`, `at_least`,
    `at_most`), in the metadata app/config/settings.py declares settings with."""
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


@dataclasses.dataclass(frozen=True)
class SchedulerSettings:
    """Admission limits, batching and timeouts."""

    max_running: int = knob(64, "requests holding pages at once", above=0)
    max_queue: int = knob(256, "requests waiting for pages before 503", at_least=0)
    max_preemptions: int = knob(16, "times a running request may be sent back to the queue when the decode "
                                       "pool runs out before it ends with 503", at_least=0)
    chunk_tokens: int | None = knob(None, f"prefill tokens per step (default: {CHUNK_TOKENS_BY_DEVICE['cpu']} "
                                             f"when prefill runs on a CPU, {CHUNK_TOKENS_ELSEWHERE} on a GPU)", above=0)
    contended_chunk_tokens: int | None = knob(
        None, "prefill tokens per step of a fair-share group already decoding while other groups are active too "
              f"(default: {CONTENDED_CHUNK_TOKENS_BY_DEVICE['cpu']} when prefill runs on a CPU, the whole chunk on a "
              "GPU)", above=0)
    contention_window_s: float = knob(
        10.0, "seconds a fair-share group counts as active after its last request; while two or more are, a prompt "
              "waiting for its first token goes ahead and steps are kept short for it, at some cost in throughput "
              "(0: never)", at_least=0)
    queue_timeout_s: float = knob(60.0, "seconds a request may wait for KV pages before it gets 503", above=0)
    transfer_timeout_s: float = knob(30.0, "seconds a KV transfer may take before it fails (its pages are "
                                              "quarantined)", above=0)
    heartbeat_s: float = knob(1.0, "seconds between asking each worker for its incarnation", above=0)
    prefix_cache: bool = knob(True, "keep full prompt pages cached after a request, shared read-only with later "
                                       "requests of the same tenant (never across tenants)")
    unsafe_cache_across_tenants: bool = knob(
        False, "TESTING ONLY, never in production: a deliberately broken guard that keys and seals the prefix cache "
               "without the tenant, so one tenant's cached prompt serves another's (what `kvfence probe` must catch)")

    def chunk_tokens_for(self, device_type: str) -> int:
        """Prefill tokens per step: --chunk-tokens, else the default for the prefill worker's device."""
        if self.chunk_tokens is not None:
            return self.chunk_tokens
        return CHUNK_TOKENS_BY_DEVICE.get(device_type, CHUNK_TOKENS_ELSEWHERE)

    def bind(self, *, page_size_tokens: int, max_context_tokens: int, disaggregated: bool,
             prefill_device_type: str) -> SchedulerConfig:
        """The config a scheduler runs with: these settings plus what the server fixed at start."""
        mine = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerSettings)}
        mine["chunk_tokens"] = chunk = self.chunk_tokens_for(prefill_device_type)
        contended = self.contended_chunk_tokens or CONTENDED_CHUNK_TOKENS_BY_DEVICE.get(prefill_device_type, chunk)
        mine["contended_chunk_tokens"] = min(contended, chunk)
        return SchedulerConfig(**mine, page_size_tokens=page_size_tokens, max_context_tokens=max_context_tokens,
                               disaggregated=disaggregated)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulerSettings):
    """What the scheduler takes. Built by `SchedulerSettings.bind` when serving; tests build it directly."""

    page_size_tokens: int  # the pools' page size (app/config/config.py PoolsConfig)
    max_context_tokens: int = 8192  # the effective limit (already min'ed with model and pools)
    disaggregated: bool = True
    chunk_tokens: int = CHUNK_TOKENS_ELSEWHERE  # prefill tokens per step, resolved (chunk_tokens_for)

    @property
    def held_back_tokens(self) -> int:
        """Prefill tokens per step of a group already decoding while several groups are active."""
        return min(self.contended_chunk_tokens or self.chunk_tokens, self.chunk_tokens)

    def __post_init__(self) -> None:
        for flag, value in (("--page-size", self.page_size_tokens), ("--max-context", self.max_context_tokens),
                            ("--chunk-tokens", self.chunk_tokens)):
            if value <= 0:
                raise ValueError(f"{flag} must be > 0, got {value}")

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size_tokens)
