"""What each kvplane client calls, read from its source: the gRPC methods and the HTTP paths.

The mesh policies must allow every call the code makes, and a policy written from memory misses
the ones nobody thinks of (a health check, a `/tokenize`). So the calls are read from the code:

- gRPC: a caller group's code builds stubs (`routing_pb2_grpc.RoutingServiceStub(...)`,
  `health_pb2_grpc.HealthStub(...)`) and calls methods on them (`stub.Route(...)`). Every method
  of a service whose stub the group builds, called by name anywhere in the group's code, is a call
  it makes, as the path `/<package>.<Service>/<Method>` the server's proxy sees.
- HTTP (the gateway to the engines): every string constant of the group's code that is a request
  path (`"/v1/completions"`, `"/tokenize"`), leaving out the paths the group serves itself (the
  arguments of `router.add_*` and the `*_PATHS` sets that name them).

A group is folders read whole (the gateway: its own and the routing client's), or, for processes
built from parts of others (the endpoint picker and the decode sidecar run pieces of the gateway),
its own folder plus what that code reaches through its imports in the folders it `follow`s (the
gateway's and the routing client's, where the calls are made; not services/common's settings and
telemetry, whose constants name etcd keys and gRPC methods it serves, not calls): of every such
module it imports from, the top-level functions, classes and constants it names, and what those
name in turn (`reachable_code`). A class is read with all its methods; a function whose name is
never imported or referenced is not read, so the sidecar, which borrows the gateway's
`split_host_port`, is not taken for a caller of routing.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .report import ROOT

HEALTH_SERVICE = "grpc.health.v1.Health"
HEALTH_METHODS = frozenset({"Check", "Watch"})
_STUB = re.compile(r"\b(\w+)_pb2_grpc\.(\w+?)(?:Async)?Stub\b")
_PATH = re.compile(r"/[a-z][\w/.-]*")


@dataclass(frozen=True)
class CallerCode:
    """A caller's code: the folders (or files) under the repository root it is made of; with
    `follow`, also what they reach of the modules they import from those folders."""

    name: str
    roots: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    follow: tuple[str, ...] = ()

    def units(self) -> list[ast.AST]:
        """The code to read: the files whole, and what they reach in the folders they follow."""
        if self.follow:
            return reachable_code(self.files(), self.roots + self.follow)
        return [ast.parse(f.read_text(encoding="utf-8")) for f in self.files()]

    def files(self) -> list[Path]:
        out: list[Path] = []
        for root in self.roots:
            path = ROOT / root
            found = [path] if path.is_file() else sorted(path.rglob("*.py"))
            out += [
                f
                for f in found
                if "_pb2" not in f.name
                and not any(str(f.relative_to(ROOT)).startswith(x) for x in self.exclude)
            ]
        return out


def proto_services() -> dict[str, frozenset[str]]:
    """kvplane's services by short name (`RoutingService`), with their RPC names."""
    out: dict[str, frozenset[str]] = {}
    for proto in sorted((ROOT / "protos" / "kvplane" / "v1").glob("*.proto")):
        text = proto.read_text()
        for match in re.finditer(r"^service\s+(\w+)\s*\{(.*?)^\}", text, re.M | re.S):
            out[match.group(1)] = frozenset(re.findall(r"^\s*rpc\s+(\w+)\s*\(", match.group(2), re.M))
    return out


def _proto_package() -> str:
    text = (ROOT / "protos" / "kvplane" / "v1" / "routing.proto").read_text()
    found = re.search(r"^package\s+([\w.]+);", text, re.M)
    return found.group(1) if found else "kvplane.v1"


def _called_names(tree: ast.AST) -> set[str]:
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }


def _units(code: Iterable[Path] | Iterable[ast.AST]) -> list[ast.AST]:
    return [c if isinstance(c, ast.AST) else ast.parse(c.read_text(encoding="utf-8")) for c in code]


def grpc_calls(code: Iterable[Path] | Iterable[ast.AST]) -> dict[str, set[str]]:
    """Paths called, by the service's short name (`RoutingService`, `Health`), in files or units."""
    stubs: set[str] = set()
    names: set[str] = set()
    for unit in _units(code):
        stubs.update(service for _, service in _STUB.findall(ast.unparse(unit)))
        names |= _called_names(unit)
    services = proto_services()
    package = _proto_package()
    out: dict[str, set[str]] = {}
    for service in sorted(stubs):
        if service == "Health":
            out[service] = {f"/{HEALTH_SERVICE}/{m}" for m in HEALTH_METHODS & names}
        elif service in services:
            out[service] = {f"/{package}.{service}/{m}" for m in services[service] & names}
    return {k: v for k, v in out.items() if v}


def _served(tree: ast.AST) -> set[int]:
    """ids of the string nodes that name a path the code serves, not one it calls."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr.startswith("add_")
        ):
            out.update(id(a) for a in node.args if isinstance(a, ast.Constant))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id.endswith("_PATHS") for t in targets):
                out.update(id(c) for c in ast.walk(node) if isinstance(c, ast.Constant))
    return out


def http_paths(code: Iterable[Path] | Iterable[ast.AST]) -> set[str]:
    """The request paths the code (files or units) calls."""
    out: set[str] = set()
    for tree in _units(code):
        served = _served(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in served
                and _PATH.fullmatch(node.value)
            ):
                out.add(node.value)
    return out


def served_http_paths(files: Iterable[Path]) -> set[str]:
    """The paths the code serves: the constant arguments of its `router.add_*` calls."""
    out: set[str] = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("add_")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and node.args[0].value.startswith("/")
            ):
                out.add(node.args[0].value)
    return out


# Where the distribution's packages live in the repository (pyproject's package-dir).
_PACKAGE_DIRS = {"kvplane.services": "services", "kvplane.connector": "connector", "kvplane.bench": "bench"}


def _module_file(module: str, within: tuple[str, ...]) -> Path | None:
    """The file of a kvplane module, if it lies in one of the folders `within`."""
    for prefix, directory in _PACKAGE_DIRS.items():
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) :].lstrip(".").replace(".", "/")
            base = ROOT / directory / rest if rest else ROOT / directory
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                relative = str(candidate.relative_to(ROOT))
                if candidate.is_file() and any(relative.startswith(w.rstrip("/") + "/") for w in within):
                    return candidate
    return None


class _Module:
    """One kvplane module: its top-level definitions, and the names its imports bind."""

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.defs: dict[str, list[ast.AST]] = {}
        for statement in self.tree.body:
            for bound in _bound_names(statement):
                self.defs.setdefault(bound, []).append(statement)
        # local name -> (module, attribute): `from m import a as b` binds b to (m, a);
        # `import m as b` binds b to (m, None).
        self.imports: dict[str, tuple[str, str | None]] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.imports[alias.asname] = (alias.name, None)


def _bound_names(node: ast.AST) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def reachable_code(files: Iterable[Path], within: tuple[str, ...]) -> list[ast.AST]:
    """`files` whole, and every top-level definition of a kvplane module in the folders `within`
    that they reach by name through their imports, transitively (see the module's docstring)."""
    modules: dict[str, _Module | None] = {}

    def module(name: str) -> _Module | None:
        if name not in modules:
            path = _module_file(name, within)
            modules[name] = _Module(name, path) if path is not None else None
        return modules[name]

    units: list[ast.AST] = []
    seen: set[tuple[str, str]] = set()
    # (module, name) pairs to read: a definition of `name` in `module`, or a name it imports.
    work: list[tuple[str, str]] = []

    def resolve(mod: _Module, name: str) -> str | None:
        """The kvplane module `name` stands for in `mod`, if it is one."""
        target = mod.imports.get(name)
        if target is None:
            return None
        full = target[0] if target[1] is None else f"{target[0]}.{target[1]}"
        return full if module(full) is not None else None

    def scan(mod: _Module, unit: ast.AST) -> None:
        """Queue every name `unit` uses that `mod` defines or imports from kvplane."""
        for node in ast.walk(unit):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                submodule = resolve(mod, node.value.id)
                if submodule is not None:
                    work.append((submodule, node.attr))
            if isinstance(node, ast.Name):
                if node.id in mod.defs:
                    work.append((mod.name, node.id))
                elif node.id in mod.imports:
                    source, attr = mod.imports[node.id]
                    if attr is not None and module(f"{source}.{attr}") is None:
                        work.append((source, attr))

    for path in files:
        name = _module_name(path)
        root = module(name) if name else None
        tree = root.tree if root is not None else ast.parse(path.read_text(encoding="utf-8"))
        units.append(tree)
        if root is not None:
            for imported in root.imports:
                # Names the root file imports are used by it (or re-exported): read them.
                source, attr = root.imports[imported]
                if attr is not None and module(f"{source}.{attr}") is None:
                    work.append((source, attr))
    while work:
        key = work.pop()
        if key in seen:
            continue
        seen.add(key)
        mod = module(key[0])
        if mod is None:
            continue
        if key[1] in mod.defs:
            for node in mod.defs[key[1]]:
                units.append(node)
                scan(mod, node)
        elif key[1] in mod.imports:
            # A re-export (`from kvplane.services.client import RouteResult`): follow it.
            source, attr = mod.imports[key[1]]
            if attr is not None:
                work.append((source, attr))
    return units


def _module_name(path: Path) -> str | None:
    """The kvplane module a repository file is."""
    relative = path.resolve().relative_to(ROOT)
    for prefix, directory in _PACKAGE_DIRS.items():
        if relative.parts[0] == directory:
            parts = list(relative.with_suffix("").parts[1:])
            if parts and parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join([prefix, *parts])
    return None
