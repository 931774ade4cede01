"""The transport plugin interface: move KV pages from a prefill worker's pool into a decode worker's.

A transport endpoint belongs to one worker and registers that worker's whole KV pool (one
contiguous tensor; page i is bytes [i * page_nbytes, (i + 1) * page_nbytes)). Two endpoints pair
once, exchanging `PairingRecord`s; any difference in the fields that define the bytes refuses the
pair as a whole. After that the sender pushes lists of source pages into lists of destination
pages, each push described by a `TransferManifest`.

Peers are authenticated: every endpoint is constructed with the deployment's secret
(`secret=DeploymentSecret`, transports/core/secret.py) and the front end's public key
(`front_key=FrontPublicKey`, transports/core/front_key.py), and serves nothing to a peer that has
not proved it holds the same secret; the built-ins run the handshake of
transports/wire/handshake.py before any other byte.

Receiving is opt-in per transfer: the receiver `expect()`s a manifest and its destination pages
(decided by the server, never by the sender) before the push; bytes for a transfer that is not
expected, or no longer expected, are never written into the pool. The manifest carries a
capability the planner signed with the front end's key; the receiver refuses to arm, and refuses a
push, whose capability does not verify (with `front_key`) for its pages and the receiver's
incarnation. A transfer succeeds only on
positive proof: every page arrived, the manifest matches what was expected, and every page's
digest recomputed over the bytes that landed equals the sender's.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import msgspec
import torch
from anyio.abc import TaskGroup


class PairingRecord(msgspec.Struct, frozen=True):
    """What both ends must agree on; `compatible_with` names the first field that differs."""

    model: str  # model identity, e.g. "SmolLM2-135M-Instruct@<config hash>"
    dtype: str  # "float32", "bfloat16", ...
    page_size_tokens: int
    page_nbytes: int
    page_layout: str  # e.g. "pages,layers,kv,kv_heads,page_size,head_dim"
    digest: str  # page digest algorithm, e.g. "xxh3_64"
    max_context_tokens: int
    incarnation: str  # random per worker start; transfers never cross incarnations
    # how the prefix cache keys a page-aligned block (both pools of a transfer must key alike, or a
    # partial hit would skip pages the other side does not hold); "" where nothing is cached
    block_hash: str = ""

    def mismatch(self, other: PairingRecord) -> str | None:
        """The first field (other than limits and incarnation) that differs, or None."""
        for name in ("model", "dtype", "page_size_tokens", "page_nbytes", "page_layout", "digest", "block_hash"):
            if getattr(self, name) != getattr(other, name):
                return f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
        return None


class EndpointInfo(msgspec.Struct, frozen=True):
    """How to reach an endpoint; exchanged at pairing."""

    transport: str  # plugin name
    address: str  # transport-specific (e.g. "127.0.0.1:41234")
    record: PairingRecord


class TransferManifest(msgspec.Struct, frozen=True):
    """Describes one push. Ids are 128-bit, minted by the server, as 32 hex digits."""

    transfer_id: str
    lease: str  # the destination lease that owns dst pages
    nonce: str  # fresh per transfer; echoed in the completion
    num_tokens: int  # tokens of KV the pages hold
    num_pages: int
    digests: list[str] = []  # per source page, over the exact bytes sent ("" list when digest is "none")
    # Ed25519 signature (hex) over (transfer_id, lease, nonce, num_tokens, num_pages, dst pages, receiver incarnation)
    # with the front end's key, where the transfer is planned (transports/core/front_key.py).
    capability: str = ""


class TransferResult(msgspec.Struct, frozen=True):
    transfer_id: str
    ok: bool
    reason: str = ""  # why it failed: "digest_mismatch", "short_transfer", "cancelled", "peer_lost", ...


class PairingRefused(RuntimeError):
    """Two endpoints disagree on a field that defines the bytes; no transfer may use the pair."""


class TransportUnavailable(RuntimeError):
    """A transport plugin is not installed or cannot start; the message says how to install it."""


class Peer(abc.ABC):
    """A paired remote endpoint (returned by `Transport.pair`)."""

    info: EndpointInfo


class Transport(abc.ABC):
    """One worker's endpoint. All methods run on the event loop; none blocks it."""

    name: ClassVar[str]

    @abc.abstractmethod
    async def start(self, task_group: TaskGroup, memory: torch.Tensor, record: PairingRecord) -> EndpointInfo:
        """Register `memory` (the pool tensor, contiguous, pages along dim 0) and start serving.

        Long-lived tasks go into `task_group`; they end when `aclose()` is called."""

    @property
    @abc.abstractmethod
    def info(self) -> EndpointInfo:
        """What `start` returned (RuntimeError before it)."""

    @abc.abstractmethod
    async def pair(self, peer: EndpointInfo) -> Peer:
        """Exchange pairing records with `peer`; raise PairingRefused on any mismatch."""

    @abc.abstractmethod
    def expect(self, manifest: TransferManifest, dst_pages: list[int]) -> None:
        """Receiver side: allow exactly this transfer to land in `dst_pages`. ValueError when its
        capability does not verify (or the pages or id are unusable)."""

    @abc.abstractmethod
    async def completion(self, transfer_id: str) -> TransferResult:
        """Receiver side: wait until the expected transfer is verified (ok) or has failed."""

    @abc.abstractmethod
    async def push(self, peer: Peer, manifest: TransferManifest, src_pages: list[int],
                   dst_pages: list[int]) -> TransferResult:
        """Sender side: send the pages and return the receiver's verdict.

        When this returns (or raises, or is cancelled), the transport no longer reads `src_pages`."""

    @abc.abstractmethod
    async def cancel(self, transfer_id: str) -> bool:
        """Stop a transfer on this side. Returns True once acknowledged: no further read (sender)
        or write (receiver) of its pages can happen. False: not confirmed (pages must stay quarantined)."""

    async def wait_quiet(self, transfer_id: str) -> bool:
        """Sender side, after `cancel(transfer_id)` returned False: wait until nothing this
        endpoint started for the transfer can still read its pages or land in the peer's (True),
        or until that can no longer be learnt (False: the pages stay quarantined for good). The
        default never learns it."""
        return False

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the endpoint can move bytes."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop serving, drop registrations, close sockets; idempotent."""
