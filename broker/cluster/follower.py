"""The follower side of replication: bulk sync, then apply the action stream.

Theory of operation
-------------------
``Applier`` does the file work and no networking: for ``FILE_LIST`` it hashes
the local data directory, deletes local files the leader lacks and returns the
paths whose (length, SHA-1) differ, to be requested; ``FILE_DATA`` chunks,
``APPEND``, ``REPLACE`` and ``DELETE`` are applied to the files in order.
With a ``Scope`` (a follower of several senders, one per shard leader: issue 27) the
applier sees only the files inside it: the sync compares and deletes nothing outside it, and
a path outside it from the sender is a protocol error (the connection is dropped before the
write), so two senders can never write one file of ours.
``finish_batch`` fsyncs every file touched (and the directories of created or
removed files) before the caller acks, so an acked byte survives a crash of
this node: that is what lets the leader count an ack towards a publisher
confirm. Each batch (everything one socket read produced) runs in a worker
thread, fsync included, so the event loop keeps serving the proxy.

``follow`` is the asyncio driver: handshake (secret, node id, then our scope), then read ->
LZ4-decompress -> split into messages -> apply the batch -> send
``ACK(total bytes applied)`` (and ``REQUEST`` after the file list). The leader
sends a heartbeat every second it has nothing else to send; nothing at all for
``LINK_TIMEOUT`` seconds means the link is dead (a cut network shows no
reset), and ``LinkSilent`` is raised. It returns when the connection ends; the
runner decides whether to reconnect, campaign or stop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import ssl
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from broker.cluster import codec
from broker.cluster.files import EVERYTHING, Scope, is_replicated, relative
from broker.store.paths import TOMBSTONE_SUFFIX

log = logging.getLogger(__name__)

MAX_OPEN_FILES = 128
LINK_TIMEOUT = 4.0  # seconds without a byte from the leader (it heartbeats every second)


class AuthRefused(Exception):
    """The leader refused our secret or protocol version."""


class ApplyFailed(Exception):
    """Our own disk refused the leader's data (full, read-only, failing): not the link's fault."""


class LinkSilent(ConnectionError):
    """Nothing, not even a heartbeat, came from the leader for ``LINK_TIMEOUT`` seconds."""


class Applier:
    def __init__(self, data_dir: Path, scope: Scope = EVERYTHING) -> None:
        self.data_dir = data_dir
        self.scope = scope
        self.applied = 0  # bytes of leader messages applied (the ack counter)
        self.merges: list[bytes] = []  # MERGE_ACKS messages to send before the REQUEST
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._touched: set[str] = set()
        self._dirs: set[Path] = set()

    def local_files(self) -> dict[str, tuple[int, bytes]]:
        """(length, SHA-1) of our replicated files. A deleted queue's tombstone, left by a crash
        while this node led (``store/paths``), is no replicated file: it is removed here."""
        found: dict[str, tuple[int, bytes]] = {}
        for root, dirs, names in os.walk(self.data_dir):
            for d in [d for d in dirs if d.endswith(TOMBSTONE_SUFFIX)]:
                dirs.remove(d)
                shutil.rmtree(Path(root) / d, ignore_errors=True)
            for name in names:
                rel = relative(self.data_dir, Path(root) / name)
                if rel is None or not is_replicated(rel) or not self.scope.covers(rel):
                    continue
                h = hashlib.sha1(usedforsecurity=False)
                length = 0
                with open(Path(root) / name, "rb") as fh:
                    while chunk := fh.read(1 << 20):
                        h.update(chunk)
                        length += len(chunk)
                found[rel] = (length, h.digest())
        return found

    def apply(self, m: codec.Message) -> list[str] | None:
        """Apply one message; returns the paths to request after a FILE_LIST."""
        request: list[str] | None = None
        kind = m.kind
        if kind == codec.APPEND:
            path, data = codec.parse_path_data(m.payload)
            self._write(self._inside(path), data, truncate=False)
        elif kind == codec.REPLACE:
            path, data = codec.parse_path_data(m.payload)
            self._write(self._inside(path), data, truncate=True)
        elif kind == codec.DELETE:
            self._delete(self._inside(codec.parse_delete(m.payload)))
        elif kind == codec.FILE_DATA:
            path, truncate, data = codec.parse_file_data(m.payload)
            self._write(self._inside(path), data, truncate=truncate)
        elif kind == codec.FILE_LIST:
            request = self._compare([self._inside_info(f) for f in codec.parse_file_list(m.payload)])
        elif kind not in (codec.BULK_DONE, codec.HEARTBEAT):
            raise codec.CodecError(f"unexpected message kind {kind} from leader")
        self.applied += m.size
        return request

    def _inside(self, rel: str) -> str:
        if not self.scope.everything and not self.scope.covers(rel):
            raise codec.CodecError(f"the leader sent {rel!r}, outside the scope we follow it for")
        return rel

    def _inside_info(self, info: codec.FileInfo) -> codec.FileInfo:
        self._inside(info.path)
        return info

    def _compare(self, files: list[codec.FileInfo]) -> list[str]:
        local = self.local_files()
        leader = {f.path: (f.length, f.sha1) for f in files}
        wanted = set(leader)
        self.merges = self._merges(local, leader)
        for rel in local:
            if rel not in wanted:
                self._delete(rel)
        return [f.path for f in files if local.get(f.path) != (f.length, f.sha1)]

    def _merges(self, local: dict[str, tuple[int, bytes]],
                leader: dict[str, tuple[int, bytes]]) -> list[bytes]:
        """Our ack files the leader lacks or has different, for segments the leader still
        has: sent to it before they are replaced, so their acks are merged, not lost."""
        out: list[bytes] = []
        for rel, info in local.items():
            head, _, name = rel.rpartition("/")
            if not name.startswith("acks.") or leader.get(rel) == info:
                continue
            seg_rel = f"{head}/msgs.{name[5:]}" if head else f"msgs.{name[5:]}"
            if seg_rel not in leader or seg_rel not in local:
                continue
            data = (self.data_dir / rel).read_bytes()
            usable = len(data) - (len(data) - 4) % 4 if len(data) >= 4 else 4
            if usable > 4:
                seg_len, seg_sha1 = local[seg_rel]
                out.append(codec.encode_merge_acks(rel, seg_len, seg_sha1, data[4:usable]))
        return out

    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is not None:
            self._fds.move_to_end(rel)
            return fd
        path = self.data_dir / rel
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent.parent)
        existed = path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if not existed:
            self._dirs.add(path.parent)
        self._fds[rel] = fd
        if len(self._fds) > MAX_OPEN_FILES:
            old, ofd = self._fds.popitem(last=False)
            if old in self._touched:
                os.fsync(ofd)
                self._touched.discard(old)
            os.close(ofd)
        return fd

    def _write(self, rel: str, data: bytes, truncate: bool) -> None:
        fd = self._fd(rel)
        if truncate:
            os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        self._touched.add(rel)

    def _delete(self, rel: str) -> None:
        fd = self._fds.pop(rel, None)
        if fd is not None:
            os.close(fd)
        self._touched.discard(rel)
        path = self.data_dir / rel
        try:
            path.unlink()
        except FileNotFoundError:
            return
        # Remove directories left empty (a deleted queue), up to the data dir.
        parent = path.parent
        while parent != self.data_dir and parent.is_relative_to(self.data_dir):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
        self._dirs.add(parent)

    def finish_batch(self) -> None:
        """fsync everything written since the last batch: acked bytes are durable."""
        for rel in self._touched:
            fd = self._fds.get(rel)
            if fd is not None:
                os.fsync(fd)
        self._touched.clear()
        for d in self._dirs:
            try:
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        self._dirs.clear()

    def run_batch(self, msgs: list[codec.Message]) -> tuple[list[str] | None, bool]:
        request: list[str] | None = None
        done = False
        for m in msgs:
            r = self.apply(m)
            if r is not None:
                request = r
            if m.kind == codec.BULK_DONE:
                done = True
        self.finish_batch()
        return request, done

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


async def follow(host: str, port: int, data_dir: Path, secret: bytes, node_id: str,
                 on_welcome: Callable[[codec.Welcome], None],
                 on_synced: Callable[[], None], executor: Executor,
                 source_ip: str | None = None, tls: ssl.SSLContext | None = None,
                 scope: Scope = EVERYTHING) -> None:
    """Replicate from the leader at host:port until the connection ends: the files ``scope``
    covers (the default: everything), and no others.

    File work runs on ``executor``, which must have ONE worker: the caller waits
    for it to drain before anything else touches the data directory.
    """
    local = (source_ip, 0) if source_ip else None
    # With ``tls`` (``broker.tls.ReplicationTLS.client``) the leader's certificate is verified before
    # the Hello: the cluster secret never crosses the network in clear.
    # Deadlines here are ``asyncio.timeout``, never ``wait_for``: on Python 3.11 ``wait_for``
    # drops a cancel that lands in the same loop turn as the answer (etcd.py, "Cancels"); a link
    # cancelled as its leader closed it then returned as after any close, and ``FollowSet``
    # retried the dead leader for ever while the runner waited for the link to end.
    async with asyncio.timeout(5.0):
        reader, writer = await asyncio.open_connection(host, port, local_addr=local, ssl=tls)
    applier = Applier(data_dir, scope)
    loop = asyncio.get_running_loop()
    try:
        writer.write(codec.encode_hello(secret, node_id) + codec.encode_scope(scope))
        async with asyncio.timeout(5.0):
            welcome = codec.parse_welcome(await reader.readexactly(codec.WELCOME_SIZE))
        if welcome.status != codec.OK:
            raise AuthRefused("wrong clustering secret" if welcome.status == codec.BAD_SECRET
                              else "protocol version refused")
        on_welcome(welcome)
        decomp = codec.StreamDecompressor()
        msgs = codec.MessageReader()
        while True:
            try:
                async with asyncio.timeout(LINK_TIMEOUT):
                    data = await reader.read(1 << 20)
            except TimeoutError:
                log.warning("replication link silent for %.0fs: presumed dead", LINK_TIMEOUT)
                raise LinkSilent(f"nothing from the leader for {LINK_TIMEOUT:.0f}s") from None
            if not data:
                log.info("leader closed the replication connection")
                return
            plain = decomp.decompress(data)
            batch = msgs.feed(plain)
            if not batch:
                continue
            try:
                request, done = await loop.run_in_executor(executor, applier.run_batch, batch)
            except OSError as exc:
                raise ApplyFailed(f"{exc.strerror or exc} ({exc.filename or 'data dir'})") from exc
            if applier.merges:
                log.info("bulk sync: offering the acks of %d ack files to the leader", len(applier.merges))
                writer.write(b"".join(applier.merges))
                applier.merges = []
            if request is not None:
                log.info("bulk sync: requesting %d files", len(request))
                writer.write(codec.encode_request(request))
            writer.write(codec.encode_ack(applier.applied))
            if done:
                log.info("bulk sync complete")
                on_synced()
    finally:
        writer.close()
        # On the same single worker, so it runs after a batch still in flight.
        loop.run_in_executor(executor, applier.close)
