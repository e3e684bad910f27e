"""Replication wire format, sans-IO (no sockets, no asyncio).

Theory of operation
-------------------
A follower opens a TCP connection to the leader's replication port and sends a
``Hello``: the magic ``SKREPL``, a protocol version byte, the cluster secret
(length-prefixed) and its node id (length-prefixed). The leader answers with one
``Welcome``: a status byte (``OK``, ``BAD_VERSION``, ``BAD_SECRET``) and, on
success, the leader's client ports — AMQP, HTTP, AMQPS, HTTPS, LMQ HTTP, LMQ
RPC, MQTT, MQTTS, 0 for one that does not listen — so a follower's proxy knows where the
leader serves each of them whatever its own port numbers are: 17 bytes,
uncompressed (version 7).

The same port also carries the follower proxy's tunnels: a ``TunnelHello``
(magic ``SKTUNL``, version, secret, which client port, the client's address,
and since version 6 the follower's node id and the tunnel's keepalive in
milliseconds; the address of a client on one of the follower's Unix sockets is
``UNIX_CLIENT``, since version 7; since version 10 the TLS the follower or cluster leader ended
for that client, as ``broker.tls.carried`` writes it, or nothing) answered by one status byte;
after ``OK`` the connection carries one client's bytes both ways, framed so each direction's
end can be told and a silent link found (``broker.cluster.tunnel``). The node id lets the leader close
a follower's tunnels when it drops that follower.

After that, leader -> follower carries messages LZ4-compressed: each write
batch is one LZ4 frame prefixed with its u32 length (``StreamCompressor``), so
a batch is decodable as soon as it arrives; follower -> leader carries plain
messages. A message is
``u8 kind, u32 payload length, payload``.

Leader -> follower: ``FILE_LIST`` (the bulk-sync index: path, logical length,
SHA-1), ``FILE_DATA`` (a chunk of a requested file; flag ``TRUNCATE`` on the
first chunk), ``BULK_DONE``, then the stream of actions ``APPEND`` (path,
bytes), ``REPLACE`` (path, whole content) and ``DELETE`` (path); ``HEARTBEAT``
(empty) whenever the leader has sent nothing for a second. Heartbeats count
like any message, so the follower's ack of one is the heartbeat back: a link
that carries neither is dead within seconds on both sides (version 2).
Follower -> leader: ``SCOPE`` (version 9) first, right behind the ``Hello``: what this
connection carries (``files.Scope``: a flags byte, bit 0 the node's shared files, bit 1 every
shard but the named ones (clear: the named ones), then the named shards as 20-byte vhost
directory digests, at most ``MAX_SCOPE_SHARDS``);
the leader reads it before its cut, lists and streams only paths inside it. Then
``REQUEST`` (paths the follower lacks or has different),
``ACK`` (u64: total uncompressed message bytes applied and fsynced so far) and, during bulk
sync, ``MERGE_ACKS`` (version 4): an ack file of the follower's that differs from the
leader's or that the leader lacks, with the length and SHA-1 of the follower's copy of its
segment; the leader acks the same positions in its store when its segment starts with those
very bytes. An ack known on any in-sync copy thus stays acked, even if the leader's own
copy lost it (a leader that crashed inside its ack sync window after its followers died).

Ack accounting: both sides count the encoded size (header included) of every
leader -> follower message after the ``Welcome``; the leader's count when it
queued a message is that message's position, and a follower ack of N covers
every message whose position is <= N.

Paths are relative POSIX paths inside the data directory; ``check_path``
refuses absolute paths, ``..`` and empty components so a leader can never make
a follower write outside its data directory.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Final, NamedTuple

import lz4.frame

from broker.cluster.files import Scope

MAGIC: Final = b"SKREPL"
TUNNEL_MAGIC: Final = b"SKTUNL"
VERSION: Final = 10  # 2: HEARTBEAT; 3: every client port in the Welcome, tunnels; 4: MERGE_ACKS;
# 5: tunnels framed (an end-of-stream marker each way); 6: tunnel keepalive, the follower's id in
# TunnelHello, the MQTT port in the Welcome; 7: the MQTTS and stream-protocol ports in the Welcome,
# Unix-socket clients in TunnelHello; 8: the stream protocol's TLS port in the Welcome; 9: SCOPE;
# 10: the client's TLS (PROXY v2's SSL TLV) in TunnelHello
MAX_TUNNEL_TLS: Final = 16 * 1024  # bytes of a TunnelHello's TLS field (broker.tls.MAX_CARRIED)
SECRET_SIZE: Final = 32

# Welcome status codes.
OK: Final = 0
BAD_VERSION: Final = 1
BAD_SECRET: Final = 2
UNAVAILABLE: Final = 3  # tunnel: the leader does not serve that port

# Client ports, in Welcome order; a TunnelHello names one of them.
AMQP_PORT: Final = 0
HTTP_PORT: Final = 1
AMQPS_PORT: Final = 2
HTTPS_PORT: Final = 3
LMQ_HTTP_PORT: Final = 4
LMQ_RPC_PORT: Final = 5
MQTT_PORT: Final = 6
MQTTS_PORT: Final = 7
STREAM_PORT: Final = 8
STREAMS_PORT: Final = 9  # the stream protocol over TLS (RabbitMQ's 5551)
WELCOME_PORTS: Final = 10  # the ports a Welcome tells (a follower proxies each)
# a node's Prometheus port, reached by a tunnel only (not in a Welcome: no follower proxies it):
# the cluster leader's metrics port asks each node serving shards for its part (``http/forward.py``)
METRICS_PORT: Final = 10
CLIENT_PORTS: Final = 11  # the ports a TunnelHello may name
PORT_NAMES: Final = ("amqp", "http", "amqps", "https", "lmq_http", "lmq_rpc", "mqtt", "mqtts", "stream",
                     "streams", "metrics")
# a TunnelHello's client address for a client on one of the follower's Unix sockets (the value of
# ``auth.users.UNIX_PEER``, which the leader's listeners treat as local, as on the follower)
UNIX_CLIENT: Final = "unix"

# Message kinds, leader -> follower.
FILE_LIST: Final = 1
FILE_DATA: Final = 2
BULK_DONE: Final = 3
APPEND: Final = 4
REPLACE: Final = 5
DELETE: Final = 6
HEARTBEAT: Final = 7
# Message kinds, follower -> leader.
REQUEST: Final = 10
ACK: Final = 11
MERGE_ACKS: Final = 12
SCOPE: Final = 13

SCOPE_SHARED: Final = 1  # SCOPE flags: the node's shared files ...
SCOPE_EVERY_SHARD: Final = 2  # ... every shard but the named ones (else: the named ones)
MAX_SCOPE_SHARDS: Final = 65536  # shards one SCOPE may name (1.3 MB): bounds what a peer makes us read
SCOPE_MAX_PAYLOAD: Final = 1 + 20 * MAX_SCOPE_SHARDS

TRUNCATE: Final = 1  # FILE_DATA flag: first chunk of a file, start from empty
MAX_PAYLOAD: Final = 64 * 1024 * 1024  # larger than any segment chunk we send; guards a bad peer
FILE_CHUNK: Final = 1024 * 1024  # bulk-sync files are sent in chunks of this size

_HEAD: Final = struct.Struct(">BI")
HEAD: Final = _HEAD  # a message's header: kind, payload length
_U8: Final = struct.Struct(">B")
_U16: Final = struct.Struct(">H")
_U32: Final = struct.Struct(">I")
_U64: Final = struct.Struct(">Q")
_WELCOME: Final = struct.Struct(f">B{WELCOME_PORTS}H")
_ENTRY_TAIL: Final = struct.Struct(">Q20s")


class CodecError(ValueError):
    """Malformed bytes from the peer: the connection must be dropped."""


class Message(NamedTuple):
    kind: int
    payload: bytes
    size: int  # encoded size, header included (the unit of acks)


@dataclass(frozen=True)
class Hello:
    version: int
    secret: bytes
    node_id: str


@dataclass(frozen=True)
class Welcome:
    status: int
    ports: tuple[int, ...] = (0,) * WELCOME_PORTS  # indexed by AMQP_PORT .. STREAMS_PORT; 0: off


@dataclass(frozen=True)
class TunnelHello:
    version: int
    secret: bytes
    port: int  # AMQP_PORT .. STREAMS_PORT
    client: tuple[str, int]  # the address the follower's proxy accepted the client from
    node_id: str = ""  # the follower whose proxy opened it
    keepalive_ms: int = 0  # silence after which either end presumes the link dead (0: none)
    tls: bytes = b""  # the TLS the sending member ended for this client: PROXY v2's SSL TLV; b"": none


@dataclass(frozen=True)
class FileInfo:
    path: str
    length: int
    sha1: bytes  # 20-byte digest of the first ``length`` bytes


def check_path(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in path:
        raise CodecError(f"unsafe replication path {path!r}")
    return path


# ---------------------------------------------------------------- handshake

def encode_hello(secret: bytes, node_id: str, version: int = VERSION) -> bytes:
    nid = node_id.encode()
    if len(secret) > 255 or len(nid) > 255:
        raise ValueError("secret and node id are at most 255 bytes")
    return MAGIC + _U8.pack(version) + _U8.pack(len(secret)) + secret + _U8.pack(len(nid)) + nid


def parse_hello(buf: bytes) -> tuple[Hello, int] | None:
    """(hello, bytes consumed), or None if more bytes are needed."""
    parsed = parse_opening(buf)
    if parsed is not None and not isinstance(parsed[0], Hello):
        raise CodecError("not a skred replication client")
    return parsed  # type: ignore[return-value]


def encode_tunnel_hello(secret: bytes, port: int, client: tuple[str, int], version: int = VERSION, *,
                        node_id: str = "", keepalive_ms: int = 0, tls: bytes = b"") -> bytes:
    host, nid = client[0].encode(), node_id.encode()
    if len(secret) > 255 or len(host) > 255 or len(nid) > 255:
        raise ValueError("secret, client address and node id are at most 255 bytes")
    if len(tls) > MAX_TUNNEL_TLS:
        raise ValueError(f"a tunnel's TLS field is at most {MAX_TUNNEL_TLS} bytes")
    return (TUNNEL_MAGIC + _U8.pack(version) + _U8.pack(len(secret)) + secret + _U8.pack(port)
            + _U8.pack(len(host)) + host + _U16.pack(client[1])
            + _U8.pack(len(nid)) + nid + _U32.pack(keepalive_ms) + _U16.pack(len(tls)) + tls)


class _Cursor:
    """Reads length-prefixed fields off a buffer; ``None`` from any read: more bytes needed."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, n: int) -> bytes | None:
        if len(self.buf) < self.pos + n:
            return None
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return bytes(out)

    def u8(self) -> int | None:
        raw = self.take(1)
        return None if raw is None else raw[0]

    def prefixed(self) -> bytes | None:
        n = self.u8()
        return None if n is None else self.take(n)


