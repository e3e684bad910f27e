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
and the headers ``http.common.PASSED_BACK`` names, the list the workers' fan-out passes back too,
Retry-After among them) is the client's. The shared state (users,
permissions, the vhost list, global and runtime parameters: ``SHARED``) is the cluster
leader's, so those paths are answered here whatever vhost they name. A node-wide list
(``LISTS``: ``/api/queues`` and the like, not a page of one) is this node's and every other
serving node's part (``open_nodes``), concatenated; a page of one, ``/api/overview`` and the
whole definitions are this node's part only (not aggregated across nodes yet).

Bounds: the answer is at most ``MAX_ANSWER`` bytes and the whole exchange ``FORWARD_TIMEOUT``
seconds. A vhost moving (closed here, its next server not known yet), a node that cannot be
reached, or an answer that does not parse: 503, as for a worker that restarts, when the
request had not been passed on yet (or only asked for something: GET, HEAD), so that it did not
happen. A change passed on whose answer then failed may have happened there: 504, which says its
outcome is not known, never an error that would claim it did not happen.
"""

from __future__ import annotations

import asyncio
import http.client
import io
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from broker import errors
from broker.http.common import PASSED_ON, error_response, passed_back

log = logging.getLogger(__name__)

FORWARD_TIMEOUT: Final = 30.0
MAX_ANSWER: Final = 64 * 1024 * 1024  # bytes of a forwarded answer (a long queue list fits)
# the requests about the cluster's shared state, answered where they land
# (a vhost's definitions, ``/api/definitions/{vhost}``, are its queues, exchanges, bindings and
# policies: that node's)
SHARED: Final = ("/api/users", "/api/permissions", "/api/topic-permissions", "/api/vhosts",
                 "/api/global-parameters", "/api/user-limits", "/api/parameters")
CLIENTS: Final = ("/connections", "/channels")  # /api/vhosts/{vhost}/...: that node's clients

# the node-wide lists: this node's part and every other serving node's (not a page of one yet)
LISTS: Final = frozenset({"/api/queues", "/api/exchanges", "/api/bindings", "/api/connections",
                          "/api/channels", "/api/consumers"})
PAGED: Final = frozenset({"page", "page_size", "columns"})

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
# a connection to the management API of the node serving ``vhost`` for the client at ``peer``;
# None: served here; raises ``errors.NotAllowed`` while it moves
OpenTo = Callable[[str, tuple[str, int]], Awaitable[Streams | None]]
# a connection to the management API of each other node serving a vhost, for the client
OpenNodes = Callable[[tuple[str, int]], Awaitable[list[Streams]]]


def unavailable(reason: str) -> web.Response:
    return error_response(503, "service_unavailable", reason)


def outcome_unknown(reason: str) -> web.Response:
    return error_response(504, "gateway_timeout",
                          f"{reason}; the request was passed on and may have been applied")


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
    return web.Response(body=body, status=got.status, headers=passed_back(got.getheaders()))


def _client(request: web.Request) -> tuple[str, int]:
    """The client's address (a follower's tunnel or a PROXY header: the one they named)."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    return (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else (request.remote or "", 0)


class VhostForward:
    """The cluster leader's middleware for the vhosts other nodes serve (see the module's comment)."""

    def __init__(self, open_to: OpenTo, open_nodes: OpenNodes | None = None) -> None:
        self.open_to = open_to
        self.open_nodes = open_nodes

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        vhost = request.match_info.get("vhost")
        if vhost is None and request.path in LISTS and request.method == "GET" \
                and not PAGED & set(request.query) and self.open_nodes is not None:
            return await self.whole_list(request, handler, self.open_nodes)
        if vhost is None or request.path.startswith(SHARED) and not request.path.endswith(CLIENTS):
            answer: web.StreamResponse = await handler(request)
            return answer
        client = _client(request)
        failed = unavailable
        try:
            async with asyncio.timeout(FORWARD_TIMEOUT):
                streams = await self.open_to(vhost, client)
                if streams is not None:
                    if request.method not in ("GET", "HEAD"):
                        failed = outcome_unknown  # from here on it may reach that node
                    return await self._exchange(request, streams)
        except errors.NotAllowed as exc:
            return unavailable(exc.reply_text)
        except TimeoutError:
            return failed(f"the node serving vhost '{vhost}' did not answer")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return failed(f"the node serving vhost '{vhost}': {exc or type(exc).__name__}")
        here: web.StreamResponse = await handler(request)  # served here
        return here

    async def whole_list(self, request: web.Request, handler: Any, open_nodes: OpenNodes
                         ) -> web.StreamResponse:
        """``LISTS``: this node's list (which also checks the user may have it) and each other
        serving node's, concatenated (each shard broker lists only the vhosts it serves, so
        nothing comes twice); a node that does not answer in time leaves its part out, logged."""
        mine: web.StreamResponse = await handler(request)
        if not isinstance(mine, web.Response) or mine.status != 200 or mine.body is None:
            return mine
        body = mine.body if isinstance(mine.body, bytes) else bytes(mine.text or "", "utf-8")
        doc = json.loads(body)
        if not isinstance(doc, list):
            return mine
        try:
            async with asyncio.timeout(FORWARD_TIMEOUT):
                nodes = await open_nodes(_client(request))
                parts = await asyncio.gather(*(self._exchange(request, n) for n in nodes),
                                             return_exceptions=True)
        except TimeoutError:
            log.warning("%s: the other nodes' parts did not come in %.0fs", request.path, FORWARD_TIMEOUT)
            return mine
        for part in parts:
            if isinstance(part, web.Response) and part.status == 200 and isinstance(part.body, bytes):
                other = json.loads(part.body)
                doc.extend(other if isinstance(other, list) else [])
            else:
                log.warning("%s: a serving node's part left out: %s", request.path,
                            part if isinstance(part, BaseException) else f"status {part.status}")
        return web.json_response(doc, status=mine.status)

    async def _exchange(self, request: web.Request, streams: Streams) -> web.Response:
        reader, writer = streams
        try:
            headers = {h: request.headers[h] for h in PASSED_ON if h in request.headers}
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
