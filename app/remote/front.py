"""`kvfence serve --discovery ...`: the HTTP front end and the scheduler, driving workers that run
in their own processes (`kvfence worker`, app/remote/worker_process.py) over authenticated control
connections (app/remote/client.py).

At start it connects to every worker discovery names (waiting for workers still loading),
checks each (this model, this page size, a KV endpoint), and pairs every prefill worker's sender
with every decode worker's receiver (a mismatch refuses that pair as a whole, as in one process);
each pair serves the smaller of its two context limits, and it serves while at least one pair
formed. While serving, the `Fleet` follows membership: a worker whose control connection drops is
lost to the scheduler at once (its requests are retried or fail with 503 worker_lost), a worker
that registers (etcd) or comes back at a listed address (static) joins and pairs, and a
registration that expires closes its worker's connection. The readiness canary's known answer
comes from a prefill worker's model alone (its `Reference` call). The front end itself loads only
the model's config and tokenizer (`load_checkpoint(weights=False)`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import anyio
import torch

from kvfence.app.config.config import DEFAULT_WORKER_TIMEOUT_S, ServeConfig
from kvfence.app.remote.client import RemoteWorker
from kvfence.app.remote.ends import remote_receiving_end, remote_sending_end
from kvfence.app.remote.discovery import Discovery, parse_discovery
from kvfence.app.remote.membership import TTL_S, Registration, find_workers, watch_workers
from kvfence.app.remote.protocol import PROTOCOL_VERSION
from kvfence.app.serve.server import model_identity, serve_http
from kvfence.app.serve.sizing import configured_context
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.protocol import WorkerLost
from kvfence.engine.tokenizer import Tokenizer
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.driver import Scheduler
from kvfence.scheduler.metrics import SchedulerMetrics
from kvfence.scheduler.transfer import TransferLink
from kvfence.transports.base import PairingRefused
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import AuthenticationFailed, DeploymentSecret

log = logging.getLogger(__name__)

CONNECT_WAIT_S = 120.0  # how long a worker that is not listening yet (still loading) is waited for
LEAVE_GRACE_S = 2 * TTL_S  # a connected worker's registration may be gone this long before it is dropped


class WorkerSetError(ValueError):
    """The discovered workers cannot serve together; the message says why and what to change."""


@dataclasses.dataclass
class RemotePair:
    prefill: RemoteWorker
    decode: RemoteWorker
    link: TransferLink
    max_context_tokens: int


async def connect_when_up(tg: anyio.abc.TaskGroup, address: str, secret: DeploymentSecret,
                          wait_s: float = CONNECT_WAIT_S, *, front_key: FrontKey,
                          timeout_s: float = DEFAULT_WORKER_TIMEOUT_S) -> RemoteWorker:
    """Connect to the worker at `address` (`timeout_s`: its liveness bound, RemoteWorker.connect),
    retrying while nothing listens there (it may still be loading its model) for up to `wait_s`.
    WorkerLost at once when it fails the handshake or refuses (it serves another scheduler)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await RemoteWorker.connect(tg, address, secret, front_key=front_key, timeout_s=timeout_s)
        except WorkerLost as e:
            if isinstance(e.__cause__, AuthenticationFailed) or e.__cause__ is None \
                    or time.monotonic() > deadline:
                raise
            await anyio.sleep(0.5)


