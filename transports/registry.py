"""Find a transport class by name: the built-ins, then plugins from the `kvfence.transports`
entry-point group.

Built-ins are imported lazily (only when asked for), so a missing optional dependency (nixl,
mooncake) only matters to whoever asks for that transport. Built-in names win over an entry point
of the same name. Every failure is a `TransportUnavailable` whose message says what to do.
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from kvfence.transports.base import Transport, TransportUnavailable

ENTRY_POINT_GROUP = "kvfence.transports"

_BUILTIN = (
    ("tcp", "kvfence.transports.tcp.transport:TcpTransport"),
    ("inprocess", "kvfence.transports.inprocess:InProcessTransport"),
    ("nixl", "kvfence.transports.onesided.nixl.transport:NixlTransport"),
    ("mooncake", "kvfence.transports.onesided.mooncake.transport:MooncakeTransport"),
)
_EXTRAS = ("nixl", "mooncake")  # built-ins that need an optional dependency: kvfence[<name>]


def _plugins() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_transports() -> list[str]:
    """Every name `transport_class` knows (installed or not), sorted."""
    return sorted({name for name, _ in _BUILTIN} | set(_plugins()))


def _install_hint(name: str, ep: EntryPoint | None) -> str:
    if ep is None and name in _EXTRAS:
        return f"install it with: pip install 'kvfence[{name}]'"
    if ep is not None:
        dist = f" ({ep.dist.name})" if ep.dist is not None else ""
        return f"check the installation of the plugin{dist} that provides entry point {ep.value!r}"
    return "this is a kvfence bug: a built-in transport failed to import"


def _load(name: str, target: str, ep: EntryPoint | None) -> Any:
    try:
        if ep is not None:
            return ep.load()
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise TransportUnavailable(
            f"transport {name!r} is not available ({type(e).__name__}: {e}); "
            f"{_install_hint(name, ep)}") from e


def transport_class(name: str) -> type[Transport]:
    """The `Transport` subclass registered as `name`.

    Raises TransportUnavailable: unknown name (the message lists the known ones), an import
    failure (with the install hint), or a target that is not a Transport subclass."""
    builtin = dict(_BUILTIN)
    ep = None
    if name in builtin:
        target = builtin[name]
    else:
        ep = _plugins().get(name)
        if ep is None:
            raise TransportUnavailable(
                f"unknown transport {name!r}; known transports: {', '.join(known_transports())}")
        target = ep.value
    cls = _load(name, target, ep)
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportUnavailable(f"transport {name!r} ({target}) is not a Transport subclass")
    return cls


def create_transport(name: str, /, **kwargs: Any) -> Transport:
    """`transport_class(name)(**kwargs)`; e.g. `create_transport("tcp", host="127.0.0.1")`."""
    return transport_class(name)(**kwargs)
