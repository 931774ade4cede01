"""Each setting declared once: a dataclass field carries its default, help, validation and names.

A config is a frozen dataclass deriving from `Settings`. Each field is one of:
- `setting(default, help, ...)`: something a user sets;
- `section(Cls)`: a nested config, a table in the TOML file;
- a plain field: bound by the code that builds the config, never read from a user.

A setting's *dest* is its one flat name: the class's `dest_prefix` plus the field name, unless it
declares its own; dests are unique across a config tree. From the declarations come:
- the flag `--<dest>` (dashes, a trailing "_s" dropped) unless it declares one (`add_flags`);
- the variable `KVFENCE_<DEST>`, plus any declared aliases;
- the TOML key: the field's dotted path (`server.port`, i.e. `port` in the `[server]` table);
- the markdown reference (`reference`) README.md carries;
and `load` merges them: defaults < TOML < KVFENCE_* variables < flags. Validation runs when a config
is constructed, whatever built it, and its messages name the flag.

A package below the app (the scheduler's `[scheduler]` table) declares its settings without
importing this module: a plain dataclass whose fields carry `Setting`'s keys as metadata
(`dataclasses.field(default=..., metadata={"help": ..., "above": 0})`, scheduler/core/config.py
`knob`); this module reads both forms the same, and checks such a class's values when it builds one
(`load`), since it has no `Settings.__post_init__`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

_SETTING, _SECTION = "kvfence.setting", "kvfence.section"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
          tuple: "a list of strings"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a `setting(...)` field declares besides its default (see `setting`)."""

    help: str
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
    above: float | None = None
    at_least: float | None = None
    at_most: float | None = None
    parse: Callable[[str], Any] | None = None
    check: Callable[[Any], object] | None = None
    dest: str | None = None
    flag: str | None = None
    env_aliases: tuple[str, ...] = ()

    def allowed(self) -> tuple[str, ...] | None:
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)


def setting(default: Any, help: str, **declared: Any) -> Any:
    """A field holding a user setting. `declared` (see `Setting`): `choices` (a sequence, or a
    function giving one, e.g. the registered transports); `above` / `at_least` / `at_most`
    (bounds); `parse` (text -> value, e.g. byte sizes; also applied to a string given for a
    non-string field); `check` (raises ValueError naming the problem); `dest`, `flag` and
    `env_aliases` when the derived names do not fit."""
    return dataclasses.field(default=default, metadata={_SETTING: Setting(help=help, **declared)})


def section(cls: type) -> Any:
    """A field holding a nested config (a TOML table of that name)."""
    return dataclasses.field(default_factory=cls, metadata={_SECTION: True})


@dataclasses.dataclass(frozen=True)
class Declared:
    """One setting of a config tree, with every name it is known by."""

    path: tuple[str, ...]  # field names from the root config, e.g. ("server", "port")
    dest: str  # the flat name: argparse dest, `load`'s flag keys, the variable's suffix
    kind: type  # str, int, float, bool, or tuple (of strings)
    optional: bool  # None is a value (meaning "derived", see the help)
    default: Any
    setting: Setting
    flag_by_field: bool = False  # its class's `flags_by_field`

    @property
    def flag(self) -> str:
        name = self.path[-1] if self.flag_by_field else self.dest
        return self.setting.flag or "--" + name.removesuffix("_s").replace("_", "-")

    @property
    def env(self) -> str:
        return "KVFENCE_" + self.dest.upper()

    @property
    def toml_key(self) -> str:
        return ".".join(self.path)

    def from_text(self, text: str) -> Any:
        """A value of this setting from a variable's or a flag's text; ValueError when it is not one."""
        if self.setting.parse is not None:
            return self.setting.parse(text)
        if self.kind is bool:
            if text.strip().lower() in _TRUE:
                return True
            if text.strip().lower() in _FALSE:
                return False
            raise ValueError(f"{text!r} is not true or false")
        if self.kind is tuple:  # a JSON array of strings, or one string
            if not text.lstrip().startswith("["):
                return (text,)
            try:
                items = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{text!r} is not a JSON array of strings ({e})") from None
            if not isinstance(items, list):
                raise ValueError(f"{text!r} is not a JSON array of strings")
            return tuple(items)
        return self.kind(text)

    def normalized(self, value: Any) -> Any:
        """`value` checked against the declaration (and converted: text parsed, an int made a
        float); ValueError naming the flag otherwise."""
        if value is None:
            if self.optional:
                return None
            raise ValueError(f"{self.flag} must be set")
        if isinstance(value, str) and (self.kind is not str or self.setting.parse is not None):
            try:
                value = self.from_text(value)
            except ValueError as e:
                raise ValueError(f"{self.flag}: {e}" if self.setting.parse else
                                 f"{self.flag} must be {_KINDS[self.kind]}, got {value!r}") from None
        value = self._typed(value)
        s = self.setting
        allowed = s.allowed()
        if allowed is not None and value not in allowed:
            raise ValueError(f"{self.flag} must be {alternatives(allowed)}, got {value!r}")
        unit = " s" if self.dest.endswith("_s") else ""
        low, high = s.at_least, s.at_most
        if low is not None and high is not None and not low <= value <= high:
            raise ValueError(f"{self.flag} must be in {low:g}..{high:g}{unit}, got {value}")
        if low is not None and value < low:
            raise ValueError(f"{self.flag} must be >= {low:g}{unit}, got {value}")
        if high is not None and value > high:
            raise ValueError(f"{self.flag} must be <= {high:g}{unit}, got {value}")
        if s.above is not None and not value > s.above:
            raise ValueError(f"{self.flag} must be > {s.above:g}{unit}, got {value}")
        if s.check is not None:
            try:
                s.check(value)
            except ValueError as e:
                raise ValueError(f"{self.flag}: {e}") from None
        return value

    def _typed(self, value: Any) -> Any:
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if self.kind is tuple and isinstance(value, list | tuple):
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"{self.flag} must be {_KINDS[tuple]}, got {value!r}")
            return tuple(value)
        if not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool)):
            raise ValueError(f"{self.flag} must be {_KINDS[self.kind]}, got {value!r}")
        return value


