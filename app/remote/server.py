"""The worker's end of the control channel (app/remote/protocol.py): one scheduler at a time.

A `kvfence worker` process (app/remote/worker_process.py) hosts one `Worker` (model, pool), its KV
transport endpoint and this server. A connection must pass the control handshake (the deployment
secret, and the front end's key, whose public half the worker holds: transports/wire/handshake.py)
before a byte of it is decoded (at most DEFAULT_MAX_UNAUTHENTICATED of them wait for theirs at
once; one more closes the oldest: transports/wire/pending.py); a scheduler that passes owns the
worker until its connection drops or falls silent for SCHEDULER_SILENCE_S (a second one is told
so and closed).

Steps run one at a time in the order they arrived, on the device's compute thread; transfer
calls run beside them on the event loop. When the owning scheduler's connection drops, the
worker ends everything that scheduler held: its transfers are cancelled, the transport endpoint
is closed (its memory registrations dropped, so no write posted for an old transfer can land any
more: every transfer touching the pool is quiet), then the worker restarts (every page untagged
and poisoned, a new incarnation) and a fresh endpoint starts. The next scheduler sees a new
incarnation and pairs again.

Drain (`drain`, on SIGTERM): from then on every step's reply says the worker is draining, so the
scheduler starts nothing new on it; the worker waits until its scheduler has been told and it holds
no live lease and no unsettled transfer (or the deadline passes), then stops.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import anyio
import anyio.abc
import msgspec
import torch
from anyio.abc import TaskGroup

from kvfence.app.remote.ends import decoded, invoke, transfer_id
from kvfence.app.remote.protocol import (
    HANDSHAKE_LABEL, PREFIX_BYTES, PROTOCOL_VERSION, SCHEDULER_SILENCE_S, Answer, AnswerBody, Call, Cut, Describe,
    Description, Done, EndCall, Failure, Paired, PairWith, Ping, Reference, Tokens, body_length, decode_call, frame,
)
from kvfence.app.serve.readiness import greedy_answer
from kvfence.engine.compute import ComputeThread
from kvfence.engine.protocol import RunStep
from kvfence.engine.tokenizer import Tokenizer
from kvfence.engine.worker import Worker
from kvfence.scheduler.transfer import LocalReceivingEnd, LocalSendingEnd
from kvfence.transports.base import EndpointInfo, PairingRecord, PairingRefused, Peer, TransferResult, Transport
from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import AuthenticationFailed, DeploymentSecret
from kvfence.transports.wire.channel import Channel, ConnectionGone, accept_forever
from kvfence.transports.wire.handshake import authenticate_as_listener
from kvfence.transports.wire.keepalive import keep_alive
from kvfence.transports.wire.pending import Unauthenticated

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0


class KvEndpoint:
    """The worker's KV transport endpoint, renewable: `renew` closes the current one (dropping its
    registrations) and starts a fresh one over the same pool, with a new incarnation in its record."""

    def __init__(self, make: Callable[[], Transport], memory: torch.Tensor,
                 record: Callable[[], PairingRecord]) -> None:
        self._make, self._memory, self._record = make, memory, record
        self.transport: Transport | None = None
        self.info: EndpointInfo | None = None
        self.peers: dict[str, Peer] = {}  # prefill side: the receivers it paired with, by endpoint address

    async def start(self, tg: TaskGroup) -> None:
        self.transport = self._make()
        self.info = await self.transport.start(tg, self._memory, self._record())
        self.peers = {}

    async def renew(self, tg: TaskGroup) -> None:
        await self.close()
        await self.start(tg)

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.aclose()
            self.transport = self.info = None
            self.peers = {}


class WorkerServer:
    """Serves `worker`'s control connections (see the module docstring). `endpoint`: its KV
    endpoint (None for a colocated worker); `model`: the model identity a pair must share;
    `max_context_tokens`: the longest request its pool holds."""

    def __init__(self, worker: Worker, compute: ComputeThread, endpoint: KvEndpoint | None,
                 secret: DeploymentSecret, tokenizer: Tokenizer, *, front_key: FrontPublicKey, model: str,
                 max_context_tokens: int) -> None:
        self.worker = worker
        self.tokenizer = tokenizer
        self.compute = compute
        self.endpoint = endpoint
        self.secret, self.front_key = secret, front_key
        self.model = model
        self.max_context_tokens = max_context_tokens
        self.owner: str | None = None  # the address of the scheduler it serves
        self._unauthenticated = Unauthenticated(f"{worker.role} worker control port")
        self._tg: TaskGroup | None = None
        self._active: set[str] = set()  # transfers armed or pushed and not yet settled
        self.served = 0  # schedulers served so far (tests wait on it)
        self.draining = False
        self._told = False  # a reply saying so reached the scheduler's connection
        self._stepped = False  # its scheduler has sent it a step (it may route to it)

    def describe(self) -> Description:
        pool = self.worker.pool
        return Description(role=self.worker.role, incarnation=self.worker.incarnation, device=str(self.worker.device),
                           model=self.model, num_pages=pool.num_pages, page_size_tokens=pool.page_size_tokens,
                           max_context_tokens=self.max_context_tokens,
                           endpoint=self.endpoint.info if self.endpoint is not None else None,
                           protocol=PROTOCOL_VERSION)

    async def serve(self, listener: socket.socket, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Accept on `listener` until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self.endpoint is not None:
                await self.endpoint.start(tg)
            task_status.started()
            try:
                await accept_forever(listener, lambda sock: self._accepted(tg, sock))
            finally:
                self._unauthenticated.close_all()
                if self.endpoint is not None:
                    with anyio.CancelScope(shield=True):
                        await self.endpoint.close()

    def _accepted(self, tg: TaskGroup, sock: socket.socket) -> None:
        """Count a new connection as unauthenticated (closing the oldest past the budget) and serve it."""
        channel = Channel(sock)
        self._unauthenticated.admit(channel)
        tg.start_soon(self._connection, channel)

    async def _connection(self, channel: Channel) -> None:
        peer = channel.peer
        try:
            with anyio.fail_after(HANDSHAKE_TIMEOUT_S):
                await authenticate_as_listener(channel, self.secret, HANDSHAKE_LABEL, front=self.front_key)
        except (AuthenticationFailed, TimeoutError, *ConnectionGone) as e:
            log.warning("control connection from %s refused: %s", peer, e or type(e).__name__)
            channel.close()
            return
        finally:
            self._unauthenticated.authenticated(channel)
        if self.owner is not None:
            await self._refuse(channel, f"this {self.worker.role} worker already serves the scheduler at {self.owner}")
            return
        self.owner, self._stepped = peer, False
        log.info("%s worker: serving the scheduler at %s (incarnation %s)", self.worker.role, peer,
                 self.worker.incarnation)
        try:
            await self._serve_scheduler(channel)
        finally:
            with anyio.CancelScope(shield=True):
                channel.close()
                await self._end_scheduler(peer)
                self.owner = None
                self.served += 1

    async def _refuse(self, channel: Channel, message: str) -> None:
        log.warning("control connection refused: %s", message)
        try:
            with anyio.fail_after(HANDSHAKE_TIMEOUT_S):
                call = await _recv_call(channel)
                async with channel.send_lock:
                    await channel.send_bytes(frame(Answer(call.call_id, Failure(message))))
        except (TimeoutError, ValueError, *ConnectionGone):
            pass
        channel.close()

    async def _serve_scheduler(self, channel: Channel) -> None:
        steps_in, steps_out = anyio.create_memory_object_stream[Call](max_buffer_size=1 << 20)

        async def answer(call_id: int, body: AnswerBody) -> None:
            try:
                async with channel.send_lock:
                    await channel.send_bytes(frame(Answer(call_id, body)))
            except ConnectionGone:  # the reader sees the connection end and ends the others
                channel.close()

        async def run_steps() -> None:  # one at a time, in arrival order
            async for call in steps_out:
                self._stepped = True
                reply = await self.compute.run(self.worker.execute, call.body)
                draining = self.draining
                if draining:
                    reply = msgspec.structs.replace(reply, draining=True)
                await answer(call.call_id, reply)
                self._told = self._told or draining

        async def run_call(call: Call) -> None:
            try:
                body = await self._handle(call.body)
            except Exception as e:  # a failed call fails that call, not the connection
                log.warning("%s worker: %s failed: %r", self.worker.role, type(call.body).__name__, e)
                body = Failure(f"{type(e).__name__}: {e}")
            await answer(call.call_id, body)

        async with steps_in, steps_out, anyio.create_task_group() as tg:
            tg.start_soon(run_steps)
            # the scheduler pings well within the bound; the worker only answers, so its ping is no message
            tg.start_soon(keep_alive, channel, _answers_only, SCHEDULER_SILENCE_S,
                          f"{self.worker.role} worker's control connection from the scheduler at {channel.peer}")
            try:
                while True:
                    call = await _recv_call(channel)
                    if isinstance(call.body, RunStep):
                        await steps_in.send(call)
                    else:
                        tg.start_soon(run_call, call)
            except (ValueError, *ConnectionGone) as e:
                log.warning("%s worker: the scheduler's control connection ended: %s", self.worker.role,
                            e or type(e).__name__)
            tg.cancel_scope.cancel()

    async def drain(self, timeout_s: float) -> bool:
        """Take nothing new (every reply says so) and wait until the scheduler was told (unless it
        never sent a step: it serves nothing here) and this worker holds no live lease and no
        unsettled transfer; False when `timeout_s` passed first."""
        self.draining, self._told = True, False
        log.info("%s worker: draining (up to %g s): %d leases live, %d transfers unsettled", self.worker.role,
                 timeout_s, len(self.worker.page_tables), len(self._active))
        with anyio.move_on_after(timeout_s):
            while self.owner is not None and ((self._stepped and not self._told) or len(self.worker.page_tables)
                                              or self._active):
                await anyio.sleep(0.05)
            return True
        log.warning("%s worker: still %d leases live after %g s of draining; stopping anyway",
                    self.worker.role, len(self.worker.page_tables), timeout_s)
        return False

    async def _handle(self, body: object) -> AnswerBody:
        endpoint = self.endpoint
        match body:
            case Ping():
                return Done()
            case Cut(step_id):
                self.worker.ask_cut(step_id)
                return Done()
            case Describe():
                return self.describe()
            case Reference(prompt, max_tokens):
                return Tokens(await self.compute.run(greedy_answer, self.worker.runner.model, self.tokenizer, prompt,
                                                     max_tokens, self.worker.pool.page_size_tokens))
        if endpoint is None or endpoint.transport is None:
            return Failure(f"the {self.worker.role} worker has no KV transport endpoint")
        transport = endpoint.transport
        match body:
            case PairWith(info):
                try:
                    peer = endpoint.peers[info.address] = await transport.pair(info)
                except PairingRefused as e:
                    return Failure(f"pairing refused: {e}")
                return Paired(peer.info.record)
            case EndCall():
                return await self._end_call(endpoint, body)
        return Failure(f"the worker does not take {type(body).__name__}")

    async def _end_call(self, endpoint: KvEndpoint, call: EndCall) -> AnswerBody:
        """Run a transfer call against this worker's own half (app/remote/ends.py), and keep
        `_active`: a transfer is unsettled from its arming or push until its verdict, its push
        succeeding, or its cancel acknowledged (receiver) or quiet learnt (sender)."""
        assert endpoint.transport is not None
        transport = endpoint.transport
        end: LocalSendingEnd | LocalReceivingEnd
        if call.end == "receiving":
            end = LocalReceivingEnd(transport)
        elif (peer := endpoint.peers.get(call.receiver)) is not None:
            end = LocalSendingEnd(transport, peer)
        else:
            return Failure(f"the prefill worker is not paired with a receiver at {call.receiver}")
        method, args = decoded(call)
        transfer = transfer_id(args)
        if method.name in ("expect", "push"):
            self._active.add(transfer)
        answer, value = await invoke(end, method, args)
        if (isinstance(value, TransferResult) and (value.ok or method.name == "completion")
                or value is True and (method.name == "wait_quiet" or call.end == "receiving")):
            self._active.discard(transfer)
        return answer

    async def _end_scheduler(self, peer: str) -> None:
        """Everything the scheduler at `peer` held ends: its transfers are made quiet by closing the
        endpoint (no registration is left for a late write), then the pool restarts blank."""
        unsettled = len(self._active)
        self._active.clear()
        if self.endpoint is not None and self._tg is not None:
            await self.endpoint.renew(self._tg)
        await self.compute.run(self.worker.restart)
        log.warning("%s worker: the scheduler at %s is gone; its leases ended (%d transfers were unsettled, "
                    "made quiet by closing the KV endpoint); now incarnation %s", self.worker.role, peer,
                    unsettled, self.worker.incarnation)


async def _recv_call(channel: Channel) -> Call:
    """The next call; ValueError on a frame that is too long or not a call (the connection is dropped)."""
    prefix = await channel.recv_bytes(PREFIX_BYTES)
    body = await channel.recv_bytes(body_length(prefix))
    try:
        return decode_call(body)
    except Exception as e:
        raise ValueError(f"undecodable control frame: {e}") from e


async def _answers_only() -> None:
    """The worker's keep-alive sends nothing of its own: the protocol is the scheduler's calls."""
