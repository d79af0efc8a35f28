"""Which part of kvplane may import which, read from the source: nothing is imported or run.

The package map comes from pyproject.toml (`[tool.setuptools]`: `package-dir` and `packages`),
so every source file has the dotted name it has once installed. Every import counts, at module
level or inside a function: `import x`, `from x import y` (as `x.y` when that is a module), a
relative import, `importlib.import_module("x")`, and a string naming a kvplane module (a command
table's `"kvplane.bench.live:main"`, loaded by name).

The rules (STYLE.md, DESIGN.md):

- pure policy and bookkeeping code does no I/O and reads no clock: time is an argument;
- the routing client and the connector import, of kvplane, only themselves, the domain model and
  the API (`kvplane.v1`), but for the exceptions named below with their reasons;
- the sim-engine (`kvplane.connector.simengine`) imports, of kvplane, itself, the connector, the
  domain model, the API and the process runtime named below; the connector never imports it;
- services/common is imported by the services, never the reverse, nor does it import the client;
- product code does not import the benchmarks (`kvplane.bench`);
- every source file is importable under one name only.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The domain model: values, their rules and their protobuf form. Pure code, importing nothing of
# kvplane but each other and kvplane.v1; what the client and the connector may build on. Every
# module of services/common/model is listed (test_every_model_module_is_domain), with what it holds.
MODEL = "kvplane.services.common.model"
DOMAIN = frozenset(
    {
        f"{MODEL}.errors",  # error types (their gRPC status is mapped elsewhere)
        f"{MODEL}.handles",  # cache handles, claims, releases
        f"{MODEL}.nodes",  # nodes, their loads and fingerprints
        f"{MODEL}.suspects",  # suspect marks on nodes
        f"{MODEL}.validation",  # input limits over the domain values
        f"{MODEL}.convert",  # protobuf <-> domain values, at the API boundary
        f"{MODEL}.headers",  # call metadata keys: the API's part the protos cannot name
        f"{MODEL}.keys",  # where each fact lives in etcd: the key layout, as pure functions
        f"{MODEL}.block_hashes",  # vLLM's prefix-cache block hashes, predicted from token ids
        f"{MODEL}.kv_events",  # vLLM's KV-cache event batches on the wire
        f"{MODEL}.loopback",  # which addresses stay on this machine (may carry a secret in clear)
        f"{MODEL}.json_text",  # compact JSON text of the values kvplane builds (kv_transfer_params)
        MODEL,
        "kvplane.connector.digests",  # the token-block digests a handle carries
    }
)
API = "kvplane.v1"

# Pure policy and bookkeeping: no I/O, no clock read. Every module below these packages, and the
# modules whose docstrings say so (a module documenting "no I/O" or "time is an argument" must be
# listed here: test_modules_documented_as_pure_are_held_to_it).
PURE_PACKAGES = (
    "kvplane.services.routing.policy",
    "kvplane.services.routing.state",
    "kvplane.services.eviction.policy",
)
PURE_MODULES = frozenset(
    {
        "kvplane.services.gateway.suspects",  # "Time is an argument ..., never read here"
        "kvplane.services.gateway.fallback",  # "`pick_engine` is a pure rule ... Time is an argument"
        "kvplane.services.gateway.failover",  # "Pure: no I/O and no clock reads"
        "kvplane.services.epp.destinations",  # "Pure: no I/O."
        "kvplane.services.routing.transfer_params",  # "Pure: vLLM's wire keys ... no I/O"
        "kvplane.services.common.runtime.bounded_map",  # a size-bounded dict, kept by routing's pure state
        "kvplane.services.common.model.block_hashes",  # "Pure: no I/O."
        "kvplane.services.common.model.loopback",  # "Pure: no I/O, no name resolution"
        "kvplane.services.ops.views",  # "Pure: no I/O; the time ... is an argument"
        "kvplane.services.etcd_access.auth_plan",  # "Pure: no I/O."
        "kvplane.services.etcd_access.principals",  # "Pure: names and a key range."
        "kvplane.bench.sim.cache_events",  # "Pure: no I/O; time is an argument."
        "kvplane.bench.sim.block_chain",  # block values as runs: pure data
        "kvplane.services.common.model.kv_events",  # "Pure: no I/O."
        "kvplane.connector.kv_events.block_set",  # "Pure: no I/O, no clock."
    }
)
# What pure code must not import: the store, network and process I/O, threads, waiting, the clock.
IO_MODULES = (
    "kvplane.services.common.store",
    "grpc",
    "aetcd",
    "aiohttp",
    "zmq",
    "asyncio",
    "uvloop",
    "socket",
    "ssl",
    "selectors",
    "http",
    "urllib.request",
    "subprocess",
    "multiprocessing",
    "concurrent",
    "threading",
    "signal",
    "os",
    "shutil",
    "tempfile",
    "time",
)
# Clock reads through datetime: `datetime.now()`, `datetime.datetime.utcnow()`, `date.today()`.
CLOCK_ATTRIBUTES = frozenset({"now", "utcnow", "today"})
CLOCK_OWNERS = frozenset({"datetime", "date"})

CLIENT = "kvplane.services.client"
CONNECTOR = "kvplane.connector"
# The sim-engine: an engine that imitates vLLM with kvplane's connector, beside the connector it
# imitates. It runs as its own process, so it is held to its own rule, not the connector's.
SIMENGINE = "kvplane.connector.simengine"
COMMON = "kvplane.services.common"
# services/common's layers, bottom to top: the domain model, the process runtime, the etcd store.
# Above them, services/common's own top modules (the settings, a service process) compose them.
COMMON_LAYERS = (MODEL, f"{COMMON}.runtime", f"{COMMON}.store")

# Named exceptions, each (importer, imported module) with the reason it stands. Every entry must
# still be used (test_every_exception_is_still_needed), so a fixed one cannot linger.
TRANSPORT_REASON = (
    "transport security shared by every kvplane client and server (PEM and secret files read and "
    "re-read, the gRPC channel made again when they change); runtime, not domain, but it imports "
    "nothing of kvplane beyond itself and the domain (test_transport_imports_only_itself_and_the_domain)"
)
TRANSPORT = frozenset(
    {
        "kvplane.services.common.runtime.secret_files",
        "kvplane.services.common.runtime.tls",
        "kvplane.services.common.runtime.reloading_channel",
    }
)
CLIENT_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("kvplane.services.client.credentials", "kvplane.services.common.runtime.secret_files"): TRANSPORT_REASON,
    ("kvplane.services.client.credentials", "kvplane.services.common.runtime.tls"): TRANSPORT_REASON,
    (
        "kvplane.services.client.credentials",
        "kvplane.services.common.runtime.reloading_channel",
    ): TRANSPORT_REASON,
}
CONNECTOR_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("kvplane.connector.node_agent.settings", "kvplane.services.client.credentials"): (
        "the node agent is a client of metadata and eviction and presents a client's credentials; "
        "the client package is held to the same rule"
    ),
    ("kvplane.connector.node_agent.control_plane", "kvplane.services.client.credentials"): (
        "the node agent's calls carry the client's call metadata (a rotated token is read again); "
        "the client package is held to the same rule"
    ),
    ("kvplane.connector.vllm_nixl", "kvplane.services.client.credentials"): (
        "the connector's settings (vLLM's kv_connector_extra_config and the environment) make the "
        "node agent's credentials"
    ),
    ("kvplane.connector.vllm_nixl", "kvplane.services.common.runtime.telemetry"): (
        "the engine process's tracer is made as every kvplane process's is (OTLP export, sampler, "
        "resource from OpenTelemetry's variables); moving Telemetry out of services/common is the "
        "restructuring of services/common, not this rule's"
    ),
}
# What the sim-engine imports of kvplane beyond itself, the connector, the domain and the API.
SIMENGINE_RUNTIME: dict[str, str] = {
    "kvplane.services.common.runtime.telemetry": (
        "the engine process's tracer, logging and process metrics are made as every kvplane "
        "process's are (as the vLLM connector's tracer is)"
    ),
    "kvplane.services.client.credentials": (
        "its node agent presents a client's credentials, made from the engine's settings (as the "
        "vLLM connector's are)"
    ),
}
BENCH_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("kvplane.services.cli", "kvplane.bench.live"): (
        "`kvplane bench` runs the live benchmark; loaded by name only when that subcommand runs"
    ),
    ("kvplane.services.cli", "kvplane.bench.sim.command"): (
        "`kvplane sim` runs the simulator; loaded by name only when that subcommand runs"
    ),
}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.target}"


def _setuptools() -> dict[str, object]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    section: dict[str, object] = config["tool"]["setuptools"]
    return section


def _package_dir() -> dict[str, str]:
    mapping = _setuptools()["package-dir"]
    assert isinstance(mapping, dict)
    return {str(k): str(v) for k, v in mapping.items()}


def _packages() -> list[str]:
    packages = _setuptools()["packages"]
    assert isinstance(packages, list)
    return [str(p) for p in packages]


def _folder(package: str) -> Path:
    """The package's folder as setuptools finds it: under its longest mapped ancestor."""
    mapping = _package_dir()
    for prefix in sorted(mapping, key=len, reverse=True):
        if package == prefix or package.startswith(prefix + "."):
            rest = package[len(prefix) :].lstrip(".")
            return ROOT / mapping[prefix] / Path(*rest.split(".")) if rest else ROOT / mapping[prefix]
    return ROOT / Path(*package.split("."))


