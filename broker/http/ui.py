"""The web management UI: static files shipped inside the package, served on the management port.

Theory of operation: the UI is one page of plain JavaScript and CSS (no build step, no third-party
code, nothing fetched from the internet) that talks only to the JSON API under ``/api/`` with the
user's basic-auth credentials. It therefore sees and may change exactly what the API lets that user
see and change: tags and vhost permissions are enforced in one place, the API. The static files hold
no data and are served without authentication; credentials live in the browser tab's
sessionStorage and travel in the Authorization header, never in a URL.

The API answers a failed login with ``WWW-Authenticate: Basic`` (RabbitMQ clients expect it), which
would make a browser pop up its own login dialog over the UI's. Requests made by the UI carry
``X-Requested-With: XMLHttpRequest``; for those the header is renamed ``X-Skred-Challenge``, so
the UI shows its own "login failed" line instead, and still tells a refused login (challenged)
from a refused action (a 401 without a challenge, as RabbitMQ answers a missing privilege).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path

from aiohttp import web

from broker.http import admin_script

STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
# Everything the page may load comes from this server; no inline script, no framing.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
_FILES = resources.files("broker.http") / "ui"
UI_CHALLENGE = "X-Skred-Challenge"  # WWW-Authenticate under a name browsers do not act on


def _static(name: str) -> web.Response:
    suffix = name[name.rfind(".") :] if "." in name else ""
    content_type = STATIC_TYPES.get(suffix)
    entry = _FILES / name
    if content_type is None or "/" in name or name.startswith(".") or not entry.is_file():
        raise web.HTTPNotFound()
    return web.Response(body=entry.read_bytes(), content_type=content_type, headers=SECURITY_HEADERS)


async def index(request: web.Request) -> web.Response:
    return _static("index.html")


async def static_file(request: web.Request) -> web.Response:
    return _static(request.match_info["name"])


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def no_browser_login_dialog(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    if response.status == 401 and request.headers.get("X-Requested-With") == "XMLHttpRequest":
        challenge = response.headers.pop("WWW-Authenticate", None)
        if challenge is not None:  # the UI still learns that its credentials were refused
            response.headers[UI_CHALLENGE] = challenge
    return response


async def cli_rabbitmqadmin(request: web.Request) -> web.Response:
    """RabbitMQ serves its rabbitmqadmin script here, without login, for ``curl -O`` in
    Dockerfiles and setup scripts. Skred serves its own command-compatible script
    (``admin_script.py``) rather than RabbitMQ's code."""
    body = Path(admin_script.__file__).read_bytes()
    return web.Response(body=body, content_type="text/x-python", charset="utf-8",
                        headers={"Content-Disposition": 'attachment; filename="rabbitmqadmin"'})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/ui/{name}", static_file)
    app.router.add_get("/cli/rabbitmqadmin", cli_rabbitmqadmin)
