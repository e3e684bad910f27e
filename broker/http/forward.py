"""The cluster leader's management API for a vhost another node serves (``[clustering]
shard_servers``): the request is answered by that node.

Theory of operation
-------------------
A request about one vhost (its route names ``{vhost}``) that another node serves goes to that
node's shard broker: ``open_to`` (``broker/cluster/elsewhere.py``) gives a connection to that
node's management listener, carried on a tunnel to its replication port that names the client's
own address (so a loopback-only user stays loopback-only there). The request is passed on as it
came (method, path and query, body, and the client's own ``Authorization``, ``Content-Type`` and
``Accept``) as HTTP/1.1 with ``Connection: close``; that node authenticates and authorizes it as if
the client had asked it directly, so forwarding grants nothing, and its answer (status, body,
``Content-Type``, ``Location``, ``WWW-Authenticate``) is the client's. The shared state (users,
permissions, the vhost list, global and runtime parameters: ``SHARED``) is the cluster
leader's, so those paths are answered here whatever vhost they name; a list over every vhost
(``/api/queues``, ``/api/overview``, the whole definitions) is this node's part only (not
aggregated across nodes yet).

Bounds: the answer is at most ``MAX_ANSWER`` bytes and the whole exchange ``FORWARD_TIMEOUT``
seconds. A vhost moving (closed here, its next server not known yet), a node that cannot be
reached, or an answer that does not parse: 503, as for a worker that restarts.
"""

from __future__ import annotations

import asyncio
import http.client
import io
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from broker import errors

FORWARD_TIMEOUT: Final = 30.0
MAX_ANSWER: Final = 64 * 1024 * 1024  # bytes of a forwarded answer (a long queue list fits)
PASSED: Final = ("Authorization", "Content-Type", "Accept")
KEPT: Final = ("Content-Type", "Location", "WWW-Authenticate")  # of the answer's headers
# the requests about the cluster's shared state, answered where they land
# (a vhost's definitions, ``/api/definitions/{vhost}``, are its queues, exchanges, bindings and
# policies: that node's)
SHARED: Final = ("/api/users", "/api/permissions", "/api/topic-permissions", "/api/vhosts",
                 "/api/global-parameters", "/api/user-limits", "/api/parameters")

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
# a connection to the management API of the node serving ``vhost`` for the client at ``peer``;
# None: served here; raises ``errors.NotAllowed`` while it moves
OpenTo = Callable[[str, tuple[str, int]], Awaitable[Streams | None]]


def unavailable(reason: str) -> web.Response:
    return web.json_response({"error": "service_unavailable", "reason": reason}, status=503)


def request_bytes(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
    """An HTTP/1.1 request closing its connection after the answer."""
    head = [f"{method} {target} HTTP/1.1", "Host: skred", "Connection: close",
            f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class _Read:
    """What ``http.client.HTTPResponse`` reads an answer from: the bytes already read."""

    def __init__(self, data: bytes) -> None:
        self._file = io.BytesIO(data)

    def makefile(self, *_args: Any, **_kw: Any) -> io.BytesIO:
        return self._file


def parse_answer(data: bytes) -> web.Response:
    """A whole HTTP/1.1 answer (read to its connection's end) as the client's answer."""
    got = http.client.HTTPResponse(_Read(data))  # type: ignore[arg-type]
    got.begin()
    body = got.read()
    kept = {k: v for k, v in got.getheaders() if k in KEPT}
    return web.Response(body=body, status=got.status, headers=kept)


class VhostForward:
    """The cluster leader's middleware for the vhosts other nodes serve (see the module's comment)."""

    def __init__(self, open_to: OpenTo) -> None:
        self.open_to = open_to

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        vhost = request.match_info.get("vhost")
        if vhost is None or request.path.startswith(SHARED):
            answer: web.StreamResponse = await handler(request)
            return answer
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        client = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else (request.remote or "", 0)
        try:
            async with asyncio.timeout(FORWARD_TIMEOUT):
                streams = await self.open_to(vhost, client)
                if streams is not None:
                    return await self._exchange(request, streams)
        except errors.NotAllowed as exc:
            return unavailable(exc.reply_text)
        except TimeoutError:
            return unavailable(f"the node serving vhost '{vhost}' did not answer")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return unavailable(f"the node serving vhost '{vhost}': {exc or type(exc).__name__}")
        here: web.StreamResponse = await handler(request)  # served here
        return here

    async def _exchange(self, request: web.Request, streams: Streams) -> web.Response:
        reader, writer = streams
        try:
            headers = {h: request.headers[h] for h in PASSED if h in request.headers}
            writer.write(request_bytes(request.method, str(request.rel_url), headers, await request.read()))
            await writer.drain()
            data = bytearray()
            while chunk := await reader.read(64 * 1024):
                data += chunk
                if len(data) > MAX_ANSWER:
                    raise ValueError(f"an answer larger than {MAX_ANSWER} bytes")
            return parse_answer(bytes(data))
        finally:
            writer.close()
