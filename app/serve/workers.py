"""Building the workers of a server from its config: compute threads, models, KV pools, runners."""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from kvfence.app.config.config import ServeConfig
from kvfence.app.serve.guards import Guards
from kvfence.app.serve.sizing import plan_pools, resolve_context
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.compute import ComputeThread
from kvfence.engine.kv_pool import UNSCRUBBED, KVPool
from kvfence.engine.kv_sanitizer import KvSanitizer
from kvfence.engine.models.family import Model
from kvfence.engine.models.registry import build_model
from kvfence.engine.loading import pick_device, pick_dtype
from kvfence.engine.runner import ModelRunner
from kvfence.engine.worker import Worker

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Workers:
    prefill: Worker
    decode: Worker | None  # None when colocated
    dtype: torch.dtype
    max_context_tokens: int  # the context every pool holds (app/serve/sizing.resolve_context)
    compute: dict[torch.device, ComputeThread]  # one per device, shared by the workers placed on it

    def compute_of(self, worker: Worker) -> ComputeThread:
        return self.compute[worker.device]

    def close(self) -> None:
        for thread in self.compute.values():
            thread.close()


def build_workers(config: ServeConfig, checkpoint: Checkpoint, intra_op_threads: int | None = None,
                  guards: Guards = Guards()) -> Workers:
    """One worker per role (or one colocated worker); models on the same device share weights.

    Each device gets a compute thread (`intra_op_threads` for its team, see engine/compute.py),
    and everything of its workers, from the weights and the pool's memory on, is made there.
    `guards`: the workers' owner-tag check and scrub (app/serve/guards.py).

    Raises UndersizedPoolError, before anything is allocated, when a pool cannot hold one request
    of the full context (unless --clamp-context)."""
    roles = ["prefill"] if config.disaggregation == "off" else ["prefill", "decode"]
    workers, dtype, context, compute = _build(config, checkpoint, roles, intra_op_threads, guards)
    return Workers(prefill=workers["prefill"], decode=workers.get("decode"), dtype=dtype, max_context_tokens=context,
                   compute=compute)


@dataclasses.dataclass
class RoleWorker:
    """The one worker of a `kvfence worker` process."""

    worker: Worker
    compute: ComputeThread
    max_context_tokens: int  # the context its pool holds (app/serve/sizing.resolve_context)


def build_role_worker(config: ServeConfig, checkpoint: Checkpoint, role: str, device: str,
                      intra_op_threads: int | None = None) -> RoleWorker:
    """The worker of `role` ("prefill" or "decode") alone, on `device`, its pool sized as that
    role's pool of a disaggregated server with these settings (UndersizedPoolError likewise)."""
    placed = (dataclasses.replace(config.workers, prefill_device=device) if role == "prefill"
              else dataclasses.replace(config.workers, decode_device=device))
    config = dataclasses.replace(config, disaggregation="on", workers=placed)
    workers, _, context, compute = _build(config, checkpoint, [role], intra_op_threads, Guards())
    return RoleWorker(workers[role], next(iter(compute.values())), context)


def _build(config: ServeConfig, checkpoint: Checkpoint, roles: list[str], intra_op_threads: int | None,
           guards: Guards) -> tuple[dict[str, Worker], torch.dtype, int, dict[torch.device, ComputeThread]]:
    devices = {"prefill": pick_device(config.workers.prefill_device),
               "decode": pick_device(config.workers.decode_device)}
    dtype = pick_dtype(config.workers.dtype, devices[roles[0]])
    # Pool sizes (a colocated pool is sized like a decode pool) come from app/serve/sizing.py.
    plans = plan_pools(config, checkpoint.config, torch.empty(0, dtype=dtype).element_size())
    context, verdicts = resolve_context(config, checkpoint.config, plans)
    for verdict in verdicts:
        if verdict.verdict != "ok":
            log.warning("%s", verdict.describe())
    models: dict[torch.device, Model] = {}
    compute: dict[torch.device, ComputeThread] = {}
    workers: dict[str, Worker] = {}
    try:
        for plan in plans:
            role = "prefill" if plan.role == "colocated" else plan.role
            if role not in roles:
                continue
            device = devices[role]
            if device not in compute:
                compute[device] = ComputeThread(f"compute-{device}", intra_op_threads)
                models[device] = compute[device].call(functools.partial(
                    build_model, attention_backend=config.workers.attention_backend), checkpoint, dtype, device)
            model = models[device]
            pool = compute[device].call(KVPool, model.config, plan.num_pages, plan.page_size_tokens, dtype, device)
            log.info("%s worker on %s: %d pages x %d tokens = %d tokens of KV (%.1f MiB, %s, %s attention, "
                     "%d intra-op threads)", plan.role, device, plan.num_pages, plan.page_size_tokens,
                     pool.capacity_tokens, plan.pool_bytes / 2**20, str(dtype).removeprefix("torch."),
                     model.attention.name, compute[device].intra_op_threads)
            sanitizer = KvSanitizer(pool.num_pages, pool.page_size_tokens) if config.workers.kv_sanitizer else None
            runner = ModelRunner(model, pool, owner_check=guards.owner_tags, sanitizer=sanitizer)
            workers[role] = Worker(plan.role, runner, scrub=config.pools.kv_scrub if guards.scrub else UNSCRUBBED,
                                   tokenizer=checkpoint.tokenizer)
    except BaseException:
        for thread in compute.values():
            thread.close()
        raise
    return workers, dtype, context, compute
