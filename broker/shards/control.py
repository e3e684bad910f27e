"""The control channel between a node's parent process and each of its workers.

Theory of operation
-------------------
The parent makes one ``socketpair(AF_UNIX, SOCK_SEQPACKET)`` per worker before it forks
it: the worker keeps one end, the parent the other. Nothing else can reach it (no path in
the file system, no abstract name), so a message on it needs no authentication: it comes
from this node's own processes.

A message is one datagram (SEQPACKET keeps the boundaries): a pickled ``dict`` with an
``op`` key, plus up to ``MAX_FDS`` file descriptors passed with ``SCM_RIGHTS`` (a client
socket being handed over). Pickle is safe here only because both ends are our own
processes; ``MAX_MESSAGE`` bounds what one datagram may carry (the socket buffers are
raised to hold it).

Messages (``op``): worker -> parent ``ready`` (its vhosts are loaded; its private HTTP
addresses), ``handover`` (a connection for another worker, with its socket), ``shared`` (a
shared file changed);
parent -> worker ``go`` (open the client listeners), ``members`` (which workers serve, their
private HTTP addresses),
``handover`` (forwarded), ``reload`` (re-read a shared file, answer ``reloaded``),
``shared_ok`` (every live worker has re-read it: the change may be acknowledged).
"""

from __future__ import annotations

import array
import pickle
import socket
from typing import Any

MAX_FDS = 4
MAX_MESSAGE = 1 << 20  # a hand-over carries client properties and at most one read past connection.open
_BUFFER = 4 << 20
_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def pair() -> tuple[socket.socket, socket.socket]:
    """A (parent end, worker end) control channel."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
    return a, b


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one message (blocking: the peer reads its channel promptly, and a message is small)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    timeout = sock.gettimeout()
    try:
        sock.settimeout(5.0)
        sock.sendmsg([data], ancillary)
    finally:
        sock.settimeout(timeout)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """One message and the descriptors that came with it; None at end of stream. Raises
    ``BlockingIOError`` on a non-blocking socket with nothing to read."""
    data, ancillary, flags, _addr = sock.recvmsg(MAX_MESSAGE, _FD_SPACE)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if not data:
        for fd in fds:
            _close(fd)
        return None
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            _close(fd)
        raise ValueError("truncated control message")
    message = pickle.loads(data)
    if not isinstance(message, dict) or "op" not in message:
        for fd in fds:
            _close(fd)
        raise ValueError("malformed control message")
    return message, fds


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass
