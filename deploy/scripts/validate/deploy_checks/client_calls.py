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
    """A caller's code: the folders (or files) under the repository root it is made of."""

    name: str
    roots: tuple[str, ...]
    exclude: tuple[str, ...] = ()

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


def grpc_calls(files: Iterable[Path]) -> dict[str, set[str]]:
    """Paths called, by the service's short name (`RoutingService`, `Health`)."""
    stubs: set[str] = set()
    names: set[str] = set()
    for path in files:
        source = path.read_text(encoding="utf-8")
        stubs.update(service for _, service in _STUB.findall(source))
        names |= _called_names(ast.parse(source))
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


def http_paths(files: Iterable[Path]) -> set[str]:
    """The request paths the code calls."""
    out: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
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
