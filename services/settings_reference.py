"""The settings reference (docs/settings.md), generated from the settings models.

    python -m kvplane.services.settings_reference > docs/settings.md      (make settings-doc)

One row per key of `KvplaneSettings` (`services/settings.py` and the sections it composes): its
key path, its environment variable, its type with its bounds, its default, and the comment above
the field in the source as its description. A field the source leaves without a comment of its
own takes the comment above the field before it when it belongs to that field's group
(`SHARES_COMMENT_ABOVE`), else its line in `DESCRIPTIONS`; `tests/unit/test_settings_reference.py`
fails when a field has neither, when either list names a field that has its own comment now, and
when docs/settings.md is not what this module writes. Secrets' defaults are never printed.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvplane.services.settings import KvplaneSettings

ENV_PREFIX = "KVPLANE_"
ENV_DELIMITER = "__"

# What each section is for (the sections' classes carry no docstring of their own).
SECTIONS: dict[str, str] = {
    "grpc": "The gRPC server of `kvplane serve` (and of a gateway that routes in its own process).",
    "etcd": "The etcd cluster the control plane keeps its state in, and how to reach it.",
    "telemetry": "Traces (OpenTelemetry), the Prometheus endpoint and logs, for every process.",
    "auth": (
        "Who may call the control plane's gRPC services; `kvplane serve` refuses to start without "
        "`auth.mode`."
    ),
    "metadata": "The metadata service: node registrations and the handles' check-out.",
    "eviction": "The eviction coordinator: its election, its sweeps and its retention policy.",
    "routing": "The routing service (and a gateway's in-process routing replica).",
    "gateway": (
        "`kvplane gateway`, the OpenAI front: its routing replicas and fallback engines, its limits and "
        "its keys. `kvplane epp` and `kvplane sidecar` read it too."
    ),
    "epp": "`kvplane epp`, the Gateway API Inference Extension endpoint picker.",
    "sidecar": "`kvplane sidecar`, beside one decode engine behind the endpoint picker.",
}

# Fields with no comment of their own that belong to the group the comment above the field
# before them describes (a key and its file, a certificate and its key, one deadline of several).
SHARES_COMMENT_ABOVE: frozenset[str] = frozenset(
    {
        "ServerTlsSection.key_file",
        "EtcdSection.tls_cert_file",
        "EtcdSection.tls_key_file",
        "EtcdSection.password",
        "EtcdSection.password_file",
        "TokenEntry.token_file",
        "MeshSection.secret_files",
        "EvictionSection.policy",
        "RoutingSection.prefix_cache_max_blocks",
        "GatewaySection.routing_token_file",
        "GatewaySection.routing_tls_ca_file",
        "GatewaySection.routing_tls_cert_file",
        "GatewaySection.routing_tls_key_file",
        "GatewaySection.routing_tls_server_name",
        "GatewaySection.fallback_decode_url",
        "GatewaySection.decode_timeout_s",
        "GatewaySection.decode_idle_timeout_s",
        "GatewaySection.tls_key_file",
        "EppSection.tenant_header",
        "EppSection.sidecars",
    }
)

# Descriptions of the fields whose source gives none (read from the code that uses each). A
# comment above the field in the source is the better home: the test fails on an entry here
# once its field has one.
DESCRIPTIONS: dict[str, str] = {
    "KvplaneSettings.grpc": "The gRPC server.",
    "KvplaneSettings.etcd": "The etcd cluster.",
    "KvplaneSettings.telemetry": "Traces, metrics and logs.",
    "KvplaneSettings.auth": "Authentication of gRPC callers.",
    "KvplaneSettings.metadata": "The metadata service.",
    "KvplaneSettings.eviction": "The eviction coordinator.",
    "KvplaneSettings.routing": "The routing service.",
    "KvplaneSettings.gateway": "The OpenAI gateway.",
    "KvplaneSettings.epp": "The endpoint picker.",
    "KvplaneSettings.sidecar": "The decode sidecar.",
    "GrpcSection.listen": (
        "Where `kvplane serve` serves gRPC (and a gateway with `gateway.routing_in_process` its routing "
        "replica), host:port."
    ),
    "GrpcSection.grace_s": (
        "On stop, how long calls in flight may finish before the server cancels them, seconds."
    ),
    "GrpcSection.tls": "The gRPC server's TLS (below); no certificate: plaintext.",
    "EtcdSection.endpoints": (
        "etcd's members, host:port each (an `https://` endpoint needs `etcd.tls_ca_file`)."
    ),
    "EtcdSection.prefix": "The prefix of every key kvplane writes in etcd.",
    "EtcdSection.request_timeout_s": "Deadline of one etcd request, seconds.",
    "EtcdSection.settle_timeout_s": (
        "How long a fenced transaction whose outcome is unknown (a timeout) is re-sent until etcd "
        "answers, seconds."
    ),
    "EtcdSection.tls_server_name": (
        "The name etcd's certificate is checked against, when it is not the endpoint's host."
    ),
    "TelemetrySection.metrics_host": "Address the Prometheus endpoint binds.",
    "TelemetrySection.log_level": "Log level: `debug`, `info`, `warning` or `error`.",
    "TelemetrySection.json_logs": "Logs as JSON lines on stderr; false: plain text lines.",
    "AuthSection.tokens": "Token mode's entries (below): each bearer token bound to one principal.",
    "AuthSection.mesh": "Mesh mode's trust in the proxy (below).",
    "TokenEntry.kind": (
        "The principal's kind: `tenant`, `node` (an engine's node agent) or `operator` (a gateway, an "
        "upstream router, the `kvplane nodes`/`drain`/... commands)."
    ),
    "TokenEntry.tenant": "A tenant principal's tenant; empty: its `name`. Unused for nodes and operators.",
    "MetadataSection.default_lease_ttl_s": (
        "A node's registration lease when the node asks for none, seconds."
    ),
    "GatewaySection.routing_attempts": (
        "Routing replicas a Route is tried on: UNAVAILABLE is retried on the next one, within "
        "`routing_timeout_s`."
    ),
    "GatewaySection.connect_timeout_s": (
        "Deadline for connecting to an engine (and of the `/v1/models` call to the fallback decode "
        "engine), seconds."
    ),
    "GatewaySection.report_timeout_s": (
        "Deadline of a turn's report to routing, and of sending the held reports when the gateway stops, "
        "seconds."
    ),
    "GatewayKey.token": "The API key a client presents.",
    "GatewayKey.tenant": "The tenant the key's requests act as.",
}


@dataclass(frozen=True)
class Row:
    """One key of the settings file."""

    path: str
    env: str
    type: str
    default: str
    description: str
    owner: str  # "Class.field", the field's home in the source


def _source_comments(cls: type) -> dict[str, str]:
    """The `# comment` lines directly above each annotated field of `cls`'s own source."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    found: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            index = node.lineno - 2  # the line above, 0-based
            comment: list[str] = []
            while index >= 0 and lines[index].strip().startswith("#"):
                comment.insert(0, lines[index].strip().lstrip("#").strip())
                index -= 1
            found[node.target.id] = " ".join(comment)
    return found


