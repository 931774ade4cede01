"""Every struct of more than three fields is built by keyword: a dataclass, a msgspec.Struct or a
NamedTuple of the packages, wherever it is built (the packages, tests/, scripts/). Built by
position, a call reads nothing of what it passes, and two fields of one type swapped, or one
added in the middle, still run.

Checked on the source, nothing imported: the structs are read from their classes (their own
annotated fields and those of their project bases, ClassVars aside), and a call counts where
its name is the struct in that file: defined there, imported from a kvfence module that has it
(or re-exports it), `module.Name` of such a module, or `cls` in one of the struct's
classmethods. A name of another library (starlette's Request) or of a smaller project class is
not the struct. Only generated constructors count: a class with its own __init__ names its
parameters itself."""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["app", "engine", "kernels", "scheduler", "transports"]  # installed as kvfence.<name>
CALLERS = [*PACKAGES, "tests", "scripts"]
MOST_POSITIONAL = 3  # fields a struct may have and still be built by position

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_SCOPES = (*_FUNCTIONS, ast.Lambda, ast.ClassDef, *_COMPREHENSIONS)

# What a name is bound to: ("module", dotted), ("class", module, name), ("from", module, name)
# (an import not yet followed) or ("other",) (anything else: a foreign name, a variable).
Target = tuple[str, ...]
OTHER: Target = ("other",)


@dataclasses.dataclass
class Struct:
    module: str
    name: str
    kind: str  # "dataclass", "struct" or "namedtuple"
    fields: list[str]  # own and inherited, base fields first
    generated: bool  # the constructor is the generated one (no __init__ of its own, not init=False)


@dataclasses.dataclass
class Source:
    path: str  # relative to the root, for the messages
    module: str | None  # kvfence.<...> for the packages, the bare stem for tests/ and scripts/
    tree: ast.Module

    @property
    def package(self) -> bool:
        return self.path.endswith("__init__.py")


