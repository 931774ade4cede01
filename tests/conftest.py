"""Shared fixtures: the default model (fetched once into KVFENCE_HOME) and the reference cases."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest
import torch

from kvfence.app.config.environment import kernel_place, kvfence_home
from kvfence.engine.checkpoint import Checkpoint, load_checkpoint
from kvfence.engine.loading import checkpoint_cache
from kvfence.engine.known_models import resolve_model
from kvfence.kernels.cpu import library

DATA = Path(__file__).parent / "data"

library.use(kernel_place())  # the test process builds and switches its CPU kernels as `kvfence` commands do


@pytest.fixture
def keylog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A key log every connection sealed in this process writes to (transports/wire/handshake.py),
    for tests/tamper_relay.py's oracle."""
    path = tmp_path / "keylog"
    monkeypatch.setenv("KVFENCE_KEYLOG_FILE", str(path))
    return path


@pytest.fixture(scope="session", autouse=True)
def _torch_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def reference() -> dict:
    """Greedy references of the default model on which two independent engines agree."""
    return json.loads((DATA / "smollm2_greedy_public.json").read_text())


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return resolve_model(None, kvfence_home(), progress=False)


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M's GGUF, fetched once into KVFENCE_HOME (engine/known_models.py)."""
    from kvfence.engine.known_models import GEMMA3_270M

    return resolve_model(GEMMA3_270M.name, kvfence_home(), progress=False)


@pytest.fixture(scope="session")
def smollm2(default_model_path: Path) -> Checkpoint:
    return load_checkpoint(default_model_path, cache_dir=checkpoint_cache(kvfence_home()))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """A small random Llama (tests/tiny_models.py), loaded from its GGUF: fast, real weights."""
    from tiny_models import TinySpec, make_tiny_pair

    gguf_path, _, _ = make_tiny_pair(tmp_path_factory.mktemp("tiny"), seed=3, spec=TinySpec())
    return load_checkpoint(gguf_path)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group for a test's servers and endpoints, cancelled when the test ends."""
    async with anyio.create_task_group() as tg:
        yield tg
        tg.cancel_scope.cancel()