@cache
def field_comments(cls: type) -> dict[str, str]:
    """Each field's description from the source: its own comment, or its group's."""
    own: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if isinstance(klass, type) and issubclass(klass, BaseModel) and klass is not BaseModel:
            own |= _source_comments(klass)
    out: dict[str, str] = {}
    previous = ""
    for name in getattr(cls, "model_fields", {}):
        text = own.get(name, "")
        if not text and f"{cls.__name__}.{name}" in SHARES_COMMENT_ABOVE:
            text = previous
        out[name] = text
        previous = text
    return out


def own_comment(cls: type, name: str) -> str:
    """The comment directly above the field in the source ("" when none)."""
    for klass in cls.__mro__:
        if issubclass(klass, BaseModel) and name in inspect.get_annotations(klass):
            return _source_comments(klass).get(name, "")
    return ""


def model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The settings model a field holds, and whether it holds a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args:
        inner = args[0]
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner, True
    return None, False


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        name = " or ".join(_type_name(a) for a in present)
        return f"{name}, or null" if len(present) < len(args) else name
    if origin is list:
        inner = args[0] if args else Any
        model, _ = model_of(annotation)
        return "list of entries (below)" if model else f"list of {_plural(_type_name(inner))}"
    if origin is dict:
        key, value = args if args else (Any, Any)
        if value is Any:
            return "mapping"
        return f"mapping of {_type_name(key)} to {_type_name(value)}"
    if annotation is SecretStr:
        return "secret string"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section (below)"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _plural(name: str) -> str:
    return name if name.startswith(("one of", "list", "mapping")) else f"{name}s"


