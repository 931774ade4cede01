"""The control channel is sealed (FAILURES 31): a relay in front of a worker's control port that
forwarded the handshake does one thing to one message — a call to the worker (describe, a step,
a ping, a transfer's call) or an answer from it (its description, a step's reply, a ping's, a transfer call's) —
flips a bit of it, replays it, swaps it with the next or drops it. Whatever it does, the
connection closes (an end logs the failed record, naming the relay as it sees it) and the worker
is lost to the scheduler: nothing altered is ever acted on."""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import msgspec
import pytest
from hosted_workers import MODEL_ID, PAGE, PAGES, host_pair
from front_keys import FRONT
from tamper_relay import TO_CONNECTOR, TO_LISTENER, TamperingRelay, keylog_in_use

from kvfence.app.remote.client import RemoteWorker
from kvfence.app.remote.front import check_worker, pair_remote
from kvfence.app.remote.protocol import HANDSHAKE_LABEL, PREFIX_BYTES
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.protocol import WorkerLost
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.core.config import SchedulerConfig
from kvfence.scheduler.driver import Scheduler
from kvfence.transports.base import PairingRefused
from kvfence.transports.core.secret import DeploymentSecret

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("keylog")]
TIMEOUT_S = 1.0  # pings every quarter of it: a dropped or held message is followed by another soon
OPS = ("flip", "replay", "reorder", "drop")
KINDS = [(TO_LISTENER, kind) for kind in ("describe", "run_step", "ping", "end_call")] + \
        [(TO_CONNECTOR, kind) for kind in ("description", "step_done", "done", "end_return")]
_message = msgspec.json.Decoder(dict)


def body_type(plain: bytes) -> str:
    """The tag of the body of the control frame a record holds whole ("" for anything else)."""
    try:
        return str(_message.decode(plain[PREFIX_BYTES:])["body"]["type"])
    except (msgspec.DecodeError, KeyError, TypeError):
        return ""


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("direction", "kind"), KINDS)
async def test_whatever_a_relay_does_to_a_control_message_loses_the_worker(
        tiny: Checkpoint, direction: str, kind: str, op: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    secret = DeploymentSecret.generate()
    async with anyio.create_task_group() as tg:
        prefill, decode = await host_pair(tg, tiny, secret)
        with TamperingRelay(decode.address, keylog_in_use(), HANDSHAKE_LABEL, body_type, kind, op, direction) as relay:
            async with anyio.create_task_group() as front:
                with anyio.fail_after(15):
                    await serve_until_lost(front, tiny, secret, prefill.address, relay)
                assert relay.tampered.is_set()
                assert any("failed authentication" in r.getMessage()
                           and (relay.address in r.getMessage() or relay.upstream_local in r.getMessage())
                           for r in caplog.records), [r.getMessage() for r in caplog.records]
                front.cancel_scope.cancel()
        tg.cancel_scope.cancel()


async def serve_until_lost(tg: anyio.abc.TaskGroup, tiny: Checkpoint, secret: DeploymentSecret, prefill: str,
                           relay: TamperingRelay) -> None:
    """Connect to the decode worker through the relay and serve short requests, with idle gaps
    (for pings), until it is lost (or, when the tampering hit its description or its pairing,
    until that fails and the loss follows)."""
    workers = [await RemoteWorker.connect(tg, prefill, secret, front_key=FRONT, timeout_s=TIMEOUT_S)]
    pair = None
    try:
        workers.append(await RemoteWorker.connect(tg, relay.address, secret, front_key=FRONT, timeout_s=TIMEOUT_S))
        for w in workers:
            check_worker(w, MODEL_ID, PAGE)
        pair = await pair_remote(*workers, PAGE, FRONT)
    except (WorkerLost, PairingRefused):
        pass
    if pair is not None:
        config = SchedulerConfig(page_size_tokens=PAGE, max_context_tokens=pair.max_context_tokens, chunk_tokens=8,
                                 disaggregated=True, transfer_timeout_s=5)
        scheduler = Scheduler(config, tiny.tokenizer, pair.prefill, pair.decode, prefill_pages=PAGES,
                              decode_pages=PAGES, link=pair.link)
        await scheduler.run(tg)

        async def load() -> None:
            while True:
                handle = scheduler.submit(list(range(20, 29)), SamplingParams(temperature=0, max_tokens=4,
                                                                              ignore_eos=True))
                async for _ in handle.deltas():
                    pass
                await anyio.sleep(TIMEOUT_S / 2)  # idle: the keep-alive pings

        async with anyio.create_task_group() as requests:
            requests.start_soon(load)
            await workers[1].lost.wait()
            requests.cancel_scope.cancel()
    if len(workers) == 2:  # else connecting to it failed: lost before it was ever used
        await workers[1].lost.wait()
    for w in workers:
        w.close()
