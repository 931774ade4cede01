"""`NixlPlane`: a `DataPlane` over NIXL (nixl 1.5.1, `nixl._api`), UCX backend.

One NIXL agent per plane, created by `open`, named "kvfence-<pid>-<random>": NIXL keys remote
metadata by agent name, does not stop two agents (even in one process) from sharing a name (a
peer could then not tell them apart), and refuses to load metadata bearing the loading agent's
own name; so names must be unique across the deployment, not only in the process. `open` registers the pool tensor as it is: DRAM for a CPU
tensor, VRAM for a CUDA one (the GPU path: NIXL writes device memory directly, no staging). The
descriptor is the agent's metadata plus the registered region (base address, size, device id,
memory type); `connect` loads it (`add_remote_agent`), `post_write` is `initialize_xfer("WRITE",
local descs, remote descs, peer, notification)` + `transfer`, `state` is `check_xfer_state`,
`notifications` is `get_new_notifs`.

What this machine showed (CPU only, loopback, no UCX_* variables needed):
  - UCX picks `cma` (process_vm_writev) for the put and `tcp` over loopback for the notification.
    The copy runs inside the NIXL call that progresses the write (`transfer` or
    `check_xfer_state`): ~2.5 GB/s, so 256 MiB holds the calling thread ~100 ms; the transport
    therefore posts writes of bounded size (`write_chunk_bytes`).
  - A write reaches DONE only after UCX flushed it to the target, and the notification is sent
    after that flush (it cannot overtake the data), from inside `check_xfer_state`: the writer
    must keep polling for the notification to leave. The flush needs the *target* agent to make
    progress too: with no progress thread, a write stays PENDING until the receiver calls
    `get_new_notifs` (which progresses its worker). So a receiver must poll `notifications()`
    while it expects writes.
  - NIXL's progress thread (`enable_prog_thread`, its default) busy-polls: ~20% of a core per idle
    agent. It is off here; the transport's poller does the progress, and only while something is
    in flight.
  - A failure surfaces as an exception from `check_xfer_state` (nixlRemoteDisconnectError when
    the target agent is gone, nixlNotFoundError when its metadata was removed), not as "ERR";
    both end the write: FAILED. A post into an unregistered range raises from `initialize_xfer`
    (nothing started); ranges are checked here first.
  - Closing a plane does not fence off its memory: a peer that has not noticed the disconnect
    yet (tens of ms on loopback) can still complete a write into it while it stays mapped (cma
    needs no registration). The transport writes only after the receiver's "go" and never relies
    on deregistration; once noticed, posts raise nixlRemoteDisconnectError.
  - An xfer handle keeps its agent alive: only when every handle is released and dropped does
    the agent go, and with it its threads (UCX's async thread) and ~18 file descriptors per agent.
  - With Debian's libibverbs installed (the mooncake transport needs it) but no RDMA device, UCX's
    InfiniBand module loads a second copy of libnl-route next to the one bundled with nixl, and
    its destructor crashes the process at exit (SIGSEGV in rtnl_tc_unregister, after Python
    finished). So where the host has no RDMA device, `open` tells UCX not to load that module
    (`UCX_MODULES=^ib`, unless the operator set UCX_MODULES): it could find nothing to use anyway.
  - UCX's tcp transport listens on ports of its own, beside the authenticated pairing, on every
    interface it may use (here: loopback and the host's external address), and authenticates no
    peer: a process holding the agent metadata, which never paired, writes and reads the pool
    through it (tests/transports/test_ucx_stranger.py). The metadata (worker address, remote keys)
    travels only inside the sealed pairing; whether it can be forged without it is not established. So `open`
    keeps UCX to the interface of the endpoint's host (UCX_NET_DEVICES while the agent is
    created, unless the operator set it), as every other socket of the endpoint is.
  - Importing nixl configures a "nixl" logger that prints INFO lines to stdout (NIXL_LOG_LEVEL
    tunes it) and sets `logging.raiseExceptions = False` for the whole process; the C++ core logs
    errors to stderr.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from kvfence.transports.base import TransportUnavailable
from kvfence.transports.onesided.data_plane import DataPlane, WriteState

log = logging.getLogger(__name__)
RDMA_DEVICES = Path("/sys/class/infiniband")
_SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address


def interface_addresses() -> dict[str, str]:
    """Every network interface here that has an IPv4 address: name -> its (primary) address."""
    out = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        out[name] = socket.inet_ntoa(packed[20:24])
    return out


def interface_of(host: str) -> str | None:
    """The network interface whose IPv4 address `host` is (or resolves to); None when no
    interface here holds it."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    return next((name for name, held in interface_addresses().items() if held == address), None)


