"""The scheduler's end of a worker in another process: one authenticated control connection
(app/remote/protocol.py) carrying its steps and its halves of every KV transfer.

`RemoteWorker` is a `WorkerChannel` (engine/protocol.py): steps go out in the order `call` was
entered, on one connection, and the worker runs them in that order. The transfer halves
scheduler/transfer.py drives, run on the prefill and the decode worker, go through its `ask`
(app/remote/ends.py). A call on a connection that is gone raises `WorkerLost`; so does every call
waiting when it goes.

Liveness (app/remote/protocol.py): a worker heard from by nothing for `timeout_s` (it was
stopped, its host or the network between went silent) is lost, and so is one that leaves a call
unanswered past CALL_DEADLINE_S; the connection is then closed, so the worker, if it comes back,
ends everything this scheduler held and rejoins as a new incarnation.
"""

from __future__ import annotations

import itertools
import logging
import math
import time

import anyio
import anyio.abc

from kvfence.app.config.config import DEFAULT_WORKER_TIMEOUT_S, MAX_WORKER_TIMEOUT_S
from kvfence.app.remote.ends import waits_on_transfer
from kvfence.app.remote.protocol import (
    CALL_DEADLINE_S, HANDSHAKE_LABEL, PREFIX_BYTES, Answer, AnswerBody, Call, CallBody, Cut, Describe, Description,
    EndCall, Paired, PairWith, Ping, Reference, Tokens, body_length, decode_answer, failure_message, frame,
)
from kvfence.engine.protocol import RunStep, StepDone, StepFailed, WorkerLost, WorkerReply
from kvfence.transports.base import EndpointInfo, PairingRecord, PairingRefused
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.wire.channel import Channel, ConnectionGone, connect, split_address
from kvfence.transports.wire.handshake import authenticate_as_connector

log = logging.getLogger(__name__)


class _Waiting:
    __slots__ = ("done", "answer")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.answer: AnswerBody | None = None


