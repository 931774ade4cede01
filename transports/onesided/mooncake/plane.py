"""`MooncakePlane`: a `DataPlane` over the Mooncake transfer engine (`mooncake.engine`), P2P
handshake metadata (no etcd), protocol "tcp" (default) or "rdma".

Engine calls used, with what they return (mooncake-transfer-engine 0.3.13):
  initialize(local_hostname, "P2PHANDSHAKE", protocol, device_name) -> 0 | -1
      local_hostname is the bare host peers dial; the engine picks its own handshake RPC port
      (any ":port" suffix is ignored) and `get_rpc_port()` tells it. Peers name the engine by
      its session id "host:rpc_port". A separate data port is published over that handshake.
  register_memory(addr, nbytes) -> 0 | error;  unregister_memory(addr) -> 0 | error
  batch_transfer_async_write(session_id, [src_addr], [dst_addr], [nbytes]) -> batch id; 0 when
      nothing was started (peer unreachable at first contact, bad arguments). The first write to
      a session runs the handshake inline (a blocking RPC, ~5 ms on loopback).
  transfer_check_status(batch_id) -> 0 waiting | 1 completed | -1 failed | -2 slice timeout.
      Non-blocking. 1 and -1 free the batch: asking again is a use-after-free (segfault). -2
      (only with MC_SLICE_TIMEOUT set) leaves the batch in flight. It looks at the batch's FIRST
      entry only, so every range is posted as its own one-entry batch.
  Not used: get_batch_transfer_status (blocks, spinning, until the batches end or 30 s pass,
  and frees them), the sync and notify variants (they block).

What DONE and FAILED mean here. TCP (the acknowledged "v2" framing; MC_TCP_PROTO=1 turns it off
and must not be set): a write completes only after the receiving engine reports the payload
applied to its memory, so DONE is true. A write fails at once when the peer is gone (connection
refused/reset: nothing more can land), but also when the engine's own timers fire
(MC_TCP_PROGRESS_TIMEOUT_SEC, MC_TCP_STATUS_TIMEOUT_SEC, 30 s by default) against a peer that is
alive but stalled: the engine then closes its socket, yet bytes already in kernel buffers are
still applied when the peer resumes (measured: 3.9 MB landed after FAILED). A failure observed
sooner than the shortest of those timers after the post cannot be a timer's, so it is reported
FAILED; a later one cannot be told apart and stays PENDING for good (the pages it targets must
stay quarantined). RDMA is untested here (no device); the same rule applies.

What is registered, and why. The engine serves two ports of its own, beside kvfence's
authenticated pairing, and authenticates neither: its P2P handshake (bound to every interface)
answers anyone with the addresses of what is registered, and its data port reads and writes
whatever is registered for anyone who connects. Measured with a stock engine that holds no
secret: with the whole pool registered, it read and wrote any page. So over tcp, where the
sending engine needs nothing of its own memory registered, `open` registers nothing, and a
receiver `expose`s only a push's dst pages, from its "go" until the push ends; outside those
ranges the engine's server refuses every read and write (tests/transports/test_peer_auth.py,
test_mooncake_plane.py). What stays open is that window: a stranger who finds the ports while a
push is in flight can read or write that push's dst pages until it ends. A stray write fails
the transfer (the receiver conceals the pages, then recomputes their digests), unless it was
already under way when they were concealed and finishes after the recomputation. Over rdma the
NIC needs the whole pool registered, so the whole pool stays reachable: run it only on a network
that only the deployment reaches.

Lifetime: `close()` unregisters what is registered and drops the engine, whose destructor stops
its listeners and joins its threads (2-3 per engine): after the first engine of a process, open/close
cycles leave thread and file-descriptor counts unchanged. That takes 0.5-1 s with the GIL held, so
every Python thread (the event loop too, even if close runs in a worker thread) stalls that long:
close at shutdown, not on a hot path. After `close()` returns, nothing lands in the pool through
this plane. What stays for the process: the engine's allocator choice and glog setup (one fd).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, ClassVar, NamedTuple

import msgspec
import torch

from kvfence.transports.base import TransportUnavailable
from kvfence.transports.onesided.data_plane import DataPlane, WriteState

log = logging.getLogger(__name__)

# transfer_check_status results
_WAITING, _COMPLETED, _FAILED, _SLICE_TIMEOUT = 0, 1, -1, -2
_NOT_STARTED = (0, -1, (1 << 64) - 1)  # batch ids that mean "nothing was submitted"
_ENGINE_TIMER_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
_ENGINE_TIMER_DEFAULT_S = 30
PROTOCOLS = ("tcp", "rdma")


class MooncakeDescriptor(msgspec.Struct, frozen=True):
    """What `open` returns (msgpack): how a peer reaches this plane's registered pool."""

    session_id: str  # "host:rpc_port" of the engine's P2P handshake
    protocol: str
    base_address: int  # the pool's first byte in the owner's address space
    nbytes: int