def parse_opening(buf: bytes) -> tuple[Hello | TunnelHello, int] | None:
    """The first message on the replication port: a follower's ``Hello`` or a proxy's
    ``TunnelHello``, with the bytes consumed; None if more bytes are needed."""
    n = len(MAGIC)
    magic = bytes(buf[:n])
    if not (MAGIC.startswith(magic) or TUNNEL_MAGIC.startswith(magic)):
        raise CodecError("not a skred replication client")
    if len(buf) < n:
        return None
    cur = _Cursor(buf, n)
    version, secret = cur.u8(), cur.prefixed()
    if version is None or secret is None:
        return None
    if magic == MAGIC:
        nid = cur.prefixed()
        if nid is None:
            return None
        try:
            return Hello(version, secret, nid.decode()), cur.pos
        except UnicodeDecodeError:
            raise CodecError("node id is not UTF-8") from None
    port, host, client_port = cur.u8(), cur.prefixed(), cur.take(2)
    if port is None or host is None or client_port is None:
        return None
    if version != VERSION:  # an older proxy: the leader refuses it by its version alone
        return TunnelHello(version, secret, port, ("0.0.0.0", 0)), cur.pos
    nid, keepalive, tls_size = cur.prefixed(), cur.take(4), cur.take(2)
    if nid is None or keepalive is None or tls_size is None:
        return None
    size = _U16.unpack(tls_size)[0]
    if size > MAX_TUNNEL_TLS:
        raise CodecError("a tunnel's TLS field is too long")
    tls = cur.take(size)
    if tls is None:
        return None
    if port >= CLIENT_PORTS:
        raise CodecError(f"tunnel to unknown client port {port}")
    try:
        client = (host.decode("ascii"), _U16.unpack(client_port)[0])
        if client[0] != UNIX_CLIENT:
            ipaddress.ip_address(client[0])  # as the follower saw it, unchanged; nothing else
    except (UnicodeDecodeError, ValueError):
        raise CodecError("client address is not an IP address") from None
    try:
        node_id = nid.decode()
    except UnicodeDecodeError:
        raise CodecError("node id is not UTF-8") from None
    return TunnelHello(version, secret, port, client, node_id, _U32.unpack(keepalive)[0], tls), cur.pos


WELCOME_SIZE: Final = _WELCOME.size


def encode_welcome(status: int, ports: tuple[int, ...] = (0,) * WELCOME_PORTS) -> bytes:
    return _WELCOME.pack(status, *ports)


def parse_welcome(buf: bytes) -> Welcome:
    if len(buf) != _WELCOME.size:
        raise CodecError("short welcome")
    status, *ports = _WELCOME.unpack(buf)
    return Welcome(status, tuple(ports))


# ---------------------------------------------------------------- messages

def encode(kind: int, payload: bytes) -> bytes:
    return _HEAD.pack(kind, len(payload)) + payload


def _path_bytes(path: str) -> bytes:
    raw = path.encode()
    return _U16.pack(len(raw)) + raw


def encode_append(path: str, data: bytes | bytearray | memoryview) -> bytes:
    p = _path_bytes(path)
    return _HEAD.pack(APPEND, len(p) + len(data)) + p + data


def encode_replace(path: str, data: bytes) -> bytes:
    p = _path_bytes(path)
    return _HEAD.pack(REPLACE, len(p) + len(data)) + p + data


def encode_delete(path: str) -> bytes:
    return encode(DELETE, _path_bytes(path))


def encode_file_data(path: str, data: bytes, truncate: bool) -> bytes:
    p = _path_bytes(path)
    return encode(FILE_DATA, p + _U8.pack(TRUNCATE if truncate else 0) + data)


