"""Where a front end finds its workers when they run in their own processes (`--discovery`).

`static://HOST:PORT,HOST:PORT`: a fixed list of control addresses (app/remote/server.py); each
worker says its role when the front end connects. `etcd://HOST:PORT`: the etcd the workers
register in (app/remote/membership.py). Parsed here, before anything starts, so a bad
value is an error that names the flag.
"""

from __future__ import annotations

import dataclasses

from kvfence.transports.wire.channel import split_address

SCHEMES = ("static", "etcd")


@dataclasses.dataclass(frozen=True)
class Discovery:
    scheme: str
    addresses: tuple[str, ...]  # static: the workers' control addresses; etcd: its client address

    @property
    def etcd(self) -> tuple[str, int] | None:
        """etcd's host and port, for the etcd scheme."""
        return split_address(self.addresses[0]) if self.scheme == "etcd" else None


def parse_discovery(text: str) -> Discovery:
    """ValueError naming --discovery for anything that is not a known scheme with addresses."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"--discovery must be {' or '.join(s + '://...' for s in SCHEMES)}, got {text!r}")
    addresses = tuple(a.strip() for a in rest.split(",") if a.strip())
    if not addresses:
        raise ValueError(f"--discovery {text!r} names no worker (static://HOST:PORT,HOST:PORT)")
    if scheme == "etcd" and len(addresses) != 1:
        raise ValueError(f"--discovery {text!r}: name one etcd endpoint (etcd://HOST:PORT)")
    for address in addresses:
        try:
            split_address(address)
        except ValueError as e:
            raise ValueError(f"--discovery: {e}") from None
    return Discovery(scheme, addresses)
