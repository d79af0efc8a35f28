"""The dev stack's engines listen on loopback only: HTTP, the NIXL side channel and UCX's own listener."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import aiohttp

from kvplane.connector.simengine.settings import SimEngineSettings
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.devstack.stack import engine_env
from tests.support.polling import eventually

_LISTEN = "0A"


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses of the process's listening TCP sockets, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != _LISTEN or inode not in inodes:
                continue
            raw = bytes.fromhex(local.split(":")[0])
            assert len(raw) * 2 == width
            # /proc prints each 32-bit word in host (little-endian) order.
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(str(ipaddress.ip_address(words)))
    return found


def _spawn_engine(port: int, log: Path) -> subprocess.Popen[bytes]:
    """A sim-engine in the dev stack's environment, with any UCX_NET_DEVICES of ours removed."""
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    settings = SimEngineSettings(
        role="decode", http_port=port, side_channel_port=0, num_blocks=64, bytes_per_block=4096
    )
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvplane.connector.simengine", *settings.argv()],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**env, **engine_env(env)},
            start_new_session=True,
        )


async def test_dev_stack_engines_listen_on_loopback_only(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "engine.log"
    proc = _spawn_engine(port, log)
    try:
        async with aiohttp.ClientSession() as session:

            async def healthy() -> bool:
                async with session.get(f"http://127.0.0.1:{port}/health") as r:
                    return r.status == 200

            await eventually(healthy, timeout_s=90, what=f"the engine to serve ({log})")
        addresses = _listening_addresses(proc.pid)
        # HTTP, the side channel and UCX's listener (NIXL's agent is made before HTTP serves).
        assert len(addresses) >= 3, addresses
        assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_an_operators_own_ucx_devices_are_kept() -> None:
    assert engine_env({"UCX_NET_DEVICES": "eth1"}) == {}
    assert engine_env({}) == {"UCX_NET_DEVICES": "lo"}
