"""Scheduler settings: frozen, validated with messages a user can act on."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    page_size_tokens: int = 16
    max_context_tokens: int = 8192  # the effective limit (already min'ed with model and pools)
    max_running: int = 64  # requests decoding at once
    max_queue: int = 256  # requests waiting for pages; beyond it: 503 with Retry-After
    chunk_tokens: int = 512  # prefill tokens per step (chunked prefill budget)
    disaggregated: bool = True
    transfer_timeout_s: float = 30.0
    queue_timeout_s: float = 60.0  # a request waiting this long for pages ends with 503
    heartbeat_s: float = 1.0  # how often each worker is asked for its incarnation
    max_preemptions: int = 16  # a request preempted more often than this ends with 503 instead

    def __post_init__(self) -> None:
        for name in ("page_size_tokens", "max_context_tokens", "max_running", "chunk_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_preemptions < 0:
            raise ValueError(f"--max-preemptions must be >= 0, got {self.max_preemptions}")
        if self.transfer_timeout_s <= 0 or self.queue_timeout_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError(f"timeouts must be > 0 s, got transfer {self.transfer_timeout_s}, "
                             f"queue {self.queue_timeout_s}, heartbeat {self.heartbeat_s}")

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size_tokens)
