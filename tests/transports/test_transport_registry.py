"""The transport registry: built-ins, entry-point plugins, and the errors that say what to do."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint

import pytest

from kvfence.transports import registry
from kvfence.transports.base import TransportUnavailable
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret
from kvfence.transports.inprocess import InProcessHub, InProcessTransport
from kvfence.transports.tcp.transport import TcpTransport


def test_builtins_resolve_and_create() -> None:
    assert registry.transport_class("tcp") is TcpTransport
    assert registry.transport_class("inprocess") is InProcessTransport
    credentials = {"secret": DeploymentSecret.generate(), "front_key": FrontKey.generate().public}
    assert isinstance(registry.create_transport("tcp", host="127.0.0.1", **credentials), TcpTransport)
    assert isinstance(registry.create_transport("inprocess", hub=InProcessHub(), **credentials), InProcessTransport)
    with pytest.raises(TypeError):  # no endpoint without the deployment secret
        registry.create_transport("tcp", front_key=credentials["front_key"])
    with pytest.raises(TypeError):  # nor without the front end's public key, which verifies capabilities
        registry.create_transport("tcp", secret=credentials["secret"])
    assert {"tcp", "inprocess", "nixl", "mooncake"} <= set(registry.known_transports())


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(TransportUnavailable) as err:
        registry.transport_class("carrier-pigeon")
    message = str(err.value)
    assert "carrier-pigeon" in message
    for name in ("tcp", "inprocess", "nixl", "mooncake"):
        assert name in message


@pytest.mark.parametrize("name", ["nixl", "mooncake"])
def test_missing_optional_transport_gives_the_install_hint(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Hide the optional package even where it is installed: None in sys.modules fails its import,
    # and the transport modules that imported it already are forgotten (monkeypatch restores both).
    ours = f"kvfence.transports.onesided.{name}"
    for module in [m for m in sys.modules if m.split(".")[0] == name or m.startswith(ours)]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(TransportUnavailable, match=rf"pip install 'kvfence\[{name}\]'"):
        registry.transport_class(name)


def test_entry_point_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    group = registry.ENTRY_POINT_GROUP
    plugins = [
        EntryPoint("fancy", "kvfence.transports.tcp.transport:TcpTransport", group),
        EntryPoint("broken", "kvfence_no_such_module:Thing", group),
        EntryPoint("notatransport", "kvfence.transports.core.digest:page_digest", group),
        EntryPoint("tcp", "kvfence.transports.inprocess:InProcessTransport", group),
    ]
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep for ep in plugins if ep.group == group])
    assert registry.transport_class("fancy") is TcpTransport
    assert registry.transport_class("tcp") is TcpTransport  # a built-in name is not overridden
    assert {"fancy", "broken", "notatransport"} <= set(registry.known_transports())
    with pytest.raises(TransportUnavailable, match="kvfence_no_such_module"):
        registry.transport_class("broken")
    with pytest.raises(TransportUnavailable, match="not a Transport subclass"):
        registry.transport_class("notatransport")
