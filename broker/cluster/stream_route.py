"""Carry a RabbitMQ Stream connection to the node serving its vhost: the client's login replayed
there, sans-IO (``[clustering] shard_servers``; the carrier is ``cluster/elsewhere.py``).

Theory of operation
-------------------
The stream protocol names the vhost in ``Open``, after the login: ``PeerProperties``,
``SaslHandshake``, ``SaslAuthenticate``, then the server's ``Tune`` and the client's answer. The
cluster leader's own stream listener plays those steps with the client (it checks the login as
for any vhost); at an ``Open`` for a vhost another node serves it hands the connection over with
the client's login frames as they arrived (``login``) and the ``Open`` with every byte after it
(``rest``). ``StreamReplay`` plays the client's side toward the serving node's stream listener
(through a tunnel to its replication port) one request at a time, as a client does: each request
waits for its response, and the node's ``SaslAuthenticate`` response decides: anything but OK is
a refusal (the node's own users and rules said no), which the client hears as the answer to its
``Open`` with the node's code, and nothing was opened. Accepted, the node sends its ``Tune``; a
``frame_max`` below what the client already took from the leader fails the carry (a frame the
client may send would be refused later); else the client's ``Tune`` answer, its ``Open`` and the
rest go to the node, and from then on the two sockets are spliced, so the node's ``Open``
response (its vhost access check) reaches the client as it is. The node's responses before that
go no further: the client had the leader's.

Bounds: the node's bytes before the splice are at most ``MAX_INPUT``; the caller bounds the time
(``vhost_route.HANDSHAKE_TIMEOUT``). A malformed or unexpected frame fails the carry, and the
client is answered ``VHOST_ACCESS_FAILURE`` (``refusal``), as while a worker that owns its vhost
restarts.
"""

from __future__ import annotations

import struct
from typing import Final

from broker.cluster.vhost_route import MAX_INPUT, Failed, Joining
from broker.streamwire import (
    AUTHENTICATION_FAILURE,
    CLOSE,
    HEARTBEAT,
    OK,
    OPEN,
    PEER_PROPERTIES,
    RESPONSE,
    SASL_AUTHENTICATE,
    SASL_HANDSHAKE,
    TUNE,
    VHOST_ACCESS_FAILURE,
    response,
)

_STEPS: Final = (PEER_PROPERTIES, SASL_HANDSHAKE, SASL_AUTHENTICATE)  # requests, in a client's order
_SIZE: Final = struct.Struct(">I")
_KEY: Final = struct.Struct(">HH")
_CORR_CODE: Final = struct.Struct(">IH")
_TUNE: Final = struct.Struct(">II")


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """The complete frames of ``data`` as (key, raw frame); a malformed one raises ``Failed``."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while len(data) - pos >= 4:
        (size,) = _SIZE.unpack_from(data, pos)
        if size < 4 or size > MAX_INPUT:
            raise Failed(f"a stream frame of {size} bytes in the handshake")
        if len(data) - pos - 4 < size:
            break
        key, _version = _KEY.unpack_from(data, pos + 4)
        out.append((key, data[pos:pos + 4 + size]))
        pos += 4 + size
    return out


def open_corr(rest: bytes) -> int:
    """The correlation id of the client's ``Open`` (``rest`` begins with it; 0 if cut short)."""
    return int(_SIZE.unpack_from(rest, 8)[0]) if len(rest) >= 12 else 0


def refusal(rest: bytes, code: int = VHOST_ACCESS_FAILURE) -> bytes:
    """The answer to the client's ``Open`` when its connection is not carried."""
    return response(OPEN, open_corr(rest), code)


class StreamReplay(Joining):
    """The client's side toward a serving node (see the module's comment).

    ``start() -> bytes`` first; then ``receive(node bytes) -> bytes to the node`` until
    ``spliced``; ``to_client`` holds what the client is sent then (the node's bytes after its
    ``Tune``). A refused login raises ``Failed`` whose answer is the client's ``Open`` response."""

    def __init__(self, login: bytes, rest: bytes, frame_max: int) -> None:
        super().__init__()
        kept = dict(frames(login))
        if SASL_AUTHENTICATE not in kept or TUNE not in kept:
            raise Failed("no stream login to replay", refusal(rest))
        self._requests = [kept[k] for k in _STEPS if k in kept]
        self._tune_ok = kept[TUNE]
        self._rest = rest
        self._frame_max = frame_max  # what the client took from the leader's Tune (0: no bound)
        self._buf = b""
        self._authenticated = False

    def start(self) -> bytes:
        return self._requests.pop(0)

    def receive(self, data: bytes) -> bytes:
        if not self._handshaking(data, lambda: Failed("the node's stream handshake too long",
                                                      refusal(self._rest))):
            return b""
        self._buf += data
        out = b""
        for key, raw in frames(self._buf):
            self._buf = self._buf[len(raw):]
            out += self._on(key, raw)
            if self._joined():
                self.to_client, self._buf = self._buf, b""
                break
        return out

    def _joined(self) -> bool:
        return self.spliced  # (a call: mypy would keep self.spliced narrowed to False)

    def _on(self, key: int, raw: bytes) -> bytes:
        if key == HEARTBEAT:
            return b""
        request = key & ~RESPONSE
        if key & RESPONSE and request in _STEPS and len(raw) >= 14:
            _corr, code = _CORR_CODE.unpack_from(raw, 8)
            if request == SASL_AUTHENTICATE:
                if code != OK:  # the node refused the login: the client's Open is answered so
                    raise Failed(f"the vhost's node refused the login (code {code})",
                                 refusal(self._rest, code or AUTHENTICATION_FAILURE))
                self._authenticated = True
                return b""
            if code != OK:
                raise Failed(f"the vhost's node answered {request} with code {code}",
                             refusal(self._rest))
            return self._requests.pop(0) if self._requests else b""
        if key == TUNE and self._authenticated and len(raw) >= 16:
            offered, _heartbeat = _TUNE.unpack_from(raw, 8)
            if offered and (self._frame_max == 0 or self._frame_max > offered):
                raise Failed(f"the vhost's node offers frame_max {offered}; the client took "
                             f"{self._frame_max}", refusal(self._rest))
            self.spliced = True
            return self._tune_ok + self._rest
        if key == CLOSE:
            raise Failed("the vhost's node closed the handshake", refusal(self._rest))
        raise Failed(f"unexpected stream frame {key:#x} from the vhost's node", refusal(self._rest))
