"""`NixlTransport`: KV pages by NIXL one-sided WRITEs (UCX), paired and steered over a small TCP
control channel. The protocol is onesided/transport.py's; the byte moving, and what NIXL does on
this kind of machine, is nixl/plane.py's. Needs the `nixl` package: pip install 'kvfence[nixl]'.

Pools must be on the CPU for now (onesided/transport.py says why); `stage_through_host` is not offered: the
staged path's host buffers are allocated per transfer, after pairing, while a one-sided write can
only target memory the writer learnt about when it paired, and a GPU pool would be registered with
NIXL directly rather than staged.
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.onesided.nixl.plane import NixlPlane
from kvfence.transports.onesided.transport import OneSidedTransport


class NixlTransport(OneSidedTransport):
    name: ClassVar[str] = "nixl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: DeploymentSecret,
                 front_key: FrontPublicKey, backend: str = "UCX",
                 **options: Any) -> None:
        """`host`/`port`: where the control channel listens (0: an ephemeral port).
        `cancel_ack_timeout_s`: how long `cancel` (and `aclose`) wait for writes in flight to end.
        `write_chunk_bytes`: the most one write moves (see OneSidedTransport). `backend`: the NIXL
        backend plugin. `secret` and the other `options` (timeouts, keep-alive, connection cap,
        write chunks): see OneSidedTransport."""
        super().__init__(NixlPlane(backend, host), host, port, secret=secret, front_key=front_key, **options)
