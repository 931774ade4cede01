"""The interface the HTTP layer needs from the serving core (the scheduler implements it)."""

from __future__ import annotations

from typing import Protocol

from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.core.tenants import Tenant


class EngineClient(Protocol):
    model_name: str
    tokenizer: Tokenizer

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt + max_tokens any request may have (advertised in /v1/models)."""
        ...

    def submit_samples(self, prompt_token_ids: list[int], samples: list[SamplingParams], tenant: Tenant,
                       cache_salt: str = "") -> list[RequestHandle]:
        """Admit the samples of one request of the authenticated `tenant` (one for `n` = 1; they
        differ only in their seeds), one handle each, or raise `AdmissionRejected` for all (400 /
        429 / 503, nothing reserved). `cache_salt` (from the body) only partitions the tenant's
        prefix cache.

        `max_tokens` is always set by the caller (the API fills the default)."""
        ...

    def flush_cache(self) -> dict[str, int]:
        """Drop every prefix-cache entry; the pages freed per worker."""
        ...

    def is_ready(self) -> bool:
        """True when the serving path has passed its readiness check, is not draining and some
        pair of workers takes requests."""
        ...
