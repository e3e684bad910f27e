"""PROXY protocol v1 (HAProxy) header parsing, sans-IO.

A follower that splices a client connection to the leader sends
``PROXY TCP4 <src> <dst> <sport> <dport>\\r\\n`` first, so the leader sees the
real client address. The header is at most 107 bytes. Only trusted peers
(cluster members, configured proxies) may send one: anyone else could forge
their address and pass the loopback-only rule for the default user.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

MAX_HEADER = 107
PREFIX = b"PROXY "


class ProxyHeaderError(ValueError):
    pass


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
