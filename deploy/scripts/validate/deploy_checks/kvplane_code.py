"""kvplane's own parsers and settings model, which the checks run flags and settings through."""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from .report import ROOT, Report


def kvplane_settings_cls() -> Any:
    from kvplane.services.settings import KvplaneSettings

    return KvplaneSettings


@contextlib.contextmanager
def kvplane_env(env: Mapping[str, str]) -> Iterator[None]:
    """The process environment with only `env`'s KVPLANE_* variables, as a container would see."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVPLANE_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("KVPLANE_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("KVPLANE_")]:
            del os.environ[key]
        os.environ.update(saved)


def load_settings(env: Mapping[str, str], config_text: str | None, flags: dict[str, Any]) -> Any:
    """KvplaneSettings from a settings file's text, KVPLANE_* variables and flag overrides."""
    import tempfile

    cls = kvplane_settings_cls()
    file_values = yaml.safe_load(config_text) if config_text else {}
    unknown = unknown_settings(file_values) + unknown_settings(env_settings(env))
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")
    env = {k: v for k, v in env.items() if k != "KVPLANE_CONFIG"}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(file_values or {}, f)
        f.flush()
        with kvplane_env(env):
            return cls.load(f.name, flags)


def unknown_settings(values: Any, model: Any = None, path: str = "") -> list[str]:
    """Keys in `values` that the settings model does not have, at any depth.

    KvplaneSettings forbids unknown top-level sections, but its sections ignore unknown keys, so
    a misspelt setting would otherwise be dropped without a word.
    """
    import typing

    from pydantic import BaseModel

    model = model or kvplane_settings_cls()
    if not isinstance(values, dict):
        return []
    out = []
    for key, value in values.items():
        field = model.model_fields.get(key)
        where = f"{path}{key}"
        if field is None:
            out.append(where)
            continue
        annotation = field.annotation
        args = typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.extend(unknown_settings(value, annotation, where + "."))
        elif (
            typing.get_origin(annotation) is list
            and args
            and isinstance(args[0], type)
            and issubclass(args[0], BaseModel)
        ):
            for i, item in enumerate(value if isinstance(value, list) else []):
                out.extend(unknown_settings(item, args[0], f"{where}[{i}]."))
    return out


def env_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """KVPLANE_<SECTION>__<FIELD> variables as nested keys (values unparsed). KVPLANE_CLIENT_*
    are not settings: every client reads them (`kvplane.services.client.credentials`)."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith("KVPLANE_") or name == "KVPLANE_CONFIG" or name.startswith("KVPLANE_CLIENT_"):
            continue
        parts = name[len("KVPLANE_") :].lower().split("__")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def settings_has_section(name: str) -> bool:
    return name in kvplane_settings_cls().model_fields


def without_section(
    config_text: str | None, env: Mapping[str, str], section: str
) -> tuple[str, dict[str, str]]:
    values = yaml.safe_load(config_text) if config_text else {}
    values.pop(section, None)
    prefix = f"KVPLANE_{section.upper()}__"
    return yaml.safe_dump(values), {k: v for k, v in env.items() if not k.startswith(prefix)}


def parse_serve(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    from kvplane.services import cli

    args = cli.build_parser().parse_args(argv)
    return args, cli._overrides(args)


def parse_front(argv: list[str]) -> dict[str, Any]:
    """`kvplane epp ...` or `kvplane sidecar ...` through its own parser: the settings its flags set."""
    from kvplane.services.epp import cli as epp_cli
    from kvplane.services.sidecar import cli as sidecar_cli

    cli = {"epp": epp_cli, "sidecar": sidecar_cli}[argv[0]]
    parser = cli.build_parser()
    parser.exit_on_error = False
    overrides: dict[str, Any] = cli.overrides(parser.parse_args(argv[1:]))
    return overrides


def check_health_probe(
    name: str, command: list[str], c: dict[str, Any], ports: Mapping[str | int, int], report: Report
) -> None:
    """An exec probe running `kvplane health` (gRPC over TLS): its flags parse, it dials a port of
    its container on loopback, and the certificate files it names are mounted."""
    from kvplane.services.health_probe import build_parser

    if not report.check(command[:2] == ["kvplane", "health"], f"{name}: runs `kvplane health`", str(command)):
        return
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args = parser.parse_args(command[2:])
    except (SystemExit, argparse.ArgumentError) as exc:
        report.check(False, f"{name}: `kvplane health` flags parse", repr(exc))
        return
    for target in args.targets:
        host, _, port = target.rpartition(":")
        report.check(
            host in ("localhost", "127.0.0.1", "[::1]") and port.isdigit() and int(port) in ports.values(),
            f"{name}: probes a port of its container on loopback ({target})",
        )
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    files = [args.tls_ca_file, args.tls_cert_file, args.tls_key_file]
    report.check(
        bool(args.tls_ca_file) and all(os.path.dirname(f) in mounts for f in files if f),
        f"{name}: the CA and certificate it presents are mounted",
    )
    # The probe's certificate is the server's own: the one the server is configured with.
    if args.tls_cert_file:
        report.check(
            env.get("KVPLANE_GRPC__TLS__CERT_FILE") == args.tls_cert_file
            and env.get("KVPLANE_GRPC__TLS__CLIENT_CA_FILE") == args.tls_ca_file,
            f"{name}: presents the server's certificate, checked by the server's client CA",
        )


def parse_sim_engine(argv: list[str]) -> Any:
    from kvplane.connector.simengine.settings import build_arg_parser, settings_from_args

    parser = build_arg_parser()
    parser.exit_on_error = False
    return settings_from_args(parser.parse_args(argv))


@functools.cache
def connector_setting_names() -> frozenset[str]:
    """Fields of ConnectorSettings, read from the source: importing it needs vLLM."""
    tree = ast.parse((ROOT / "connector" / "vllm_nixl.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ConnectorSettings":
            return frozenset(
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            )
    raise RuntimeError("ConnectorSettings not found in connector/vllm_nixl.py")


def module_file(module: str) -> Path | None:
    """Source file of a kvplane.* module, by the distribution's package-dir mapping."""
    mapping = {"kvplane.connector": "connector", "kvplane.services": "services", "kvplane.bench": "bench"}
    for prefix, directory in mapping.items():
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) :].lstrip(".").replace(".", "/")
            path = ROOT / directory / (rest + ".py" if rest else "__init__.py")
            return path if path.exists() else None
    return None


def host_port(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)
