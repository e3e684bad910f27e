"""PROXY protocol (HAProxy) v1 and v2 header parsing, sans-IO.

Theory of operation
-------------------
A load balancer or a follower that splices a client connection to the leader
sends a PROXY header before the client's first byte, so the broker sees the
real client address. v1 is one text line,
``PROXY TCP4 <src> <dst> <sport> <dport>\\r\\n`` (at most 107 bytes); v2 is
binary: a 12-byte signature, a version/command byte (0x20 LOCAL, 0x21 PROXY),
an address family/transport byte, a big-endian u16 length, then the address
block (IPv4: 4+4+2+2 bytes, IPv6: 16+16+2+2) and TLVs, which are skipped.
``LOCAL`` (a health check by the proxy itself) and ``UNSPEC`` keep the
socket's own address.

The listener (``broker.net.listener``) peeks the first bytes of every
connection: ``sniff`` says whether they are a header, can't tell yet, or are
protocol bytes (AMQP, a TLS ClientHello, an HTTP request line); ``parse``
returns how many bytes the header takes so exactly those are consumed before
TLS or the protocol starts. Only trusted peers (cluster members, configured
proxies) may send one: anyone else could forge their address and pass the
loopback-only rule for the default user.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from collections.abc import Iterable

MAX_HEADER = 107
PREFIX = b"PROXY "
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_MAX = 16 + 0xFFFF  # fixed part + the largest length field
_V2_FIXED = struct.Struct(">12sBBH")
_V2_INET = struct.Struct(">4s4sHH")
_V2_INET6 = struct.Struct(">16s16sHH")


class ProxyHeaderError(ValueError):
    pass


class Sniff(enum.Enum):
    NONE = "none"  # not a PROXY header: protocol bytes
    MORE = "more"  # too few bytes to tell
    HEADER = "header"  # a v1 or v2 header starts here


def sniff(data: bytes) -> Sniff:
    for prefix in (PREFIX, V2_SIGNATURE):
        n = min(len(data), len(prefix))
        if data[:n] == prefix[:n]:
            return Sniff.HEADER if len(data) >= len(prefix) else Sniff.MORE
    return Sniff.NONE


def parse(data: bytes) -> tuple[int, tuple[str, int] | None] | None:
    """Parse a v1 or v2 header at the start of ``data`` (see ``parse_v1`` for the result)."""
    if data.startswith(PREFIX):
        return parse_v1(data)
    return parse_v2(data)


def parse_v2(data: bytes) -> tuple[int, tuple[str, int] | None] | None:
    if len(data) < _V2_FIXED.size:
        return None
    sig, ver_cmd, fam, length = _V2_FIXED.unpack_from(data)
    if sig != V2_SIGNATURE:
        raise ProxyHeaderError("not a PROXY v2 header")
    if ver_cmd >> 4 != 2:
        raise ProxyHeaderError(f"PROXY v2 header with version {ver_cmd >> 4}")
    cmd = ver_cmd & 0x0F
    if cmd not in (0, 1):
        raise ProxyHeaderError(f"PROXY v2 header with unknown command {cmd}")
    end = _V2_FIXED.size + length
    if len(data) < end:
        return None
    if cmd == 0:  # LOCAL: the proxy's own connection
        return end, None
    family, block = fam >> 4, data[_V2_FIXED.size:end]
    layout = {1: _V2_INET, 2: _V2_INET6}.get(family)
    if layout is None:  # UNSPEC or UNIX: no IP address to report
        return end, None
    if len(block) < layout.size:
        raise ProxyHeaderError("PROXY v2 address block too short")
    src, _dst, sport, _dport = layout.unpack_from(block)
    return end, (str(ipaddress.ip_address(src)), int(sport))


def encode_v2(src: tuple[str, int], dst: tuple[str, int]) -> bytes:
    s, d = ipaddress.ip_address(src[0]), ipaddress.ip_address(dst[0])
    if s.version != d.version:
        raise ValueError("PROXY v2: source and destination of different families")
    fam, layout = (0x11, _V2_INET) if s.version == 4 else (0x21, _V2_INET6)
    block = layout.pack(s.packed, d.packed, src[1], dst[1])
    return _V2_FIXED.pack(V2_SIGNATURE, 0x21, fam, len(block)) + block


def parse_v1(data: bytes) -> tuple[int, tuple[str, int] | None] | None:
    """Parse a v1 header at the start of ``data``.

    Returns None if more bytes are needed, else (bytes consumed, (src ip, src
    port) or None for ``PROXY UNKNOWN``). Raises ProxyHeaderError when the
    header is malformed.
    """
    end = data.find(b"\r\n", 0, MAX_HEADER)
    if end < 0:
        if len(data) >= MAX_HEADER:
            raise ProxyHeaderError("PROXY header too long or not terminated")
        return None
    try:
        parts = data[:end].decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise ProxyHeaderError("PROXY header is not ASCII") from None
    if parts[0] != "PROXY" or len(parts) < 2:
        raise ProxyHeaderError("not a PROXY header")
    if parts[1] == "UNKNOWN":
        return end + 2, None
    if parts[1] not in ("TCP4", "TCP6") or len(parts) != 6:
        raise ProxyHeaderError(f"malformed PROXY header: {data[:end]!r}")
    try:
        src = ipaddress.ip_address(parts[2])
        ipaddress.ip_address(parts[3])
        sport, dport = int(parts[4]), int(parts[5])
    except ValueError:
        raise ProxyHeaderError(f"malformed PROXY header: {data[:end]!r}") from None
    if not (0 <= sport <= 65535 and 0 <= dport <= 65535):
        raise ProxyHeaderError("PROXY header port out of range")
    if (src.version == 4) != (parts[1] == "TCP4"):
        raise ProxyHeaderError("PROXY header address family mismatch")
    return end + 2, (str(src), sport)


def encode_v1(src: tuple[str, int], dst: tuple[str, int]) -> bytes:
    family = "TCP6" if ":" in src[0] else "TCP4"
    return f"PROXY {family} {src[0]} {dst[0]} {src[1]} {dst[1]}\r\n".encode("ascii")


def is_trusted(peer_ip: str, networks: Iterable[str], peers: Iterable[str]) -> bool:
    try:
        ip = ipaddress.ip_address(peer_ip)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for p in peers:
        if str(ip) == p:
            return True
    for net in networks:
        try:
            if ip in ipaddress.ip_network(net, strict=False):
                return True
        except ValueError:
            continue
    return False
