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


# ------------------------------------------------------------------ PROXY v2 (binary)
def _v2(cmd: int, fam: int, addr: bytes, tlvs: bytes = b"") -> bytes:
    body = addr + tlvs
    return proxy.V2_SIGNATURE + bytes([0x20 | cmd, fam]) + len(body).to_bytes(2, "big") + body


def test_v2_tcp4_and_tcp6_and_tlvs_skipped() -> None:
    addr4 = bytes([192, 0, 2, 7, 127, 0, 0, 1]) + (40000).to_bytes(2, "big") + (5672).to_bytes(2, "big")
    data = _v2(1, 0x11, addr4, tlvs=b"\x04\x00\x03abc") + b"AMQP\x00\x00\x09\x01"
    assert proxy.parse(data) == (len(data) - 8, ("192.0.2.7", 40000))
    import ipaddress
    a6 = ipaddress.ip_address("2001:db8::1").packed + ipaddress.ip_address("::1").packed
    data6 = _v2(1, 0x21, a6 + (1).to_bytes(2, "big") + (2).to_bytes(2, "big"))
    assert proxy.parse(data6) == (len(data6), ("2001:db8::1", 1))


def test_v2_local_command_keeps_the_socket_address() -> None:
    data = _v2(0, 0x00, b"")
    assert proxy.parse(data) == (16, None)


def test_v2_needs_more_bytes_then_parses() -> None:
    line = proxy.encode_v2(("192.0.2.7", 40000), ("127.0.0.1", 5672))
    for cut in (1, 11, 12, 15, 16, len(line) - 1):
        assert proxy.parse(line[:cut]) is None, cut
    assert proxy.parse(line) == (len(line), ("192.0.2.7", 40000))
    line6 = proxy.encode_v2(("2001:db8::5", 7), ("::1", 5672))
    assert proxy.parse(line6) == (len(line6), ("2001:db8::5", 7))


@pytest.mark.parametrize("bad", [
    proxy.V2_SIGNATURE + b"\x11\x11\x00\x0c" + b"\x00" * 12,    # version 1 in the v2 framing
    proxy.V2_SIGNATURE + b"\x22\x11\x00\x0c" + b"\x00" * 12,    # unknown command
    proxy.V2_SIGNATURE + b"\x21\x11\x00\x04" + b"\x00" * 4,     # INET address block too short
    proxy.V2_SIGNATURE + b"\x21\x21\x00\x0c" + b"\x00" * 12,    # INET6 address block too short
])
def test_v2_malformed_refused(bad: bytes) -> None:
    with pytest.raises(proxy.ProxyHeaderError):
        proxy.parse(bad)


def test_sniff_tells_proxy_from_protocol_bytes() -> None:
    assert proxy.sniff(b"AMQP\x00\x00\x09\x01") is proxy.Sniff.NONE
    assert proxy.sniff(b"\x16\x03\x01\x02\x00") is proxy.Sniff.NONE  # a TLS ClientHello
    assert proxy.sniff(b"POST /api HTTP/1.1\r\n") is proxy.Sniff.NONE
    assert proxy.sniff(b"PRO") is proxy.Sniff.MORE
    assert proxy.sniff(b"\r\n\r\n\x00") is proxy.Sniff.MORE
    assert proxy.sniff(b"PROXY TCP4") is proxy.Sniff.HEADER
    assert proxy.sniff(proxy.V2_SIGNATURE) is proxy.Sniff.HEADER
    # v1 through the generic parse too
    assert proxy.parse(b"PROXY UNKNOWN\r\nxyz") == (15, None)
