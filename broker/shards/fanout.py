"""The management API of a multi-worker node, answered for the whole node by any worker.

Theory of operation
-------------------
Each worker serves the node's management port (``SO_REUSEPORT``) and a private one on
127.0.0.1 that the others use (``WorkerLink.http``). A request that lands on a worker is,
by this middleware, after the usual authentication:

* *about one vhost* (its route has a ``{vhost}``): answered by the worker that owns the vhost
  (forwarded to its private port when that is another one; 503 while it restarts);
* *a node-wide list* (``LISTS``): this worker's part and every other worker's part
  (asked with ``X-Skred-Worker-Local``), concatenated; ``/api/overview`` adds the counts up,
  ``/metrics`` (and its detailed and per-object forms, on the management port and on the
  metrics port) adds up samples of the same name and labels (``broker.http.aggregate``);
* *one connection or channel by name* (``ONE_OF``): this worker's answer, or when it does not
  know the name (404), the first other worker's that does;
* *the node's app* (``APP``: ``skredctl stop_app``/``start_app``): this worker's handler and
  every other worker's at once (each authenticates the forwarded request itself), so every
  worker closes or opens its client listeners; 503 naming a worker that did not (both are
  idempotent: asking again finishes the job);
* *a change of shared state* (another method than GET/HEAD on a path of ``SHARED``): run
  under ``WorkerLink.changing`` (the node-wide lock; acknowledged once every worker re-read
  what it changed).

A forwarded request carries the client's own ``Authorization`` header: the worker that
answers authenticates and authorizes it as if the client had asked it directly, so the
private port grants nothing the public one does not (and the local header only narrows an
answer). A page of a list (``page``, ``page_size``, ``columns``) or a sort of one is cut from
the whole node's list (``paged``). A worker's part missing (restarting) is said, never
under-counted: 503 naming it (``broker.http.aggregate.partial``), the overview its
``partial``. ``GET /api/definitions`` merges every worker's export
(``broker.shards.definitions``; 503 while a worker restarts: a document without its vhosts
would pass for the node's). Not yet aggregated: the import of a whole node's definitions of a
document whose vhosts span workers (``POST /api/definitions`` answers 501: it could not be all
or nothing across workers; one whose vhosts are one worker's goes whole to that worker, the
per-vhost form works), ``/api/nodes``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from broker.http.aggregate import add_counts, merge_metrics, partial
from broker.http.common import (
    MGMT_KEY,
    PASSED_ON,
    RECORD_ROUTES,
    ApiError,
    error_response,
    paginate,
    passed_back,
)
from broker.shards.definitions import merge_exports, owners
from broker.shards.worker import WorkerLink

LOCAL = "X-Skred-Worker-Local"
LISTS = frozenset({"/api/queues", "/api/exchanges", "/api/bindings", "/api/connections", "/api/channels",
                   "/api/consumers", "/api/vhosts"})
PAGED = frozenset({"page", "page_size", "columns"})  # applied to the whole list, not to parts
ARRANGED = PAGED | {"sort", "sort_reverse"}  # a list arranged once joined
METRICS = frozenset({"/metrics", "/metrics/detailed", "/metrics/per-object"})
# one connection or channel by name (GET, DELETE): answered by the worker it is on
ONE_OF = ("/api/connections/", "/api/channels/")
# the requests that may change shared state (users.json, vhosts.json, global parameters); an HTTP
# publish or get is not one of them and takes no node-wide lock
SHARED = ("/api/users", "/api/permissions", "/api/topic-permissions", "/api/vhosts", "/api/global-parameters",
          "/api/user-limits", "/api/definitions", "/api/parameters")
APP = frozenset({"/api/broker/stop", "/api/broker/start"})  # every worker's client listeners
FORWARD_TIMEOUT = 30.0
RELAY_CHUNK = 1 << 16  # bytes of a relayed answer held here at once, beyond the transports' buffers


class Fanout:
    """The middleware of one worker's management app (``port`` "http") or metrics app ("metrics":
    the port without authentication; its other workers' parts come from their private metrics
    ports, which serve only what that port serves)."""

    def __init__(self, link: WorkerLink, port: str = "http") -> None:
        self.link = link
        self.port = port
        self._client: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def client(self) -> aiohttp.ClientSession:
        if self._client is None or self._client.closed:
            self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT))
        return self._client

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        link = self.link
        local = LOCAL in request.headers and self._private(request)
        vhost = request.match_info.get("vhost")
        if request.path == "/api/definitions" and not local and request.method == "GET":
            return await self.definitions(request, handler)
        if request.path == "/api/definitions" and not local:
            spanned = await self.import_at(request)
            if spanned is not None:
                return spanned
        if not local and vhost is not None and not link.owns(vhost):
            if _relayed(request):
                return await self.relay(request, link.owner(vhost))
            forwarded: web.StreamResponse = await self.forward(request, link.owner(vhost))
            return forwarded
        if not local and request.path in APP and request.method == "PUT":
            return await self.every_worker(request, handler)
        if request.method not in ("GET", "HEAD") and request.path.startswith(SHARED):
            async with link.changing():
                changed: web.StreamResponse = await handler(request)
            return changed
        if not local and request.path in LISTS and ARRANGED & set(request.query) and link.index in link.http:
            return await self.paged(request)
        one_of = not local and request.path.startswith(ONE_OF)
        try:
            mine: web.StreamResponse = await handler(request)
        except (ApiError, web.HTTPNotFound) as exc:
            if not one_of or exc.status != 404:
                raise
            found = await self.elsewhere(request)
            if found is None:
                raise
            return found
        if local or not (request.path in LISTS or request.path in METRICS or request.path == "/api/overview"):
            return mine
        if not isinstance(mine, web.Response) or mine.status != 200 or mine.body is None:
            return mine
        others = [i for i in range(link.count) if i != link.index]
        parts = await asyncio.gather(*(self.ask(request, i) for i in others))
        missing = _missing(others, parts)
        got = [p for p in parts if p is not None]
        body = mine.body if isinstance(mine.body, bytes) else bytes(mine.text or "", "utf-8")
        if request.path != "/api/overview" and missing:  # a whole that would pass for the node's
            return partial(missing)
        if request.path in METRICS:
            text = merge_metrics([body.decode(), *(p.decode() for p in got)])
            return web.Response(body=text.encode(), headers={"Content-Type": mine.headers["Content-Type"]})
        doc = json.loads(body)
        if request.path == "/api/overview":
            for other in got:
                add_counts(doc, json.loads(other))
            if missing:
                doc["partial"] = missing
        elif isinstance(doc, list):
            for other in map(json.loads, got):
                if isinstance(other, list):
                    doc.extend(other)
        return web.json_response(doc, status=mine.status)

    async def every_worker(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """``APP``: on every worker at once (each checks the user may: a refusal here is every
        worker's, since they read the same users file)."""
        others = sorted(i for i in range(self.link.count) if i != self.link.index)
        found = await asyncio.gather(handler(request), *(self.forward(request, i) for i in others))
        mine: web.StreamResponse = found[0]
        answers: list[web.Response] = found[1:]
        if mine.status >= 300:
            return mine
        failed = [i for i, got in zip(others, answers, strict=True) if got.status >= 300]
        if failed:
            return web.json_response({"error": "service_unavailable", "reason": (
                f"worker(s) {failed} of this node did not follow; ask again")}, status=503)
        return mine

    async def definitions(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The whole node's definitions: this worker's export (which also checks that the user
        may have it) and every other worker's, merged (``broker.shards.definitions``)."""
        mine: web.StreamResponse = await handler(request)
        if not isinstance(mine, web.Response) or mine.status != 200 or mine.body is None:
            return mine
        link = self.link
        missing = [i for i in range(link.count)
                   if i != link.index and (i not in link.up or i not in link.http)]
        parts = [] if missing else await asyncio.gather(
            *(self.ask(request, i) for i in range(link.count) if i != link.index))
        if missing or any(p is None for p in parts):
            return web.json_response({"error": "service_unavailable", "reason": (
                "a worker of this node is restarting: the definitions would miss its vhosts")}, status=503)
        body = mine.body if isinstance(mine.body, bytes) else bytes(mine.text or "", "utf-8")
        doc = merge_exports(json.loads(body), [json.loads(p) for p in parts if p is not None])
        kept = {k: v for k, v in mine.headers.items() if k == "Content-Disposition"}
        return web.json_response(doc, dumps=lambda d: json.dumps(d, indent=2), headers=kept)

    async def import_at(self, request: web.Request) -> web.StreamResponse | None:
        """A whole node's import (``broker.shards.definitions``): the answer of the one worker
        whose vhosts the document names, 501 when it names several, None to import it here."""
        try:
            doc = json.loads(await request.read())
        except ValueError:
            return None  # the handler answers it (400)
        link = self.link
        named = owners(doc, link.owner)
        if len(named) > 1:
            return web.json_response({"error": "not_implemented", "reason": (
                f"the document names vhosts of {len(named)} workers of this node, and an import is all or "
                "nothing on one worker only: import it per vhost (/api/definitions/{vhost}), or on a node "
                "of one worker ([main] workers = 1)")}, status=501)
        if not named or link.index in named:
            return None
        return await self.forward(request, named.pop())

    async def paged(self, request: web.Request) -> web.Response:
        """A page (or the columns) of a node-wide list: every worker's whole part (this one's too,
        through its private port, so each applies the user's view of it), then the filter,
        sort, columns and page over all of them at once."""
        whole = request.rel_url.with_query({k: v for k, v in request.query.items() if k not in PAGED})
        every = range(self.link.count)
        parts = await asyncio.gather(*(self.ask(request, i, whole) for i in every))
        missing = _missing(every, parts)
        if missing:
            return partial(missing)
        items: list[dict[str, Any]] = []
        for part in parts:
            doc = json.loads(part) if part is not None else []
            items.extend(doc if isinstance(doc, list) else [])
        return paginate(request, items)

    async def elsewhere(self, request: web.Request) -> web.Response | None:
        """A connection or channel by name lives on one worker: the first other that knows it."""
        for i in sorted(self.link.http):
            if i != self.link.index:
                found = await self.forward(request, i)
                if found.status != 404:
                    return found
        return None

    def _private(self, request: web.Request) -> bool:
        """Did ``request`` come in on this worker's private port (only a worker asks for a
        worker's own part there; on the node's port the header is ignored)?"""
        mine = (self.link.http if self.port == "http" else self.link.metrics).get(self.link.index)
        transport = request.transport
        where = transport.get_extra_info("sockname") if transport is not None else None
        return mine is not None and isinstance(where, tuple) and int(where[1]) == mine[1]

    def _target(self, index: int, request: web.Request, rel_url: URL | None = None) -> str | None:
        address = (self.link.http if self.port == "http" else self.link.metrics).get(index)
        if address is None or index not in self.link.up:
            return None
        return f"http://{address[0]}:{address[1]}{rel_url or request.rel_url}"

    async def ask(self, request: web.Request, index: int, rel_url: URL | None = None) -> bytes | None:
        """Worker ``index``'s own part of the answer to ``request`` (None: it cannot give one now)."""
        url = self._target(index, request, rel_url)
        if url is None:
            return None
        headers = {h: request.headers[h] for h in PASSED_ON if h in request.headers}
        headers[LOCAL] = "1"
        try:
            async with self.client().get(url, headers=headers) as got:
                return await got.read() if got.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def forward(self, request: web.Request, index: int) -> web.Response:
        """The answer of worker ``index`` (the vhost's owner) to ``request``."""
        url = self._target(index, request)
        if url is None:
            return _restarting()
        headers = {h: request.headers[h] for h in PASSED_ON if h in request.headers}
        headers[LOCAL] = "1"
        body = await request.read()
        try:
            async with self.client().request(request.method, url, headers=headers, data=body) as got:
                data = await got.read()
                return web.Response(body=data, status=got.status, headers=_kept(got))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _unreachable(index, exc)

    async def relay(self, request: web.Request, index: int) -> web.StreamResponse:
        """``forward`` for a GET whose answer is passed on as it arrives (``_relayed``). Its
        time bound is the owner's send timeout (a stalled client stalls this read, the owner
        cuts its side off), so no total here, only a bound on silence."""
        url = self._target(index, request)
        if url is None:
            return _restarting()
        headers = {h: request.headers[h] for h in PASSED_ON if h in request.headers}
        headers[LOCAL] = "1"
        timeout = aiohttp.ClientTimeout(total=None, sock_read=FORWARD_TIMEOUT)
        try:
            async with self.client().request("GET", url, headers=headers, timeout=timeout) as got:
                if got.status != 200:
                    return web.Response(body=await got.read(), status=got.status, headers=_kept(got))
                return await _relay(request, got, _kept(got))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _unreachable(index, exc)


def _missing(workers: Iterable[int], parts: list[bytes | None]) -> list[str]:
    return [f"worker {i} of this node (restarting)" for i, p in zip(workers, parts, strict=True) if p is None]


def _restarting() -> web.Response:
    return error_response(503, "service_unavailable", "the worker of this vhost is restarting")


def _unreachable(index: int, exc: BaseException) -> web.Response:
    return error_response(503, "service_unavailable", f"worker {index}: {exc}")


def _kept(got: aiohttp.ClientResponse) -> dict[str, str]:
    return passed_back(got.headers.items())


def _relayed(request: web.Request) -> bool:
    """Whether the answer is passed on as it arrives rather than read whole first: a GET of the raw
    stream records (up to 64 MiB each), whose memory the owner's records budget bounds only
    while the owner is still sending them."""
    route = request.match_info.route.resource
    return request.method == "GET" and route is not None and route.canonical in RECORD_ROUTES


async def _relay(request: web.Request, got: aiohttp.ClientResponse, headers: dict[str, str]
                 ) -> web.StreamResponse:
    """Pass ``got``'s body on in chunks, at the client's pace (each write waits for the client's
    transport to drain, and this side then stops reading the owner's answer), within the records
    send timeout, as the owner sends (the loopback's socket buffers may take the whole answer
    off the owner's hands, so the owner's timeout alone does not bound a stalled client here).
    An answer that
    cannot be finished (the owner cut it off, the client went away) has the client's connection
    aborted: its length was promised, so a short body must not pass for a whole one."""
    resp = web.StreamResponse(status=got.status, headers=headers)
    if got.content_length is not None:
        resp.content_length = got.content_length
    try:
        async with asyncio.timeout(request.app[MGMT_KEY].records.send_timeout):
            await resp.prepare(request)
            async for chunk in got.content.iter_chunked(RELAY_CHUNK):
                await resp.write(chunk)
            await resp.write_eof()
    except (aiohttp.ClientError, TimeoutError, OSError):
        if request.transport is not None:
            request.transport.abort()
    return resp
