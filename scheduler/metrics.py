"""Prometheus metrics of one server (a registry per instance: no module-level state)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from kvfence.scheduler.core.request import Request

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SchedulerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvfence_requests", "Requests by tenant and final status", ["tenant", "status"],
                                registry=r)
        self.ttft = Histogram("kvfence_time_to_first_token_seconds", "Time to first token, by tenant", ["tenant"],
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.prefilled = Counter("kvfence_prefill_tokens", "Prompt tokens the prefill computed, by tenant (the "
                                 "prompt tokens less those served from the prefix cache, plus recomputation after "
                                 "a preemption): what a first token's latency is made of", ["tenant"], registry=r)
        self.itl = Histogram("kvfence_inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvfence_e2e_request_latency_seconds", "Admission to last token",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tokens = Counter("kvfence_tokens", "Tokens by tenant and kind: prompt (of finished requests), "
                              "completion (generated), cached (prompt tokens served from the prefix cache)",
                              ["tenant", "kind"], registry=r)
        self.pages = Gauge("kvfence_kv_pages", "KV pages by worker (its name: its role in one process, "
                           "role@address elsewhere) and state", ["worker", "state"], registry=r)
        self.waiting = Gauge("kvfence_requests_waiting", "Requests waiting for pages", registry=r)
        self.running = Gauge("kvfence_requests_running", "Requests holding pages", registry=r)
        self.transfers = Counter("kvfence_kv_transfers", "KV transfers by result", ["result"], registry=r)
        self.transfer_bytes = Counter("kvfence_kv_transfer_bytes", "Bytes of KV moved", registry=r)
        self.handoff = Histogram("kvfence_kv_handoff_seconds",
                                 "Prefill done (first token sampled) to KV landed and verified in the decode pool",
                                 buckets=(0.001, 0.0025, *_LATENCY_BUCKETS_S), registry=r)
        self.integrity_violations = Counter(
            "kvfence_kv_integrity_violations", "Reads refused by the owner-tag check or the KV sanitizer",
            ["worker", "check"], registry=r)
        self.worker_restarts = Counter("kvfence_worker_restarts", "Worker restarts seen (new incarnations)",
                                       ["worker"], registry=r)
        self.draining = Gauge("kvfence_worker_draining", "1 while a worker drains (it takes no new request)",
                              ["worker"], registry=r)
        self.worker_losses = Counter("kvfence_worker_losses", "Workers lost (control connection dropped or "
                                     "membership expired), by worker", ["worker"], registry=r)
        self.retries = Counter("kvfence_request_retries", "Requests retried on another pair after a lost worker "
                               "(before their first token)", registry=r)
        self.rejections = Counter("kvfence_admission_rejections", "Requests refused at admission",
                                  ["reason"], registry=r)
        self.preemptions = Counter("kvfence_preemptions", "Running requests sent back to the queue to be "
                                   "recomputed because the decode pool ran out", registry=r)
        self.steps_cut = Counter("kvfence_steps_cut", "Steps of prompt chunks stopped between layers so that a "
                                 "prompt of another group waiting for its first token went first, by worker",
                                 ["worker"], registry=r)
        self.quarantine_age = Gauge("kvfence_kv_quarantine_age_seconds",
                                    "How long the oldest quarantine of a pool has lasted (0: none)", ["worker"],
                                    registry=r)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def preempted(self) -> None:
        self.preemptions.inc()

    def step_cut(self, worker: str) -> None:
        self.steps_cut.labels(worker).inc()

    def integrity_violation(self, worker: str, check: str = "owner_tag") -> None:
        self.integrity_violations.labels(worker, check).inc()

    def worker_restart(self, worker: str) -> None:
        self.worker_restarts.labels(worker).inc()

    def worker_lost(self, name: str) -> None:
        """Worker `name` is gone: counted, and its pool's series leave /metrics."""
        self.worker_losses.labels(name).inc()
        for state in ("total", "in_use", "free", "quarantined", "cached"):
            try:
                self.pages.remove(name, state)
            except KeyError:
                pass
        for gauge in (self.quarantine_age, self.draining):
            try:
                gauge.remove(name)
            except KeyError:
                pass

    def retried(self) -> None:
        self.retries.inc()

    def queue_sizes(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def token(self, req: Request, now: float) -> None:
        if req.first_token_s is None:
            req.first_token_s = now
            self.ttft.labels(req.tenant).observe(now - req.created_s)
        elif req.last_token_s is not None:
            self.itl.observe(now - req.last_token_s)
        req.last_token_s = now
        self.tokens.labels(req.tenant, "completion").inc()

    def prefill(self, req: Request, num_tokens: int) -> None:
        self.prefilled.labels(req.tenant).inc(num_tokens)

    def finished(self, req: Request, now: float) -> None:
        self.requests.labels(req.tenant, req.state.value if req.finish_reason is None else req.finish_reason).inc()
        self.tokens.labels(req.tenant, "prompt").inc(len(req.prompt))
        if req.cached_tokens:
            self.tokens.labels(req.tenant, "cached").inc(req.cached_tokens)
        self.e2e.observe(now - req.created_s)

    def transfer(self, ok: bool, nbytes: int, handoff_s: float) -> None:
        """One transfer ended; `handoff_s`: from its prefill's end until now."""
        self.transfers.labels("ok" if ok else "failed").inc()
        if ok:
            self.transfer_bytes.inc(nbytes)
            self.handoff.observe(handoff_s)

    def pool(self, worker: str, total: int, used: int, quarantined: int = 0, cached: int = 0,
             quarantine_age_s: float = 0.0, draining: bool = False) -> None:
        """`used`: pages leases hold (sealed ones they share included); `cached`: pages only the
        prefix cache holds (evictable)."""
        self.draining.labels(worker).set(int(draining))
        self.pages.labels(worker, "total").set(total)
        self.pages.labels(worker, "in_use").set(used)
        self.pages.labels(worker, "free").set(total - used - quarantined - cached)
        self.pages.labels(worker, "quarantined").set(quarantined)
        self.pages.labels(worker, "cached").set(cached)
        self.quarantine_age.labels(worker).set(quarantine_age_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