@cache
def _names_by_file() -> dict[Path, tuple[str, ...]]:
    names: dict[Path, list[str]] = {}
    for package in _packages():
        for path in sorted(_folder(package).glob("*.py")):
            name = package if path.name == "__init__.py" else f"{package}.{path.stem}"
            names.setdefault(path, []).append(name)
    return {path: tuple(found) for path, found in names.items()}


@cache
def modules() -> dict[str, Path]:
    """Every module of the distribution: dotted name -> source file."""
    return {name: path for path, names in _names_by_file().items() for name in names}


def _within(name: str, packages: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


_MODULE_STRING = re.compile(r"(kvplane(?:\.\w+)+)(?::[\w.]+)?")


def _imports(name: str, path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    known = modules()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield Import(name, submodule if submodule in known else base, node.lineno)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if callee in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield Import(name, node.args[0].value, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _MODULE_STRING.fullmatch(node.value)
            if match and match.group(1) in known:
                yield Import(name, match.group(1), node.lineno)


@cache
def imports() -> tuple[Import, ...]:
    # A set: `import_module("kvplane.x")` is both a call and a string naming a module.
    found = {imp for name, path in modules().items() for imp in _imports(name, path)}
    return tuple(sorted(found, key=lambda imp: (imp.importer, imp.line, imp.target)))


def _clock_reads(name: str) -> Iterator[str]:
    tree = ast.parse(modules()[name].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in CLOCK_ATTRIBUTES:
            owner = node.value
            owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if owner_name in CLOCK_OWNERS:
                yield f"{name} (line {node.lineno}) reads the clock: {ast.unparse(node)}"


def is_pure(name: str) -> bool:
    return name in PURE_MODULES or _within(name, PURE_PACKAGES)


def _io_and_clock(names: Iterable[str]) -> list[str]:
    selected = set(names)
    found = [
        f"{imp}: I/O" for imp in imports() if imp.importer in selected and _within(imp.target, IO_MODULES)
    ]
    for name in sorted(selected):
        found.extend(_clock_reads(name))
    return found


def _outside_domain(
    package: str, exceptions: dict[tuple[str, str], str], apart: tuple[str, ...] = ()
) -> list[str]:
    """Imports of kvplane by `package` (but its subpackages `apart`, held to their own rules)
    that reach beyond itself, the domain and the API."""
    return [
        str(imp)
        for imp in imports()
        if _within(imp.importer, [package])
        and not _within(imp.importer, apart)
        and _within(imp.target, ["kvplane"])
        and not _within(imp.target, [package, API])
        and imp.target not in DOMAIN
        and (imp.importer, imp.target) not in exceptions
    ]


# --- one name per module -----------------------------------------------------------------------


def test_no_mapped_folder_lies_inside_another() -> None:
    """A folder mapped inside another mapped one would give its files two names."""
    folders = {package: (ROOT / folder).resolve() for package, folder in _package_dir().items()}
    nested = [
        f"{inner} ({folders[inner]}) lies in {outer} ({folders[outer]})"
        for inner in folders
        for outer in folders
        if inner != outer and folders[inner].is_relative_to(folders[outer])
    ]
    assert not nested, nested
    assert all(folder.is_dir() for folder in folders.values()), folders


def test_every_source_file_has_exactly_one_name() -> None:
    twice = {str(path.relative_to(ROOT)): names for path, names in _names_by_file().items() if len(names) > 1}
    assert not twice, twice


def test_every_folder_of_modules_is_a_listed_package() -> None:
    """A folder left out of `packages` is missing from the wheel and from the editable install."""
    listed = {_folder(package).resolve() for package in _packages()}
    roots = [ROOT / folder for folder in _package_dir().values()]
    unlisted = sorted(
        str(folder.relative_to(ROOT))
        for root in roots
        for folder in {p.parent.resolve() for p in root.rglob("*.py") if "__pycache__" not in p.parts}
        if folder not in listed
    )
    assert not unlisted, f"add these to [tool.setuptools] packages in pyproject.toml: {unlisted}"


def test_no_code_imports_a_folder_as_a_top_level_module() -> None:
    """`services`, `connector`, `bench` and `protos` are folders, never import names."""
    folders = ("services", "connector", "bench", "protos")
    sources = list(modules().items())
    sources += [(str(p.relative_to(ROOT)), p) for p in sorted((ROOT / "tests").rglob("*.py"))]
    found = [
        str(imp) for name, path in sources for imp in _imports(name, path) if _within(imp.target, folders)
    ]
    assert not found, found


# --- pure code ---------------------------------------------------------------------------------


def test_pure_policy_and_bookkeeping_do_no_io_and_read_no_clock() -> None:
    pure = [name for name in modules() if is_pure(name)]
    assert pure and set(PURE_MODULES) <= set(pure), sorted(PURE_MODULES - set(pure))
    violations = _io_and_clock(pure)
    # Nor may it reach I/O through kvplane: of kvplane, only the domain and other pure code.
    violations += [
        f"{imp}: neither domain nor pure"
        for imp in imports()
        if is_pure(imp.importer)
        and _within(imp.target, ["kvplane"])
        and not (imp.target in DOMAIN or is_pure(imp.target))
    ]
    assert not violations, "\n".join(violations)


def test_modules_documented_as_pure_are_held_to_it() -> None:
    documented = re.compile(r"no I/O|time is an argument", re.IGNORECASE)
    unlisted = []
    for name, path in modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if documented.search(doc) and not is_pure(name):
            unlisted.append(name)
    assert not unlisted, f"documented as pure, add to PURE_MODULES: {unlisted}"


def test_every_model_module_is_domain() -> None:
    unlisted = sorted(name for name in modules() if _within(name, [MODEL]) and name not in DOMAIN)
    assert not unlisted, f"add to DOMAIN, saying what it holds: {unlisted}"


def test_the_domain_model_is_pure_and_imports_only_itself_and_the_api() -> None:
    assert modules().keys() >= DOMAIN, sorted(DOMAIN - modules().keys())
    violations = _io_and_clock(DOMAIN)
    violations += [
        str(imp)
        for imp in imports()
        if imp.importer in DOMAIN
        and _within(imp.target, ["kvplane"])
        and not (imp.target in DOMAIN or _within(imp.target, [API]))
    ]
    assert not violations, "\n".join(violations)


ROUTER = "kvplane.services.routing.router"
# The store's record types (a handle with its revision, a check-out) are what the Router's ports
# pass; the rest of the store is I/O.
STORE_RECORDS = "kvplane.services.common.store.records"


def test_the_router_takes_no_protobuf_and_does_no_io_of_its_own() -> None:
    """The Router (DESIGN: one Router, called by the service and the simulator) works on domain
    values and reaches the cluster, the check-out and the clock only through its ports."""
    forbidden = (API, "grpc", "aetcd", "asyncio", "time")
    assert any(_within(name, [ROUTER]) for name in modules())
    violations = [
        str(imp)
        for imp in imports()
        if _within(imp.importer, [ROUTER])
        and (
            _within(imp.target, forbidden)
            or (_within(imp.target, ["kvplane.services.common.store"]) and imp.target != STORE_RECORDS)
        )
    ]
    violations += [found for name in modules() if _within(name, [ROUTER]) for found in _clock_reads(name)]
    assert not violations, "\n".join(violations)


# --- the client and the connector ----------------------------------------------------------------


def test_the_client_imports_only_the_domain_and_the_api() -> None:
    violations = _outside_domain(CLIENT, CLIENT_EXCEPTIONS)
    assert not violations, "\n".join(violations)


def test_the_connector_imports_only_the_domain_and_the_api() -> None:
    violations = _outside_domain(CONNECTOR, CONNECTOR_EXCEPTIONS, apart=(SIMENGINE,))
    # The connector runs inside vLLM; the sim-engine imitates it, never the other way round.
    violations += [
        str(imp)
        for imp in imports()
        if _within(imp.importer, [CONNECTOR])
        and not _within(imp.importer, [SIMENGINE])
        and _within(imp.target, [SIMENGINE])
    ]
    assert not violations, "\n".join(violations)


def test_the_sim_engine_imports_only_the_connector_the_domain_the_api_and_the_process_runtime() -> None:
    """The sim-engine is a product part: no service, no benchmark; of services/common only the
    domain and the runtime every kvplane process shares (SIMENGINE_RUNTIME)."""
    violations = [
        str(imp)
        for imp in imports()
        if _within(imp.importer, [SIMENGINE])
        and _within(imp.target, ["kvplane"])
        and not _within(imp.target, [CONNECTOR, API])
        and imp.target not in DOMAIN
        and imp.target not in SIMENGINE_RUNTIME
    ]
    assert not violations, "\n".join(violations)


def test_transport_imports_only_itself_and_the_domain() -> None:
    assert modules().keys() >= TRANSPORT, sorted(TRANSPORT - modules().keys())
    violations = [
        str(imp)
        for imp in imports()
        if imp.importer in TRANSPORT
        and _within(imp.target, ["kvplane"])
        and imp.target not in TRANSPORT | DOMAIN
    ]
    assert not violations, "\n".join(violations)


# --- services/common and the benchmarks ----------------------------------------------------------


def test_services_common_imports_no_service_and_not_the_client() -> None:
    """services/common is below metadata, routing, eviction, gateway and the client; of the
    connector it may use only what is domain (the digests)."""
    violations = [
        str(imp)
        for imp in imports()
        if _within(imp.importer, [COMMON])
        and _within(imp.target, ["kvplane.services", CONNECTOR])
        and not (_within(imp.target, [COMMON]) or imp.target == "kvplane.services" or imp.target in DOMAIN)
    ]
    assert not violations, "\n".join(violations)


def test_services_common_layers_import_only_downwards() -> None:
    """model <- runtime <- store <- the rest of common: no layer imports one above it."""
    assert all(_within(layer, modules()) for layer in COMMON_LAYERS), COMMON_LAYERS
    violations = [
        f"{imp}: {layer} imports above itself"
        for imp in imports()
        for rank, layer in enumerate(COMMON_LAYERS)
        if _within(imp.importer, [layer])
        and _within(imp.target, [COMMON])
        and not _within(imp.target, COMMON_LAYERS[: rank + 1])
    ]
    assert not violations, "\n".join(violations)


def test_product_code_does_not_import_the_benchmarks() -> None:
    violations = [
        str(imp)
        for imp in imports()
        if not _within(imp.importer, ["kvplane.bench"])
        and _within(imp.target, ["kvplane.bench"])
        and (imp.importer, imp.target) not in BENCH_EXCEPTIONS
    ]
    assert not violations, "\n".join(violations)


def test_every_exception_is_still_needed() -> None:
    used = {(imp.importer, imp.target) for imp in imports()}
    named = CLIENT_EXCEPTIONS.keys() | CONNECTOR_EXCEPTIONS.keys() | BENCH_EXCEPTIONS.keys()
    stale = sorted(named - used)
    targets = {imp.target for imp in imports() if _within(imp.importer, [SIMENGINE])}
    stale += sorted(set(SIMENGINE_RUNTIME) - targets)
    assert not stale, f"no longer imported, remove the exception: {stale}"
