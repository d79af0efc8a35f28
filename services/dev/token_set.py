"""A development deployment's bearer tokens and keys, fresh for each deployment, as files laid out
so that each process mounts only its own (compose's init service writes them into volumes).

  <name>/token                 one per node and operator principal (its token, alone)
  control-plane/tokens.yaml    every node and operator token with its principal: the services'
                               `auth.tokens_file`
  gateways/api-keys.yaml       one API key per tenant: the gateways' `gateway.api_keys_file`
  gateways/cache-salt-key      the key every gateway salts P's prefix cache with
                               (`gateway.cache_salt_key_file`)

Every file is a secret (written 0600). Tokens are 32 random bytes, URL-safe base64.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence

TOKEN_FILE = "token"
CONTROL_PLANE = "control-plane"
TOKENS_FILE = "tokens.yaml"
GATEWAYS = "gateways"
API_KEYS_FILE = "api-keys.yaml"
CACHE_SALT_KEY_FILE = "cache-salt-key"
# A principal's name is its folder's name.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def new_token() -> str:
    """256 random bits as 64 hex digits. Not base64: a token that starts with `-` reads as an
    option to any command line it is passed on (one in 64 base64url tokens does)."""
    return secrets.token_hex(32)


def _check_names(nodes: Sequence[str], operators: Sequence[str], tenants: Sequence[str]) -> None:
    principals = [*nodes, *operators]
    for name in [*principals, *tenants]:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"{name!r}: a name is letters, digits, '.', '_' and '-', starting with a letter or digit"
            )
    for name in principals:
        if name in (CONTROL_PLANE, GATEWAYS):
            raise ValueError(f"{name!r} is the name of a shared folder: choose another principal name")
    for names, what in ((principals, "principal"), (tenants, "tenant")):
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"{what} {repeated[0]!r} is named twice")


def token_set_files(
    nodes: Sequence[str],
    operators: Sequence[str],
    tenants: Sequence[str],
    new_secret: Callable[[], str] = new_token,
) -> dict[str, bytes]:
    """Every file of the set, by its path under the output folder (layout: the module's docstring)."""
    _check_names(nodes, operators, tenants)
    if not (nodes or operators):
        raise ValueError("name at least one node or operator principal")
    files: dict[str, bytes] = {}
    entries = []
    for kind, names in (("node", nodes), ("operator", operators)):
        for name in names:
            token = new_secret()
            files[f"{name}/{TOKEN_FILE}"] = token.encode()
            entries.append({"token": token, "kind": kind, "name": name})
    files[f"{CONTROL_PLANE}/{TOKENS_FILE}"] = json.dumps(entries, indent=2).encode()  # JSON is YAML
    if tenants:
        keys = [{"token": new_secret(), "tenant": tenant} for tenant in tenants]
        files[f"{GATEWAYS}/{API_KEYS_FILE}"] = json.dumps(keys, indent=2).encode()
        files[f"{GATEWAYS}/{CACHE_SALT_KEY_FILE}"] = new_secret().encode()
    return files
