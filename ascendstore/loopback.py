"""Free TCP ports on loopback for servers that tests and benchmarks start.

The usual trick, ``bind(("127.0.0.1", 0))`` then close, only says a port is free
*now*: the server that will listen on it starts later, and until it does the
kernel may hand the same port to the next ``bind(0)``. Asking twice in a row for
two ports of one server (a ``mooncake_master``'s RPC and metrics ports) then
gets one port twice, seldom but for real: the master's admin server took the
port, its RPC server could not, and the master exited right after its port had
answered (a CI failure, 2026-12-04). So every port handed out here is drawn
while the others of the same call are still bound, and none is handed out twice
by one process.

``bind(0)`` also draws from the kernel's ephemeral range, where every outgoing
connection takes its local port: while a server is down (killed, to be restarted
on the same ports) or not started yet, a client's connection can sit on its port.
Ports here come from below that range (and above 12000-17000, where Mooncake's
clients listened in our runs), drawn at random and checked by binding them.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_given: set[int] = set()
_lock = threading.Lock()
#: draws tolerated in one call (ports given already, or in use)
_MAX_DRAWS = 2000
#: servers' ports start here: above the ports Mooncake's clients and transfer engine listen on
SERVER_PORTS_FROM = 20000
#: a system-wide source: a seeded ``random`` (tests seed it) or a forked copy of a
#: private generator would draw the same ports in two processes
_rng = random.SystemRandom()


def server_port_range() -> range:
    """Where ports are drawn: from ``SERVER_PORTS_FROM`` up to the kernel's ephemeral
    range (empty where that range starts too low to leave room: then ``bind(0)``)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    ports = range(SERVER_PORTS_FROM, min(ephemeral_low, 1 << 16))
    return ports if len(ports) >= 1000 else range(0)


def _draw(host: str, ports: range) -> socket.socket | None:
    s = socket.socket()
    try:
        s.bind((host, _rng.choice(ports) if ports else 0))
    except OSError:  # in use: draw again
        s.close()
        return None
    return s


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` now, none handed out before by this process."""
    ports = server_port_range()
    with _lock:
        held: list[socket.socket] = []
        out: list[int] = []
        try:
            for _ in range(_MAX_DRAWS):
                if len(out) == n:
                    return out
                s = _draw(host, ports)
                if s is None:
                    continue
                held.append(s)  # stays bound until all n are drawn: none can come twice
                port = s.getsockname()[1]
                if port not in _given:
                    _given.add(port)
                    out.append(port)
            if len(out) == n:
                return out
            raise RuntimeError(f"no {n} free ports on {host} in {_MAX_DRAWS} draws ({len(_given)} handed out)")
        finally:
            for s in held:
                s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port free on ``host`` now, never handed out before by this process."""
    return free_ports(1, host)[0]
