"""`kvplane dev-tokens`: fresh tokens and keys for a development deployment (compose), written as
`token_set` lays them out, so that no well-known credential is committed or shared."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvplane.services.dev.credential_files import CredentialFilesExist, add_write_options, write_set
from kvplane.services.dev.token_set import (
    API_KEYS_FILE,
    CACHE_SALT_KEY_FILE,
    CONTROL_PLANE,
    GATEWAYS,
    TOKEN_FILE,
    TOKENS_FILE,
)

_EPILOG = f"""\
Layout, every file 0600 (folders 0700), one folder per reader:
  NAME/{TOKEN_FILE}                   each --node and --operator principal's own token
                               (KVPLANE_CLIENT_TOKEN_FILE, gateway.routing_token_file,
                               the engines' auth token file)
  {CONTROL_PLANE}/{TOKENS_FILE}    every node and operator token with its principal:
                               the services' auth.tokens_file
  {GATEWAYS}/{API_KEYS_FILE}       one API key per --tenant: gateway.api_keys_file
  {GATEWAYS}/{CACHE_SALT_KEY_FILE}      the gateways' shared gateway.cache_salt_key_file"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplane dev-tokens",
        description="write fresh control-plane tokens, API keys and the cache-salt key of a "
        "development deployment (compose), a folder per reader",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="folder to write into (created if missing)")
    p.add_argument(
        "--node", action="append", default=[], help="a node principal (its node id); repeat (default: none)"
    )
    p.add_argument(
        "--operator", action="append", default=[], help="an operator principal; repeat (default: none)"
    )
    p.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant given a gateway API key; repeat (default: none)",
    )
    add_write_options(p)
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    from kvplane.services.dev.token_set import token_set_files

    out = Path(args.out)
    try:
        files = token_set_files(args.node, args.operator, args.tenant)
        if not write_set(out, files, lambda _: True, args):
            print(f"kept the tokens in {out}: every file exists")
            return 0
    except (CredentialFilesExist, ValueError, OSError) as exc:
        print(f"kvplane dev-tokens: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(files)} token and key files to {out}")
    return 0
