"""`--discovery` and `kvfence worker` settings: a bad value is an error that names the flag and
what to use instead, before anything starts."""

from __future__ import annotations

import dataclasses

import pytest

from kvfence.app.cli import main
from kvfence.app.config.config import ServeConfig
from kvfence.app.remote.discovery import Discovery, parse_discovery
from kvfence.app.remote.worker_process import check_worker_settings
from kvfence.transports.core.front_key import FrontKey
from kvfence.transports.core.secret import DeploymentSecret


def test_static_discovery_lists_control_addresses_and_etcd_names_one_endpoint() -> None:
    assert parse_discovery("static://10.0.0.1:9301, [::1]:9302") == Discovery("static", ("10.0.0.1:9301", "[::1]:9302"))
    assert parse_discovery("etcd://10.0.0.1:2379").etcd == ("10.0.0.1", 2379)
    assert parse_discovery("static://10.0.0.1:9301").etcd is None


@pytest.mark.parametrize("text, message", [
    ("10.0.0.1:9301", "must be static://"),
    ("dns://workers", "must be static://"),
    ("etcd://10.0.0.1:2379,10.0.0.2:2379", "one etcd endpoint"),
    ("static://", "names no worker"),
    ("static://10.0.0.1", "not a host:port"),
])
def test_bad_discovery_names_the_flag(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        parse_discovery(text)
    assert "--discovery" in str(e.value)


def test_serve_refuses_bad_discovery_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--discovery", "static://nowhere"]) == 2
    assert "--discovery" in capsys.readouterr().err


def test_a_worker_process_needs_a_network_transport_the_secret_and_the_front_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = ServeConfig()
    with pytest.raises(ValueError, match="--role"):
        check_worker_settings(config, "colocated")
    inprocess = dataclasses.replace(config, transport=dataclasses.replace(config.transport, name="inprocess"))
    with pytest.raises(ValueError, match="moves KV only inside one process"):
        check_worker_settings(inprocess, "prefill")
    with pytest.raises(ValueError, match="--transport-secret-file"):
        check_worker_settings(config, "decode")
    listed = dataclasses.replace(config, discovery="static://10.0.0.1:9301")
    with pytest.raises(ValueError, match="only in etcd"):
        check_worker_settings(listed, "decode")
    secret = tmp_path / "s"
    secret.write_text("ab" * 32)
    secret_only = dataclasses.replace(config, transport=dataclasses.replace(config.transport, secret_file=str(secret)))
    with pytest.raises(ValueError, match="--front-public-key-file"):  # it takes steps only from its front end
        check_worker_settings(secret_only, "decode")
    ok = dataclasses.replace(secret_only, transport=dataclasses.replace(secret_only.transport,
                                                                        front_public_key_file=str(tmp_path / "f.pub")))
    with pytest.raises(ValueError, match="--front-public-key-file .*cannot read it"):  # the files are read too
        check_worker_settings(ok, "decode")
    front = FrontKey.generate()
    front.write(tmp_path / "f", tmp_path / "f.pub")
    secret_read, key_read = check_worker_settings(ok, "decode")
    assert key_read.fingerprint == front.public.fingerprint
    assert isinstance(secret_read, DeploymentSecret)
