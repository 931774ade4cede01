"""A scheduler with real workers (and, disaggregated, a real transport) for in-process tests."""

from __future__ import annotations

import dataclasses

import torch
from anyio.abc import TaskGroup

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.engine.llama import LlamaModel
from kvfence.engine.runner import ModelRunner
from kvfence.engine.worker import Worker, WorkerChannel
from kvfence.scheduler.config import SchedulerConfig
from kvfence.scheduler.core import Scheduler
from kvfence.scheduler.ids import mint_id
from kvfence.scheduler.messages import id_hex
from kvfence.scheduler.transfer import TransferLink
from kvfence.transports.base import PairingRecord, Transport
from kvfence.transports.faults import FaultInjectingTransport, FaultPlan
from kvfence.transports.registry import transport_class


def make_worker(checkpoint: Checkpoint, role: str, num_pages: int, page_size: int) -> Worker:
    model = LlamaModel(checkpoint, torch.float32)
    return Worker(role, ModelRunner(model, KVPool(model.config, num_pages, page_size, torch.float32)))


@dataclasses.dataclass
class Serving:
    scheduler: Scheduler
    workers: list[Worker]
    transports: list[Transport]

    async def aclose(self) -> None:
        for t in self.transports:
            await t.aclose()


async def start_serving(tg: TaskGroup, checkpoint: Checkpoint, mode: str, config: SchedulerConfig,
                        num_pages: int, faults: str = "") -> Serving:
    """mode: "colocated", or a transport name ("tcp", "inprocess") for a disaggregated pair;
    `faults`: a FaultPlan spec applied to the sending (prefill) side."""
    page = config.page_size_tokens
    if mode == "colocated":
        w = make_worker(checkpoint, "colocated", num_pages, page)
        scheduler = Scheduler(config, checkpoint.tokenizer, WorkerChannel(w), None, prefill_pages=num_pages,
                              decode_pages=num_pages)
        await scheduler.run(tg)
        return Serving(scheduler, [w], [])
    pw, dw = make_worker(checkpoint, "prefill", num_pages, page), make_worker(checkpoint, "decode", num_pages, page)
    kwargs = {}
    if mode == "inprocess":
        from kvfence.transports.inprocess import InProcessHub
        kwargs = {"hub": InProcessHub()}
    cls = transport_class(mode)
    sender, receiver = cls(**kwargs), cls(**kwargs)
    if faults:
        sender = FaultInjectingTransport(sender, FaultPlan.parse(faults))
    record = PairingRecord(model="tiny", dtype="float32", page_size_tokens=page, page_nbytes=pw.pool.page_nbytes,
                           page_layout="test", digest="xxh3_64", max_context_tokens=config.max_context_tokens,
                           incarnation=id_hex(mint_id()))
    info = await receiver.start(tg, dw.pool.data, record)
    await sender.start(tg, pw.pool.data, record)
    peer = await sender.pair(info)
    link = TransferLink(sender, receiver, peer, page, pw.pool.page_nbytes)
    scheduler = Scheduler(config, checkpoint.tokenizer, WorkerChannel(pw), WorkerChannel(dw), prefill_pages=num_pages,
                          decode_pages=num_pages, link=link)
    await scheduler.run(tg)
    return Serving(scheduler, [pw, dw], [sender, receiver])
