"""Building the workers of a server from its config: models, KV pools, runners."""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvfence.app.config import ServeConfig
from kvfence.app.sizing import plan_pools, resolve_context
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.kv_sanitizer import KvSanitizer
from kvfence.engine.llama import LlamaModel
from kvfence.engine.loading import pick_device, pick_dtype
from kvfence.engine.runner import ModelRunner
from kvfence.engine.worker import Worker

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Workers:
    prefill: Worker
    decode: Worker | None  # None when colocated
    dtype: torch.dtype
    max_context_tokens: int  # the context every pool holds (app/sizing.resolve_context)


def build_workers(config: ServeConfig, checkpoint: Checkpoint) -> Workers:
    """One worker per role (or one colocated worker); models on the same device share weights.

    Raises UndersizedPoolError, before anything is allocated, when a pool cannot hold one request
    of the full context (unless config.clamp_context)."""
    roles = ["prefill"] if config.disaggregation == "off" else ["prefill", "decode"]
    devices = {"prefill": pick_device(config.prefill_device), "decode": pick_device(config.decode_device)}
    dtype = pick_dtype(config.dtype, devices["prefill"])
    # Pool sizes (a colocated pool is sized like a decode pool) come from app/sizing.py.
    plans = plan_pools(config, checkpoint.config, torch.empty(0, dtype=dtype).element_size())
    context, verdicts = resolve_context(config, checkpoint.config, plans)
    for verdict in verdicts:
        if verdict.verdict != "ok":
            log.warning("%s", verdict.describe())
    models: dict[torch.device, LlamaModel] = {}
    workers: dict[str, Worker] = {}
    for role, plan in zip(roles, plans, strict=True):
        device = devices[role]
        if device not in models:
            models[device] = LlamaModel(checkpoint, dtype, device, attention_backend=config.attention_backend)
        model = models[device]
        pool = KVPool(model.config, plan.num_pages, plan.page_size_tokens, dtype, device)
        log.info("%s worker on %s: %d pages x %d tokens = %d tokens of KV (%.1f MiB, %s, %s attention)",
                 plan.role, device, plan.num_pages, plan.page_size_tokens, pool.capacity_tokens,
                 plan.pool_bytes / 2**20, str(dtype).removeprefix("torch."), model.attention.name)
        sanitizer = KvSanitizer(pool.num_pages, pool.page_size_tokens) if config.kv_sanitizer else None
        workers[role] = Worker(plan.role, ModelRunner(model, pool, sanitizer=sanitizer), scrub=config.kv_scrub)
    return Workers(workers["prefill"], workers.get("decode"), dtype, context)
