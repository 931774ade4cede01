"""Workers served on loopback control ports in this process, as `kvfence worker` serves one (a
real WorkerServer, a real tcp KV endpoint, a real control listener), for tests of the scheduler
driving remote workers."""

from __future__ import annotations

import anyio
import anyio.abc
import torch
from front_keys import FRONT
from serving_harness import compute_thread, make_worker

from kvfence.app.remote.server import KvEndpoint, WorkerServer
from kvfence.app.serve.pairing import role_record
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.worker import Worker
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.registry import create_transport
from kvfence.transports.wire.channel import listen

PAGE, PAGES, CONTEXT = 4, 64, 96
MODEL_ID = "tiny"


class Hosted:
    """A worker served on a loopback control port, as `kvfence worker` serves one."""

    def __init__(self, tiny: Checkpoint, role: str, secret: DeploymentSecret, dtype: torch.dtype = torch.float32) -> None:
        self.worker: Worker = make_worker(tiny, role, PAGES, PAGE, dtype)
        pool = self.worker.pool
        front_key = FRONT.public  # the test front end's (tests/front_keys.py)
        self.endpoint = KvEndpoint(lambda: create_transport("tcp", secret=secret, front_key=front_key,
                                                            host="127.0.0.1"),
                                   pool.data, lambda: role_record(pool, MODEL_ID, CONTEXT))
        self.server = WorkerServer(self.worker, compute_thread(), self.endpoint, secret, tiny.tokenizer,
                                   front_key=front_key, model=MODEL_ID, max_context_tokens=CONTEXT)
        self.listener = listen("127.0.0.1", 0)
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.scope = anyio.CancelScope()

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        """Serve in `tg` (until `kill` or `tg` is cancelled)."""
        await tg.start(serve_until_cancelled, self)

    def kill(self) -> None:
        """Stop serving now: its control connection and listener close (the worker is gone)."""
        self.scope.cancel()

    def tags(self) -> list[int]:
        return [self.worker.pool.owner(p) for p in range(self.worker.pool.num_pages)]


async def host_pair(tg: anyio.abc.TaskGroup, tiny: Checkpoint, secret: DeploymentSecret,
                    roles: tuple[str, ...] = ("prefill", "decode")) -> list[Hosted]:
    """One worker per role in `roles`, each serving in `tg` until it is cancelled."""
    hosted = [Hosted(tiny, role, secret) for role in roles]
    for h in hosted:
        await h.start(tg)
    return hosted


async def serve_until_cancelled(h: Hosted, *, task_status: anyio.abc.TaskStatus[None]) -> None:
    with h.scope:
        try:
            await h.server.serve(h.listener, task_status=task_status)
        finally:
            h.listener.close()
