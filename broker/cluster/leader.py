"""The leader side of replication: the store's ReplicationSink plus the server on 5679.

Theory of operation
-------------------
``FileIndex`` is the checksum cache. It is built once, before the broker loads
(nothing writes then), by hashing every replicated file; afterwards it is kept
current by the sink calls themselves: an ``append`` feeds the bytes to the
file's running SHA-1 and adds to its logical length, a ``replace`` restarts
both, a ``delete`` drops the entry. A checksum is then ``hasher.copy().digest()``
— no file is ever re-read to answer a follower, so a full sync never stalls
publishing. Logical length matters: the write segment is preallocated on disk,
but only the bytes reported to the sink exist for replication.

Bulk sync has a single cut, taken synchronously on the event loop (all sink
calls happen on that thread, so nothing can slip in between): flush the
stores (buffered ack bytes reach the page cache), snapshot the index, and start
holding every later action in the follower's backlog. The follower requests
the files whose (length, SHA-1) differ; their first ``length`` bytes are read
from disk in a worker thread — bytes below a file's logical length never change
in place, and a file replaced or deleted after the cut is fixed by the held
actions. Small replaced files (queue ``meta``) are served from memory because
their disk copy may lag the sink. Then ``BULK_DONE``, then the backlog, then
live actions.

Each follower gets an LZ4-compressed stream (a frame per batch); positions count uncompressed message
bytes. ISR: a follower joins the in-sync set once it has acked everything sent
(it is added locally *before* the etcd write, so no confirm can skip it in
between); it leaves when it disconnects or has data outstanding and no ack
progress for ``STALL_TIMEOUT`` (a heartbeat after each idle second is data
too, so a silently dead link is found that way) — then etcd is updated first and only after
that do pending confirms stop waiting for it. A removal etcd did not take is
retried (backing off up to a second) until it is written or we stop leading:
a member etcd no longer lists must never hold confirms, and one it still lists
must not be skipped. A follower dropped because its link failed (silent,
reset, a failed write) takes its proxy's client tunnels with it (each names
its follower): those clients are cut off from us as surely as its link, and
closing their connections here now returns their unacked deliveries to their
queues instead of holding them for as long as the cut lasts. ``barrier()`` snapshots the
positions sent to every ISR member; the Syncer runs confirm callbacks when the
barrier resolves. A fenced leader (lease lost) resolves no barrier ever again;
``lease_valid`` (the runner's local lease clock) is checked before resolving
any, so confirms stop the moment the lease must be presumed expired, without
waiting for the runner's next look.

The server is our own accept loop: ``HandshakeGate`` (``broker.cluster.gate``)
sees each connection's address before its TLS handshake, bounds the
connections per address that have not yet proved they know the secret, and
logs refusals once per burst. The hello is read to its last byte and no
further, so bytes a peer sends right behind it stay in the stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from broker.cluster import codec, tunnel
from broker.cluster.files import EVERYTHING, Scope, is_replicated, relative, shard_of
from broker.cluster.gate import HandshakeGate
from broker.tls import PeerTLS

log = logging.getLogger(__name__)

STALL_TIMEOUT = 3.0  # seconds without ack progress (with data outstanding) before a follower is dropped
HANDSHAKE_TIMEOUT = 5.0
HEARTBEAT_EVERY = 1.0  # seconds of silence after which a follower is sent a heartbeat
_HEARTBEAT = codec.encode(codec.HEARTBEAT, b"")
ISR_RETRY_MAX = 1.0  # seconds: longest pause between attempts to write an ISR removal
CACHE_LIMIT = 64 * 1024  # replaced files up to this size are kept in memory for bulk sync


class FileEntry:
    __slots__ = ("length", "hasher", "cached")

    def __init__(self) -> None:
        self.length = 0
        self.hasher = hashlib.sha1(usedforsecurity=False)
        self.cached: bytes | None = None


class FileIndex:
    """Logical length + running SHA-1 of every replicated file (the checksum cache)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.files: dict[str, FileEntry] = {}

    def scan(self, shard: str | None = None) -> None:
        """Hash every file on disk; call before anything writes (a worker thread is fine).
        With ``shard`` (a vhost directory), that shard's files alone, its old entries forgotten:
        a shard server opening a shard whose files replication wrote since it started (their
        entries, if any, count only what this sink sent, not the bytes on disk)."""
        if shard is not None:
            self.forget(shard)
        for root, _dirs, names in os.walk(self.data_dir if shard is None else self.data_dir / shard):
            for name in names:
                path = Path(root) / name
                rel = relative(self.data_dir, path)
                if rel is None or not is_replicated(rel):
                    continue
                entry = FileEntry()
                with open(path, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        entry.hasher.update(chunk)
                        entry.length += len(chunk)
                self.files[rel] = entry

    def register(self, rel: str) -> None:
        self.files[rel] = FileEntry()

    def append(self, rel: str, data: bytes | bytearray | memoryview) -> None:
        entry = self.files.get(rel)
        if entry is None:
            entry = self.files[rel] = FileEntry()
        entry.hasher.update(data)
        entry.length += len(data)
        entry.cached = None

    def replace(self, rel: str, data: bytes) -> None:
        entry = self.files[rel] = FileEntry()
        entry.hasher.update(data)
        entry.length = len(data)
        entry.cached = data if len(data) <= CACHE_LIMIT else None

    def delete(self, rel: str) -> None:
        self.files.pop(rel, None)

    def forget(self, shard: str) -> None:
        """Drop the entries of ``shard``'s files (a shard server closed it: others write them now)."""
        for rel in [r for r in self.files if shard_of(r) == shard]:
            del self.files[rel]

    def snapshot(self) -> list[codec.FileInfo]:
        return [codec.FileInfo(rel, e.length, e.hasher.copy().digest()) for rel, e in self.files.items()]


class FollowerConn:
    """One connected follower: its output stream, positions and sync state."""

    def __init__(self, node_id: str, peer: str, writer: asyncio.StreamWriter,
                 scope: Scope = EVERYTHING) -> None:
        self.node_id = node_id
        self.peer = peer
        self.writer = writer
        # what this follower takes from us (its SCOPE); ``everything`` is read on the hot path
        self.scope = scope
        self.everything = scope.everything
        self.compressor = codec.StreamCompressor()
        self.out: list[bytes] = []
        self.backlog: list[bytes] | None = []  # held actions during bulk sync; None once live
        self.sent = 0  # position of the last message queued for the wire
        self.acked = 0
        self.last_progress = time.monotonic()
        self.synced = False  # BULK_DONE sent and backlog released
        # Per shard (kept by ``ShardedLeaderSink``): the position of the last action of each
        # shard sent live, when the oldest of its actions this follower has not acked was sent,
        # and where the live stream began (the bulk sync and backlog before it carry every
        # shard): the follower holds a shard's every action once it acked both.
        self.shard_sent: dict[str, int] = {}
        self.shard_since: dict[str, float] = {}
        self.floor = 0
        self.wake = asyncio.Event()
        self.written = asyncio.Event()  # set by the writer whenever ``out`` has been drained
        self.closed = False

    def send(self, msg: bytes) -> None:
        if self.sent == self.acked:
            self.last_progress = time.monotonic()  # the stall clock starts when data is outstanding
        self.out.append(msg)
        self.sent += len(msg)
        self.wake.set()

    def action(self, msg: bytes) -> None:
        if self.backlog is not None:
            self.backlog.append(msg)
        else:
            self.send(msg)

    def holds(self, shard: str) -> bool:
        """Whether this follower acked every action of ``shard`` sent to it so far (never one
        outside the scope it takes from us)."""
        return self.synced and self.acked >= max(self.floor, self.shard_sent.get(shard, 0)) \
            and (self.everything or self.scope.takes(shard))

    @property
    def lag(self) -> int:
        return self.sent - self.acked + sum(len(m) for m in self.backlog or ())


# True: written; False: we are not the leader any more; None: etcd did not answer, try again.
IsrPublisher = Callable[[list[str]], Awaitable[bool | None]]


class LeaderSink:
    """ReplicationSink for the leader; also runs the replication server."""

    active = True

    def __init__(self, data_dir: Path, node_id: str, secret: bytes, publish_isr: IsrPublisher) -> None:
        self.data_dir = data_dir
        self.node_id = node_id
        self.secret = secret
        self.publish_isr = publish_isr
        self.index = FileIndex(data_dir)
        self.followers: dict[str, FollowerConn] = {}
        self.isr: set[str] = set()  # follower ids confirms wait for
        self.flush_stores: Callable[[], None] = lambda: None
        # Ack positions a follower has for one of our segments (path of the ack file): acked in
        # our store too; returns how many were new. Set by the runner to the broker's.
        self.merge_acks: Callable[[Path, list[int]], int] = lambda path, positions: 0
        # our client listeners by codec.PORT_NAMES (ports told to followers, tunnel targets)
        self.client_addresses: Callable[[], dict[str, tuple[str, int]]] = dict
        # leg of a tunnel to our own listener -> the client's address (the broker's listeners read it)
        self.proxied_peers: MutableMapping[tuple[str, int], tuple[str, int]] = {}
        # such a leg -> the client's TLS the member carrying it ended (EXTERNAL reads it)
        self.proxied_tls: MutableMapping[tuple[str, int], PeerTLS] = {}
        self.fenced = False
        self.lease_valid: Callable[[], bool] = lambda: True
        self.refused = 0
        # why a follower's scope is refused (None: served): a shard server sends only the shards
        # it serves, never a copy it follows from elsewhere (cluster/shard_server.py)
        self.scope_refused: Callable[[Scope], str | None] = lambda scope: None
        self.member_ips: set[str] = set()  # addresses of authenticated followers (PROXY trust)
        self._barriers: list[tuple[dict[FollowerConn, int], asyncio.Future[None]]] = []
        self._isr_lock = asyncio.Lock()
        self._listening: socket.socket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # follower proxies' client tunnels, by the id of the follower that opened them
        self._tunnels: dict[str, set[asyncio.StreamWriter]] = {}
        self._tls: ssl.SSLContext | None = None
        self.gate = HandshakeGate()  # unfinished connections per source, refusals logged per burst

    # ------------------------------------------------------------ ReplicationSink
    def register_file(self, path: Path) -> None:
        rel = relative(self.data_dir, path)
        if rel is not None and is_replicated(rel):
            self.index.register(rel)
            msg = codec.encode_replace(rel, b"")
            for f in self.followers.values():
                if f.everything or f.scope.covers(rel):
                    f.action(msg)

    def append(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        rel = relative(self.data_dir, path)
        if rel is None or not is_replicated(rel):
            return
        self.index.append(rel, data)
        if self.followers:
            msg = codec.encode_append(rel, data)
            for f in self.followers.values():
                if f.everything or f.scope.covers(rel):
                    f.action(msg)

    def replace(self, path: Path, data: bytes) -> None:
        rel = relative(self.data_dir, path)
        if rel is None or not is_replicated(rel):
            return
        self.index.replace(rel, data)
        if self.followers:
            msg = codec.encode_replace(rel, data)
            for f in self.followers.values():
                if f.everything or f.scope.covers(rel):
                    f.action(msg)

    def delete(self, path: Path) -> None:
        rel = relative(self.data_dir, path)
        if rel is None or not is_replicated(rel):
            return
        self.index.delete(rel)
        if self.followers:
            msg = codec.encode_delete(rel)
            for f in self.followers.values():
                if f.everything or f.scope.covers(rel):
                    f.action(msg)

    async def wait_for_followers(self) -> None:
        await self.barrier()

    # ------------------------------------------------------------ ISR barrier
    def barrier(self) -> asyncio.Future[None]:
        """A future resolved once every ISR member acked everything sent to it so far."""
        return self._barrier_at({f: f.sent for fid in self.isr if (f := self.followers.get(fid)) is not None})

    def _barrier_at(self, positions: dict[FollowerConn, int]) -> asyncio.Future[None]:
        """A future resolved once each follower acked its position (one that left the ISR
        first no longer counts) and every ISR member is connected."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.fenced and not self.lease_valid():
            self.fence()
        if self.fenced:
            return fut  # never: a leader without its lease must not confirm
        targets = {f: pos for f, pos in positions.items() if f.acked < pos}
        if not targets and all(fid in self.followers for fid in self.isr):
            fut.set_result(None)
        else:
            self._barriers.append((targets, fut))
        return fut

    def _check_barriers(self) -> None:
        if self.fenced or not self._barriers:
            return
        if not self.lease_valid():
            self.fence()
            return
        keep: list[tuple[dict[FollowerConn, int], asyncio.Future[None]]] = []
        for targets, fut in self._barriers:
            # A target whose follower left the ISR (removed from etcd first) no longer counts.
            if all(f.node_id not in self.isr or f.acked >= pos for f, pos in targets.items()) \
                    and all(fid in self.followers for fid in self.isr):
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((targets, fut))
        self._barriers = keep

    def shard_replicas(self, shard: str) -> list[str]:
        """The ISR members holding every action of ``shard`` (a vhost directory) sent so far, we
        first: the shard's own acks, read off the one stream (kept by ``ShardedLeaderSink``)."""
        return [self.node_id, *sorted(fid for fid in self.isr
                                      if (f := self.followers.get(fid)) is not None and f.holds(shard))]

    def fence(self) -> None:
        self.fenced = True

    async def drain(self, timeout: float) -> bool:
        """Wait until the ISR acked everything (graceful shutdown); False on timeout."""
        try:
            async with asyncio.timeout(timeout):
                await self.barrier()
            return True
        except TimeoutError:
            return False

    # ------------------------------------------------------------ server
    async def start(self, bind: str, port: int, tls: ssl.SSLContext | None = None) -> tuple[str, int]:
        """Listen for followers (over TLS with ``tls``: see ``broker.tls.ReplicationTLS``).

        Our own accept loop, not ``asyncio.start_server``: the gate sees a connection's address
        before its TLS handshake starts, so a stranger over its limit costs no handshake, and the
        handshake shares HANDSHAKE_TIMEOUT with the hello (not asyncio's default of 60 s)."""
        self._tls = tls
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(bind or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _name, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(1024)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._listening = sock
        self._spawn(self._accept(sock))
        self._spawn(self._watchdog())
        name = sock.getsockname()
        return str(name[0]), int(name[1])

    async def stop(self) -> None:
        if self._listening is not None:
            self._listening.close()
            self._listening = None
        for f in list(self.followers.values()):
            self._close(f)
        self.followers.clear()
        for node_id in list(self._tunnels):
            self._cut_tunnels(node_id)
        for t in list(self._tasks):
            t.cancel()
        self._tasks.clear()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def status(self) -> dict[str, Any]:
        return {
            "leader": self.node_id,
            "isr": sorted([self.node_id, *self.isr]),
            "followers": {f.node_id: {"peer": f.peer, "lag": f.lag, "synced": f.synced}
                          for f in self.followers.values()},
        }

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            try:
                conn, addr = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors, say: the connection waits in the backlog
                if not failing:  # once per run of failures
                    log.warning("replication port: accept failed: %s", exc)
                failing = True
                await asyncio.sleep(0.1)
                continue
            failing = False
            source = str(addr[0])
            if not self.gate.enter(source):
                self._refusal(source, "too many unfinished connections", "refused a connection from %s: "
                              "%d unfinished connections from it already", source, self.gate.pending[source])
                conn.close()
                continue
            self._spawn(self._handle(conn, (source, int(addr[1]))))

    async def _handle(self, conn: socket.socket, peer_info: tuple[str, int]) -> None:
        source = peer_info[0]
        try:
            opened = await self._authenticate(conn, source, f"{peer_info[0]}:{peer_info[1]}")
        finally:
            self.gate.leave(source)
        if opened is None:
            return
        hello, reader, writer = opened
        peer = f"{peer_info[0]}:{peer_info[1]}"
        if self.fenced:
            writer.close()
            return
        if isinstance(hello, codec.TunnelHello):
            tunnels = self._tunnels.setdefault(hello.node_id, set())
            tunnels.add(writer)
            try:
                await tunnel.serve_tunnel(hello, reader, writer, self.client_addresses, self.proxied_peers,
                                          self.proxied_tls)
            finally:
                tunnels.discard(writer)
                if not tunnels and self._tunnels.get(hello.node_id) is tunnels:
                    del self._tunnels[hello.node_id]
            return
        addresses, told = self.client_addresses(), codec.PORT_NAMES[:codec.WELCOME_PORTS]
        writer.write(codec.encode_welcome(codec.OK, tuple(addresses[name][1] if name in addresses else 0
                                                          for name in told)))
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                scope = await self._read_scope(reader)
        except (TimeoutError, codec.CodecError, OSError, asyncio.IncompleteReadError) as exc:
            log.warning("follower %s at %s sent no scope: %s", hello.node_id, peer, exc or type(exc).__name__)
            writer.close()
            return
        refused = self.scope_refused(scope)
        if refused is not None:
            log.warning("follower %s at %s refused: %s", hello.node_id, peer, refused)
            writer.close()
            return
        self.member_ips.add(str(peer_info[0]))
        old = self.followers.get(hello.node_id)
        if old is not None:
            self._drop(old, "reconnected")
        f = FollowerConn(hello.node_id, peer, writer, scope)
        log.info("follower %s connected from %s, starting bulk sync%s", f.node_id, peer,
                 "" if f.everything else f" of {_describe(scope)}")
        # The cut: synchronous, so no sink call can fall between snapshot and backlog.
        self.flush_stores()
        snapshot = self.index.snapshot()
        if not f.everything:
            snapshot = [i for i in snapshot if scope.covers(i.path)]
        self.followers[f.node_id] = f
        f.send(codec.encode_file_list(snapshot))
        writer_task = self._spawn(self._write_loop(f))
        try:
            await self._read_loop(f, reader, {i.path: i.length for i in snapshot})
        except (ConnectionError, asyncio.IncompleteReadError, codec.CodecError, OSError) as exc:
            if not f.closed:
                log.warning("follower %s: %s", f.node_id, exc or type(exc).__name__)
                self._drop(f, str(exc) or type(exc).__name__, link_lost=True)
        finally:
            writer_task.cancel()
            self._drop(f, "disconnected")

    async def _authenticate(self, conn: socket.socket, source: str, peer: str) -> tuple[
            codec.Hello | codec.TunnelHello, asyncio.StreamReader, asyncio.StreamWriter] | None:
        """TLS (if on) and the hello within HANDSHAKE_TIMEOUT, the version and the secret
        checked; None (and the connection closed) if any of it fails."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(reader)
        writer: asyncio.StreamWriter | None = None

        async def opening() -> codec.Hello | codec.TunnelHello:
            nonlocal writer
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, conn, ssl=self._tls,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT if self._tls is not None else None)
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            return await self._read_hello(reader)

        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                hello = await opening()
        except (TimeoutError, codec.CodecError, OSError, asyncio.IncompleteReadError) as exc:
            why = str(exc) or type(exc).__name__
            self._refusal(source, why, "replication handshake from %s failed: %s", peer, why)
            if writer is not None:
                writer.close()
            else:
                conn.close()
            return None
        assert writer is not None
        kind = "follower" if isinstance(hello, codec.Hello) else "tunnel"
        who = hello.node_id if isinstance(hello, codec.Hello) else f"from {hello.client[0]}"
        if hello.version != codec.VERSION:
            self._refusal(source, f"protocol version {hello.version}",
                          "refused %s %r at %s: protocol version %d", kind, who, peer, hello.version)
            writer.write(self._status(hello, codec.BAD_VERSION))
            writer.close()
            return None
        if not hmac.compare_digest(hello.secret, self.secret):
            self.refused += 1
            self._refusal(source, "wrong clustering secret", "refused %s %r at %s: wrong clustering secret",
                          kind, who, peer)
            writer.write(self._status(hello, codec.BAD_SECRET))
            writer.close()
            return None
        self.gate.authenticated(source)
        return hello, reader, writer

    def _refusal(self, source: str, why: str, msg: str, *args: object) -> None:
        """Log a refusal from ``source`` if it starts a burst (the gate counts the rest)."""
        if self.gate.refused(source, why, time.monotonic()):
            log.warning(msg, *args)

    @staticmethod
    def _status(hello: codec.Hello | codec.TunnelHello, status: int) -> bytes:
        return codec.encode_welcome(status) if isinstance(hello, codec.Hello) else bytes([status])

    @staticmethod
    async def _read_hello(reader: asyncio.StreamReader) -> codec.Hello | codec.TunnelHello:
        """The opening message, read a byte at a time (from the stream's buffer: no system call
        each) so not one byte past it is taken: whatever the peer sent right behind it (a
        tunnel's first frame) stays in ``reader`` for the tunnel or the follower's read loop.
        At most the hello's size (~520 bytes) parses of a buffer that small."""
        buf = b""
        while True:
            parsed = codec.parse_opening(buf)
            if parsed is not None:
                return parsed[0]
            buf += await reader.readexactly(1)

    @staticmethod
    async def _read_scope(reader: asyncio.StreamReader) -> Scope:
        """The follower's first message, its ``SCOPE`` (its length bounded before it is read)."""
        kind, length = codec.HEAD.unpack(await reader.readexactly(codec.HEAD.size))
        if kind != codec.SCOPE or length > codec.SCOPE_MAX_PAYLOAD:
            raise codec.CodecError(f"expected a scope, got message kind {kind} of {length} bytes")
        return codec.parse_scope(await reader.readexactly(length))

    async def _read_loop(self, f: FollowerConn, reader: asyncio.StreamReader,
                         lengths: dict[str, int]) -> None:
        msgs = codec.MessageReader()
        while not f.closed:
            data = await reader.read(65536)
            if not data:
                return
            for m in msgs.feed(data):
                if m.kind == codec.ACK:
                    self._on_ack(f, codec.parse_ack(m.payload))
                elif m.kind == codec.REQUEST:
                    self._spawn(self._send_files(f, codec.parse_request(m.payload), lengths))
                elif m.kind == codec.MERGE_ACKS:
                    self._spawn(self._merge_acks(f, *codec.parse_merge_acks(m.payload)))
                else:
                    raise codec.CodecError(f"unexpected message kind {m.kind} from follower")

    async def _merge_acks(self, f: FollowerConn, rel: str, seg_length: int, seg_sha1: bytes,
                          positions: list[int]) -> None:
        """A follower's acks for one of our segments: merged when our segment starts with the
        very bytes the follower's copy holds (else the queue was deleted and made again since,
        and the positions name other messages)."""
        head, _, name = rel.rpartition("/")
        seg = self.data_dir / head / f"msgs.{name[5:]}" if name.startswith("acks.") else None
        if seg is None or not positions or not f.scope.covers(rel):
            return
        loop = asyncio.get_running_loop()
        same = await loop.run_in_executor(None, _starts_with, seg, seg_length, seg_sha1)
        if not same:
            log.info("follower %s: acks of %s not merged (the segment differs)", f.node_id, rel)
            return
        n = self.merge_acks(self.data_dir / rel, [p for p in positions if p < seg_length])
        if n:
            log.warning("follower %s had %d acks for %s that this node had lost: merged", f.node_id, n, rel)

    async def _send_files(self, f: FollowerConn, paths: list[str], lengths: dict[str, int]) -> None:
        loop = asyncio.get_running_loop()
        sent_bytes = 0
        for rel in paths:
            length = lengths.get(rel)
            if length is None:
                continue
            entry = self.index.files.get(rel)
            cached = entry.cached if entry is not None else None
            truncate = True
            if cached is not None and len(cached) == length:
                f.send(codec.encode_file_data(rel, cached, True))
                continue
            offset = 0
            while offset < length or truncate:
                n = min(codec.FILE_CHUNK, length - offset)
                chunk = await loop.run_in_executor(None, _read_at, self.data_dir / rel, offset, n)
                f.send(codec.encode_file_data(rel, chunk, truncate))
                truncate = False
                offset += n
                sent_bytes += len(chunk)
                if len(chunk) < n:
                    break  # replaced or deleted since the cut: the backlog fixes it
                # keep memory bounded: one chunk in flight, wait for the writer to drain it
                f.written.clear()
                while f.out and not f.closed:
                    await f.written.wait()
                    f.written.clear()
                if f.closed:
                    return
        f.send(codec.encode(codec.BULK_DONE, b""))
        backlog, f.backlog = f.backlog or [], None
        for msg in backlog:
            f.send(msg)
        f.floor = f.sent
        f.synced = True
        log.info("follower %s: bulk sync sent (%d files, %d bytes), streaming", f.node_id, len(paths),
                 sent_bytes)

    async def _write_loop(self, f: FollowerConn) -> None:
        try:
            while not f.closed:
                try:
                    async with asyncio.timeout(HEARTBEAT_EVERY):
                        await f.wake.wait()
                except TimeoutError:
                    f.send(_HEARTBEAT)  # acked like data: the watchdog sees a dead link too
                f.wake.clear()
                if not f.out:
                    continue
                data = b"".join(f.out)
                f.out.clear()
                f.writer.write(f.compressor.compress(data))
                await f.writer.drain()
                f.written.set()
        except (ConnectionError, OSError) as exc:
            log.warning("follower %s: write failed: %s", f.node_id, exc)
            self._drop(f, "write failed", link_lost=True)

    def _on_ack(self, f: FollowerConn, acked: int) -> None:
        if acked > f.sent:
            raise codec.CodecError("ack beyond what was sent")
        if acked > f.acked:
            f.acked = acked
            f.last_progress = time.monotonic()
        self._maybe_join(f)
        self._check_barriers()

    async def isr_written(self, write: Callable[[list[str]], Awaitable[bool | None]]) -> bool | None:
        """``write`` the ISR as it stands (us first, then our in-sync followers), between the
        ISR's own writes: no join or leave changes it meanwhile."""
        async with self._isr_lock:
            return await write(sorted([self.node_id, *self.isr]))

    def _maybe_join(self, f: FollowerConn) -> None:
        if f.synced and f.acked == f.sent and f.node_id not in self.isr and not self.fenced \
                and self.followers.get(f.node_id) is f:
            self.isr.add(f.node_id)  # before the etcd write: confirms wait for it from now on
            self._spawn(self._publish_isr(f"follower {f.node_id} in sync"))

    async def _publish_isr(self, why: str) -> None:
        async with self._isr_lock:
            members = sorted([self.node_id, *self.isr])
            ok = await self.publish_isr(members)
            if ok:
                log.info("ISR is now %s (%s)", members, why)
            else:
                log.error("could not write the ISR (%s): leadership lost?", why)
        self._check_barriers()

    def _drop(self, f: FollowerConn, why: str, link_lost: bool = False) -> None:
        """Forget a follower; ``link_lost``: its link failed (silent, reset, a write failed), so
        its proxy's clients are cut off from us too: their tunnels are cut with it, and their
        connections here close now, their deliveries back in their queues. (A follower that
        ends its link itself drops its proxy's clients itself when it must.)"""
        live = not f.closed  # the first drop of this connection (it may be dropped again on its way out)
        self._close(f)
        if self.followers.get(f.node_id) is f:
            del self.followers[f.node_id]
            log.warning("follower %s dropped: %s", f.node_id, why)
        if live and link_lost:
            cut = self._cut_tunnels(f.node_id)
            if cut:
                log.warning("closed %d client tunnels of follower %s with it", cut, f.node_id)
        if f.node_id in self.isr and not self.fenced:
            self._spawn(self._remove_from_isr(f.node_id, why))

    async def _remove_from_isr(self, node_id: str, why: str) -> None:
        delay = 0.1
        async with self._isr_lock:
            while node_id in self.isr and not self.fenced:
                if not self.lease_valid():
                    self.fence()
                    break
                members = sorted([self.node_id, *(i for i in self.isr if i != node_id)])
                # etcd first: only once the ISR no longer names it may confirms skip it.
                written = await self.publish_isr(members)
                if written:
                    self.isr.discard(node_id)
                    log.warning("ISR is now %s (%s left: %s)", members, node_id, why)
                    break
                if written is False:
                    log.error("could not remove %s from the ISR: not the leader any more", node_id)
                    self.fence()
                    break
                log.warning("could not remove %s from the ISR yet: retrying in %.1fs", node_id, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, ISR_RETRY_MAX)
        self._check_barriers()

    def _cut_tunnels(self, node_id: str) -> int:
        """Close (abort: no end marker, a cut) every tunnel ``node_id``'s proxy opened."""
        tunnels = self._tunnels.pop(node_id, set())
        for w in tunnels:
            w.transport.abort()
        return len(tunnels)

    @staticmethod
    def _close(f: FollowerConn) -> None:
        if not f.closed:
            f.closed = True
            f.wake.set()
            f.written.set()
            f.writer.close()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            self.gate.sweep(now)
            for f in list(self.followers.values()):
                self._maybe_join(f)
                if f.sent > f.acked and now - f.last_progress > STALL_TIMEOUT:
                    self._drop(f, f"no ack for {now - f.last_progress:.1f}s with "
                                  f"{f.sent - f.acked} bytes outstanding", link_lost=True)


def _describe(scope: Scope) -> str:
    shards = "every shard" if scope.shards is None else f"{len(scope.shards)} shards"
    return f"{shards}{' and the shared files' if scope.shared else ''}"


def _read_at(path: Path, offset: int, n: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read(n)
    except FileNotFoundError:
        return b""


def _starts_with(path: Path, length: int, sha1: bytes) -> bool:
    """Whether the file at ``path`` is at least ``length`` bytes and they hash to ``sha1``."""
    h = hashlib.sha1(usedforsecurity=False)
    left = length
    try:
        with open(path, "rb") as fh:
            while left:
                chunk = fh.read(min(left, 1 << 20))
                if not chunk:
                    return False
                h.update(chunk)
                left -= len(chunk)
    except FileNotFoundError:
        return False
    return h.digest() == sha1
