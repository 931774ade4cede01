"""FAILURES 20 on the production digest path, through the scheduler: one byte of a page is
flipped after the sender computed its digest — on the wire (a tcp relay between the two
endpoints) or in the source memory a one-sided WRITE is reading (a NIXL plane that flips it at
post time) — and the receiver's digest over what landed catches it: the request fails closed
with no token, and the next request is served exactly."""

from __future__ import annotations

import importlib.util
import socket
import threading

import anyio
import pytest
import torch
from nixl_planes import PlaneTransport, WrappedNixlPlane
from serving_harness import start_serving_over, wait_idle

from kvfence.engine.checkpoint import Checkpoint
from kvfence.engine.sampling import SamplingParams
from kvfence.scheduler.config import SchedulerConfig
from kvfence.transports.base import EndpointInfo
from kvfence.transports.core.secret import MAC_BYTES, NONCE_BYTES, DeploymentSecret
from kvfence.transports.onesided.data_plane import WriteState
from kvfence.transports.tcp.transport import TcpTransport
from kvfence.transports.tcp.wire import Frame
from kvfence.transports.wire.channel import split_address
from kvfence.transports.wire.framing import LEN_SIZE, decode_frame, frame_length
from kvfence.transports.wire.handshake import MAGIC
from kvfence.transports.wire.messages import Page, PushHeader

pytestmark = pytest.mark.anyio
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
CONFIG = SchedulerConfig(page_size_tokens=4, max_context_tokens=64, chunk_tokens=16, disaggregated=True,
                         transfer_timeout_s=5)


async def outcome(scheduler, prompt=PROMPT):  # type: ignore[no-untyped-def]
    ids, last = [], None
    async for d in scheduler.submit(prompt, GREEDY).deltas():
        ids += d.token_ids
        last = d
    return ids, last.finish_reason, last.error.code if last.error else None


class FlippingRelay:
    """A TCP relay between a sender and its receiver that flips one byte of the first page of
    the `flip_push`-th push it carries (the n-th push header seen), and passes everything else."""

    def __init__(self, target: str, flip_push: int) -> None:
        self.target, self.flip_push = target, flip_push
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.flipped = 0

    def serve_one(self) -> None:  # blocking, in a thread
        conn, _ = self.listener.accept()
        upstream = socket.create_connection(split_address(self.target))
        back = threading.Thread(target=self._pipe, args=(upstream, conn), daemon=True)
        back.start()
        with conn, upstream:
            self._forward(conn, upstream)
        back.join(timeout=5)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _read(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise ConnectionResetError
            data += chunk
        return data

    def _forward(self, conn: socket.socket, upstream: socket.socket) -> None:
        """Sender -> receiver: the handshake as it is, then frame by frame, page bytes raw."""
        try:
            upstream.sendall(self._read(conn, len(MAGIC) + NONCE_BYTES))
            upstream.sendall(self._read(conn, MAC_BYTES))
            pushes, page_nbytes = 0, 0
            while True:
                prefix = self._read(conn, LEN_SIZE)
                body = self._read(conn, frame_length(prefix))
                upstream.sendall(prefix + body)
                frame = decode_frame(body, Frame)
                if isinstance(frame, PushHeader):
                    pushes, page_nbytes = pushes + 1, frame.page_nbytes
                elif isinstance(frame, Page):
                    page = bytearray(self._read(conn, page_nbytes))
                    if pushes == self.flip_push and frame.index == 0:
                        page[page_nbytes // 3] ^= 0x01  # after the sender hashed what it sent
                        self.flipped += 1
                    upstream.sendall(page)
        except (OSError, ConnectionResetError):
            pass


async def test_a_byte_flipped_on_the_wire_is_caught_by_the_receivers_digest(tiny: Checkpoint) -> None:
    secret = DeploymentSecret.generate()
    sender, receiver = TcpTransport(secret=secret), TcpTransport(secret=secret)
    relays: list[FlippingRelay] = []

    def via_relay(info: EndpointInfo) -> EndpointInfo:
        relays.append(FlippingRelay(info.address, flip_push=2))
        return EndpointInfo(info.transport, relays[-1].address, info.record)

    async with anyio.create_task_group() as tg:
        async def relay_soon(info: EndpointInfo) -> EndpointInfo:
            routed = via_relay(info)
            tg.start_soon(anyio.to_thread.run_sync, relays[-1].serve_one)
            return routed

        s = await start_serving_over(tg, tiny, CONFIG, 64, sender, receiver, secret, route=relay_soon)
        want, reason, error = await outcome(s.scheduler)
        assert (reason, error) == ("length", None) and len(want) == 4
        with anyio.fail_after(10):
            ids, reason, error = await outcome(s.scheduler)
        assert (ids, reason, error) == ([], None, "kv_transfer_failed")  # no token, never `length`
        assert relays[0].flipped == 1
        assert await outcome(s.scheduler) == (want, "length", None)  # the pair carries on
        await wait_idle(s.scheduler)
        await s.aclose()
        relays[0].listener.close()
        tg.cancel_scope.cancel()


class FlippingPlane(WrappedNixlPlane):
    """A real NIXL plane that flips one byte of the source range of its `flip_write`-th write
    right as it posts it (after the sender's digests were computed), restoring it once DONE."""

    def __init__(self, flip_write: int) -> None:
        super().__init__()
        self.flip_write, self.posts, self.flipped = flip_write, 0, 0
        self.memory: torch.Tensor | None = None
        self.restore: dict[int, int] = {}  # id(handle) -> offset to flip back

    def open(self, memory: torch.Tensor) -> bytes:
        self.memory = memory.reshape(-1).view(torch.uint8)
        return super().open(memory)

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        assert self.memory is not None
        self.posts += 1
        offset = None
        if self.posts == self.flip_write:
            offset = ranges[0][0] + ranges[0][2] // 3
            self.memory[offset] ^= 1
            self.flipped += 1
        handle = super().post_write(peer, ranges, notification)
        if offset is not None:
            self.restore[id(handle)] = offset
        return handle

    def state(self, handle: object) -> WriteState:
        state = super().state(handle)
        if state is not WriteState.PENDING and (offset := self.restore.pop(id(handle), None)) is not None:
            assert self.memory is not None
            self.memory[offset] ^= 1
        return state


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")
async def test_a_byte_flipped_under_a_one_sided_write_is_caught_by_the_receivers_digest(tiny: Checkpoint) -> None:
    secret = DeploymentSecret.generate()
    plane = FlippingPlane(flip_write=2)
    async with anyio.create_task_group() as tg:
        s = await start_serving_over(tg, tiny, CONFIG, 64, PlaneTransport(plane, secret),
                                     PlaneTransport(WrappedNixlPlane(), secret), secret)
        want, reason, error = await outcome(s.scheduler)
        assert (reason, error) == ("length", None) and len(want) == 4
        with anyio.fail_after(10):
            assert await outcome(s.scheduler) == ([], None, "kv_transfer_failed")
        assert plane.flipped == 1
        assert await outcome(s.scheduler) == (want, "length", None)
        await wait_idle(s.scheduler)
        await s.aclose()
        tg.cancel_scope.cancel()
