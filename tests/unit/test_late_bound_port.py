"""Ports for servers that bind late are taken below the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from kvplane.services.common.local_etcd import late_bound_port


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {late_bound_port() for _ in range(20)}
    assert all(port < low for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free
