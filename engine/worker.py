"""A worker: one device, one model replica, one KV pool, driven by scheduler messages.

Compute runs in a worker thread (never on the event loop), one step at a time. The scheduler
talks to a worker only through `WorkerChannel.call`, which round-trips every message through
msgspec, so the worker could live in another process without changing the scheduler.
"""

from __future__ import annotations

import logging

import anyio
import anyio.to_thread
import msgspec
import torch

from kvfence.engine.kv_pool import SCRUB_MODES, KVPool
from kvfence.engine.runner import ModelRunner, SeqWork
from kvfence.scheduler.messages import (
    OwnerMismatch, RunStep, StepDone, StepFailed, WorkerReply, WorkerRequest, id_from_hex, id_hex,
)

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, role: str, runner: ModelRunner, scrub: str = "poison") -> None:
        """`scrub`: what released pages are filled with (see KVPool.clear)."""
        if scrub not in SCRUB_MODES:
            raise ValueError(f"--kv-scrub must be one of {', '.join(SCRUB_MODES)}, got {scrub!r}")
        self.role = role
        self.runner = runner
        self.scrub = scrub
        self.device = runner.pool.device

    @property
    def pool(self) -> KVPool:
        return self.runner.pool

    def execute(self, request: WorkerRequest) -> WorkerReply:
        """Run one message to completion (called in the worker's thread)."""
        match request:
            case RunStep():
                try:
                    return self._run_step(request)
                except Exception as e:  # a failed step fails its requests, not the worker
                    log.exception("%s worker: step %d failed", self.role, request.step_id)
                    return StepFailed(request.step_id, f"{type(e).__name__}: {e}")
        raise TypeError(f"unknown worker message {type(request).__name__}")

    def _run_step(self, cmd: RunStep) -> StepDone:
        if cmd.released:
            self.pool.clear(cmd.released, self.scrub)
        for grant in cmd.grants:
            self.pool.assign(grant.pages, id_from_hex(grant.lease))
        if not cmd.seqs:
            return StepDone(cmd.step_id, [])
        works = [SeqWork(s.token_ids, s.context_tokens, s.page_table, id_from_hex(s.lease),
                         s.sampling.params() if s.sampling is not None else None, s.output_index)
                 for s in cmd.seqs]
        with torch.inference_mode():
            result = self.runner.step(works)
        return StepDone(cmd.step_id, result.tokens,
                        [OwnerMismatch(v.work_index, v.page, id_hex(v.owner)) for v in result.violations])


class WorkerChannel:
    """The scheduler's end of the connection to one worker (in-process for now)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.role = worker.role
        self._encoder = msgspec.msgpack.Encoder()
        self._request_decoder = msgspec.msgpack.Decoder(WorkerRequest)
        self._reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
        self._limiter = anyio.CapacityLimiter(1)  # one step at a time per worker

    def _serve(self, payload: bytes) -> bytes:
        return self._encoder.encode(self.worker.execute(self._request_decoder.decode(payload)))

    async def call(self, request: WorkerRequest) -> WorkerReply:
        payload = self._encoder.encode(request)
        # Not cancellable mid-step: the step owns its pages until it returns.
        reply = await anyio.to_thread.run_sync(self._serve, payload, limiter=self._limiter)
        return self._reply_decoder.decode(reply)
