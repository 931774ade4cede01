"""Liveness of the control channel (app/remote/protocol.py): a worker that falls silent (the
network between goes quiet, as in a partition; its process is stopped) is lost within the worker
timeout, and one whose device is stuck (it answers pings but not a step) within the call
deadline. Either way the request on it ends with `worker_lost` and no token after that, the
pages on the live worker return to baseline, and the worker, once it hears that its scheduler
dropped it, ends everything it held and comes back as a new incarnation that serves again."""

from __future__ import annotations

import logging
import socket
import threading
import time

import anyio
import anyio.abc
import pytest
from front_keys import FRONT
from hosted_workers import MODEL_ID, PAGE, PAGES, Hosted, host_pair
from serving_harness import wait_idle

from kvfence.app.remote import client
from kvfence.app.remote.client import RemoteWorker
from kvfence.app.remote.front import check_worker, pair_remote
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.driver import Scheduler
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.wire.channel import split_address

pytestmark = pytest.mark.anyio
TIMEOUT_S = 1.0
PROMPT = list(range(30, 52))
LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


class SilenceableRelay:
    """Forwards bytes between a scheduler and a worker until `silence()`: then neither side gets
    another byte (the sockets stay open: a partition, not a reset) until `resume()`."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.05)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.quiet, self.stop = threading.Event(), threading.Event()

    def silence(self) -> None:
        self.quiet.set()

    def resume(self) -> None:
        self.quiet.clear()

    def __enter__(self) -> SilenceableRelay:
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.listener.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            upstream = socket.create_connection(split_address(self.target))
            for src, dst in ((conn, upstream), (upstream, conn)):
                src.settimeout(0.05)
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self.stop.is_set():
                if self.quiet.is_set():
                    time.sleep(0.01)
                    continue
                try:
                    data = src.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for sock in (dst, src):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        src.close()  # each direction's pipe owns the socket it reads


async def serve(tg: anyio.abc.TaskGroup, tiny: Checkpoint, secret: DeploymentSecret,
                addresses: list[str]) -> tuple[Scheduler, list[RemoteWorker]]:
    workers = [await RemoteWorker.connect(tg, a, secret, front_key=FRONT, timeout_s=TIMEOUT_S) for a in addresses]
    for w in workers:
        check_worker(w, MODEL_ID, PAGE)
    pair = await pair_remote(*workers, PAGE, FRONT)
    config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=pair.max_context_tokens, chunk_tokens=8,
                             disaggregated=True, transfer_timeout_s=5)
    scheduler = Scheduler(config, tiny.tokenizer, pair.prefill, pair.decode, prefill_pages=PAGES,
                          decode_pages=PAGES, link=pair.link)
    await scheduler.run(tg)
    return scheduler, workers


async def stream_until_lost(scheduler: Scheduler, fault) -> tuple[int, int, str | None]:  # type: ignore[no-untyped-def]
    """Stream one long request; `fault()` once its first tokens came. (tokens before the fault,
    tokens after it, the error code it ended with)."""
    before = after = 0
    code = None
    async for d in scheduler.submit(PROMPT, LONG).deltas():
        if before == 0:
            before = len(d.token_ids)
            if before:
                fault()
        else:
            after += len(d.token_ids)
        code = d.error.code if d.error else None
    return before, after, code


async def comes_back(hosted: Hosted, old_incarnation: str) -> None:
    """Until the worker ended what its dropped scheduler held: a new incarnation, every page untagged."""
    with anyio.fail_after(10):
        while not (hosted.server.served == 1 and hosted.worker.incarnation != old_incarnation):
            await anyio.sleep(0.02)
    assert hosted.tags() == [0] * PAGES and hosted.server.owner is None


async def test_a_worker_gone_silent_is_lost_within_its_timeout_and_comes_back_new(
        tiny: Checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        with SilenceableRelay(hosted[1].address) as relay:
            async with anyio.create_task_group() as front:
                scheduler, workers = await serve(front, tiny, secret, [hosted[0].address, relay.address])
                old = hosted[1].worker.incarnation
                with anyio.fail_after(4 * TIMEOUT_S):  # the bound, with room for a slow machine
                    before, after, code = await stream_until_lost(scheduler, relay.silence)
                assert before > 0 and code == "worker_lost" and workers[1].lost.is_set()
                assert any("nothing heard from it" in r.getMessage() and relay.address in r.getMessage()
                           for r in caplog.records)
                await wait_idle(scheduler)  # the live prefill worker's pages are back
                relay.resume()  # the worker learns its scheduler dropped it
                await comes_back(hosted[1], old)
                workers[0].close()
                await comes_back(hosted[0], hosted[0].worker.incarnation)
                front.cancel_scope.cancel()
            async with anyio.create_task_group() as again:  # it serves again, as the new incarnation
                scheduler, workers = await serve(again, tiny, secret, [hosted[0].address, relay.address])
                assert workers[1].description is not None
                assert workers[1].description.incarnation == hosted[1].worker.incarnation != old
                before, after, code = await stream_until_lost(scheduler, lambda: None)
                assert code is None and before + after == LONG.max_tokens
                await wait_idle(scheduler)
                for w in workers:
                    w.close()
                again.cancel_scope.cancel()
        tg.cancel_scope.cancel()


async def test_a_worker_whose_step_never_returns_is_lost_at_the_call_deadline(
        tiny: Checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Its device is stuck: it answers every ping, but a step never comes back."""
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr(client, "CALL_DEADLINE_S", 3 * TIMEOUT_S)
    secret = DeploymentSecret.generate()
    stuck, release = threading.Event(), threading.Event()
    async with anyio.create_task_group() as tg:
        hosted = await host_pair(tg, tiny, secret)
        decode = hosted[1].worker
        execute = decode.execute

        def hangs_once_stuck(step):  # type: ignore[no-untyped-def]
            if stuck.is_set():
                release.wait(30)
            return execute(step)

        monkeypatch.setattr(decode, "execute", hangs_once_stuck)
        async with anyio.create_task_group() as front:
            scheduler, workers = await serve(front, tiny, secret, [h.address for h in hosted])
            old = decode.incarnation
            with anyio.fail_after(6 * TIMEOUT_S):
                before, _, code = await stream_until_lost(scheduler, stuck.set)
            assert before > 0 and code == "worker_lost" and workers[1].lost.is_set()
            assert any("RunStep unanswered" in r.getMessage() for r in caplog.records)
            await wait_idle(scheduler)
            release.set()
            await comes_back(hosted[1], old)
            workers[0].close()
            front.cancel_scope.cancel()
        tg.cancel_scope.cancel()
