"""Pairing the workers at start: the smaller context limit wins (FAILURES 3); a byte-defining
mismatch refuses the pair as a whole with one clear log line (FAILURES 18)."""

from __future__ import annotations

import logging

import anyio
import pytest
import torch

from front_keys import FRONT
from ports import free_port

from kvfence.app.serve.pairing import pair_workers, role_record
from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.kv_pool import KVPool
from kvfence.transports.base import PairingRefused
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.inprocess import InProcessHub

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pool(tiny: Checkpoint, num_pages: int, page_size: int = 4, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(tiny.config, num_pages, page_size, dtype)


async def test_the_pair_serves_the_smaller_limit_known_at_pairing(tiny: Checkpoint) -> None:
    prefill, decode = pool(tiny, 64), pool(tiny, 20)  # 256 and 80 tokens
    async with anyio.create_task_group() as tg:
        paired = await pair_workers(tg, "tcp", (prefill, role_record(prefill, "m", 200)),
                                    (decode, role_record(decode, "m", 200)), DeploymentSecret.generate(), FRONT)
        assert paired.max_context_tokens == 80
        assert paired.peer.info.record.max_context_tokens == 80
        for endpoint in paired.endpoints:
            await endpoint.aclose()


@pytest.mark.parametrize(("decode_kwargs", "field"), [
    ({"dtype": torch.bfloat16}, "dtype"),
    ({"page_size": 8}, "page_size_tokens"),
])
async def test_a_mismatch_refuses_the_pair_with_one_clear_line(
        tiny: Checkpoint, caplog: pytest.LogCaptureFixture, decode_kwargs: dict, field: str) -> None:
    prefill, decode = pool(tiny, 16), pool(tiny, 16, **decode_kwargs)
    caplog.set_level(logging.ERROR, logger="kvfence.app.serve.pairing")
    async with anyio.create_task_group() as tg:
        with pytest.raises(PairingRefused, match=field):
            await pair_workers(tg, "tcp", (prefill, role_record(prefill, "m", 64)),
                               (decode, role_record(decode, "m", 64)), DeploymentSecret.generate(), FRONT)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("pairing refused: prefill -> decode over tcp: ") and field in line
    assert "no request will be routed" in line


async def test_different_models_refuse_the_pair(tiny: Checkpoint) -> None:
    prefill, decode = pool(tiny, 16), pool(tiny, 16)
    async with anyio.create_task_group() as tg:
        with pytest.raises(PairingRefused, match="model"):
            await pair_workers(tg, "inprocess", (prefill, role_record(prefill, "tiny@1", 64)),
                               (decode, role_record(decode, "tiny@2", 64)), DeploymentSecret.generate(), FRONT,
                               options={"hub": InProcessHub()})




async def test_each_role_listens_where_its_options_say(tiny: Checkpoint) -> None:
    from kvfence.app.config.config import load_config

    port = free_port()  # outside the range the prefill endpoint's own port 0 is drawn from
    transport = load_config({"transport_decode_port": port}, {}, None).transport
    prefill, decode = pool(tiny, 16), pool(tiny, 16)
    async with anyio.create_task_group() as tg:
        paired = await pair_workers(tg, transport.name, (prefill, role_record(prefill, "m", 64)),
                                    (decode, role_record(decode, "m", 64)), DeploymentSecret.generate(), FRONT,
                                    role_options={r: transport.endpoint_options(r) for r in ("prefill", "decode")})
        assert paired.peer.info.address == f"127.0.0.1:{port}"
        for endpoint in paired.endpoints:
            await endpoint.aclose()