class RemoteWorker:
    """One worker's control connection. Make it with `connect`; `lost` is set once it is gone."""

    def __init__(self, address: str, channel: Channel, timeout_s: float = DEFAULT_WORKER_TIMEOUT_S) -> None:
        self.address = address
        self.device = ""  # its own process and device: no other worker's steps queue with its
        self.channel = channel
        self.timeout_s = timeout_s
        self.description: Description | None = None
        self.lost = anyio.Event()
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}

    @classmethod
    async def connect(cls, tg: anyio.abc.TaskGroup, address: str, secret: DeploymentSecret, *, front_key: FrontKey,
                      handshake_timeout_s: float = 10.0,
                      timeout_s: float = DEFAULT_WORKER_TIMEOUT_S) -> RemoteWorker:
        """Connect to the worker's control address, prove the deployment secret and the front end's
        key `front_key` (and check the worker's proof of the secret), start reading answers and
        keeping it alive (`timeout_s`: see the module docstring) in `tg` and ask who it is.
        WorkerLost when it cannot be reached, fails the handshake, or refuses (it serves another
        scheduler)."""
        if not 0 < timeout_s <= MAX_WORKER_TIMEOUT_S:
            raise ValueError(f"a worker timeout is in (0, {MAX_WORKER_TIMEOUT_S:g}] s, got {timeout_s!r}")
        host, port = split_address(address)
        try:
            with anyio.fail_after(handshake_timeout_s):
                channel = Channel(await connect(host, port))
                try:
                    await authenticate_as_connector(channel, secret, HANDSHAKE_LABEL, front_key=front_key)
                except BaseException:
                    channel.close()
                    raise
        except (TimeoutError, *ConnectionGone) as e:  # AuthenticationFailed is a ConnectionError too
            raise WorkerLost(f"worker at {address}: {e or type(e).__name__}") from e
        worker = cls(address, channel, timeout_s)
        tg.start_soon(worker._read, name=f"control-{address}")
        tg.start_soon(worker._keep_alive, tg, name=f"keepalive-{address}")
        answer = await worker.ask(Describe())
        if not isinstance(answer, Description):
            worker.close()
            raise WorkerLost(f"worker at {address}: {failure_message(answer)}")
        worker.description = answer
        return worker

    @property
    def role(self) -> str:
        assert self.description is not None
        return self.description.role

    @property
    def name(self) -> str:
        """How the scheduler, its logs and its metrics name this worker: role@address."""
        return f"{self.role}@{self.address}"

    async def call(self, request: RunStep) -> WorkerReply:
        """A step, as `WorkerChannel.call`."""
        answer = await self.ask(request)
        if isinstance(answer, StepDone | StepFailed):
            return answer
        return StepFailed(step_id=request.step_id, message=failure_message(answer))

    async def cut(self, step_id: int) -> None:
        """`WorkerChannel.cut`: a call of its own, answered beside the step it names."""
        await self.ask(Cut(step_id))

    async def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The greedy continuation of `prompt` on the worker's model alone (the readiness canary's answer)."""
        answer = await self.ask(Reference(prompt, max_tokens))
        if not isinstance(answer, Tokens):
            raise RuntimeError(f"worker at {self.address}: {failure_message(answer)}")
        return answer.token_ids

    async def pair_with(self, endpoint: EndpointInfo) -> PairingRecord:
        """Prefill worker: pair with the decode worker's endpoint; the receiver's record.
        PairingRefused when the two disagree on the bytes."""
        answer = await self.ask(PairWith(endpoint))
        if not isinstance(answer, Paired):
            raise PairingRefused(failure_message(answer).removeprefix("pairing refused: "))
        return answer.record

    async def ask(self, body: CallBody) -> AnswerBody:
        """Send one call and wait for its answer. WorkerLost if the connection is (or goes) away,
        or the answer to a step or a control call does not come within CALL_DEADLINE_S (the worker
        is then lost). A transfer's calls whose method waits on the transfer (scheduler/transfer.py
        `waits_on_transfer`: a push, a verdict, quiet) wait on the network and on the other
        worker, as long as the transfer's own timeout and quarantine say: only the keep-alive
        bounds them."""
        if self.lost.is_set():
            raise WorkerLost(f"the control connection to {self.address} is gone")
        call_id, waiting = next(self._ids), _Waiting()
        self._waiting[call_id] = waiting
        try:
            bound_s = math.inf if isinstance(body, EndCall) and waits_on_transfer(body) else CALL_DEADLINE_S
            with anyio.move_on_after(bound_s) as deadline:
                try:
                    async with self.channel.send_lock:
                        await self.channel.send_bytes(frame(Call(call_id, body)))
                except ConnectionGone as e:
                    self._gone(f"send failed: {e}")
                await waiting.done.wait()
            if deadline.cancelled_caught:
                self._gone(f"{type(body).__name__} unanswered for {CALL_DEADLINE_S:g} s")
        finally:
            self._waiting.pop(call_id, None)
        if waiting.answer is None:
            raise WorkerLost(f"the control connection to {self.address} is gone")
        return waiting.answer

    async def _read(self) -> None:
        try:
            while True:
                prefix = await self.channel.recv_bytes(PREFIX_BYTES)
                answer: Answer = decode_answer(await self.channel.recv_bytes(body_length(prefix)))
                waiting = self._waiting.get(answer.call_id)
                if waiting is not None:  # else its caller gave up waiting
                    waiting.answer = answer.body
                    waiting.done.set()
        except (ValueError, *ConnectionGone) as e:
            self._gone(str(e) or type(e).__name__)

    async def _keep_alive(self, tg: anyio.abc.TaskGroup) -> None:
        """Ping whenever nothing went either way for a quarter of `timeout_s`; lose the worker
        once nothing came back for all of it."""
        interval_s, pinging = self.timeout_s / 4, False

        async def ping() -> None:
            nonlocal pinging
            pinging = True
            try:
                await self.ask(Ping())
            except WorkerLost:
                pass
            finally:
                pinging = False

        while not self.lost.is_set():
            await anyio.sleep(interval_s)
            now = time.monotonic()
            if (silent_s := now - self.channel.last_recv_s) > self.timeout_s and not self.channel.has_unread():
                self._gone(f"nothing heard from it for {silent_s:.1f} s (worker timeout {self.timeout_s:g} s)")
            elif not pinging and min(silent_s, now - self.channel.last_send_s) >= interval_s / 2:
                tg.start_soon(ping)

    def _gone(self, why: str | None) -> None:
        """The connection is gone (`why`: logged; None: closed on purpose); every waiting call fails."""
        if not self.lost.is_set() and why is not None:
            log.warning("the control connection to the worker at %s is gone: %s", self.address, why)
        self.lost.set()
        self.channel.close()
        for waiting in self._waiting.values():
            waiting.done.set()

    def close(self) -> None:
        self._gone(None)
