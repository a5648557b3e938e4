"""``free_port`` hands out loopback ports outside the kernel's ephemeral range: an outgoing connection can never
take one as its source port between the pick and the listen (the race that can abort a rendezvous store)."""

import random
import socket

from dynemb.distributed.launch import _ephemeral_low, free_port


def test_ports_are_free_distinct_enough_and_below_the_ephemeral_range():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= p < low for p in ports)
    assert len(set(ports)) == 50  # drawn at random, and never one handed out a moment ago
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: the caller can listen on it


def test_a_taken_port_is_not_handed_out(monkeypatch):
    draw = random.randrange
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    draws = iter([port, port])  # the taken port twice, then real draws (a fixed third port may be taken too)
    monkeypatch.setattr("dynemb.distributed.launch.random.randrange", lambda *a: next(draws, None) or draw(*a))
    try:
        assert free_port() != port
    finally:
        taken.close()


def test_a_port_just_handed_out_is_not_handed_out_again(monkeypatch):
    """A server's HTTP and gRPC ports come from two calls before either is bound: the same draw twice (1 in ~12,000
    a pair) gave both the same port and a failed test."""
    draw = random.randrange
    first = free_port()
    draws = iter([first, first])  # the kernel would let it be bound again: it is still free
    monkeypatch.setattr("dynemb.distributed.launch.random.randrange", lambda *a: next(draws, None) or draw(*a))
    assert free_port() != first