class _Peer(NamedTuple):
    session_id: str
    base_address: int
    nbytes: int


class _Write:
    """One `post_write`: the engine batches still in flight and how the finished ones ended."""

    __slots__ = ("live", "posted_at", "failed", "unproven")

    def __init__(self, posted_at: float) -> None:
        self.live: list[int] = []  # batch ids not yet seen terminal; never polled once terminal
        self.posted_at = posted_at  # time.monotonic() just before the first submission
        self.failed = False  # some range did not fully land
        self.unproven = False  # a failure that an engine timer may have caused (see module doc)


class _Exposure:
    """The pool ranges one `expose` registered: their first bytes' addresses."""

    __slots__ = ("addresses",)

    def __init__(self) -> None:
        self.addresses: list[int] = []


def merge_ranges(ranges: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Sort `(src_offset, dst_offset, nbytes)` by source and coalesce neighbours that are
    contiguous in both source and destination (fewer engine batches, same bytes)."""
    merged: list[tuple[int, int, int]] = []
    for src, dst, nbytes in sorted(ranges):
        if merged:
            last_src, last_dst, last_n = merged[-1]
            if src == last_src + last_n and dst == last_dst + last_n:
                merged[-1] = (last_src, last_dst, last_n + nbytes)
                continue
        merged.append((src, dst, nbytes))
    return merged


def engine_timer_s() -> int:
    """The shortest engine timer after which a TCP write fails although the peer may still be
    applying its bytes. Read the way the engine reads it (atoi; unset or <= 0 means 30)."""
    values = []
    for name in _ENGINE_TIMER_ENV:
        try:
            value = int(os.environ.get(name, "").strip() or 0)
        except ValueError:  # the engine's atoi would take a numeric prefix; assume the worst
            value = 1
        values.append(value if value > 0 else _ENGINE_TIMER_DEFAULT_S)
    return min(values)


class MooncakePlane(DataPlane):
    """Moves bytes with Mooncake one-sided WRITEs. Every method returns without waiting for a
    transfer, except `close` (see module doc) and the first write to a session (handshake)."""

    name: ClassVar[str] = "mooncake"
    delivers_notifications: ClassVar[bool] = False  # async writes carry no notification

    def __init__(self, protocol: str = "tcp", device_name: str = "", hostname: str = "127.0.0.1",
                 *, trusted_failure_s: float | None = None) -> None:
        """`device_name`: comma-separated RDMA devices ("" = all / tcp). `hostname`: what peers
        dial to reach this engine. `trusted_failure_s`: a failure seen later than this after the
        post is not trusted to be final (default: the engine's shortest TCP timer)."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be one of {PROTOCOLS}, not {protocol!r}")
        if not hostname or ":" in hostname:
            raise ValueError(f"mooncake hostname must be a bare IPv4 address or name, not {hostname!r}")
        self.protocol, self.device_name, self.hostname = protocol, device_name, hostname
        self.trusted_failure_s = float(engine_timer_s() if trusted_failure_s is None else trusted_failure_s)
        self._engine: Any = None
        self.session_id = ""  # "host:rpc_port" once open
        self._memory: torch.Tensor | None = None  # held so the registered bytes outlive the registration
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._writes: set[_Write] = set()  # posted and not released
        self._exposed: set[_Exposure] = set()  # pool ranges registered for pushes in flight (tcp)

    def open(self, memory: torch.Tensor) -> bytes:
        if self._engine is not None or self._closed:
            raise RuntimeError("a mooncake plane opens once")
        if not memory.is_contiguous() or memory.nbytes == 0:
            raise ValueError("the pool must be a contiguous, non-empty tensor")
        try:
            from mooncake import engine as mooncake_engine
        except ImportError as e:
            raise TransportUnavailable("mooncake is not installed; install it with: "
                                       "pip install 'kvfence[mooncake]'") from e
        if memory.device.type != "cpu" and not getattr(mooncake_engine, "SUPPORT_CUDA", False):
            # this build would treat a device pointer as host memory
            raise TransportUnavailable(f"this mooncake build cannot move {memory.device} memory; "
                                       "install the CUDA build: pip install mooncake-transfer-engine")
        engine = mooncake_engine.TransferEngine()
        if engine.initialize(self.hostname, "P2PHANDSHAKE", self.protocol, self.device_name) != 0:
            raise TransportUnavailable(f"mooncake engine did not start ({self.protocol} on "
                                       f"{self.hostname!r}, devices {self.device_name!r})")
        if self.protocol != "tcp":
            if (rc := engine.register_memory(memory.data_ptr(), memory.nbytes)) != 0:
                raise TransportUnavailable(f"mooncake could not register {memory.nbytes} bytes: {rc}")
            log.warning("mooncake over %s: the whole KV pool stays registered with an engine whose own ports "
                        "authenticate no one; only a network that only this deployment reaches keeps other "
                        "processes from its pages (over tcp, only the pages of a transfer in flight are)",
                        self.protocol)
        self._engine, self._memory = engine, memory
        self.session_id = f"{self.hostname}:{engine.get_rpc_port()}"
        return msgspec.msgpack.encode(MooncakeDescriptor(session_id=self.session_id, protocol=self.protocol,
                                                         base_address=memory.data_ptr(), nbytes=memory.nbytes))

    def expose(self, ranges: list[tuple[int, int]]) -> object:
        """Over tcp: register each `(offset, nbytes)` of the pool (contiguous ones as one) until
        `conceal`; the engine's server refuses any write or read outside what is registered.
        Over rdma the whole pool is registered at `open` (the NIC needs it): None."""
        if self._engine is None or self._memory is None:
            raise RuntimeError("mooncake plane is not open")
        if self.protocol != "tcp":
            return None
        merged = merge_ranges([(off, off, nbytes) for off, nbytes in ranges])
        self._check_ranges(merged, self._memory.nbytes, self._memory.nbytes)
        exposure, base = _Exposure(), self._memory.data_ptr()
        for off, _, nbytes in merged:
            if (rc := self._engine.register_memory(base + off, nbytes)) != 0:
                self.conceal(exposure)
                raise RuntimeError(f"mooncake could not register pool bytes {off}..{off + nbytes}: {rc}")
            exposure.addresses.append(base + off)
        self._exposed.add(exposure)
        return exposure

    def conceal(self, exposure: object) -> None:
        if not isinstance(exposure, _Exposure) or self._engine is None:
            return
        for address in exposure.addresses:
            self._engine.unregister_memory(address)
        exposure.addresses = []
        self._exposed.discard(exposure)

    def connect(self, descriptor: bytes) -> str:
        """Remember a peer; no I/O (the handshake happens on the first write). The key is the
        peer's session id; connecting again replaces what was known (a re-registered pool)."""
        if self._engine is None:
            raise RuntimeError("mooncake plane is not open")
        desc = msgspec.msgpack.decode(descriptor, type=MooncakeDescriptor)
        if desc.protocol != self.protocol:
            raise ValueError(f"peer {desc.session_id} speaks {desc.protocol!r}, this plane {self.protocol!r}")
        self._peers[desc.session_id] = _Peer(desc.session_id, desc.base_address, desc.nbytes)
        return desc.session_id

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        """One engine batch per merged range. `notification` is not carried (see
        `delivers_notifications`). ValueError on bad ranges, ConnectionError when the peer cannot
        be reached at first contact; both mean nothing was started. If a later range fails to
        post, the ranges already started keep going and the write ends FAILED. No ranges: DONE."""
        if self._engine is None or self._memory is None:
            raise RuntimeError("mooncake plane is not open")
        target = self._peers.get(peer)
        if target is None:
            raise KeyError(f"unknown peer {peer!r}: connect() it first")
        merged = merge_ranges(ranges)
        self._check_ranges(merged, self._memory.nbytes, target.nbytes)
        src_base = self._memory.data_ptr()
        write = _Write(time.monotonic())
        for i, (src, dst, nbytes) in enumerate(merged):
            batch_id = self._engine.batch_transfer_async_write(
                target.session_id, [src_base + src], [target.base_address + dst], [nbytes])
            if batch_id in _NOT_STARTED:
                if i == 0:
                    raise ConnectionError(f"mooncake could not start a write to {peer}")
                write.failed = True  # nothing of this or later ranges was started
                break
            write.live.append(batch_id)
        self._writes.add(write)
        return write

    @staticmethod
    def _check_ranges(merged: list[tuple[int, int, int]], src_nbytes: int, dst_nbytes: int) -> None:
        end = 0
        for src, dst, nbytes in sorted(merged, key=lambda r: r[1]):
            if nbytes <= 0 or src < 0 or src + nbytes > src_nbytes or dst < 0 or dst + nbytes > dst_nbytes:
                raise ValueError(f"range (src={src}, dst={dst}, nbytes={nbytes}) is empty or outside "
                                 f"the pools ({src_nbytes} local, {dst_nbytes} remote bytes)")
            if dst < end:
                raise ValueError(f"destination ranges overlap at offset {dst}")
            end = dst + nbytes

    def state(self, handle: object) -> WriteState:
        """Polls the engine. Poll often: a failure first seen `trusted_failure_s` or more after
        the post is indistinguishable from an engine timeout, so it stays PENDING."""
        write = self._known(handle)
        if write.live:
            self._poll(write)
        if write.live or write.unproven:
            return WriteState.PENDING
        return WriteState.FAILED if write.failed else WriteState.DONE

    def _poll(self, write: _Write) -> None:
        still: list[int] = []
        for batch_id in write.live:
            code = self._engine.transfer_check_status(batch_id)
            if code == _COMPLETED:
                continue  # the engine freed the batch: never ask about it again
            if code == _FAILED:
                write.failed = True
                if time.monotonic() - write.posted_at >= self.trusted_failure_s:
                    write.unproven = True
                continue
            still.append(batch_id)  # waiting, or a slice timeout (a warning; still in flight)
        write.live = still

    def release(self, handle: object) -> None:
        """Forget a terminal handle (again: no-op). RuntimeError for a PENDING one."""
        if not isinstance(handle, _Write) or handle not in self._writes:
            return
        if self.state(handle) is WriteState.PENDING:
            raise RuntimeError("releasing a pending mooncake write: its bytes could still land")
        self._writes.discard(handle)

    def _known(self, handle: object) -> _Write:
        if not isinstance(handle, _Write) or handle not in self._writes:
            raise KeyError("not a live handle of this mooncake plane (released, or another plane's)")
        return handle

    def close(self) -> None:
        """Unregister the pool and drop the engine; idempotent. RuntimeError (and the plane stays
        open) while an engine batch is in flight: tearing the engine down under it could neither
        stop its bytes nor keep the engine's bookkeeping alive. Writes left PENDING because
        their failure is unproven do not hold `close` up; they stay PENDING."""
        if self._engine is None:
            self._closed = True
            return
        for write in self._writes:
            if write.live:
                self._poll(write)
        if busy := sum(1 for w in self._writes if w.live):
            raise RuntimeError(f"mooncake plane has {busy} writes in flight; close after they end")
        assert self._memory is not None
        for exposure in list(self._exposed):
            self.conceal(exposure)
        if self.protocol != "tcp":
            self._engine.unregister_memory(self._memory.data_ptr())
        self._engine, self._memory, self._closed = None, None, True  # destructor joins the threads
        self._peers.clear()