class Project:
    """The sources, what each module's names are, and the structs among its classes."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self.modules = {s.module: s for s in sources if s.module}
        self.modules.update({name: Source("", name, ast.Module(body=[], type_ignores=[]))
                             for name in _packages_of(m for m in self.modules if m.startswith("kvfence."))
                             if name not in self.modules})
        self._globals = {name: _bindings(s.tree, s.module, s.package) for name, s in self.modules.items()}
        self._structs: dict[tuple[str, str], Struct | None] = {}

    def resolve(self, target: Target, seen: frozenset[Target] = frozenset()) -> Target:
        """`target` with its imports followed to what they name."""
        if target[0] != "from" or target in seen:
            return target if target[0] != "from" else OTHER
        _, module, name = target
        if f"{module}.{name}" in self.modules:
            return ("module", f"{module}.{name}")
        return self.member(module, name, seen | {target})

    def member(self, module: str, name: str, seen: frozenset[Target] = frozenset()) -> Target:
        """What `name` is at the top of `module`."""
        if f"{module}.{name}" in self.modules:
            return ("module", f"{module}.{name}")
        bound = self._globals.get(module, {}).get(name)
        return _one({self.resolve(t, seen) for t in bound}) if bound else OTHER

    def struct(self, module: str, name: str) -> Struct | None:
        """The struct `module`.`name` is, or None where it is no struct (or no class)."""
        key = (module, name)
        if not module.startswith("kvfence."):
            return None  # a class of tests/ or scripts/: not one of the packages' structs
        if key not in self._structs:
            self._structs[key] = None  # a class that is its own base stops here
            body = self.modules[module].tree.body if module in self.modules else []
            node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)
            self._structs[key] = self._read(module, node) if node else None
        return self._structs[key]

    def _read(self, module: str, node: ast.ClassDef) -> Struct | None:
        bases = [self._base(module, b) for b in node.bases]
        parents = [b for b in bases if isinstance(b, Struct)]
        kinds = {b.kind if isinstance(b, Struct) else b for b in bases if b}
        inherited: list[str] = []
        for parent in parents:
            inherited += [f for f in parent.fields if f not in inherited]
        own_init = any(isinstance(n, _FUNCTIONS) and n.name in ("__init__", "__new__") for n in node.body)
        decorators = [d for d in node.decorator_list if _tail(d.func if isinstance(d, ast.Call) else d) == "dataclass"]
        if decorators:
            no_init = any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                          for d in decorators if isinstance(d, ast.Call) for k in d.keywords)
            kind, generated = "dataclass", not own_init and not no_init
        elif kinds & {"struct", "namedtuple"}:
            kind, generated = "struct" if "struct" in kinds else "namedtuple", not own_init
        elif "dataclass" in kinds:  # not decorated itself: its bases' constructor, and its annotations are no fields
            return Struct(module, node.name, "dataclass", inherited,
                          not own_init and all(p.generated for p in parents))
        else:
            return None
        return Struct(module, node.name, kind, inherited + [f for f in _annotated(node) if f not in inherited],
                      generated)

    def _base(self, module: str, base: ast.expr) -> Struct | str | None:
        """A base class: a project struct, "struct" or "namedtuple" for a foreign one, else None."""
        target = self.expression(base, lambda name: self.member(module, name))
        if target[0] == "class":
            return self.struct(target[1], target[2])
        if target[0] == "struct":
            return "struct"
        text = ast.unparse(base)
        if text.endswith("Struct"):
            return "struct"
        if text.split(".")[-1] == "NamedTuple":
            return "namedtuple"
        return None

    def expression(self, node: ast.expr, lookup: Callable[[str], Target]) -> Target:
        """What `node`, a name or a dotted name, is, its first name looked up with `lookup`."""
        if isinstance(node, ast.Name):
            return lookup(node.id)
        if isinstance(node, ast.Attribute):
            outer = self.expression(node.value, lookup)
            if outer[0] == "module":
                return self.member(outer[1], node.attr)
        return OTHER


def _one(targets: set[Target]) -> Target:
    """The one thing a name is bound to in a scope, or OTHER where the scope binds it to several
    (an import and a fallback, two imports): such a name is not known to be the struct."""
    return targets.pop() if len(targets) == 1 else OTHER


def _tail(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""


def _packages_of(modules: Iterator[str]) -> set[str]:
    return {".".join(m.split(".")[:i]) for m in modules for i in range(1, m.count(".") + 1)}


def _annotated(node: ast.ClassDef) -> list[str]:
    """The fields a class body declares: its annotated names, but ClassVars and dataclasses.KW_ONLY."""
    fields = []
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            annotation = statement.annotation
            text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
            head = str(text).split("[")[0].split(".")[-1].strip()
            if head not in ("ClassVar", "KW_ONLY"):
                fields.append(statement.target.id)
    return fields


def _absolute(module: str | None, path_is_package: bool, level: int, name: str | None) -> str:
    """The module a `from` import names, relative ones made absolute."""
    if not level or not module:
        return name or ""
    parts = module.split(".")
    base = parts if path_is_package else parts[:-1]
    base = base[:len(base) - level + 1]
    return ".".join([*base, name] if name else base)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes that run in `scope`, those of the scopes inside it aside (their names,
    decorators, defaults and bases are the outer scope's)."""
    if isinstance(scope, (ast.Module, ast.ClassDef, *_FUNCTIONS)):
        stack: list[ast.AST] = list(scope.body)
    elif isinstance(scope, ast.Lambda):
        stack = [scope.body]
    elif isinstance(scope, _COMPREHENSIONS):
        stack = [*scope.generators, *(getattr(scope, part) for part in ("elt", "key", "value") if hasattr(scope, part))]
    else:
        stack = []
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _FUNCTIONS):
            stack += [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d)]
        elif isinstance(node, ast.Lambda):
            stack += [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]
        elif isinstance(node, ast.ClassDef):
            stack += [*node.decorator_list, *node.bases, *node.keywords]
        elif not isinstance(node, _COMPREHENSIONS):
            stack += ast.iter_child_nodes(node)


def _arguments(scope: ast.AST) -> list[str]:
    if not isinstance(scope, (*_FUNCTIONS, ast.Lambda)):
        return []
    a = scope.args
    return [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x]