def alternatives(choices: Sequence[str]) -> str:
    """"'a' or 'b'", "'a', 'b' or 'c'"."""
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


class Settings:
    """Base of a frozen dataclass of declared settings: constructing one validates every setting
    field (and stores the converted value). A subclass with checks across fields extends
    `__post_init__` and calls this one first. `dest_prefix` starts the dests of its fields (so
    their variables); with `flags_by_field` their flags are named by the field alone (a
    command's own options: `kvfence probe --key`, variable KVFENCE_PROBE_KEY)."""

    dest_prefix: ClassVar[str] = ""
    flags_by_field: ClassVar[bool] = False

    def __post_init__(self) -> None:
        validate(self)


def validate(config: Any) -> None:
    """Check every setting field of `config` (a dataclass instance) and store its converted value;
    ValueError naming the flag."""
    for decl in _own(type(config), ()):
        value = getattr(config, decl.path[-1])
        fixed = decl.normalized(value)
        if fixed is not value:
            object.__setattr__(config, decl.path[-1], fixed)


def _kind(hint: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of `X` or `X | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"a setting holds one type (or None), not {hint}")
        return _kind(args[0])[0], True
    if typing.get_origin(hint) is tuple:
        if typing.get_args(hint) != (str, ...):
            raise TypeError(f"a list setting holds strings (tuple[str, ...]), not {hint}")
        return tuple, False
    return hint, False


def _own(cls: type, path: tuple[str, ...]) -> Iterator[Declared]:
    """The settings `cls` itself declares (not those of its sections)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        s = f.metadata.get(_SETTING)
        if s is None and "help" in f.metadata:  # declared as plain metadata, by a package below the app
            s = Setting(**f.metadata)
        if s is None:
            continue
        kind, optional = _kind(hints[f.name])
        if kind not in _KINDS:
            raise TypeError(f"{cls.__name__}.{f.name}: a setting is a str, int, float, bool or tuple[str, ...], "
                            f"not {kind}")
        prefix = getattr(cls, "dest_prefix", "")
        yield Declared(path=(*path, f.name), dest=s.dest or prefix + f.name, kind=kind, optional=optional,
                       default=f.default, setting=s, flag_by_field=getattr(cls, "flags_by_field", False))


def _sections(cls: type) -> Iterator[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get(_SECTION):
            yield f.name, hints[f.name]


def declared(cls: type, path: tuple[str, ...] = ()) -> list[Declared]:
    """Every setting of the config tree rooted at `cls`, depth first in declaration order.
    TypeError when two share a dest or a flag (a declaration bug)."""
    found = list(_own(cls, path))
    for name, sub in _sections(cls):
        found += declared(sub, (*path, name))
    if not path:
        for attr in ("dest", "flag"):
            seen: dict[str, Declared] = {}
            for d in found:
                other = seen.setdefault(getattr(d, attr), d)
                if other is not d:
                    raise TypeError(f"{other.toml_key} and {d.toml_key} share the {attr} {getattr(d, attr)!r}")
    return found


def add_flags(parser: argparse.ArgumentParser, cls: type, only: Sequence[str] | None = None) -> None:
    """One flag per setting of `cls` (or of the dests in `only`), grouped by section, each with
    default None so that `load` knows it was not given."""
    groups: dict[tuple[str, ...], Any] = {}
    for d in declared(cls):
        if only is not None and d.dest not in only:
            continue
        table = d.path[:-1]
        if table not in groups:
            groups[table] = parser.add_argument_group(f"[{'.'.join(table)}]") if table and only is None else parser
        kw: dict[str, Any] = {"dest": d.dest, "default": None, "help": _flag_help(d)}
        if d.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif d.kind is tuple:  # repeatable: each use adds one
            kw["action"], kw["type"], kw["metavar"] = "append", str, d.path[-1].upper()
        else:
            kw["type"] = str if d.setting.parse is not None else d.kind
            kw["choices"] = d.setting.allowed()
            if kw["choices"] is None:
                kw["metavar"] = _metavar(d)
        groups[table].add_argument(d.flag, **kw)


def _metavar(d: Declared) -> str:
    if d.dest.endswith("_s"):
        return "SECONDS"
    if d.setting.parse is not None:
        return "VALUE"
    return {int: "N", float: "X"}.get(d.kind) or d.path[-1].upper()


def _flag_help(d: Declared) -> str:
    text = d.setting.help.replace("%", "%%")  # argparse formats help with %
    if d.default is None or d.default == () or d.kind is bool and d.default is False:
        return text
    shown = d.default if isinstance(d.default, str) and d.default else _toml(d.default)
    return f"{text} (default {shown})"


def _toml(value: Any) -> str:
    """`value` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return f'"{value}"' if isinstance(value, str) else str(value)


def load(cls: type, flags: Mapping[str, Any], environ: Mapping[str, str], table: Mapping[str, Any],
         source: str = "the config file") -> Any:
    """A `cls` from its declared defaults < `table` (parsed TOML, one nested table per section)
    < KVFENCE_* variables in `environ` < `flags` (by dest; None means not given, other keys are
    ignored). ValueError for an unknown key in `table` (named with `source`) or a variable whose
    text is not a value of its setting; the config's own validation names the flag."""
    decls = declared(cls)
    values = _from_table(cls, table, (), source)
    for d in decls:
        names = [d.env, *d.setting.env_aliases]
        name = next((n for n in names if n in environ), None)
        if name is not None:
            try:
                values[d.path] = d.from_text(environ[name])
            except ValueError as e:
                raise ValueError(f"{name}={environ[name]!r} is not a valid value for {d.flag} ({e})") from None
        if flags.get(d.dest) is not None:
            values[d.path] = flags[d.dest]
    return _build(cls, values, ())


def _from_table(cls: type, table: Mapping[str, Any], path: tuple[str, ...], source: str) -> dict[tuple[str, ...], Any]:
    own = {d.path[-1]: d for d in _own(cls, path)}
    sections = dict(_sections(cls))
    values: dict[tuple[str, ...], Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in own:
            values[(*path, name)] = value
        elif name in sections and isinstance(value, Mapping):
            values |= _from_table(sections[name], value, (*path, name), source)
        else:
            raise ValueError(f"{source}: unknown setting {'.'.join((*path, key))!r}{_hint(cls, name, path)}")
    return values


def _hint(cls: type, name: str, path: tuple[str, ...]) -> str:
    """Where a setting of that name lives, for a key written in the wrong table."""
    if path:
        return ""
    for d in declared(cls):
        if name in (d.dest, d.path[-1]) and len(d.path) > 1:
            return f"; did you mean {d.path[-1]!r} in the [{'.'.join(d.path[:-1])}] table?"
    return ""


def _build(cls: type, values: Mapping[tuple[str, ...], Any], path: tuple[str, ...]) -> Any:
    kwargs = {d.path[-1]: values[d.path] for d in _own(cls, path) if d.path in values}
    for name, sub in _sections(cls):
        kwargs[name] = _build(sub, values, (*path, name))
    built = cls(**kwargs)
    if not isinstance(built, Settings):  # declared as plain metadata: checked here
        validate(built)
    return built


def reference(cls: type) -> str:
    """A markdown table of every setting: TOML key, flag, variable, default and meaning."""
    rows = ["| TOML key | flag | variable | default | meaning |", "|---|---|---|---|---|"]
    for d in declared(cls):
        meaning = d.setting.help
        allowed = d.setting.allowed()
        if allowed is not None:
            meaning += "; one of " + ", ".join(f"`{c}`" for c in allowed)
        env = " / ".join(f"`{e}`" for e in (d.env, *d.setting.env_aliases))
        default = "unset" if d.default is None or d.default == () else f"`{_toml(d.default)}`"
        meaning = meaning.replace("|", r"\|")
        rows.append(f"| `{d.toml_key}` | `{d.flag}` | {env} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"
