"""`kvfence serve --discovery ...`: the HTTP front end and the scheduler, driving workers that run
in their own processes (`kvfence worker`, app/worker_process.py) over authenticated control
connections (scheduler/remote_worker.py).

At start it connects to every worker discovery names (waiting for workers still loading),
checks that they form a prefill and a decode worker of this model with this page size, pairs
the prefill worker's sender with the decode worker's receiver (a mismatch refuses the pair as a
whole, as in one process), and serves the smaller of their context limits. The readiness
canary's known answer comes from the prefill worker's model alone (its `Reference` call). The
front end itself loads only the model's config and tokenizer (`load_checkpoint(weights=False)`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import anyio
import torch

from kvfence.app.config import ServeConfig
from kvfence.app.discovery import parse_discovery
from kvfence.app.membership import find_workers
from kvfence.app.server import model_identity, serve_http
from kvfence.engine.checkpoint import Checkpoint
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.metrics import SchedulerMetrics
from kvfence.scheduler.remote_worker import RemoteReceivingEnd, RemoteSendingEnd, RemoteWorker, WorkerLost
from kvfence.scheduler.transfer import TransferLink
from kvfence.transports.base import PairingRefused
from kvfence.transports.core.secret import AuthenticationFailed, DeploymentSecret

log = logging.getLogger(__name__)

CONNECT_WAIT_S = 120.0  # how long a worker that is not listening yet (still loading) is waited for


class WorkerSetError(ValueError):
    """The discovered workers cannot serve together; the message says why and what to change."""


@dataclasses.dataclass
class RemotePair:
    prefill: RemoteWorker
    decode: RemoteWorker
    link: TransferLink
    max_context_tokens: int


async def connect_when_up(tg: anyio.abc.TaskGroup, address: str, secret: DeploymentSecret,
                          wait_s: float = CONNECT_WAIT_S) -> RemoteWorker:
    """Connect to the worker at `address`, retrying while nothing listens there (it may still be
    loading its model) for up to `wait_s`. WorkerLost at once when it fails the handshake or
    refuses (it serves another scheduler)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await RemoteWorker.connect(tg, address, secret)
        except WorkerLost as e:
            if isinstance(e.__cause__, AuthenticationFailed) or e.__cause__ is None \
                    or time.monotonic() > deadline:
                raise
            await anyio.sleep(0.5)


async def pair_remote(workers: list[RemoteWorker], model_id: str, page_size_tokens: int,
                      secret: DeploymentSecret) -> RemotePair:
    """The prefill and the decode worker among `workers`, paired. WorkerSetError when they are not
    exactly one of each, of this model and page size; PairingRefused when their pools disagree."""
    by_role: dict[str, list[RemoteWorker]] = {}
    for w in workers:
        by_role.setdefault(w.role, []).append(w)
    if sorted(by_role) != ["decode", "prefill"] or any(len(ws) != 1 for ws in by_role.values()):
        found = ", ".join(f"{w.role} at {w.address}" for w in workers)
        raise WorkerSetError(f"serving needs one prefill and one decode worker; discovery found {found}")
    (prefill,), (decode,) = by_role["prefill"], by_role["decode"]
    for w in (prefill, decode):
        d = w.description
        assert d is not None
        if d.model != model_id:
            raise WorkerSetError(f"the {d.role} worker at {w.address} serves {d.model}, this front end {model_id}: "
                                 "start every process with the same --model")
        if d.page_size_tokens != page_size_tokens:
            raise WorkerSetError(f"the {d.role} worker at {w.address} has pages of {d.page_size_tokens} tokens, this "
                                 f"front end {page_size_tokens}: start every process with the same --page-size")
    endpoint = decode.description.endpoint if decode.description else None
    if endpoint is None:
        raise WorkerSetError(f"the decode worker at {decode.address} has no KV transport endpoint")
    record = await prefill.pair_with(endpoint)
    assert prefill.description is not None
    context = min(prefill.description.max_context_tokens, record.max_context_tokens)
    link = TransferLink(RemoteSendingEnd(prefill), RemoteReceivingEnd(decode), record.incarnation,
                        page_size_tokens, record.page_nbytes, secret)
    log.info("paired the prefill worker at %s -> the decode worker at %s over %s (%s); context limits %d and %d "
             "tokens, serving %d", prefill.address, decode.address, endpoint.transport, endpoint.address,
             prefill.description.max_context_tokens, record.max_context_tokens, context)
    return RemotePair(prefill, decode, link, context)


async def _registered_pair(host: str, port: int) -> list[str]:
    """The control addresses of a prefill and a decode worker registered in etcd (the first of
    each role, when there are more: one pair serves for now)."""
    found = await find_workers(host, port, CONNECT_WAIT_S)
    pair = [next(r for r in found if r.role == role) for role in ("prefill", "decode")]
    log.info("etcd at %s:%d lists %d workers; serving with %s", host, port, len(found),
             " and ".join(f"the {r.role} worker at {r.control} (incarnation {r.incarnation})" for r in pair))
    return [r.control for r in pair]


async def serve_remote(config: ServeConfig, checkpoint: Checkpoint, model_name: str) -> int:
    """Serve through the discovered workers until SIGTERM/SIGINT drained (0); 1 when they cannot
    be reached or used together (logged)."""
    assert config.discovery is not None
    discovery = parse_discovery(config.discovery)
    if not config.transport.secret_file:
        log.error("--discovery needs the deployment secret the workers were started with: --transport-secret-file")
        return 1
    secret = DeploymentSecret.from_file(config.transport.secret_file)
    async with anyio.create_task_group() as tg:
        workers: list[RemoteWorker] = []
        try:
            addresses = list(discovery.addresses)
            if discovery.etcd is not None:
                addresses = await _registered_pair(*discovery.etcd)
            for address in addresses:
                workers.append(await connect_when_up(tg, address, secret))
            pair = await pair_remote(workers, model_identity(checkpoint, model_name),
                                     config.pools.page_size_tokens, secret)
        except (WorkerLost, WorkerSetError, PairingRefused, TimeoutError) as e:
            log.error("cannot serve through the discovered workers: %s", e)
            for w in workers:
                w.close()
            tg.cancel_scope.cancel()
            return 1
        prefill, decode = pair.prefill, pair.decode
        assert prefill.description is not None and decode.description is not None
        scheduler_config = config.scheduler.bind(
            page_size_tokens=config.pools.page_size_tokens, max_context_tokens=pair.max_context_tokens,
            disaggregated=True, prefill_device_type=torch.device(prefill.description.device).type)
        scheduler = Scheduler(scheduler_config, checkpoint.tokenizer, prefill, decode,
                              prefill_pages=prefill.description.num_pages, decode_pages=decode.description.num_pages,
                              link=pair.link, metrics=SchedulerMetrics())
        await serve_http(tg, config, model_name, checkpoint.tokenizer, scheduler, prefill.reference,
                         f"disaggregated: workers at {prefill.address} and {decode.address}")
        for w in workers:
            w.close()
        tg.cancel_scope.cancel()
    return 0
