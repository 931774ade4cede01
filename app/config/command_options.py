"""The options of the commands other than `serve` and `check` (whose settings are app/config/config.py's
ServeConfig), declared once like every setting (app/config/settings.py): each a flag named by its field
(`kvfence probe --key`), a KVFENCE_<COMMAND>_<NAME> variable and a key of the command's table in
the --config TOML file (`[probe] key = ...`). Operands (`kvfence generate PROMPT`, `kvfence probe
URL`) stay arguments: they are what the command works on, not how.

`serve` reads none of these tables: one file can hold a whole deployment's settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from kvfence.app.config import settings
from kvfence.app.config.settings import Settings, section, setting


@dataclasses.dataclass(frozen=True)
class WorkerOptions(Settings):
    """`kvfence worker`: which pool it holds and where its front ends reach it."""

    dest_prefix: ClassVar[str] = "worker_"
    flags_by_field: ClassVar[bool] = True

    role: str | None = setting(None, "the pool this worker holds (needed)", choices=("prefill", "decode"))
    device: str = setting("auto", "auto, cpu or cuda:N (one worker process per GPU)")
    control: str = setting("127.0.0.1:0", "HOST:PORT its scheduler connects to (authenticated with the "
                                          "deployment secret)")
    advertise: str | None = setting(None, "HOST:PORT front ends reach --control at, as registered in etcd "
                                          "(default: --control)")


@dataclasses.dataclass(frozen=True)
class GenerateOptions(Settings):
    """`kvfence generate`: how the one prompt is run and what is printed."""

    dest_prefix: ClassVar[str] = "generate_"
    flags_by_field: ClassVar[bool] = True

    device: str = setting("auto", "auto, cpu or cuda:N")
    max_tokens: int = setting(64, "tokens to generate at most", above=0)
    temperature: float = setting(0.0, "sampling temperature (0: greedy)", at_least=0)
    top_p: float = setting(1.0, "nucleus sampling: the smallest set of tokens holding this much probability",
                           above=0, at_most=1)
    top_k: int = setting(0, "keep the k most likely tokens (0: all)", at_least=-1)
    seed: int | None = setting(None, "seed of the sampling noise (unset: drawn)")
    stop: tuple[str, ...] = setting((), "a string that ends the output (repeatable; a variable holds a JSON array)")
    ignore_eos: bool = setting(False, "generate past the model's end-of-generation tokens")
    chat: bool = setting(False, "wrap the prompt as one user message in the chat template")
    json: bool = setting(False, "print one JSON object with the ids and the text")


@dataclasses.dataclass(frozen=True)
class ProbeOptions(Settings):
    """`kvfence probe URL`: who the prober is, and how it reports."""

    dest_prefix: ClassVar[str] = "probe_"
    flags_by_field: ClassVar[bool] = True

    key: str | None = setting(None, "API key of tenant A (the one that plants canaries)")
    other_key: str | None = setting(None, "API key of tenant B (the one that must never see A's); without it B is A")
    model: str | None = setting(None, "model name (default: the first of /v1/models)")
    context: int | None = setting(None, "advertised context in tokens (default: max_model_len of /v1/models, "
                                        "else 2048)", above=0)
    timeout_s: float = setting(120.0, "seconds per request", above=0)
    json: bool = setting(False, "print the report as JSON instead of a table")
    progress: bool = setting(True, "a progress bar on stderr")


@dataclasses.dataclass(frozen=True)
class StatusOptions(Settings):
    """`kvfence status`: where the deployment's workers are listed and how it is shown."""

    dest_prefix: ClassVar[str] = "status_"
    flags_by_field: ClassVar[bool] = True

    discovery: str | None = setting(None, "etcd://HOST:PORT the workers register in")
    front: str | None = setting(None, "a front end's base URL, e.g. http://127.0.0.1:8000 (its /metrics has each "
                                      "worker's pool)")
    admin_key: str | None = setting(None, "the front end's admin key, when it serves with --api-keys",
                                    env_aliases=("KVFENCE_ADMIN_KEY",))
    json: bool = setting(False, "print JSON instead of a table")
    transport_secret_file: str | None = setting(
        None, "the deployment secret: list only registrations signed with it (without it, etcd's registrations "
              "are shown unverified)", env_aliases=("KVFENCE_TRANSPORT_SECRET_FILE",))


@dataclasses.dataclass(frozen=True)
class FrontKeyOptions(Settings):
    """`kvfence front-key`: where the front end's key pair is written."""

    dest_prefix: ClassVar[str] = "front_key_"
    flags_by_field: ClassVar[bool] = True

    key: str = setting("front.key", "where the private key goes (mode 600)")
    public: str = setting("front.pub", "where the public key goes")


# command -> (its table in the --config file, its options)
COMMANDS: dict[str, tuple[str, type[Settings]]] = {
    "worker": ("worker", WorkerOptions),
    "generate": ("generate", GenerateOptions),
    "probe": ("probe", ProbeOptions),
    "status": ("status", StatusOptions),
    "front-key": ("front_key", FrontKeyOptions),
}
TABLES = frozenset(table for table, _ in COMMANDS.values())


def _root(table: str, options: type[Settings]) -> type[Settings]:
    """A config whose one section is `options` under `table`, so its TOML keys read `[table] name`."""
    return dataclasses.make_dataclass(f"{options.__name__}Root", [(table, options, section(options))],
                                      bases=(Settings,), frozen=True)


_ROOTS = {command: _root(table, options) for command, (table, options) in COMMANDS.items()}


def declared_root(command: str) -> type[Settings]:
    """The config tree of `command`'s options (for add_flags and the reference)."""
    return _ROOTS[command]


def load_options(command: str, flags: Mapping[str, Any], environ: Mapping[str, str],
                 file_table: Mapping[str, Any], config_file: Path | None = None) -> Any:
    """`command`'s options: declared defaults < its table of the parsed --config file < variables
    < flags (by dest). ValueError naming the key, the variable or the flag."""
    table, _ = COMMANDS[command]
    own = {table: file_table[table]} if table in file_table else {}
    root = settings.load(_ROOTS[command], flags, environ, own, source=f"--config {config_file}")
    return getattr(root, table)


def options_reference() -> str:
    """A markdown table per command of its options."""
    parts = []
    for command, (table, _) in COMMANDS.items():
        parts.append(f"`kvfence {command}` (`[{table}]`):\n\n" + settings.reference(_ROOTS[command]))
    return "\n".join(parts)
