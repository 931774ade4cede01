"""`kvfence serve`: one asyncio process with the HTTP front end, the scheduler and the workers.

Every long-lived task (hypercorn, worker loops, transfers, transport endpoints, the signal
watcher) runs in one task group; leaving it cancels them all.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import time
from typing import cast

import anyio
import anyio.abc
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.typing import ASGIFramework

from kvfence.app.api.edge import allowed_hosts
from kvfence.app.api.grammar_compiler import GrammarCompiler
from kvfence.app.api.keys import ApiKeys
from kvfence.app.api.routes import build_app
from kvfence.app.config.config import ServeConfig
from kvfence.app.serve.gc_heap import startup_heap_frozen
from kvfence.app.serve.guards import Guards
from kvfence.app.serve.pairing import pair_workers, role_record
from kvfence.app.serve.readiness import ReadinessCanary, Reference, local_reference
from kvfence.app.serve.workers import Workers, build_workers
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.compute import confine_to_one_intra_op_thread
from kvfence.engine.sampling import SamplingParams
from kvfence.engine.tokenizer import Tokenizer
from kvfence.engine.worker import LocalWorkerChannel
from kvfence.scheduler.core.tenants import Tenant
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.handle import RequestHandle
from kvfence.scheduler.metrics import SchedulerMetrics
from kvfence.transports.base import PairingRefused, Transport
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret

log = logging.getLogger(__name__)


class ServingEngine:
    """What the HTTP layer talks to (app/api/engine_client.EngineClient)."""

    def __init__(self, model_name: str, tokenizer: Tokenizer, scheduler: Scheduler, canary: ReadinessCanary) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.canary = canary

    @property
    def max_context_tokens(self) -> int:
        return self.scheduler.max_context_tokens

    def submit_samples(self, prompt_token_ids: list[int], samples: list[SamplingParams], tenant: Tenant,
                       cache_salt: str = "") -> list[RequestHandle]:
        return self.scheduler.submit_samples(prompt_token_ids, samples, tenant, cache_salt)

    def flush_cache(self) -> dict[str, int]:
        return self.scheduler.flush_cache()

    def is_ready(self) -> bool:
        return self.canary.passed and not self.scheduler.draining and self.scheduler.can_serve


def model_identity(checkpoint: Checkpoint, name: str) -> str:
    digest = hashlib.sha256(repr(checkpoint.config).encode()).hexdigest()[:16]
    return f"{name}@{digest}"


async def _drain_on_signal(scheduler: Scheduler, shutdown: anyio.Event, timeout_s: float) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: draining (up to %g s)", signal.Signals(signum).name, timeout_s)
            scheduler.draining = True
            deadline = time.monotonic() + timeout_s
            while scheduler.in_flight() and time.monotonic() < deadline:
                await anyio.sleep(0.05)
            if scheduler.in_flight():
                log.warning("shutdown timeout: %d requests still in flight", scheduler.in_flight())
            shutdown.set()
            return


async def serve(config: ServeConfig, checkpoint: Checkpoint, model_name: str,
                intra_op_threads: int | None = None, guards: Guards = Guards()) -> int:
    """Serve the workers of this process until SIGTERM/SIGINT drained (0), or 1 when their transport
    endpoints refused to pair (logged); with --discovery, app/remote/front.py's `serve_remote` serves
    instead. `intra_op_threads`: each device's compute thread team (engine/compute.py). `guards`:
    every isolation guard on, unless a program measuring their cost says otherwise
    (app/serve/guards.py; in one process, over tcp, only)."""
    if guards.off() and (config.discovery is not None or config.transport.name != "tcp"):
        raise ValueError("guards can be turned off only in one process, over tcp")
    if config.discovery is not None:
        raise ValueError("with --discovery the workers run elsewhere: app/remote/front.py's serve_remote serves")
    guards.warn()
    workers = build_workers(config, checkpoint, intra_op_threads, guards)
    try:
        confine_to_one_intra_op_thread()  # torch work outside the compute threads stays single-threaded
        return await _serve_workers(config, checkpoint, model_name, workers, guards)
    finally:
        workers.close()


async def _serve_workers(config: ServeConfig, checkpoint: Checkpoint, model_name: str, workers: Workers,
                         guards: Guards) -> int:
    prefill_pool = workers.prefill.pool
    decode_pool = workers.decode.pool if workers.decode is not None else prefill_pool
    context = workers.max_context_tokens  # every pool holds it (checked before allocation)
    metrics = SchedulerMetrics()
    async with anyio.create_task_group() as tg:
        link = None
        transports: list[Transport] = []
        if workers.decode is not None:
            model_id = model_identity(checkpoint, model_name)
            roles = [(pool, role_record(pool, model_id, context, guards)) for pool in (prefill_pool, decode_pool)]
            transport = config.transport
            secret = DeploymentSecret.from_file(transport.secret_file) if transport.secret_file \
                else DeploymentSecret.generate()  # both workers live in this process
            front_key = FrontKey.from_file(transport.front_key_file) if transport.front_key_file \
                else FrontKey.generate()
            try:
                paired = await pair_workers(tg, transport.name, roles[0], roles[1], secret, front_key,
                                            transport.fault_inject,
                                            role_options={role: transport.endpoint_options(role)
                                                          for role in ("prefill", "decode")}, guards=guards)
            except PairingRefused:
                tg.cancel_scope.cancel()
                return 1
            link, transports, context = paired.link, paired.endpoints, paired.max_context_tokens
        scheduler_config = config.scheduler.bind(
            page_size_tokens=config.pools.page_size_tokens, max_context_tokens=context,
            disaggregated=workers.decode is not None, prefill_device_type=workers.prefill.device.type)
        prefill_channel = LocalWorkerChannel(workers.prefill, workers.compute_of(workers.prefill))
        decode_channel = None if workers.decode is None else \
            LocalWorkerChannel(workers.decode, workers.compute_of(workers.decode))
        scheduler = Scheduler(
            scheduler_config, checkpoint.tokenizer, prefill_channel, decode_channel,
            prefill_pages=prefill_pool.num_pages, decode_pages=decode_pool.num_pages, link=link, metrics=metrics)
        reference = local_reference(workers.compute_of(workers.prefill), workers.prefill.runner.model,
                                    checkpoint.tokenizer, config.pools.page_size_tokens)
        await serve_http(tg, config, model_name, checkpoint.tokenizer, scheduler, reference,
                         "disaggregated" if workers.decode is not None else "colocated", checkpoint.config.vocab_size)
        for t in transports:
            await t.aclose()
        tg.cancel_scope.cancel()
    return 0


async def serve_http(tg: anyio.abc.TaskGroup, config: ServeConfig, model_name: str, tokenizer: Tokenizer,
                     scheduler: Scheduler, reference: Reference, mode: str, vocab_size: int) -> None:
    """Run the scheduler, the readiness canary and the HTTP API in `tg` until SIGTERM/SIGINT
    drained. `vocab_size`: the model's logits width (what grammars are compiled for)."""
    await scheduler.run(tg)
    scheduler_config = scheduler.config
    canary = ReadinessCanary(scheduler, tokenizer, reference, interval_s=config.canary.interval_s,
                             timeout_s=scheduler_config.transfer_timeout_s + 30)
    engine = ServingEngine(model_name, tokenizer, scheduler, canary)
    metrics = scheduler.metrics

    def metrics_text() -> tuple[bytes, str]:
        scheduler.refresh_metrics()
        return metrics.render()

    http = config.server
    grammars = GrammarCompiler(tokenizer, vocab_size, budget_s=http.grammar_compile_timeout_s)
    grammars.start()
    keys = ApiKeys.load(http.api_keys)
    app = build_app(engine, metrics_text, max_body_bytes=http.max_body_bytes, stall_timeout_s=http.stall_timeout_s,
                    api_keys=keys, grammars=grammars, max_response_entries=http.max_response_entries,
                    body_timeout_s=http.body_timeout_s, allow_special_tokens=http.allow_special_tokens_in_content,
                    allowed_hosts=allowed_hosts(http.allowed_hosts, http.host, keys.enabled),
                    max_in_flight=http.max_requests_in_flight)
    hyper = HypercornConfig()
    hyper.bind = [f"{http.host}:{http.port}"]
    hyper.accesslog = None
    hyper.graceful_timeout = 1.0
    shutdown = anyio.Event()
    tg.start_soon(_drain_on_signal, scheduler, shutdown, http.shutdown_timeout_s)
    tg.start_soon(canary.run, name="readiness-canary")
    log.info("serving %s on http://%s:%d (context %d tokens, prefill chunks of %d tokens, %s)", model_name,
             http.host, http.port, scheduler_config.max_context_tokens, scheduler_config.chunk_tokens, mode)
    served = anyio.Event()

    async def run_http() -> None:
        # In its own task: hypercorn's asyncio.TaskGroup must not have the task-group owner as
        # its parent, or its shutdown cancellation leaks into anyio's cancel scope accounting.
        # Starlette types its ASGI callable with its own aliases, which hypercorn's do not accept.
        await hypercorn_serve(cast(ASGIFramework, app), hyper, shutdown_trigger=shutdown.wait)
        served.set()

    with startup_heap_frozen():
        tg.start_soon(run_http, name="http")
        await served.wait()
    grammars.close()