def _bindings(scope: ast.AST, module: str | None, package: bool) -> dict[str, set[Target]]:
    """What each name `scope` binds is bound to (imports not yet followed)."""
    bound: dict[str, set[Target]] = {name: {OTHER} for name in _arguments(scope)}
    free: set[str] = set()
    for node in _own_nodes(scope):
        targets: list[tuple[str, Target]] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    targets.append((alias.asname, ("module", alias.name)))
                else:
                    targets.append((alias.name.split(".")[0], ("module", alias.name.split(".")[0])))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, package, node.level, node.module)
            targets += [(a.asname or a.name, ("from", source, a.name)) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.ClassDef):
            top = module is not None and isinstance(scope, ast.Module)  # a class at the top of a module
            targets.append((node.name, ("class", module or "", node.name) if top else OTHER))
        elif isinstance(node, (*_FUNCTIONS, ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            targets.append((node.name, OTHER))
        elif isinstance(node, ast.MatchMapping) and node.rest:
            targets.append((node.rest, OTHER))
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            made = isinstance(scope, ast.Module) and _defstruct(node, scope)
            targets.append((node.id, ("struct",) if made else OTHER))
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            free.update(node.names)
        for name, target in targets:
            bound.setdefault(name, set()).add(target)
    for name in free:
        bound.pop(name, None)
    return bound


def _defstruct(name: ast.Name, module: ast.Module) -> bool:
    """`name = msgspec.defstruct(...)` at the top of a module: a Struct made at run time."""
    return any(isinstance(s, ast.Assign) and name in s.targets and isinstance(s.value, ast.Call)
               and _tail(s.value.func) == "defstruct" for s in module.body)


def _module_of(path: Path, root: Path) -> str:
    """The module `path` is imported as: kvfence.<...> in the packages, its bare stem in tests/ and
    scripts/ (their helpers are imported so, from the folder on sys.path)."""
    relative = path.relative_to(root)
    if relative.parts[0] not in PACKAGES:
        return path.stem
    parts = ["kvfence", *relative.with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def read_project(root: Path) -> Project:
    sources = []
    stems: dict[str, int] = {}
    paths = [p for folder in CALLERS for p in sorted((root / folder).rglob("*.py"))]
    for path in paths:
        stems[path.stem] = stems.get(path.stem, 0) + (path.relative_to(root).parts[0] not in PACKAGES)
    for path in paths:
        module: str | None = _module_of(path, root)
        if module and not module.startswith("kvfence.") and stems[module] > 1:
            module = None  # a stem of tests/ or scripts/ that names several files: imported by none of them here
        sources.append(Source(str(path.relative_to(root)), module, ast.parse(path.read_text(), str(path))))
    return Project(sources)


def positional_constructions(project: Project, source: Source) -> list[tuple[ast.Call, Struct]]:
    """(call, struct) of every call in `source` that builds a struct of more than
    MOST_POSITIONAL fields with an argument by position."""
    def visit(scope: ast.AST, chain: list[tuple[ast.AST, dict[str, set[Target]]]]) -> Iterator[tuple[ast.Call, Struct]]:
        bound = _bindings(scope, source.module, source.package)
        chain = [*chain, (scope, bound)]

        def lookup(name: str) -> Target:
            for depth, (node, names) in enumerate(reversed(chain)):
                if isinstance(node, ast.ClassDef) and depth:
                    continue  # a class body's names are not seen by the functions in it
                if name in names:
                    return _one({project.resolve(t) for t in names[name]})
            return OTHER

        for node in _own_nodes(scope):
            if isinstance(node, _SCOPES):
                yield from visit(node, chain)
            if isinstance(node, ast.Call) and node.args:
                target = project.expression(node.func, lookup)
                if target[0] == "class":
                    struct = project.struct(target[1], target[2])
                    if struct and struct.generated and len(struct.fields) > MOST_POSITIONAL:
                        yield node, struct

    found = {id(call): (call, struct) for call, struct in visit(source.tree, [])}
    # `cls(...)` in a classmethod of a struct at the top of a package module builds that struct
    for cls in source.tree.body:
        if not isinstance(cls, ast.ClassDef) or not source.module:
            continue
        struct = project.struct(source.module, cls.name)
        if not (struct and struct.generated and len(struct.fields) > MOST_POSITIONAL):
            continue
        for method in cls.body:
            if (isinstance(method, _FUNCTIONS) and method.args.args
                    and any(_tail(d) == "classmethod" for d in method.decorator_list)):
                name = method.args.args[0].arg
                found.update((id(n), (n, struct)) for n in ast.walk(method) if isinstance(n, ast.Call) and n.args
                             and isinstance(n.func, ast.Name) and n.func.id == name)
    return sorted(found.values(), key=lambda item: (item[0].lineno, item[0].col_offset))


def structs(project: Project) -> list[Struct]:
    """Every struct class of the packages, whatever its number of fields."""
    found = []
    for source in project.sources:
        if source.module and source.module.startswith("kvfence."):
            for node in source.tree.body:
                if isinstance(node, ast.ClassDef) and (struct := project.struct(source.module, node.name)):
                    found.append(struct)
    return found


def test_every_struct_of_more_than_three_fields_is_built_by_keyword() -> None:
    project = read_project(ROOT)
    found = [f"{source.path}:{call.lineno}: {struct.name} ({struct.module}, {len(struct.fields)} fields)"
             for source in project.sources for call, struct in positional_constructions(project, source)]
    assert not found, (f"structs of more than {MOST_POSITIONAL} fields built by position (pass every argument "
                       "by keyword):\n" + "\n".join(found))


def test_the_structs_are_found() -> None:
    """The reading of the classes still sees the structs it is there for (were it to see none, the
    check above would pass on anything)."""
    found = {(s.module, s.name): s for s in structs(read_project(ROOT))}
    run_step = found[("kvfence.engine.protocol", "RunStep")]
    assert run_step.kind == "struct" and run_step.generated and len(run_step.fields) > MOST_POSITIONAL
    assert len([s for s in found.values() if len(s.fields) > MOST_POSITIONAL]) > 20


# A package module and callers of it: every call the check must flag ends in `# by position`.
PROBE_STRUCTS = '''
import dataclasses
from typing import ClassVar, NamedTuple

import msgspec


@dataclasses.dataclass(frozen=True)
class Four:
    a: int
    b: int
    c: int
    d: int
    limit: ClassVar[int] = 3


@dataclasses.dataclass
class Three:
    a: int
    b: int
    c: int
    limit: ClassVar[int] = 3


class Base(msgspec.Struct):
    a: int
    b: int


class Derived(Base):
    c: int
    d: int

    @classmethod
    def make(cls, n: int) -> "Derived":
        return cls(n, n, n, n)  # by position


class Quad(NamedTuple):
    a: int
    b: int
    c: int
    d: int


@dataclasses.dataclass
class Own:
    a: int
    b: int
    c: int
    d: int

    def __init__(self, a: int, b: int, c: int, d: int) -> None:
        pass


FOUR = Four(1, 2, c=3, d=4)  # by position
'''

PROBE_OTHER = '''
import dataclasses
from .probe import Derived


@dataclasses.dataclass
class Four:
    a: int
'''

PROBE_CALLER = '''
import kvfence.app.probe
from starlette.requests import Request
from kvfence.app import probe
from kvfence.app import probe as alias
from kvfence.app.probe import Four, Three, Own
from kvfence.app.other import Four as Small, Derived


def build(request: Request) -> None:
    Four(a=1, b=2, c=3, d=4)
    Four(*(1, 2, 3, 4))  # by position
    probe.Quad(1, 2, 3, 4)  # by position
    alias.Quad(a=1, b=2, c=3, d=4)
    kvfence.app.probe.Four(1, 2, 3, 4)  # by position
    Derived(1, 2, 3, 4)  # by position
    Three(1, 2, 3)
    Own(1, 2, 3, 4)
    Small(1)
    Request(1, 2, 3, 4)


def shadowed(Four: object) -> None:
    Four(1, 2, 3, 4)


def local() -> None:
    from starlette.requests import Request as Four
    Four(1, 2, 3, 4)
'''


def test_the_check_flags_a_positional_call_and_passes_a_keyword_one() -> None:
    texts = {"app/probe.py": PROBE_STRUCTS, "app/other.py": PROBE_OTHER, "tests/test_probe.py": PROBE_CALLER}
    sources = [Source(path, "test_probe" if path.startswith("tests/") else "kvfence." + path[:-3].replace("/", "."),
                      ast.parse(text)) for path, text in texts.items()]
    project = Project(sources)
    found = {(s.path, call.lineno) for s in sources for call, _ in positional_constructions(project, s)}
    marked = {(path, number) for path, text in texts.items()
              for number, line in enumerate(text.splitlines(), 1) if line.endswith("# by position")}
    assert found == marked
    derived = project.struct("kvfence.app.probe", "Derived")
    assert derived and derived.kind == "struct" and derived.fields == ["a", "b", "c", "d"]
    assert [s.name for s in structs(project)] == ["Four", "Three", "Base", "Derived", "Quad", "Own", "Four"]
