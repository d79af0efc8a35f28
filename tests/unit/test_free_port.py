"""Ports for servers started later are taken below the kernel's ephemeral range, and one
process never gets the same port twice."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from kvplane.services.common.runtime import ports
from kvplane.services.common.runtime.ports import free_port


def test_the_port_is_free_and_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free


def test_ports_picked_before_any_is_bound_all_differ() -> None:
    # 2,000 random picks from some 22,000 ports would repeat one about 90 times over.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_an_ipv6_loopback_port_is_free_there() -> None:
    port = free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


def test_with_no_room_below_the_ephemeral_range_the_kernels_ports_are_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1024)
    picked = [free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    for port in picked:
        assert port >= 1024
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_the_pick_leaves_the_random_modules_state_alone() -> None:
    # The ports come from the process's own generator: processes whose `random` a test framework
    # seeded alike (Hypothesis does, per example) do not pick alike, and the framework's
    # generator is not moved.
    state = random.getstate()
    free_port()
    assert random.getstate() == state
