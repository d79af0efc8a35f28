"""`kvplane etcd-setup` (prepare an etcd for kvplane: its users, their role, auth on) and
`kvplane dev-certs` (the CA and certificates such an etcd and kvplane's processes present)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvplane.services.dev.credential_files import CredentialFilesExist, add_write_options, write_set
from kvplane.services.etcd_access.principals import ROOT_USER, process_users

# etcd's default listen address, and what a development etcd's certificate names by default.
DEFAULT_ETCD = "127.0.0.1:2379"
DEFAULT_SANS = ("localhost", "127.0.0.1", "::1")
DEFAULT_CA_NAME = "kvplane etcd CA"
# What `kvplane etcd-setup` waits for at most while etcd does not answer yet (seconds).
DEFAULT_WAIT_S = 60.0

_SETUP_EPILOG = f"""\
Connects with the etcd section of kvplane's settings (--config or KVPLANE_CONFIG, then
KVPLANE_ETCD__* variables): endpoints, TLS (KVPLANE_ETCD__TLS_CA_FILE) and the client certificate
of {ROOT_USER} (KVPLANE_ETCD__TLS_CERT_FILE, KVPLANE_ETCD__TLS_KEY_FILE; CN={ROOT_USER}). Once auth is
on, only {ROOT_USER} may change users and roles. etcd must run with --client-cert-auth and
--trusted-ca-file (the CA of the certificates below), so that it takes each process's user from
its certificate's Common Name.

It creates, or leaves as they are when present:
  role kvplane   READWRITE on the prefix (etcd.prefix) and no other permission
  users          {", ".join(process_users())}
                 (metadata, routing, eviction, a gateway routing in its own process), no
                 password, each with the role kvplane and no other
  user {ROOT_USER}      with the root role (no password when created here)
