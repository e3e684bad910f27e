"""PROXY protocol v1 parsing and the trust rule (broker/net/proxy.py), without sockets."""

from __future__ import annotations

import pytest

from broker.net import proxy


def test_parses_tcp4_and_tcp6_and_reports_bytes_used() -> None:
    data = b"PROXY TCP4 192.0.2.7 127.0.0.1 40000 5672\r\nAMQP\x00\x00\x09\x01"
    assert proxy.parse_v1(data) == (len(data) - 8, ("192.0.2.7", 40000))
    assert proxy.parse_v1(b"PROXY TCP6 2001:db8::1 ::1 1 2\r\n") == (32, ("2001:db8::1", 1))
    assert proxy.parse_v1(b"PROXY UNKNOWN\r\n") == (15, None)


def test_needs_more_bytes_until_the_line_ends() -> None:
    assert proxy.parse_v1(b"PROXY TCP4 192.0.2.7 127.0.0.1 4000") is None


@pytest.mark.parametrize("bad", [
    b"PROXY TCP4 999.0.2.7 127.0.0.1 1 2\r\n",        # not an address
    b"PROXY TCP4 192.0.2.7 127.0.0.1 1\r\n",          # missing field
    b"PROXY TCP4 192.0.2.7 127.0.0.1 1 70000\r\n",    # port out of range
    b"PROXY TCP4 2001:db8::1 ::1 1 2\r\n",            # family mismatch
    b"PROXY UDP4 192.0.2.7 127.0.0.1 1 2\r\n",        # unknown protocol
    b"PROXY TCP4 \xff 127.0.0.1 1 2\r\n",             # not ASCII
    b"PROXY " + b"x" * 200,                            # never terminated within 107 bytes
])
def test_malformed_headers_are_refused(bad: bytes) -> None:
    with pytest.raises(proxy.ProxyHeaderError):
        proxy.parse_v1(bad)


def test_encode_round_trips() -> None:
    line = proxy.encode_v1(("192.0.2.7", 40000), ("127.0.0.1", 5672))
    assert proxy.parse_v1(line) == (len(line), ("192.0.2.7", 40000))


def test_trust_by_network_or_member_address() -> None:
    assert proxy.is_trusted("10.1.2.3", ["10.0.0.0/8"], [])
    assert proxy.is_trusted("::ffff:127.0.0.2", [], ["127.0.0.2"])  # v4-mapped member
    assert not proxy.is_trusted("192.0.2.9", ["10.0.0.0/8"], ["127.0.0.2"])
    assert not proxy.is_trusted("not-an-ip", ["0.0.0.0/0"], [])
    assert not proxy.is_trusted("10.1.2.3", ["bogus"], [])
