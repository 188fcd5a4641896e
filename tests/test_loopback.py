"""Loopback ports for the servers tests and benchmarks start (ascendstore.loopback)."""

from __future__ import annotations

import socket

from ascendstore.loopback import SERVER_PORTS_FROM, free_port, free_ports, server_port_range


def test_no_port_is_handed_out_twice():
    # 600 draws of the bind(0)-then-close trick among the ~14k ports bind(0) picks
    # from here repeat one with probability ~1 - e^-13 (measured here: 6-18 repeats
    # in five tries); a server started on the second copy cannot listen.
    ports = [free_port() for _ in range(300)] + [p for _ in range(50) for p in free_ports(6)]
    assert len(set(ports)) == len(ports)


def test_ports_are_free_and_distinct_within_a_call():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    held = []
    try:
        for p in ports:  # every one can be bound (and so listened on) right away
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", p))
            s.listen(1)
    finally:
        for s in held:
            s.close()


def test_ports_lie_below_the_ephemeral_range():
    # Outgoing connections take local ports from the ephemeral range: one could sit
    # on a killed server's port before its restart. Linux ships 32768-60999.
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert server_port_range() == range(SERVER_PORTS_FROM, low)
    assert all(SERVER_PORTS_FROM <= p < low for p in free_ports(50))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    # Narrow the range to 1000 ports and hold 990 of them: every port handed out is one of the other 10.
    monkeypatch.setattr("ascendstore.loopback.server_port_range", lambda: range(41000, 42000))
    held = []
    try:
        for p in range(41000, 41990):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                s.close()
                continue
            held.append(s)
        busy = {s.getsockname()[1] for s in held}
        got = free_ports(3)
        assert not set(got) & busy and all(41000 <= p < 42000 for p in got)
    finally:
        for s in held:
            s.close()
