"""A real NIXL data plane with a seam for tests: `WrappedNixlPlane` delegates every call to a
`NixlPlane`, so a test overrides only the call it changes (when a write is posted, what it
reads); `PlaneTransport` is a one-sided transport over any such plane."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from front_keys import FRONT

from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.onesided.data_plane import DataPlane, WriteState
from kvfence.transports.onesided.transport import OneSidedTransport


class WrappedNixlPlane(DataPlane):
    name: ClassVar[str] = "nixl"
    delivers_notifications: ClassVar[bool] = True

    def __init__(self) -> None:
        from kvfence.transports.onesided.nixl.plane import NixlPlane  # needs nixl: import where used

        self.inner = NixlPlane()

    def open(self, memory: torch.Tensor) -> bytes:
        return self.inner.open(memory)

    def connect(self, descriptor: bytes) -> str:
        return self.inner.connect(descriptor)

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        return self.inner.post_write(peer, ranges, notification)

    def state(self, handle: object) -> WriteState:
        return self.inner.state(handle)

    def release(self, handle: object) -> None:
        self.inner.release(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        return self.inner.notifications()

    def close(self) -> None:
        self.inner.close()


class PlaneTransport(OneSidedTransport):
    name: ClassVar[str] = "nixl"

    def __init__(self, plane: DataPlane, secret: DeploymentSecret, **options: Any) -> None:
        super().__init__(plane, secret=secret, front_key=FRONT.public, **options)
