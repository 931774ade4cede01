"""KV pool sizing, checked against the context at start-up, per role.

The invariant: every KV pool holds at least one request of the full context. A prompt must fit in the
prefill pool and prompt + max_tokens in the decode pool (a colocated pool holds both, and is sized like
a decode pool). An undersized pool is refused with UndersizedPoolError, or, with `clamp_context`, the
advertised context shrinks to what every pool holds. A pool holding fewer than two full-context
requests is a warning, returned for the caller to log. Pure arithmetic: nothing is allocated.
"""

from __future__ import annotations

import dataclasses

from kvfence.app.config.config import ServeConfig
from kvfence.engine.model_config import ModelConfig

# Pools sized by default hold this many full contexts.
DEFAULT_CONTEXTS = {"prefill": 2, "decode": 4}
# Below this many full contexts per pool, a verdict is "warn".
WARN_BELOW_CONTEXTS = 2


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """One role's KV pool: `num_pages` pages of `page_size_tokens` tokens, `bytes_per_token` each."""

    role: str  # "prefill", "decode" or "colocated"
    num_pages: int
    page_size_tokens: int
    bytes_per_token: int
    pool_tokens: int  # num_pages * page_size_tokens
    pool_bytes: int  # pool_tokens * bytes_per_token

    def __post_init__(self) -> None:
        if self.pool_tokens != self.num_pages * self.page_size_tokens:
            raise ValueError(f"{self.role} pool: pool_tokens {self.pool_tokens} != "
                             f"{self.num_pages} pages x {self.page_size_tokens} tokens")
        if self.pool_bytes != self.pool_tokens * self.bytes_per_token:
            raise ValueError(f"{self.role} pool: pool_bytes {self.pool_bytes} != "
                             f"{self.pool_tokens} tokens x {self.bytes_per_token} bytes")

    @property
    def flag_prefix(self) -> str:
        """The flags that size this pool: a colocated pool is sized by the decode ones."""
        return "prefill" if self.role == "prefill" else "decode"


@dataclasses.dataclass(frozen=True)
class SizingVerdict:
    """How one pool compares to the context: ratio = pool_tokens / context_tokens.

    verdict: "undersized" when ratio < 1 (one full-context request does not fit), "warn" when
    ratio < 2 (fewer than two fit at once), else "ok".
    """

    role: str
    pool_tokens: int
    bytes_per_token: int
    context_tokens: int

    def __post_init__(self) -> None:
        if self.context_tokens <= 0:
            raise ValueError(f"the context must be > 0 tokens, got {self.context_tokens}")

    @property
    def ratio(self) -> float:
        return self.pool_tokens / self.context_tokens

    @property
    def verdict(self) -> str:
        if self.pool_tokens < self.context_tokens:
            return "undersized"
        if self.pool_tokens < WARN_BELOW_CONTEXTS * self.context_tokens:
            return "warn"
        return "ok"

    def describe(self) -> str:
        """One sentence for a log line."""
        return (f"{self.role} KV pool holds {self.pool_tokens} tokens = {self.ratio:.2f} x the context of "
                f"{self.context_tokens} tokens ({self.verdict})")


class UndersizedPoolError(ValueError):
    """A pool cannot hold one full-context request; the message names the role, both sizes and the fixes."""

    def __init__(self, message: str, verdicts: list[SizingVerdict], fitting_context_tokens: int) -> None:
        super().__init__(message)
        self.verdicts = verdicts
        self.fitting_context_tokens = fitting_context_tokens  # what --clamp-context would advertise


def configured_context(config: ServeConfig, model: ModelConfig) -> int:
    """`--max-context`, else the model's context; never more than the model's."""
    return min(config.pools.max_context or model.max_context_tokens, model.max_context_tokens)