def check_worker(worker: RemoteWorker, model_id: str, page_size_tokens: int) -> None:
    """WorkerSetError when `worker` cannot serve with this front end: another control protocol
    version, not a prefill or decode worker, another model, another page size, or no KV endpoint."""
    d = worker.description
    assert d is not None
    if d.protocol != PROTOCOL_VERSION:
        raise WorkerSetError(f"the worker at {worker.address} speaks control protocol {d.protocol}, this front end "
                             f"{PROTOCOL_VERSION}: run the same kvfence version in every process")
    if d.role not in ("prefill", "decode"):
        raise WorkerSetError(f"the worker at {worker.address} is {d.role}: a front end drives prefill and decode "
                             "workers (start them with --role prefill or --role decode)")
    if d.model != model_id:
        raise WorkerSetError(f"the {d.role} worker at {worker.address} serves {d.model}, this front end {model_id}: "
                             "start every process with the same --model")
    if d.page_size_tokens != page_size_tokens:
        raise WorkerSetError(f"the {d.role} worker at {worker.address} has pages of {d.page_size_tokens} tokens, this "
                             f"front end {page_size_tokens}: start every process with the same --page-size")
    if d.endpoint is None:
        raise WorkerSetError(f"the {d.role} worker at {worker.address} has no KV transport endpoint")


async def pair_remote(prefill: RemoteWorker, decode: RemoteWorker, page_size_tokens: int,
                      front_key: FrontKey) -> RemotePair:
    """Pair checked workers: `prefill`'s sender with `decode`'s receiver. PairingRefused when their
    pools disagree on the bytes (the pair is refused as a whole); WorkerLost when either goes."""
    assert prefill.description is not None and decode.description is not None
    endpoint = decode.description.endpoint
    assert endpoint is not None
    record = await prefill.pair_with(endpoint)
    context = min(prefill.description.max_context_tokens, record.max_context_tokens)
    link = TransferLink(remote_sending_end(prefill.ask, endpoint.address), remote_receiving_end(decode.ask),
                        record.incarnation, page_size_tokens, record.page_nbytes, front_key)
    log.info("paired the prefill worker at %s -> the decode worker at %s over %s (%s); context limits %d and %d "
             "tokens, serving %d", prefill.address, decode.address, endpoint.transport, endpoint.address,
             prefill.description.max_context_tokens, record.max_context_tokens, context)
    return RemotePair(prefill=prefill, decode=decode, link=link, max_context_tokens=context)


