"""Loopback ports for servers that tests, benchmarks and development stacks start.

A port is chosen below the kernel's ephemeral range. A port found free by binding port 0 is an
ephemeral one: until its server binds it (a child process, seconds later, or again after a
restart), any outgoing connection may take it as its source port, or another process binding
port 0 may get it, and the server then fails with "address already in use".

Within one process no port is handed out twice, so several picked before any is bound differ.
Where the ephemeral range leaves too few ports below it, the kernel's own choice is taken.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

# Where the kernel's ephemeral ports start when /proc does not say (Linux's default).
_EPHEMERAL_LOW = 32768
# Ports already handed out by this process; forgotten once this many, oldest first.
_REMEMBERED = 4096
# Fewer ports than this below the ephemeral range: pick ephemeral ones instead.
_MIN_SPAN = 2 * _REMEMBERED
# The process's own generator, seeded from the OS. The `random` module may be seeded by others
# (Hypothesis reseeds it per example, and warns when a strategy's draw moves it): picks from it
# would then repeat, in this process and in any other seeded alike.
_rng = random.Random()

_lock = threading.Lock()
_handed_out: dict[int, None] = {}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_pick(family: socket.AddressFamily, host: str) -> int:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that binds now, lies below the ephemeral range (where that leaves
    enough), and that this process has not handed out before."""
    low = _ephemeral_low()
    floor = 10_000 if low > 10_000 + _MIN_SPAN else 1024
    below = low - floor >= _MIN_SPAN
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with _lock:
        for _ in range(500):
            port = _rng.randrange(floor, low) if below else _kernel_pick(family, host)
            if port in _handed_out or not _bindable(family, host, port):
                continue
            _handed_out[port] = None
            if len(_handed_out) > _REMEMBERED:
                del _handed_out[next(iter(_handed_out))]
            return port
    raise OSError(f"no free port on {host} that this process has not handed out already")
