"""`MooncakeTransport`: KV pages by Mooncake transfer-engine batch WRITEs (P2PHANDSHAKE metadata;
the `tcp` protocol by default, `rdma` selectable with device names), paired and steered over a
small TCP control channel. The protocol is onesided/transport.py's; the byte moving, and what the
engine does and does not guarantee, is mooncake/plane.py's. Needs the Mooncake transfer engine
(pip install 'kvfence[mooncake]') and Debian's libibverbs1, librdmacm1 and libnuma1.

A Mooncake write carries no notification, so the sender tells the receiver "landed" on the
control channel only once every write is DONE: the manifest's completion can never overtake the
data it describes. Pools must be on the CPU (see nixl/transport.py for why staging does not apply).
"""

from __future__ import annotations

from typing import Any, ClassVar

# Imported here, not only when a plane opens, so that looking the transport up already fails (with
# the install hint, transports/registry.py) where the engine or its system libraries are missing.
import mooncake.engine  # noqa: F401

from kvfence.transports.core.front_key import FrontPublicKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.onesided.mooncake.plane import MooncakePlane
from kvfence.transports.onesided.transport import OneSidedTransport


class MooncakeTransport(OneSidedTransport):
    name: ClassVar[str] = "mooncake"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: DeploymentSecret,
                 front_key: FrontPublicKey, protocol: str = "tcp",
                 device_name: str = "", write_chunk_bytes: int = 64 << 20, **options: Any) -> None:
        """`host`/`port`: where the control channel listens (0: an ephemeral port); the engine is
        reached at `host` too. `protocol`: "tcp" or "rdma"; `device_name`: RDMA devices,
        comma-separated ("" for tcp). `cancel_ack_timeout_s`: how long `cancel` (and `aclose`)
        wait for writes in flight to end. `write_chunk_bytes`: the most one write moves (the engine
        copies in its own threads, so chunks only bound how much a cancel must wait for). `secret`
        and the other `options` (timeouts, keep-alive, connection cap): see OneSidedTransport."""
        super().__init__(MooncakePlane(protocol, device_name, host), host, port, secret=secret, front_key=front_key,
                         write_chunk_bytes=write_chunk_bytes, **options)