@contextlib.contextmanager
def ucx_kept_to(host: str) -> Iterator[None]:
    """UCX's tcp transport listens on every interface it may use, on ports of its own, beside the
    authenticated pairing; while an agent is created (UCX reads its settings then), keep it to the
    interface of the endpoint's host, as every other socket of the endpoint is (UCX_NET_DEVICES,
    restored afterwards so that no child process inherits it). An operator's own
    UCX_NET_DEVICES, or an endpoint that listens everywhere itself, is left alone; a host no
    interface here holds restricts nothing (logged)."""
    interface = None
    if "UCX_NET_DEVICES" not in os.environ and host not in ("0.0.0.0", ""):
        interface = interface_of(host)
        if interface is None:
            log.warning("no network interface here holds %r: UCX may listen on every interface", host)
    if interface is None:
        yield
        return
    os.environ["UCX_NET_DEVICES"] = interface
    try:
        yield
    finally:
        del os.environ["UCX_NET_DEVICES"]


def skip_ucx_ib_without_rdma_devices() -> None:
    """Keep UCX from loading its InfiniBand module on a host without RDMA devices (module docstring:
    it would crash the process at exit). An operator's own UCX_MODULES is left alone."""
    if "UCX_MODULES" not in os.environ and not (RDMA_DEVICES.is_dir() and any(RDMA_DEVICES.iterdir())):
        os.environ["UCX_MODULES"] = "^ib"


class NixlDescriptor(msgspec.Struct, frozen=True):
    """What `open` returns (msgpack): how a peer writes into this plane's registered pool."""

    agent: str
    metadata: bytes  # nixl_agent.get_agent_metadata()
    base_address: int
    nbytes: int
    device_id: int  # 0 for DRAM
    mem_type: str  # "DRAM" or "VRAM"


class _Write:
    """One `post_write`: the NIXL xfer handle until released, and the last state seen."""

    __slots__ = ("xfer", "state")

    def __init__(self, xfer: Any, state: WriteState) -> None:
        self.xfer: Any = xfer  # nixl's xfer handle (nixl ships no types); None once released
        self.state = state


