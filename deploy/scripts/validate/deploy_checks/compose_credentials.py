"""The compose stack's credentials: none committed, each container given only its own.

The one-shot writers (`kvplane dev-certs`, `kvplane dev-tokens`) write a folder per reader, each
folder a named volume; a reader is checked to mount the volume of its own folder where its
settings read it: a service's etcd client certificate is the one whose CN is its etcd user, an
engine's token the one of its node id. etcd serves TLS only and requires client certificates,
and no kvplane process is told to reach it insecurely.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import yaml

from .report import Report

# Variables that would carry a credential itself rather than a file holding it.
INLINE_SECRETS = (
    "KVPLANE_AUTH__TOKENS",
    "KVPLANE_GATEWAY__ROUTING_TOKEN",
    "KVPLANE_GATEWAY__API_KEYS",
    "KVPLANE_GATEWAY__CACHE_SALT_KEY",
    "KVPLANE_ETCD__PASSWORD",
    "KVPLANE_SIM_AUTH_TOKEN",
    "KVPLANE_AUTH_TOKEN",
    "KVPLANE_CLIENT_TOKEN",
)


def _env(svc: dict[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (svc.get("environment") or {}).items() if v is not None}


def _flag(command: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in command if a.startswith(f"--{name}=")]


def writer_folders(services: dict[str, Any], subcommand: str) -> dict[str, str]:
    """The writer running `kvplane SUBCOMMAND --out=DIR`: volume name -> the folder it holds."""
    for svc in services.values():
        command = list(svc.get("command") or [])
        if command[:1] == [subcommand]:
            out = (_flag(command, "out") or ["/"])[0].rstrip("/")
            return {
                str(m["source"]): posixpath.relpath(str(m["target"]), out)
                for m in svc.get("volumes") or []
                if m.get("type") == "volume" and posixpath.dirname(str(m["target"]).rstrip("/")) == out
            }
    return {}


def volume_at(svc: dict[str, Any], path: str) -> str:
    """The named volume a file `path` is read from in this container ('' for none)."""
    best, source = "", ""
    for mount in svc.get("volumes") or []:
        target = str(mount.get("target", "")).rstrip("/")
        if mount.get("type") == "volume" and path.startswith(target + "/") and len(target) > len(best):
            best, source = target, str(mount["source"])
    return source


def check_credentials(services: dict[str, Any], config_text: str, report: Report) -> None:
    from kvplane.services.etcd_access.principals import PROCESS_USERS, ROOT_USER

    certs = writer_folders(services, "dev-certs")
    tokens = writer_folders(services, "dev-tokens")
    report.check(bool(certs), "compose: a one-shot service writes etcd's certificates (kvplane dev-certs)")
    report.check(bool(tokens), "compose: a one-shot service writes the tokens (kvplane dev-tokens)")
    writers = {n for n, s in services.items() if (s.get("command") or [""])[0] in ("dev-certs", "dev-tokens")}
    token_command = next(
        (list(s["command"]) for n, s in services.items() if n in writers and s["command"][0] == "dev-tokens"),
        [],
    )
    operators = set(_flag(token_command, "operator"))

    config = yaml.safe_load(config_text) or {}
    report.check(
        not (config.get("auth") or {}).get("tokens")
        and not (config.get("gateway") or {}).get("api_keys")
        and not (config.get("gateway") or {}).get("cache_salt_key"),
        "compose kvplane.yaml: no tokens, API keys or cache-salt key written in it",
    )
    for name, svc in services.items():
        env = _env(svc)
        inline = [k for k in INLINE_SECRETS if env.get(k)]
        report.check(not inline, f"compose {name}: no credential in its environment", str(inline))
        report.check(
            env.get("KVPLANE_ETCD__ALLOW_INSECURE", "false").lower() in ("false", "0", ""),
            f"compose {name}: does not reach etcd insecurely",
        )
        command = list(svc.get("command") or [])
        if command[:1] == ["etcd"]:
            _check_etcd(name, command, certs, svc, report)
        elif command[:1] == ["serve"]:
            user = PROCESS_USERS["metadata" if command[1] == "all" else command[1]]
            _check_etcd_client(name, env, svc, certs, user, report)
            _check_from(
                name,
                svc,
                env,
                "KVPLANE_AUTH__TOKENS_FILE",
                tokens,
                {"control-plane"},
                report,
                "the tokens file",
            )
        elif command[:1] == ["etcd-setup"]:
            _check_etcd_client(name, env, svc, certs, ROOT_USER, report)
        elif command[:1] == ["gateway"]:
            key = "KVPLANE_GATEWAY__ROUTING_TOKEN_FILE"
            _check_from(name, svc, env, key, tokens, operators, report, "an operator's own folder")
            for key in ("KVPLANE_GATEWAY__API_KEYS_FILE", "KVPLANE_GATEWAY__CACHE_SALT_KEY_FILE"):
                _check_from(name, svc, env, key, tokens, {"gateways"}, report, "the gateways' folder")
        elif "KVPLANE_SIM_AUTH_TOKEN_FILE" in env:
            node = (_flag(command, "node-id") or [""])[0]
            _check_from(
                name, svc, env, "KVPLANE_SIM_AUTH_TOKEN_FILE", tokens, {node}, report, f"node {node}'s folder"
            )
        elif "KVPLANE_AUTH_TOKEN_FILE" in env:
            node = _vllm_node_id(command)
            _check_from(
                name, svc, env, "KVPLANE_AUTH_TOKEN_FILE", tokens, {node}, report, f"node {node}'s folder"
            )
        elif name not in writers:
            mounted = {str(m.get("source")) for m in svc.get("volumes") or []}
            leaked = sorted(mounted & (set(certs) | set(tokens)))
            report.check(not leaked, f"compose {name}: mounts no credential volume", str(leaked))
        if name not in writers:
            _check_no_other_tokens(name, svc, env, tokens, report)


def _vllm_node_id(command: list[str]) -> str:
    for arg in _flag(command, "kv-transfer-config"):
        return str(json.loads(arg).get("kv_connector_extra_config", {}).get("kvplane", {}).get("node_id", ""))
    return ""


def _check_etcd(
    name: str, command: list[str], certs: dict[str, str], svc: dict[str, Any], report: Report
) -> None:
    urls = ",".join(_flag(command, "listen-client-urls")).split(",")
    report.check(
        "--client-cert-auth" in command and all(u.startswith("https://") for u in urls if u),
        f"compose {name}: serves clients over TLS only and requires their certificates (--client-cert-auth)",
        str(urls),
    )
    for flag in ("cert-file", "key-file", "trusted-ca-file"):
        path = (_flag(command, flag) or [""])[0]
        report.check(
            certs.get(volume_at(svc, path)) == "etcd-server",
            f"compose {name}: --{flag} from etcd's own certificate folder",
            path,
        )


def _check_etcd_client(
    name: str, env: dict[str, str], svc: dict[str, Any], certs: dict[str, str], user: str, report: Report
) -> None:
    for key in ("KVPLANE_ETCD__TLS_CA_FILE", "KVPLANE_ETCD__TLS_CERT_FILE", "KVPLANE_ETCD__TLS_KEY_FILE"):
        path = env.get(key, "")
        report.check(
            certs.get(volume_at(svc, path)) == user,
            f"compose {name}: {key} from the certificate of etcd user {user}",
            f"{path!r} in volume {volume_at(svc, path)!r}",
        )


def _check_from(
    name: str,
    svc: dict[str, Any],
    env: dict[str, str],
    key: str,
    tokens: dict[str, str],
    folders: set[str],
    report: Report,
    whose: str,
) -> None:
    path = env.get(key, "")
    folder = tokens.get(volume_at(svc, path), "")
    report.check(
        bool(path) and folder in folders,
        f"compose {name}: {key} from {whose}",
        f"{path!r} in the folder {folder!r}",
    )


def _check_no_other_tokens(
    name: str, svc: dict[str, Any], env: dict[str, str], tokens: dict[str, str], report: Report
) -> None:
    """The container mounts the writer's volumes its settings read, and no other."""
    mounted = {str(m.get("source")) for m in svc.get("volumes") or []} & set(tokens)
    read = {volume_at(svc, v) for k, v in env.items() if k.endswith("_FILE")}
    report.check(
        mounted <= read,
        f"compose {name}: mounts no other principal's token",
        str(sorted(tokens[v] for v in mounted - read)),
    )