def encode_file_list(files: list[FileInfo]) -> bytes:
    parts = [_path_bytes(f.path) + _ENTRY_TAIL.pack(f.length, f.sha1) for f in files]
    return encode(FILE_LIST, b"".join(parts))


def encode_request(paths: list[str]) -> bytes:
    return encode(REQUEST, b"".join(_path_bytes(p) for p in paths))


def encode_ack(applied: int) -> bytes:
    return encode(ACK, _U64.pack(applied))


def encode_scope(scope: Scope) -> bytes:
    shards = sorted(scope.excluded if scope.shards is None else scope.shards)
    if len(shards) > MAX_SCOPE_SHARDS:
        raise ValueError(f"a scope names at most {MAX_SCOPE_SHARDS} shards")
    flags = (SCOPE_SHARED if scope.shared else 0) | (SCOPE_EVERY_SHARD if scope.shards is None else 0)
    try:
        digests = b"".join(bytes.fromhex(s) for s in shards)
    except ValueError:
        raise ValueError("a shard is named by its vhost directory (40 hex digits)") from None
    if len(digests) != 20 * len(shards):
        raise ValueError("a shard is named by its vhost directory (40 hex digits)")
    return encode(SCOPE, _U8.pack(flags) + digests)


def parse_scope(payload: bytes) -> Scope:
    if not payload or len(payload) > SCOPE_MAX_PAYLOAD or (len(payload) - 1) % 20:
        raise CodecError("bad scope")
    flags = payload[0]
    if flags & ~(SCOPE_SHARED | SCOPE_EVERY_SHARD):
        raise CodecError(f"unknown scope flags {flags:#x}")
    names = frozenset(payload[i:i + 20].hex() for i in range(1, len(payload), 20))
    if flags & SCOPE_EVERY_SHARD:
        return Scope(bool(flags & SCOPE_SHARED), None, names)
    return Scope(bool(flags & SCOPE_SHARED), names)


def encode_merge_acks(path: str, segment_length: int, segment_sha1: bytes, positions: bytes) -> bytes:
    """``path``: the ack file; ``positions``: its u32 little-endian entries (no header)."""
    return encode(MERGE_ACKS, _path_bytes(path) + _ENTRY_TAIL.pack(segment_length, segment_sha1) + positions)