def _num_pages(config: ServeConfig, prefix: str, bytes_per_page: int, context_tokens: int) -> int:
    """Explicit pages, else memory // bytes per page (at least 1), else DEFAULT_CONTEXTS[prefix] contexts."""
    pools = config.pools
    pages = getattr(pools, f"{prefix}_num_pages")
    memory = getattr(pools, f"{prefix}_kv_memory")  # bytes
    if pages is not None:
        return int(pages)
    if memory is not None:
        return max(1, int(memory) // bytes_per_page)
    return -(-DEFAULT_CONTEXTS[prefix] * context_tokens // pools.page_size_tokens)


def plan_pools(config: ServeConfig, model: ModelConfig, element_size: int) -> list[PoolPlan]:
    """The pools build_workers allocates: [prefill, decode], or [colocated] with disaggregation off.

    `element_size` is the bytes of one KV element in the serving dtype (4 for float32, 2 for bfloat16).
    """
    if element_size <= 0:
        raise ValueError(f"element_size must be > 0 bytes, got {element_size}")
    context = configured_context(config, model)
    bytes_per_token = model.kv_bytes_per_token(element_size)
    page_size_tokens = config.pools.page_size_tokens
    bytes_per_page = bytes_per_token * page_size_tokens
    roles = ["prefill", "decode"] if config.disaggregation == "on" else ["colocated"]
    plans = []
    for role in roles:
        prefix = "prefill" if role == "prefill" else "decode"
        pages = _num_pages(config, prefix, bytes_per_page, context)
        tokens = pages * page_size_tokens
        plans.append(PoolPlan(role=role, num_pages=pages, page_size_tokens=page_size_tokens,
                              bytes_per_token=bytes_per_token, pool_tokens=tokens, pool_bytes=tokens * bytes_per_token))
    return plans


def check_sizing(plans: list[PoolPlan], context_tokens: int) -> list[SizingVerdict]:
    """One verdict per plan, in order, against a context of `context_tokens`."""
    return [SizingVerdict(role=p.role, pool_tokens=p.pool_tokens, bytes_per_token=p.bytes_per_token,
                          context_tokens=context_tokens) for p in plans]


def _pages(n: int) -> str:
    return f"{n} page" if n == 1 else f"{n} pages"


def _undersized_message(plans: list[PoolPlan], verdicts: list[SizingVerdict], fitting: int) -> str:
    parts = []
    for plan, v in zip(plans, verdicts):
        if v.verdict != "undersized":
            continue
        need_pages = -(-v.context_tokens // plan.page_size_tokens)
        need_mib = -(-need_pages * plan.page_size_tokens * plan.bytes_per_token // 2**20)
        parts.append(
            f"the {plan.role} KV pool holds {plan.pool_tokens} tokens ({_pages(plan.num_pages)} x "
            f"{plan.page_size_tokens} tokens) but the context is {v.context_tokens} tokens, so a full-context "
            f"request does not fit; grow it with --{plan.flag_prefix}-num-pages {need_pages} or "
            f"--{plan.flag_prefix}-kv-memory {need_mib}MiB")
    return ("; ".join(parts) + f"; or lower the context with --max-context {fitting}, "
            f"or pass --clamp-context to serve a context of {fitting} tokens")


def resolve_context(config: ServeConfig, model: ModelConfig,
                    plans: list[PoolPlan]) -> tuple[int, list[SizingVerdict]]:
    """The context to advertise, and each pool's verdict against it.

    The configured context (see configured_context) if every pool holds it. Otherwise, with
    `config.pools.clamp_context`, the largest context every pool holds (the smallest pool_tokens), with the
    verdicts recomputed for it; without, UndersizedPoolError. "warn" verdicts are returned, not raised.
    """
    if not plans:
        raise ValueError("no KV pools to check")
    context = configured_context(config, model)
    verdicts = check_sizing(plans, context)
    if all(v.verdict != "undersized" for v in verdicts):
        return context, verdicts
    fitting = min(p.pool_tokens for p in plans)
    if config.pools.clamp_context:
        return fitting, check_sizing(plans, fitting)
    raise UndersizedPoolError(_undersized_message(plans, verdicts, fitting), verdicts, fitting)


_COLUMNS = ("role", "pool tokens", "bytes per token", "context", "ratio", "verdict")


def _ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.4f}"  # 0.0020, not 0.00, for a tiny pool


def render_table(verdicts: list[SizingVerdict]) -> str:
    """A plain-text table, one row per pool, for `kvfence check`."""
    rows = [_COLUMNS] + [(v.role, str(v.pool_tokens), str(v.bytes_per_token), str(v.context_tokens),
                          _ratio_text(v.ratio), v.verdict) for v in verdicts]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = []
    for row in rows:
        cells = [cell.ljust(w) if i in (0, 5) else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
