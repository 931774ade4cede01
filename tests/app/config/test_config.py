"""Server settings: defaults < TOML file < KVFENCE_* variables < flags, with actionable errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfence.app.config.config import ServeConfig, config_reference, load_config, parse_bytes
from kvfence.scheduler.core.config import SchedulerSettings


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "kvfence.toml"
    f.write_text('[server]\nport = 9001\n[scheduler]\nmax-running = 3\nmax_queue = 7\n'
                 '[transport]\nname = "inprocess"\n')
    c = load_config({"port": 9003, "max_queue": None}, {"KVFENCE_PORT": "9002", "KVFENCE_MAX_RUNNING": "5"}, f)
    assert (c.server.port, c.scheduler.max_running, c.transport.name, c.scheduler.max_queue) == (
        9003, 5, "inprocess", 7)
    assert load_config({}, {}, None) == ServeConfig()


@pytest.mark.parametrize("flags, message", [
    ({"disaggregation": "maybe"}, "--disaggregation must be 'on' or 'off'"),
    ({"port": 70000}, "--port must be in"),
    ({"max_running": 0}, "--max-running must be > 0"),
    ({"decode_num_pages": -1}, "--decode-num-pages must be > 0"),
    ({"chunk_tokens": 0}, "--chunk-tokens must be > 0"),
    ({"prefill_kv_memory": "lots"}, "cannot read 'lots' as a size"),
])
def test_bad_values(flags: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(flags, {}, None)


def test_bad_file_and_env(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("prot = 1\n")
    with pytest.raises(ValueError, match="unknown setting 'prot'"):
        load_config({}, {}, f)
    f.write_text("port = \n")
    with pytest.raises(ValueError, match="bad.toml"):
        load_config({}, {}, f)
    with pytest.raises(ValueError, match="KVFENCE_PORT='http'"):
        load_config({}, {"KVFENCE_PORT": "http"}, None)


def test_parse_bytes() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("-1GiB")


def test_boolean_from_environment() -> None:
    assert load_config({}, {"KVFENCE_CLAMP_CONTEXT": "true"}, None).pools.clamp_context is True
    assert load_config({}, {"KVFENCE_CLAMP_CONTEXT": "0"}, None).pools.clamp_context is False
    with pytest.raises(ValueError, match="KVFENCE_CLAMP_CONTEXT='maybe'"):
        load_config({}, {"KVFENCE_CLAMP_CONTEXT": "maybe"}, None)
    assert load_config({"kv_scrub": "zero"}, {}, None).pools.kv_scrub == "zero"
    with pytest.raises(ValueError, match="--kv-scrub"):
        load_config({"kv_scrub": "shred"}, {}, None)


def test_fault_injection_setting() -> None:
    assert load_config({}, {"KVFENCE_FAULTS": "corrupt#2"}, None).transport.fault_inject == "corrupt#2"
    assert load_config({}, {}, None).transport.fault_inject == ""  # off unless configured
    with pytest.raises(ValueError, match="unknown fault"):
        load_config({"fault_inject": "explode"}, {}, None)


def test_prefill_chunk_default_follows_the_prefill_device() -> None:
    # A CPU prefill step holds up the decode steps on the same cores: smaller chunks there.
    assert ServeConfig().scheduler.chunk_tokens_for("cpu") == 128
    assert ServeConfig().scheduler.chunk_tokens_for("cuda") == 512
    assert SchedulerSettings(chunk_tokens=64).chunk_tokens_for("cuda") == 64
    assert load_config({}, {"KVFENCE_CHUNK_TOKENS": "256"}, None).scheduler.chunk_tokens_for("cpu") == 256


def test_the_contended_chunk_follows_the_prefill_device_and_never_exceeds_the_chunk() -> None:
    def bound(settings: SchedulerSettings, device: str) -> int:
        return settings.bind(page_size_tokens=16, max_context_tokens=1024, disaggregated=True,
                             prefill_device_type=device).held_back_tokens

    assert bound(SchedulerSettings(), "cpu") == 32
    assert bound(SchedulerSettings(), "cuda") == 512  # a whole chunk takes milliseconds there
    assert bound(SchedulerSettings(contended_chunk_tokens=16), "cuda") == 16
    assert bound(SchedulerSettings(chunk_tokens=24), "cpu") == 24
    assert load_config({"contended_chunk_tokens": 8}, {}, None).scheduler.contended_chunk_tokens == 8
    with pytest.raises(ValueError, match="contended-chunk-tokens"):
        load_config({"contended_chunk_tokens": 0}, {}, None)


def test_transport_endpoint_options() -> None:
    # The defaults are what the transports' constructors default to: loopback, ephemeral ports.
    assert ServeConfig().transport.endpoint_options("prefill") == {"host": "127.0.0.1", "port": 0}
    c = load_config({"transport": "mooncake", "transport_decode_port": 7001, "transport_host": "10.0.0.2",
                     "mooncake_unauthenticated_ports_ok": True},
                    {"KVFENCE_MOONCAKE_PROTOCOL": "rdma", "KVFENCE_MOONCAKE_DEVICE_NAME": "mlx5_0"}, None)
    assert c.transport.endpoint_options("prefill") == {"host": "10.0.0.2", "port": 0, "protocol": "rdma",
                                                       "device_name": "mlx5_0"}  # the consent is not an option
    assert c.transport.endpoint_options("decode")["port"] == 7001
    nixl = load_config({"transport": "nixl", "nixl_backend": "GDS", "nixl_unauthenticated_ports_ok": True}, {},
                       None).transport
    assert nixl.endpoint_options("decode") == {"host": "127.0.0.1", "port": 0, "backend": "GDS"}
    assert load_config({"transport": "inprocess"}, {}, None).transport.endpoint_options("decode") == {}
    # Mooncake's own ports, and UCX's under NIXL, authenticate no one: each runs only with the operator's
    # consent, however given
    with pytest.raises(ValueError,
                       match="--transport mooncake: .* authenticate no one.*--mooncake-unauthenticated-ports-ok"):
        load_config({"transport": "mooncake"}, {}, None)
    with pytest.raises(ValueError, match="--transport nixl: UCX.* authenticate no one, so a worker's whole KV pool "
                                         "is reachable.*--nixl-unauthenticated-ports-ok"):
        load_config({"transport": "nixl", "mooncake_unauthenticated_ports_ok": True}, {}, None)
    assert load_config({}, {"KVFENCE_TRANSPORT": "mooncake", "KVFENCE_MOONCAKE_UNAUTHENTICATED_PORTS_OK": "1"},
                       None).transport.mooncake.unauthenticated_ports_ok
    with pytest.raises(ValueError, match="--mooncake-protocol must be 'tcp' or 'rdma'"):
        load_config({"mooncake_protocol": "ib"}, {}, None)
    with pytest.raises(ValueError, match="--transport-prefill-port and --transport-decode-port must differ"):
        load_config({"transport_prefill_port": 7001, "transport_decode_port": 7001}, {}, None)
    with pytest.raises(ValueError, match="--transport must be .*'tcp', got 'carrier-pigeon'"):
        load_config({}, {"KVFENCE_TRANSPORT": "carrier-pigeon"}, None)


def test_nested_tables_and_sizes_from_the_file(tmp_path: Path) -> None:
    f = tmp_path / "kvfence.toml"
    f.write_text('[pools]\ndecode_kv_memory = "2GiB"\n[transport.mooncake]\nprotocol = "rdma"\n'
                 '[server]\nmax_body_bytes = "1MiB"\nstall_timeout_s = 5\n')
    c = load_config({}, {}, f)
    assert (c.pools.decode_kv_memory, c.server.max_body_bytes, c.server.stall_timeout_s) == (2 << 30, 1 << 20, 5.0)
    assert c.transport.mooncake.protocol == "rdma"
    f.write_text("port = 9000\n")  # the flat key of the flag: the message says where it lives
    with pytest.raises(ValueError, match=r"unknown setting 'port'; did you mean 'port' in the \[server\] table"):
        load_config({}, {}, f)
    f.write_text('[server]\nport = "http"\n')
    with pytest.raises(ValueError, match="--port must be an integer, got 'http'"):
        load_config({}, {}, f)


README = Path(__file__).parents[3] / "README.md"
START, END = "<!-- settings reference:", "<!-- end of settings reference -->"


def test_the_readme_reference_is_the_generated_one(tmp_path: Path) -> None:
    text = README.read_text()
    block = text[text.index(START):text.index(END)]
    assert block.split("\n", 1)[1] == config_reference(), "regenerate it: kvfence config-reference"
    example = text[text.index("```toml\n") + len("```toml\n"):]
    (tmp_path / "example.toml").write_text(example[:example.index("```")])
    assert load_config({}, {}, tmp_path / "example.toml").pools.decode_kv_memory == 2 << 30  # the example is valid