def parse_merge_acks(payload: bytes) -> tuple[str, int, bytes, list[int]]:
    """-> (ack file path, segment length, segment SHA-1, positions)."""
    path, pos = _take_path(payload, 0)
    if pos + _ENTRY_TAIL.size > len(payload) or (len(payload) - pos - _ENTRY_TAIL.size) % 4:
        raise CodecError("bad merge-acks message")
    length, sha1 = _ENTRY_TAIL.unpack_from(payload, pos)
    pos += _ENTRY_TAIL.size
    positions = [p for (p,) in struct.iter_unpack("<I", payload[pos:])]
    return path, int(length), bytes(sha1), positions


def _take_path(payload: bytes, pos: int) -> tuple[str, int]:
    if pos + 2 > len(payload):
        raise CodecError("truncated path")
    (n,) = _U16.unpack_from(payload, pos)
    pos += 2
    if pos + n > len(payload):
        raise CodecError("truncated path")
    try:
        path = payload[pos:pos + n].decode()
    except UnicodeDecodeError:
        raise CodecError("path is not UTF-8") from None
    return check_path(path), pos + n


def parse_path_data(payload: bytes) -> tuple[str, bytes]:
    """APPEND / REPLACE payload -> (path, data)."""
    path, pos = _take_path(payload, 0)
    return path, payload[pos:]


def parse_delete(payload: bytes) -> str:
    path, pos = _take_path(payload, 0)
    if pos != len(payload):
        raise CodecError("trailing bytes after path")
    return path


def parse_file_data(payload: bytes) -> tuple[str, bool, bytes]:
    path, pos = _take_path(payload, 0)
    if pos >= len(payload):
        raise CodecError("truncated file data")
    return path, bool(payload[pos] & TRUNCATE), payload[pos + 1:]


def parse_file_list(payload: bytes) -> list[FileInfo]:
    files: list[FileInfo] = []
    pos = 0
    while pos < len(payload):
        path, pos = _take_path(payload, pos)
        if pos + _ENTRY_TAIL.size > len(payload):
            raise CodecError("truncated file list entry")
        length, sha1 = _ENTRY_TAIL.unpack_from(payload, pos)
        pos += _ENTRY_TAIL.size
        files.append(FileInfo(path, int(length), bytes(sha1)))
    return files


def parse_request(payload: bytes) -> list[str]:
    paths: list[str] = []
    pos = 0
    while pos < len(payload):
        path, pos = _take_path(payload, pos)
        paths.append(path)
    return paths


def parse_ack(payload: bytes) -> int:
    if len(payload) != _U64.size:
        raise CodecError("bad ack")
    return int(_U64.unpack(payload)[0])


class MessageReader:
    """Splits a byte stream into messages: feed bytes, get every complete message."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        buf = self._buf
        buf += data
        out: list[Message] = []
        pos = 0
        size = len(buf)
        while size - pos >= _HEAD.size:
            kind, length = _HEAD.unpack_from(buf, pos)
            if length > MAX_PAYLOAD:
                raise CodecError(f"message of {length} bytes is too large")
            end = pos + _HEAD.size + length
            if end > size:
                break
            out.append(Message(kind, bytes(buf[pos + _HEAD.size:end]), end - pos))
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


class StreamCompressor:
    """Leader -> follower compression: each batch becomes one LZ4 frame, length-prefixed.

    One frame per batch (rather than one endless frame) because a streaming LZ4
    decompressor may hold back the tail of a block until more input arrives, and
    a follower must be able to apply, fsync and ack every batch as soon as it lands.
    """

    def compress(self, data: bytes) -> bytes:
        frame = lz4.frame.compress(data, block_linked=False, content_checksum=False)
        return _U32.pack(len(frame)) + bytes(frame)


class StreamDecompressor:
    def __init__(self) -> None:
        self._buf = bytearray()

    def decompress(self, data: bytes) -> bytes:
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        while len(buf) - pos >= _U32.size:
            (n,) = _U32.unpack_from(buf, pos)
            if n > MAX_PAYLOAD:
                raise CodecError(f"LZ4 frame of {n} bytes is too large")
            end = pos + _U32.size + n
            if end > len(buf):
                break
            try:
                out.append(bytes(lz4.frame.decompress(bytes(buf[pos + _U32.size:end]))))
            except RuntimeError as exc:  # lz4 reports corrupt input as RuntimeError
                raise CodecError(f"corrupt LZ4 frame: {exc}") from None
            pos = end
        if pos:
            del buf[:pos]
        return b"".join(out)
