"""The settings of `kvfence serve` (and `check`, `generate`): nested frozen configs, one per concern.

Every setting is declared once, here or next to its owner (scheduler/core/config.py), with
app/config/settings.py: its default, help, validation, flag, KVFENCE_* variable and TOML key all come
from that one declaration, and so do `kvfence serve --help` and the reference in README.md
(`kvfence config-reference`). Sources, lowest first: defaults < TOML file (`--config`; one table per
section, e.g. `[server] port = 9000`) < KVFENCE_* variables < flags. Choice lists live with the code
that owns them: scrub modes in engine/kv_pool.py, attention backends in engine/attention_backend.py,
transports in transports/registry.py, Mooncake protocols in transports/onesided/mooncake/plane.py.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from kvfence.app.config import settings
from kvfence.app.config.command_options import TABLES as COMMAND_TABLES
from kvfence.app.config.command_options import options_reference
from kvfence.app.config.settings import Settings, section, setting
from kvfence.engine.attention_backend import BACKEND_NAMES
from kvfence.engine.kv_pool import SCRUB_MODES
from kvfence.scheduler.core.config import SchedulerSettings
from kvfence.transports.faults import FaultPlan
from kvfence.transports.onesided.mooncake.plane import PROTOCOLS as MOONCAKE_PROTOCOLS
from kvfence.transports.registry import known_transports

DISAGGREGATION = ("on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# The built-in transports whose endpoints listen on host:port; inprocess and plugins get only
# the secret and their own table's options.
LISTENING_TRANSPORTS = ("tcp", "nixl", "mooncake")
# The one-sided transports' engines listen on ports kvfence cannot authenticate; each runs only with
# the operator's consent (tests/transports/test_ucx_stranger.py, test_mooncake_plane.py).
UNAUTHENTICATED_PORTS = {"nixl": "UCX, under NIXL, listens on ports of its own that authenticate no one",
                         "mooncake": "the Mooncake engine listens on ports of its own that authenticate no one"}
EXPOSED = {"nixl": "a worker's whole KV pool is",
           "mooncake": "the pages of a transfer in flight (over rdma: the whole pool) are"}
DEFAULT_WORKER_TIMEOUT_S = 5.0  # the scheduler's bound on a silent worker (kvfence serve --worker-timeout)
# The longest --worker-timeout, and how long a worker waits for a silent scheduler before it drops it
# (app/remote/protocol.py's SCHEDULER_SILENCE_S): pings go every quarter of it, well inside the worker's bound.
MAX_WORKER_TIMEOUT_S = 60.0

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1048576' -> bytes."""
    s = text.strip().lower().replace(" ", "")
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    try:
        value = float(digits) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 512MiB or 2GiB") from None
    if value <= 0:
        raise ValueError(f"a memory size must be > 0, got {text!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ServerConfig(Settings):
    """The HTTP front end."""

    host: str = setting("127.0.0.1", "address the HTTP API listens on")
    port: int = setting(8000, "port the HTTP API listens on", at_least=0, at_most=65535)
    max_body_bytes: int = setting(16 << 20, "largest request body accepted, e.g. 16MiB; a longer one gets 413 "
                                            "before it is read further", above=0, parse=parse_bytes)
    stall_timeout_s: float = setting(30.0, "seconds a streaming client may read nothing before its request is "
                                           "aborted", above=0)
    shutdown_timeout_s: float = setting(30.0, "seconds in-flight requests get to finish after SIGTERM", at_least=0)
    body_timeout_s: float = setting(60.0, "seconds a request body may take to arrive in full; past it, 408",
                                    above=0)
    max_requests_in_flight: int = setting(1024, "HTTP requests served at once, streams included; past it, 503 "
                                                "with Retry-After (/health, /ready and /metrics always answer)",
                                          above=0)
    allowed_hosts: str | None = setting(None, "host names the API answers to, comma-separated, or * for any; "
                                              "default: with --api-keys off and a loopback --host, only loopback "
                                              "names (a web page cannot drive the server by DNS rebinding or a "
                                              "cross-site post), else any. Name the hosts a proxy forwards")
    allow_special_tokens_in_content: bool = setting(False, "encode a special token's text written in a chat "
                                                           "message as the special token (default: as text, so "
                                                           "a message cannot open a turn of another role)")
    max_response_entries: int = setting(1 << 18, "most tokens and logprob entries one request's response may "
                                                 "carry: samples x (top_logprobs + 1) x max_tokens, plus echoed "
                                                 "prompt logprobs; a request over it gets 400", above=0)
    grammar_compile_timeout_s: float = setting(0.75, "seconds a request's JSON schema may take to compile (in a "
                                                    "process of its own, killed past it: the request gets 400)",
                                               above=0, at_most=60)
    api_keys: str | None = setting(None, "TOML file of tenants: their API keys (as SHA-256 digests) and limits, "
                                         "and the admin key for /metrics (app/api/keys.py); without it every "
                                         "request is the anonymous tenant")
    log_level: str = setting("info", "log level", choices=LOG_LEVELS)


@dataclasses.dataclass(frozen=True)
class WorkersConfig(Settings):
    """Where and how the prefill and decode workers compute."""

    dtype: str = setting("auto", "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    weights: str = setting("native", "a GGUF file's quantized matrices: native (multiplied in their own block "
                                     "types, Q8_0 Q4_0 Q4_1 Q5_0 Q4_K Q6_K, by the CPU kernels in float32, with "
                                     "the bits of float32; dequantized at load anywhere else) or float32 "
                                     "(dequantized at load)", choices=("native", "float32"))
    prefill_device: str = setting("auto", "device of the prefill worker (the colocated one): auto, cpu or cuda:N")
    decode_device: str = setting("auto", "device of the decode worker: auto, cpu or cuda:N")
    attention_backend: str = setting("auto", "paged attention and KV store: auto (triton on CUDA when installed; "
                                             "on the CPU, cpu where its kernels build; else torch)",
                                     choices=BACKEND_NAMES)
    kv_sanitizer: bool = setting(False, "record which lease wrote every KV slot and fail any request that reads a "
                                        "slot its lease did not write (a testing aid; costs a check over the "
                                        "context per step)")


@dataclasses.dataclass(frozen=True)
class PoolsConfig(Settings):
    """The KV page pools, sized per role against the context at start (app/serve/sizing.py)."""

    page_size_tokens: int = setting(16, "tokens per KV page", above=0, flag="--page-size")
    prefill_num_pages: int | None = setting(None, "prefill KV pool size in pages (default: from "
                                                  "--prefill-kv-memory, else 2 full contexts)", above=0)
    decode_num_pages: int | None = setting(None, "decode (or colocated) KV pool size in pages (default: from "
                                                 "--decode-kv-memory, else 4 full contexts)", above=0)
    prefill_kv_memory: int | None = setting(None, "prefill KV pool size in bytes, e.g. 1GiB", above=0,
                                            parse=parse_bytes)
    decode_kv_memory: int | None = setting(None, "decode (or colocated) KV pool size in bytes, e.g. 2GiB", above=0,
                                           parse=parse_bytes)
    max_context: int | None = setting(None, "longest prompt + completion, in tokens (default: the model's)",
                                      above=0)
    clamp_context: bool = setting(False, "serve the largest context every KV pool holds instead of refusing an "
                                         "undersized pool")
    kv_scrub: str = setting("poison", "what freed KV pages are filled with (poison: a stale read shows)",
                            choices=SCRUB_MODES)


@dataclasses.dataclass(frozen=True)
class NixlOptions(Settings):
    """Options of the nixl transport's endpoints."""

    dest_prefix: ClassVar[str] = "nixl_"
    backend: str = setting("UCX", "NIXL backend plugin of the data plane")
    unauthenticated_ports_ok: bool = setting(
        False, "required to use nixl: accept that UCX's own listener authenticates no one, so any process that "
               "reaches it and knows a pool's address (a network observer sees it) reads and writes the whole "
               "pool; only where the deployment alone reaches its hosts")


@dataclasses.dataclass(frozen=True)
class MooncakeOptions(Settings):
    """Options of the mooncake transport's endpoints."""

    dest_prefix: ClassVar[str] = "mooncake_"
    protocol: str = setting("tcp", "Mooncake transfer protocol", choices=MOONCAKE_PROTOCOLS)
    device_name: str = setting("", "RDMA devices, comma-separated (empty: all, or none for tcp)")
    unauthenticated_ports_ok: bool = setting(
        False, "required to use mooncake: accept that the Mooncake engine's own ports authenticate no one, so "
               "the pages of a transfer in flight (over rdma: the whole pool) are reachable from any host that "
               "reaches this one; only where the deployment alone reaches its hosts")


@dataclasses.dataclass(frozen=True)
class TransportConfig(Settings):
    """The KV transport between the prefill and the decode worker's endpoints."""

    dest_prefix: ClassVar[str] = "transport_"
    name: str = setting("tcp", "KV transport plugin", choices=known_transports, dest="transport")
    host: str = setting("127.0.0.1", "address the transport endpoints listen on (tcp, nixl, mooncake)")
    prefill_port: int = setting(0, "port of the prefill worker's endpoint (0: an ephemeral port)",
                                at_least=0, at_most=65535)
    decode_port: int = setting(0, "port of the decode worker's endpoint (0: an ephemeral port)",
                               at_least=0, at_most=65535)
    secret_file: str | None = setting(None, "file holding the deployment secret the transport endpoints "
                                            "authenticate each other with (at least 32 bytes); default: a fresh "
                                            "secret per process, enough when both workers live in it")
    front_key_file: str | None = setting(None, "file holding the front end's private signing key (PEM, made with "
                                               "`kvfence front-key`): it signs every push's capability and every "
                                               "control connection to a worker; default: a fresh key per process, "
                                               "enough when both workers live in it", dest="front_key_file")
    front_public_key_file: str | None = setting(None, "a worker's: file holding the front end's public key (PEM, "
                                                      "made with `kvfence front-key`), which every capability and "
                                                      "every front end's control connection must verify against",
                                                dest="front_public_key_file")
    fault_inject: str = setting("", "testing only: inject transfer faults on the sending side, e.g. "
                                    "'corrupt#3,delay=0.2@0.1'", dest="fault_inject", check=FaultPlan.parse,
                                env_aliases=("KVFENCE_FAULTS",))
    nixl: NixlOptions = section(NixlOptions)
    mooncake: MooncakeOptions = section(MooncakeOptions)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_port and self.prefill_port == self.decode_port:
            raise ValueError(f"--transport-prefill-port and --transport-decode-port must differ (both endpoints "
                             f"listen in this process), got {self.prefill_port} for both")
        own = self.own_options()
        if own is not None and not own.unauthenticated_ports_ok:
            raise ValueError(f"--transport {self.name}: {UNAUTHENTICATED_PORTS[self.name]}, so {EXPOSED[self.name]} "
                             f"reachable from any host that reaches this one (docs/architecture.md, \"The trust "
                             f"boundary of the transports\"). Use tcp, or pass --{self.name}-unauthenticated-ports-ok "
                             f"where only the deployment reaches these hosts")

    def own_options(self) -> NixlOptions | MooncakeOptions | None:
        """The options table of this transport, for the ones that have one."""
        return self.nixl if self.name == "nixl" else self.mooncake if self.name == "mooncake" else None

    def endpoint_options(self, role: str) -> dict[str, Any]:
        """Keyword arguments of `create_transport(self.name, secret=..., **these)` for the endpoint
        of `role` ("prefill" or "decode"): where it listens, for the transports that listen, and
        the options of this transport's own table."""
        if self.name not in LISTENING_TRANSPORTS:
            return {}
        port = self.prefill_port if role == "prefill" else self.decode_port
        own = self.own_options()
        options = dataclasses.asdict(own) if own is not None else {}
        options.pop("unauthenticated_ports_ok", None)  # the operator's consent, checked above: not an option
        return {"host": self.host, "port": port, **options}


@dataclasses.dataclass(frozen=True)
class CanaryConfig(Settings):
    """The readiness canary (app/serve/readiness.py)."""

    dest_prefix: ClassVar[str] = "canary_"
    interval_s: float = setting(30.0, "seconds between readiness canaries through the real serving path", above=0)


@dataclasses.dataclass(frozen=True)
class ServeConfig(Settings):
    """Everything `kvfence serve` runs with."""

    model: str | None = setting(None, "GGUF file, Hugging Face model directory, or known name (default: "
                                      "SmolLM2-135M-Instruct)")
    served_model_name: str | None = setting(None, "the model id clients send (default: from --model)")
    disaggregation: str = setting("on", "on: separate prefill and decode workers with a KV transport; off: one "
                                        "colocated worker", choices=DISAGGREGATION)
    discovery: str | None = setting(None, "where the workers are when each runs in its own process (`kvfence "
                                          "worker`): static://HOST:PORT,HOST:PORT (their control addresses); "
                                          "unset: the workers run in this process")
    worker_timeout_s: float = setting(DEFAULT_WORKER_TIMEOUT_S, "with --discovery: seconds a worker may stay silent "
                                                                "(it is pinged well within them) before it is lost: "
                                                                "its requests are retried or end with 503 worker_lost",
                                      above=0, at_most=MAX_WORKER_TIMEOUT_S)
    server: ServerConfig = section(ServerConfig)
    workers: WorkersConfig = section(WorkersConfig)
    pools: PoolsConfig = section(PoolsConfig)
    scheduler: SchedulerSettings = section(SchedulerSettings)
    transport: TransportConfig = section(TransportConfig)
    canary: CanaryConfig = section(CanaryConfig)


def read_config_file(config_file: Path | None) -> dict[str, Any]:
    """The parsed TOML of `--config` ({} without one); ValueError naming the file."""
    if config_file is None:
        return {}
    try:
        return tomllib.loads(config_file.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config {config_file}: {e}") from e


def load_config(flags: Mapping[str, Any], environ: Mapping[str, str], config_file: Path | None) -> ServeConfig:
    """Merge the sources (`flags` by dest, e.g. {"max_running": 8}; None: not given). ValueError,
    naming the file, the variable or the flag, for anything that is not a setting or its value.
    The commands' own tables (app/config/command_options.py) are theirs, not this config's."""
    table = {k: v for k, v in read_config_file(config_file).items() if k not in COMMAND_TABLES}
    config: ServeConfig = settings.load(ServeConfig, flags, environ, table, source=f"--config {config_file}")
    return config


def config_reference() -> str:
    """The markdown tables of every setting that README.md carries: `serve`'s (and `check`'s), then
    each other command's options."""
    return (settings.reference(ServeConfig) + "\nThe other commands' options, each command's in its own table of "
            "the --config file:\n\n" + options_reference())