class Fleet:
    """The workers one front end serves through, by control address. Each is connected,
    authenticated and checked once, then paired with every worker of the other role (a refused
    pair is logged and left out; its workers serve in their other pairs). Pairs go to the
    scheduler as they form (before it exists: `pairs`); a worker whose connection drops, or that
    stays silent for `worker_timeout_s`, is lost to the scheduler at once, and with `rejoin` its
    address is connected to again until a worker serves there (a new incarnation)."""

    def __init__(self, tg: anyio.abc.TaskGroup, secret: DeploymentSecret, front_key: FrontKey, model_id: str,
                 page_size_tokens: int, *, rejoin: bool, worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S) -> None:
        self.tg, self.secret, self.model_id, self.page_size_tokens = tg, secret, model_id, page_size_tokens
        self.front_key = front_key
        self.rejoin = rejoin
        self.worker_timeout_s = worker_timeout_s
        self.workers: dict[str, RemoteWorker] = {}
        self.pairs: list[RemotePair] = []
        self.scheduler: Scheduler | None = None
        self._joining: set[str] = set()
        self._closing = False

    async def join(self, address: str, wait_s: float = CONNECT_WAIT_S) -> bool:
        """Connect to the worker at `address` and pair it with the others; False (logged) when it
        cannot serve here."""
        if address in self.workers or address in self._joining:
            return True
        self._joining.add(address)
        try:
            try:
                worker = await connect_when_up(self.tg, address, self.secret, wait_s, front_key=self.front_key,
                                               timeout_s=self.worker_timeout_s)
            except WorkerLost as e:
                log.error("cannot use the worker at %s: %s", address, e)
                return False
            try:
                check_worker(worker, self.model_id, self.page_size_tokens)
            except WorkerSetError as e:
                log.error("the worker at %s cannot serve with this front end: %s", address, e)
                worker.close()
                return False
            self.workers[address] = worker
            self.tg.start_soon(self._watch, worker, name=f"watch-{address}")
            for other in [w for w in self.workers.values() if w.role != worker.role]:
                await self._pair(*((worker, other) if worker.role == "prefill" else (other, worker)))
            return True
        finally:
            self._joining.discard(address)

    def leave(self, address: str) -> None:
        """The worker at `address` left membership: its connection is closed (so it is lost)."""
        worker = self.workers.get(address)
        if worker is not None:
            log.warning("the %s worker at %s has not been registered for %g s: its connection is closed", worker.role,
                        address, LEAVE_GRACE_S)
            worker.close()

    async def _pair(self, prefill: RemoteWorker, decode: RemoteWorker) -> None:
        try:
            pair = await pair_remote(prefill, decode, self.page_size_tokens, self.front_key)
        except (PairingRefused, WorkerLost) as e:
            log.error("the pair prefill worker at %s -> decode worker at %s is refused as a whole: %s",
                      prefill.address, decode.address, e)
            return
        if prefill.lost.is_set() or decode.lost.is_set():
            return
        if self.scheduler is None:
            self.pairs.append(pair)
        else:
            self.scheduler.add_pair(*_pair_args(pair))

    async def _watch(self, worker: RemoteWorker) -> None:
        await worker.lost.wait()
        if self._closing:  # the front end is stopping: nothing is lost
            return
        if self.workers.get(worker.address) is worker:
            del self.workers[worker.address]
        self.pairs = [p for p in self.pairs if worker not in (p.prefill, p.decode)]
        if self.scheduler is not None:
            self.scheduler.worker_lost(worker.name)
        if self.rejoin:
            while worker.address not in self.workers and not await self.join(worker.address, wait_s=3600.0):
                await anyio.sleep(1.0)  # refused for now (it serves another scheduler): ask again

    async def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The readiness canary's answer, from a live prefill worker's model alone."""
        for worker in [w for w in self.workers.values() if w.role == "prefill"]:
            try:
                return await worker.reference(prompt, max_tokens)
            except WorkerLost:
                continue
        raise RuntimeError("no prefill worker is connected to compute the canary's answer")

    def start_scheduler(self, config: SchedulerConfig, tokenizer: Tokenizer) -> Scheduler:
        """The scheduler serving every pair formed so far (at least one), and every later one."""
        first, *more = self.pairs
        prefill, decode, link, prefill_pages, decode_pages, context = _pair_args(first)
        scheduler = Scheduler(config, tokenizer, prefill, decode, prefill_pages=prefill_pages,
                              decode_pages=decode_pages, link=link, metrics=SchedulerMetrics(),
                              max_context_tokens=context)
        for pair in more:
            scheduler.add_pair(*_pair_args(pair))
        self.scheduler, self.pairs = scheduler, []
        return scheduler

    def close(self) -> None:
        self._closing = True
        for worker in list(self.workers.values()):
            worker.close()


def _pair_args(pair: RemotePair) -> tuple[RemoteWorker, RemoteWorker, TransferLink, int, int, int]:
    """Scheduler.add_pair's arguments for `pair`."""
    prefill, decode = pair.prefill.description, pair.decode.description
    assert prefill is not None and decode is not None
    return pair.prefill, pair.decode, pair.link, prefill.num_pages, decode.num_pages, pair.max_context_tokens


async def _initial_addresses(discovery: Discovery, secret: DeploymentSecret) -> list[str]:
    """The control addresses to start with: the static list, or every worker registered in etcd
    (signed with `secret`) once there is a prefill and a decode worker."""
    if discovery.etcd is None:
        return list(discovery.addresses)
    host, port = discovery.etcd
    found = await find_workers(host, port, secret, CONNECT_WAIT_S)
    log.info("etcd at %s:%d lists %d workers: %s", host, port, len(found),
             ", ".join(f"{r.role} at {r.control} (incarnation {r.incarnation})" for r in found))
    return [r.control for r in found]


