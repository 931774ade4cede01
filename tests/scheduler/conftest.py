"""Fixtures shared by the scheduler tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest


@pytest.fixture
async def task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group for a test's servers and endpoints, cancelled when the test ends."""
    async with anyio.create_task_group() as tg:
        yield tg
        tg.cancel_scope.cancel()