def _bounds(info: FieldInfo) -> str:
    parts: list[str] = []
    for item in info.metadata:
        if isinstance(item, annotated_types.Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Ge):
            parts.append(f">= {item.ge}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"<= {item.le}")
    return ", ".join(parts)


def _holds_secret(annotation: Any) -> bool:
    if annotation is SecretStr:
        return True
    return any(_holds_secret(a) for a in typing.get_args(annotation))


def _default(info: FieldInfo) -> str:
    if _holds_secret(info.annotation):
        return "(secret)"
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return "(below)"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def rows(model: type[BaseModel] = KvplaneSettings, prefix: str = "", env: str = ENV_PREFIX) -> Iterator[Row]:
    """Every key under `model`, depth first, in the source's order."""
    comments = field_comments(model)
    for name, info in model.model_fields.items():
        owner = f"{model.__name__}.{name}"
        path = f"{prefix}{name}"
        variable = f"{env}{name.upper()}" if env else ""
        kind = _type_name(info.annotation)
        bounds = _bounds(info)
        description = comments.get(name, "") or DESCRIPTIONS.get(owner, "")
        yield Row(path, variable, f"{kind}, {bounds}" if bounds else kind, _default(info), description, owner)
        sub, is_list = model_of(info.annotation)
        if sub is not None:
            if is_list:
                # A list's entries have no variable of their own: the list is set whole, as JSON.
                yield from rows(sub, f"{path}[].", "")
            else:
                yield from rows(sub, f"{path}.", f"{variable}{ENV_DELIMITER}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    """docs/settings.md."""
    out = [
        "# Settings reference",
        "",
        "<!-- Generated by `python -m kvplane.services.settings_reference > docs/settings.md` (`make",
        "settings-doc`) from the settings models; do not edit by hand. -->",
        "",
        "Every kvplane process (`kvplane serve`, `kvplane gateway`, `kvplane epp`, `kvplane sidecar`)",
        "reads one typed settings object, `kvplane.services.settings.KvplaneSettings`. Sources, lowest",
        "to highest precedence: the defaults below, a YAML file (`--config`, or `KVPLANE_CONFIG`),",
        "environment variables, then command-line flags. A misspelt key is an error, not ignored.",
        "",
        "- **Environment variables** name the key path in capitals after `KVPLANE_`, its parts joined",
        "  by `__`: `gateway.routing_token_file` is `KVPLANE_GATEWAY__ROUTING_TOKEN_FILE`. Lists and",
        "  mappings are JSON: `KVPLANE_ETCD__ENDPOINTS='[\"10.0.0.1:2379\"]'`. The entries of a list",
        "  (`auth.tokens[]`, `gateway.api_keys[]`) have no variable of their own: set the list whole.",
        "- **Secrets** are shown here as (secret), and the start-up log masks them. Prefer the `*_file`",
        "  form of a secret where there is one: files are read again when they change.",
        "- **Not here**: the vLLM connector's settings (`kv_connector_extra_config.kvplane`), listed in",
        "  `connector/vllm_nixl.py`'s module docstring, and the sim-engine's flags (`kvplane sim-engine",
        "  --help`).",
        "",
    ]
    sections = list(KvplaneSettings.model_fields)
    out.append("Sections: " + ", ".join(f"[`{s}`](#{s})" for s in sections) + ".")
    out.append("")
    by_section: dict[str, list[Row]] = {s: [] for s in sections}
    for row in rows():
        section = row.path.split(".", 1)[0]
        if "." in row.path:
            by_section[section].append(row)
    for section in sections:
        out += [f"## {section}", "", SECTIONS[section], ""]
        out.append("| key | environment variable | type | default | description |")
        out.append("|---|---|---|---|---|")
        for row in by_section[section]:
            env = f"`{row.env}`" if row.env else "(in the list)"
            cells = [f"`{row.path}`", env, _cell(row.type), _cell(row.default), _cell(row.description)]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out + _client_environment())


def _client_environment() -> list[str]:
    """The clients' own variables: they read no settings file."""
    from kvplane.services.client.credentials import ClientCredentials

    comments = _source_comments(ClientCredentials)
    out = [
        "## Client environment variables",
        "",
        "Operator commands (`kvplane nodes`, `handles`, `drain`, `status`, `end-conversation`),",
        "`kvplane health` and `kvplane.services.client` read their credentials from the environment;",
        "operator commands also take their target from `KVPLANE_CLIENT_TARGET`. The vLLM connector's",
        "node agent has names of its own, `KVPLANE_` and its configuration key",
        "(`KVPLANE_AUTH_TOKEN_FILE`, `KVPLANE_TLS_CA_FILE`, ...: `connector/vllm_nixl.py`), and reads",
        "`KVPLANE_CLIENT_ALLOW_PLAINTEXT` as every client does.",
        "",
        "| environment variable | meaning |",
        "|---|---|",
    ]
    for f in dataclasses.fields(ClientCredentials):
        out.append(f"| `KVPLANE_CLIENT_{f.name.upper()}` | {_cell(comments.get(f.name, ''))} |")
    out.append("")
    return out


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
