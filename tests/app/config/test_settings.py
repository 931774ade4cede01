"""Declaring settings once (app/config/settings.py): one field gives the flag, the variable, the TOML key,
the reference row and the validation."""

from __future__ import annotations

import argparse
import dataclasses
from typing import ClassVar

import pytest

from kvfence.app.config import settings
from kvfence.app.config.config import ServeConfig, ServerConfig
from kvfence.app.config.settings import Settings, section, setting


# A throwaway setting added the one way a setting is added: a field on the config that owns it.
@dataclasses.dataclass(frozen=True)
class ServerWithWidgets(ServerConfig):
    widgets: int = setting(3, "widgets per response", above=0)


@dataclasses.dataclass(frozen=True)
class ServeWithWidgets(ServeConfig):
    server: ServerWithWidgets = section(ServerWithWidgets)


def parse(cls: type, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, cls)
    return parser.parse_args(argv)


def test_adding_a_setting_touches_one_place() -> None:
    # The flag, with its help and default.
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, ServeWithWidgets)
    assert "widgets per response (default 3)" in " ".join(parser.format_help().split())
    flags = vars(parser.parse_args(["--widgets", "5"]))
    assert settings.load(ServeWithWidgets, flags, {}, {}).server.widgets == 5
    # The variable, the TOML key (in its section's table), the default.
    assert settings.load(ServeWithWidgets, {}, {"KVFENCE_WIDGETS": "6"}, {}).server.widgets == 6
    assert settings.load(ServeWithWidgets, {}, {}, {"server": {"widgets": 7}}).server.widgets == 7
    assert settings.load(ServeWithWidgets, {}, {}, {}).server.widgets == 3
    # The reference row, and validation that names the flag, from wherever the value came.
    assert "| `server.widgets` | `--widgets` | `KVFENCE_WIDGETS` | `3` | widgets per response |" in \
        settings.reference(ServeWithWidgets)
    with pytest.raises(ValueError, match="--widgets must be > 0, got 0"):
        settings.load(ServeWithWidgets, {}, {}, {"server": {"widgets": 0}})
    with pytest.raises(ValueError, match="--widgets must be > 0, got -1"):
        ServerWithWidgets(widgets=-1)


def test_every_setting_has_one_dest_flag_and_variable() -> None:
    decls = settings.declared(ServeConfig)
    assert len({d.dest for d in decls}) == len({d.flag for d in decls}) == len({d.env for d in decls}) == len(decls)
    assert all(d.setting.help for d in decls)


@dataclasses.dataclass(frozen=True)
class Inner(Settings):
    dest_prefix: ClassVar[str] = "inner_"
    size: int = setting(1, "a size", above=0)


@dataclasses.dataclass(frozen=True)
class Clash(Settings):
    inner_size: int = setting(2, "the same dest as inner.size")
    inner: Inner = section(Inner)


def test_two_settings_with_one_dest_are_a_declaration_error() -> None:
    with pytest.raises(TypeError, match="inner_size and inner.size share the dest 'inner_size'"):
        settings.declared(Clash)


@dataclasses.dataclass(frozen=True)
class Toy(Settings):
    colour: str = setting("red", "paint", choices=("red", "green", "blue"))
    timeout_s: float = setting(1.0, "a timeout", above=0)
    limit: int | None = setting(None, "a limit (default: none)", at_least=0)
    verbose: bool = setting(False, "talk more")
    fault: str = setting("", "a fault", env_aliases=("KVFENCE_SHORT",))
    inner: Inner = section(Inner)


def test_values_are_converted_and_checked_against_the_declaration() -> None:
    assert Toy(timeout_s=2).timeout_s == 2.0 and isinstance(Toy(timeout_s=2).timeout_s, float)
    assert Toy(limit="5").limit == 5  # text from a TOML string or a variable is parsed
    with pytest.raises(ValueError, match=r"--colour must be 'red', 'green' or 'blue', got 'pink'"):
        Toy(colour="pink")
    with pytest.raises(ValueError, match="--timeout must be > 0 s, got 0"):
        Toy(timeout_s=0)
    with pytest.raises(ValueError, match="--limit must be >= 0, got -1"):
        Toy(limit=-1)
    with pytest.raises(ValueError, match="--limit must be an integer, got 'many'"):
        Toy(limit="many")
    with pytest.raises(ValueError, match="--verbose must be true or false, got 1"):
        Toy(verbose=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--inner-size must be > 0"):
        settings.load(Toy, {"inner_size": 0}, {}, {})


def test_sources_in_order_and_their_errors() -> None:
    table = {"colour": "green", "inner": {"size": 4}, "verbose": True}
    environ = {"KVFENCE_COLOUR": "blue", "KVFENCE_INNER_SIZE": "5", "KVFENCE_VERBOSE": "no"}
    toy = settings.load(Toy, {"inner_size": 6, "colour": None}, environ, table)
    assert (toy.colour, toy.inner.size, toy.verbose) == ("blue", 6, False)
    assert vars(parse(Toy, "--no-verbose"))["verbose"] is False  # a flag can turn a true setting off
    assert settings.load(Toy, {}, {"KVFENCE_SHORT": "drop"}, {}).fault == "drop"  # an alias
    assert settings.load(Toy, {}, {"KVFENCE_SHORT": "drop", "KVFENCE_FAULT": "corrupt"}, {}).fault == "corrupt"
    with pytest.raises(ValueError, match=r"KVFENCE_TIMEOUT_S='soon' is not a valid value for --timeout"):
        settings.load(Toy, {}, {"KVFENCE_TIMEOUT_S": "soon"}, {})
    with pytest.raises(ValueError, match=r"toy.toml: unknown setting 'inner.sise'"):
        settings.load(Toy, {}, {}, {"inner": {"sise": 1}}, source="toy.toml")


def test_a_key_in_the_wrong_table_says_where_it_lives() -> None:
    with pytest.raises(ValueError, match=r"unknown setting 'port'; did you mean 'port' in the \[server\] table"):
        settings.load(ServeConfig, {}, {}, {"port": 9000})
    with pytest.raises(ValueError, match=r"unknown setting 'transport'; did you mean 'name' in the \[transport\]"):
        settings.load(ServeConfig, {}, {}, {"transport": "tcp"})


def test_the_reference_lists_every_setting_with_its_names() -> None:
    text = settings.reference(Toy)
    assert text.splitlines()[0] == "| TOML key | flag | variable | default | meaning |"
    assert "| `colour` | `--colour` | `KVFENCE_COLOUR` | `\"red\"` | paint; one of `red`, `green`, `blue` |" in text
    assert "| `limit` | `--limit` | `KVFENCE_LIMIT` | unset | a limit (default: none) |" in text
    assert "| `fault` | `--fault` | `KVFENCE_FAULT` / `KVFENCE_SHORT` | `\"\"` | a fault |" in text
    assert "| `inner.size` | `--inner-size` | `KVFENCE_INNER_SIZE` | `1` | a size |" in text