async def _follow_etcd(fleet: Fleet, host: str, port: int, secret: DeploymentSecret) -> None:
    """Keep the fleet to what etcd lists: a new registration joins; a worker whose registration
    stays gone for LEAVE_GRACE_S leaves (it is lost). The grace is for a worker that lives: its
    lease may expire while etcd or the network is away, or someone may delete its key, and it puts
    the key back within a third of the TTL; a worker that died or stopped is lost by its
    connection or the keep-alive long before."""
    changed = anyio.Event()
    listed: list[Registration] = []
    missing_since: dict[str, float] = {}

    def on_change(registrations: list[Registration]) -> None:
        nonlocal listed
        listed = registrations
        changed.set()

    async def reconcile() -> None:
        nonlocal changed
        while True:
            await changed.wait()
            changed = anyio.Event()
            addresses, now = {r.control for r in listed}, time.monotonic()
            for address in [a for a in missing_since if a in addresses or a not in fleet.workers]:
                del missing_since[address]
            for address in [a for a in fleet.workers if a not in addresses]:
                if now - missing_since.setdefault(address, now) >= LEAVE_GRACE_S:
                    del missing_since[address]
                    fleet.leave(address)
            for address in addresses - fleet.workers.keys():
                fleet.tg.start_soon(fleet.join, address, 10.0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reconcile)
        await watch_workers(host, port, secret, on_change)


async def serve_remote(config: ServeConfig, checkpoint: Checkpoint, model_name: str) -> int:
    """Serve through the discovered workers until SIGTERM/SIGINT drained (0); 1 when no pair of
    them can serve together (logged)."""
    assert config.discovery is not None
    discovery = parse_discovery(config.discovery)
    if not config.transport.secret_file:
        log.error("--discovery needs the deployment secret the workers were started with: --transport-secret-file")
        return 1
    if not config.transport.front_key_file:
        log.error("--discovery needs the front end's key, whose public half the workers were started with: "
                  "--front-key-file (make a pair with: kvfence front-key)")
        return 1
    secret = DeploymentSecret.from_file(config.transport.secret_file)
    front_key = FrontKey.from_file(config.transport.front_key_file)
    page_size = config.pools.page_size_tokens
    async with anyio.create_task_group() as tg:
        fleet = Fleet(tg, secret, front_key, model_identity(checkpoint, model_name), page_size,
                      rejoin=discovery.etcd is None, worker_timeout_s=config.worker_timeout_s)
        try:
            addresses = await _initial_addresses(discovery, secret)
        except TimeoutError as e:
            log.error("cannot serve through the discovered workers: %s", e)
            addresses = []
        for address in addresses:
            await fleet.join(address)
        if not fleet.pairs:
            found = ", ".join(f"{w.role} at {a}" for a, w in fleet.workers.items()) or "none usable"
            log.error("cannot serve through the discovered workers: no prefill and decode worker pair formed "
                      "(workers: %s)", found)
            fleet.close()
            tg.cancel_scope.cancel()
            return 1
        prefill = fleet.pairs[0].prefill.description
        assert prefill is not None
        scheduler = fleet.start_scheduler(config.scheduler.bind(
            page_size_tokens=page_size, max_context_tokens=configured_context(config, checkpoint.config),
            disaggregated=True, prefill_device_type=torch.device(prefill.device).type), checkpoint.tokenizer)
        if discovery.etcd is not None:
            tg.start_soon(_follow_etcd, fleet, *discovery.etcd, secret, name="etcd-membership")
        workers = ", ".join(f"{w.role} at {a}" for a, w in fleet.workers.items())
        await serve_http(tg, config, model_name, checkpoint.tokenizer, scheduler, fleet.reference,
                         f"disaggregated: {len(scheduler.core.pairs)} pairs of workers ({workers})",
                         checkpoint.config.vocab_size)
        fleet.close()
        tg.cancel_scope.cancel()
    return 0
