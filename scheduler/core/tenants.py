"""Tenants as the scheduler sees them: a name every request carries (each lease belongs to one
request), and the limits admission holds it to.

The tenant comes from the authenticated API key (app/api/keys.py), never from a request body. The
core counts each tenant's queued and running requests (`TenantLoad`, kept where states change) and
its tokens (`TokenBucket`); time comes in with every call, as everywhere in the core.
"""

from __future__ import annotations

import dataclasses
import math

from kvfence.scheduler.core.errors import AdmissionRejected


@dataclasses.dataclass(frozen=True)
class Tenant:
    """`max_running`: requests holding pages at once; `max_queued`: requests waiting for pages;
    `tokens_per_minute`: prompt plus generated tokens, charged at admission for the prompt and
    max_tokens and settled when the request ends. None: no limit beyond the server's. `weight`:
    its share of running slots and decode pages against the other tenants' (fair shares,
    scheduler/core/reservation.py and scheduler/core/preemption.py). `share`: who within the tenant is a
    share of its own ("": the tenant is one; without API keys, each client address is, so one
    client's flood cannot take every slot); not part of the tenant's identity."""

    name: str
    max_running: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None
    weight: int = 1
    share: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").replace(".", "").isalnum():
            raise ValueError(f"a tenant name is letters, digits, '-', '_' and '.', got {self.name!r}")
        for field in ("max_running", "max_queued", "tokens_per_minute", "weight"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"tenant {self.name!r}: {field} must be a positive integer, got {value!r}")


    @property
    def share_key(self) -> str:
        """The fair-share group its requests count in."""
        return f"{self.name}/{self.share}" if self.share else self.name


ANONYMOUS = Tenant(name="anonymous")  # every request when the server runs without API keys
INTERNAL = Tenant(name="internal")  # the server's own requests (the readiness canary)
RESERVED_NAMES = (ANONYMOUS.name, INTERNAL.name)


class TokenBucket:
    """Tokens per minute, as a bucket that refills continuously up to one minute's worth. A request
    is admitted while the bucket is not in debt; what it then uses may run it into debt, which
    later requests wait out (`retry_after_s`)."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(per_minute)
        self.level = self.capacity
        self.at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)

    def retry_after_s(self, now: float) -> int | None:
        """None if a request may start now; else whole seconds until one may."""
        self._refill(now)
        if self.level >= -1e-6:  # not in debt (within rounding)
            return None
        return max(1, math.ceil(round(-self.level / self.rate, 6)))

    def spend(self, tokens: int, now: float) -> None:
        """Take `tokens` (a negative count gives back what was taken and not used, never past a
        full bucket)."""
        self._refill(now)
        self.level = min(self.capacity, self.level - tokens)


@dataclasses.dataclass
class TenantLoad:
    """One tenant's requests by where they are, and its token bucket (None: no rate limit)."""

    tenant: Tenant
    queued: int = 0
    running: int = 0
    bucket: TokenBucket | None = None

    @property
    def at_running_limit(self) -> bool:
        return self.tenant.max_running is not None and self.running >= self.tenant.max_running

    def spend(self, tokens: int, now: float) -> None:
        """Charge `tokens` to the tenant's bucket (no bucket: no rate limit)."""
        if self.bucket is not None:
            self.bucket.spend(tokens, now)


class TenantLoads(dict[str, TenantLoad]):
    """Every tenant seen so far, by name (a bucket outlives a tenant's idle spells: its debt stays)."""

    def of(self, tenant: Tenant, now: float) -> TenantLoad:
        """`tenant`'s load, made on first sight (or remade, keeping its counts, if its limits changed)."""
        load = self.get(tenant.name)
        if load is None or load.tenant != tenant:
            bucket = TokenBucket(tenant.tokens_per_minute, now) if tenant.tokens_per_minute else None
            load = self[tenant.name] = (TenantLoad(tenant=tenant, bucket=bucket) if load is None
                                        else dataclasses.replace(load, tenant=tenant, bucket=bucket))
        return load

    @staticmethod
    def refusal(load: TenantLoad, now: float, count: int = 1) -> tuple[str, AdmissionRejected] | None:
        """Why `count` more requests of this tenant (the samples of one request) are refused now (a
        metrics reason and the 429), or None."""
        t = load.tenant
        retry = load.bucket.retry_after_s(now) if load.bucket is not None else None
        if retry is not None:
            return "tenant_rate", AdmissionRejected(
                429, "rate_limit_exceeded", f"tenant {t.name} is over its {t.tokens_per_minute} tokens per minute; "
                f"retry in {retry} s", error_type="rate_limit_error", retry_after_s=retry)
        if t.max_queued is not None and load.queued + count > t.max_queued:
            return "tenant_queue_full", AdmissionRejected(
                429, "rate_limit_exceeded", f"tenant {t.name} already has {load.queued} requests waiting (its limit "
                f"is {t.max_queued}); retry shortly", error_type="rate_limit_error", retry_after_s=1)
        return None