class NixlPlane(DataPlane):
    """Moves bytes with NIXL WRITEs; every method returns without waiting for a transfer (but see
    the module docstring: on a CPU loopback the copy itself runs inside `post_write` / `state`)."""

    name: ClassVar[str] = "nixl"
    delivers_notifications: ClassVar[bool] = True

    def __init__(self, backend: str = "UCX", hostname: str = "127.0.0.1") -> None:
        """`hostname`: the endpoint's host; UCX's own listeners stay on its interface."""
        self.backend, self.hostname = backend, hostname
        self.agent_name = ""
        self._agent: nixl_agent | None = None
        self._registration: object | None = None
        self._memory: torch.Tensor | None = None  # held so the registered bytes outlive the registration
        self._region: NixlDescriptor | None = None
        self._peers: dict[str, NixlDescriptor] = {}
        self._writes: set[_Write] = set()  # posted and not released
        self._closed = False

    def open(self, memory: torch.Tensor) -> bytes:
        """Create the agent and register `memory`. TransportUnavailable when the backend does
        not start or the memory cannot be registered. Blocks the caller ~30 ms here (the first
        agent of a process ~0.4 s: UCX loads its transports): once per endpoint, at start."""
        if self._agent is not None or self._closed:
            raise RuntimeError("a nixl plane opens once")
        if not memory.is_contiguous() or memory.nbytes == 0:
            raise ValueError("the pool must be a contiguous, non-empty tensor")
        skip_ucx_ib_without_rdma_devices()
        self.agent_name = f"kvfence-{os.getpid()}-{secrets.token_hex(8)}"
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[self.backend])
        with ucx_kept_to(self.hostname):
            agent = nixl_agent(self.agent_name, config)
        if self.backend not in agent.backends:
            raise TransportUnavailable(f"the NIXL {self.backend} backend did not start "
                                       f"(plugins found: {', '.join(agent.get_plugin_list()) or 'none'})")
        try:
            self._registration = agent.register_memory(memory)
        except Exception as e:
            raise TransportUnavailable(f"NIXL could not register {memory.nbytes} bytes on {memory.device}: {e}") from e
        on_host = memory.device.type == "cpu"
        self._agent, self._memory = agent, memory
        self._region = NixlDescriptor(agent=self.agent_name, metadata=agent.get_agent_metadata(),
                                      base_address=memory.data_ptr(), nbytes=memory.nbytes,
                                      device_id=0 if on_host else memory.get_device(),
                                      mem_type="DRAM" if on_host else "VRAM")
        return msgspec.msgpack.encode(self._region)

    def connect(self, descriptor: bytes) -> str:
        """Load a peer's metadata (again: reloads it); the key is its agent name. ValueError for
        a descriptor that is not a NIXL plane's."""
        agent = self._open()
        try:
            peer = msgspec.msgpack.decode(descriptor, type=NixlDescriptor)
        except msgspec.DecodeError as e:
            raise ValueError(f"not a nixl plane descriptor: {e}") from e
        if peer.agent != self.agent_name:  # a loopback write names this agent; NIXL loads nothing for it
            loaded = agent.add_remote_agent(peer.metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != peer.agent:
                raise ValueError(f"the descriptor names agent {peer.agent!r}, its metadata {name!r}")
        self._peers[peer.agent] = peer
        return peer.agent

    def post_write(self, peer: str, ranges: list[tuple[int, int, int]], notification: bytes) -> object:
        """One NIXL WRITE of every range. KeyError: unknown peer; ValueError: a range outside
        either pool; RuntimeError (or NIXL's error): the post failed. Any raise: nothing started."""
        agent, local = self._open(), self._region
        assert local is not None
        remote = self._peers.get(peer)
        if remote is None:
            raise KeyError(f"unknown peer {peer!r}: connect() it first")
        if not ranges:
            raise ValueError("a write needs at least one range")
        for src, dst, nbytes in ranges:
            if nbytes <= 0 or src < 0 or dst < 0 or src + nbytes > local.nbytes or dst + nbytes > remote.nbytes:
                raise ValueError(f"range (src={src}, dst={dst}, nbytes={nbytes}) is empty or outside the pools "
                                 f"({local.nbytes} local, {remote.nbytes} remote bytes)")
        spans = np.array(ranges, dtype=np.uint64)  # (n, 3): src_offset, dst_offset, nbytes
        src_descs = np.stack([spans[:, 0] + np.uint64(local.base_address), spans[:, 2],
                              np.full(len(spans), local.device_id, dtype=np.uint64)], axis=1)
        dst_descs = np.stack([spans[:, 1] + np.uint64(remote.base_address), spans[:, 2],
                              np.full(len(spans), remote.device_id, dtype=np.uint64)], axis=1)
        xfer = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src_descs, local.mem_type),
                                     agent.get_xfer_descs(dst_descs, remote.mem_type), peer, notification)
        try:
            status = agent.transfer(xfer)
        except BaseException:
            xfer.release()
            raise
        if status == "ERR":
            xfer.release()
            raise RuntimeError(f"NIXL refused to post a write to {peer}")
        write = _Write(xfer, WriteState.DONE if status == "DONE" else WriteState.PENDING)
        self._writes.add(write)
        return write

    def state(self, handle: object) -> WriteState:
        """Asks NIXL while PENDING (which also progresses the write); a terminal state sticks."""
        write = self._known(handle)
        if write.state is WriteState.PENDING:
            try:
                status = self._open().check_xfer_state(write.xfer)
            except Exception as e:  # NIXL reports a dead peer or a dropped one by raising
                log.warning("nixl write to a peer failed: %s: %s", type(e).__name__, e)
                status = "ERR"
            if status != "PROC":
                write.state = WriteState.DONE if status == "DONE" else WriteState.FAILED
        return write.state

    def release(self, handle: object) -> None:
        """Free a terminal write's handle (again: no-op). RuntimeError for a PENDING one."""
        if not isinstance(handle, _Write) or handle not in self._writes:
            return
        if handle.state is WriteState.PENDING:
            raise RuntimeError("releasing a pending nixl write: its bytes could still land")
        self._writes.discard(handle)
        self._drop(handle)

    def notifications(self) -> list[tuple[str, bytes]]:
        """New notifications, by sending agent; also progresses this agent (see module doc)."""
        if self._agent is None:
            return []
        try:
            notes = self._agent.get_new_notifs()
        except Exception as e:  # a broken connection surfaces here too; the writes report it
            log.warning("nixl notifications failed: %s: %s", type(e).__name__, e)
            return []
        return [(peer, note) for peer, items in notes.items() for note in items]

    def close(self) -> None:
        """Release every handle (a PENDING one is aborted by NIXL if it can be), drop the peers,
        deregister the pool and destroy the agent; idempotent."""
        agent, self._agent, self._closed = self._agent, None, True
        if agent is None:
            return
        for write in self._writes:
            self._drop(write)
        self._writes.clear()
        for peer in self._peers:
            if peer != self.agent_name:
                try:
                    agent.remove_remote_agent(peer)
                except Exception:
                    log.exception("removing nixl peer %s failed", peer)
        self._peers.clear()
        try:
            agent.deregister_memory(self._registration)
        except Exception:
            log.exception("deregistering the pool from nixl failed")
        self._registration = self._memory = self._region = None

    def _open(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError("nixl plane is not open")
        return self._agent

    def _known(self, handle: object) -> _Write:
        if not isinstance(handle, _Write) or handle not in self._writes:
            raise KeyError("not a live handle of this nixl plane (released, or another plane's)")
        return handle

    @staticmethod
    def _drop(write: _Write) -> None:
        """Release the xfer handle and forget it: a handle left referenced keeps its agent alive."""
        xfer, write.xfer = write.xfer, None
        if xfer is not None:
            try:
                xfer.release()
            except Exception:
                log.exception("releasing a nixl xfer handle failed")
