"""Building the workers of a server from its config: models, KV pools, runners."""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvfence.app.config import ServeConfig, parse_bytes
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
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
    max_context_tokens: int  # min of the configured and the model's context


def _pool_pages(config: ServeConfig, role: str, bytes_per_page: int, context_tokens: int) -> int:
    pages = getattr(config, f"{role}_num_pages")
    memory = getattr(config, f"{role}_kv_memory")
    if pages is not None:
        return int(pages)
    if memory is not None:
        return max(1, parse_bytes(memory) // bytes_per_page)
    contexts = 2 if role == "prefill" else 4
    return -(-contexts * context_tokens // config.page_size_tokens)


def build_workers(config: ServeConfig, checkpoint: Checkpoint) -> Workers:
    """One worker per role (or one colocated worker); models on the same device share weights."""
    context = min(config.max_context or checkpoint.config.max_context_tokens, checkpoint.config.max_context_tokens)
    roles = ["prefill"] if config.disaggregation == "off" else ["prefill", "decode"]
    devices = {"prefill": pick_device(config.prefill_device), "decode": pick_device(config.decode_device)}
    dtype = pick_dtype(config.dtype, devices["prefill"])
    models: dict[torch.device, LlamaModel] = {}
    workers: dict[str, Worker] = {}
    for role in roles:
        device = devices[role]
        if device not in models:
            models[device] = LlamaModel(checkpoint, dtype, device)
        model = models[device]
        bytes_per_page = model.config.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size()) \
            * config.page_size_tokens
        # A colocated worker holds prompt and output, like a decode worker: size it like one.
        sizing_role = role if config.disaggregation == "on" else "decode"
        num_pages = _pool_pages(config, sizing_role, bytes_per_page, context)
        pool = KVPool(model.config, num_pages, config.page_size_tokens, dtype, device)
        name = role if config.disaggregation == "on" else "colocated"
        log.info("%s worker on %s: %d pages x %d tokens = %d tokens of KV (%.1f MiB, %s)", name, device,
                 num_pages, config.page_size_tokens, pool.capacity_tokens, num_pages * bytes_per_page / 2**20,
                 str(dtype).removeprefix("torch."))
        workers[role] = Worker(name, ModelRunner(model, pool))
    return Workers(workers["prefill"], workers.get("decode"), dtype, context)