and enables auth. Safe to run again, e.g. on every deploy."""

_CERTS_EPILOG = f"""\
Layout (each folder as a Kubernetes TLS Secret: ca.crt, tls.crt, tls.key):
  ca/              ca.crt, ca.key (the CA's key: keep it away from every server)
  etcd-server/     etcd's certificate (--cert-file, --key-file; --trusted-ca-file=ca.crt)
  {ROOT_USER}/            CN={ROOT_USER}: kvplane etcd-setup, backups (etcd's superuser)
  kvplane-*/       one per process kind, CN=its etcd user ({", ".join(process_users())}):
                   KVPLANE_ETCD__TLS_CERT_FILE and KVPLANE_ETCD__TLS_KEY_FILE
Keys are written 0600, certificates 0644, folders 0700. For development and compose; a
production CA is the deployment's own (cert-manager, Vault, ...)."""


def _setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplane etcd-setup",
        description="prepare an etcd for kvplane: a user per process kind, confined to kvplane's "
        "key prefix, authenticated by client certificate; root; auth enabled",
        epilog=_SETUP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", help="YAML settings file (default: KVPLANE_CONFIG, else none)")
    p.add_argument(
        "--etcd",
        help=f"comma-separated etcd endpoints, host:port (default: etcd.endpoints, else {DEFAULT_ETCD})",
    )
    p.add_argument("--prefix", help="kvplane's key prefix (default: etcd.prefix, else /kvplane/v1/)")
    p.add_argument(
        "--wait-s",
        type=float,
        default=DEFAULT_WAIT_S,
        help=f"how long to wait for etcd to answer at first, seconds (default {DEFAULT_WAIT_S:g})",
    )
    p.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each call, seconds (default 5)")
    p.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    return p


def etcd_setup_main(argv: Sequence[str]) -> int:
    args = _setup_parser().parse_args(list(argv))
    from kvplane.services.settings import KvplaneSettings
    from kvplane.services.settings_errors import SettingsError

    overrides: dict[str, Any] = {}
    if args.etcd:
        overrides["endpoints"] = [e.strip() for e in args.etcd.split(",") if e.strip()]
    if args.prefix:
        overrides["prefix"] = args.prefix
    try:
        settings = KvplaneSettings.load(args.config, {"etcd": overrides} if overrides else None)
    except SettingsError as exc:
        print(f"kvplane etcd-setup: {exc}", file=sys.stderr)
        return 2
    from kvplane.services.etcd_access.auth_setup import SetupFailed

    try:
        for line in asyncio.run(_setup(settings.etcd, args)):
            print(line)
    except (SetupFailed, ValueError, OSError) as exc:
        print(f"kvplane etcd-setup: {exc}", file=sys.stderr)
        return 1
    return 0


async def _setup(etcd: Any, args: argparse.Namespace) -> list[str]:
    """The lines to print: each step taken (or that would be), then the outcome."""
    import grpc

    from kvplane.services.etcd_access.auth_plan import plan
    from kvplane.services.etcd_access.auth_setup import EtcdAuth, SetupFailed, channel_to
    from kvplane.services.etcd_access.principals import prefix_range

    store = etcd.store_settings()
    keys = prefix_range(store.prefix)
    deadline = time.monotonic() + args.wait_s
    attempt = 0
    while True:
        endpoint = store.endpoints[attempt % len(store.endpoints)]
        channel = channel_to(endpoint, store.credentials)
        try:
            auth = EtcdAuth(channel, args.timeout_s)
            try:
                state = await auth.state(process_users())
            except SetupFailed as exc:
                cause = exc.__cause__
                unanswered = isinstance(cause, grpc.aio.AioRpcError) and cause.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
                if not unanswered or time.monotonic() >= deadline:
                    raise SetupFailed(f"{endpoint}: {exc}") from exc
                attempt += 1
                await asyncio.sleep(1.0)  # etcd may be starting: ask again until the deadline
                continue
            steps = plan(state, keys, process_users())
            lines = []
            for step in steps:
                if not args.dry_run:
                    await auth.apply(step)
                lines.append(("would " if args.dry_run else "") + step.describe())
            if not steps:
                lines.append(f"etcd at {endpoint} is ready for kvplane: nothing to change")
            elif not args.dry_run:
                lines.append(f"etcd at {endpoint} is ready for kvplane: {len(steps)} changes")
            return lines
        finally:
            await channel.close()


def _certs_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplane dev-certs",
        description="write a CA, etcd's server certificate and a client certificate per etcd user "
        "(CN = the user), for development and compose",
        epilog=_CERTS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="folder to write into (created if missing)")
    p.add_argument(
        "--san",
        action="append",
        help="a host name or IP address etcd's certificate names; repeat for each "
        f"(default: {', '.join(DEFAULT_SANS)})",
    )
    p.add_argument(
        "--user",
        action="append",
        help="write a client certificate for this etcd user only; repeat "
        f"(default: {ROOT_USER} and every process user)",
    )
    p.add_argument("--days", type=int, default=365, help="validity of every certificate, days (default 365)")
    p.add_argument(
        "--ca-name", default=DEFAULT_CA_NAME, help=f"the CA's Common Name (default {DEFAULT_CA_NAME!r})"
    )
    add_write_options(p)
    return p


def dev_certs_main(argv: Sequence[str]) -> int:
    args = _certs_parser().parse_args(list(argv))
    from kvplane.services.etcd_access.certificates import Authority, bundle_files, is_key

    out = Path(args.out)
    try:
        if args.days < 1:
            raise ValueError("--days must be at least 1")
        now = datetime.datetime.now(datetime.UTC)
        ca = Authority.create(args.ca_name, now, args.days)
        server = ca.issue_server(args.san or DEFAULT_SANS, now, args.days)
        users = args.user or [ROOT_USER, *process_users()]
        files = bundle_files(ca, server, {user: ca.issue_client(user, now, args.days) for user in users})
        if not write_set(out, files, is_key, args):
            print(f"kept the certificates in {out}: every file exists")
            return 0
    except (CredentialFilesExist, ValueError, OSError) as exc:
        print(f"kvplane dev-certs: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a CA, etcd's certificate and client certificates for {', '.join(users)} to {out}")
    return 0
