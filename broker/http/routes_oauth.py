"""The management UI's single sign-on: OpenID Connect's authorization-code flow with PKCE.

Theory of operation
-------------------
The browser does the flow; the broker only says where the provider is and relays one request.

1. ``GET /api/auth`` (read before login, as RabbitMQ's UI does) tells the page whether OAuth is
   on, the client id, the scopes to ask for and the provider's authorization and end-session
   endpoints (from the discovery document the broker fetched, ``broker.auth.oauth_keys``).
2. The page makes a PKCE verifier and its S256 challenge and a random ``state``, keeps both in
   the tab's sessionStorage, and sends the browser to the authorization endpoint with the
   page's own address (``<origin>/``) as ``redirect_uri``.
3. The provider logs the user in and sends the browser back with ``code`` and ``state``; the
   page checks ``state`` and posts ``code``, the verifier and the redirect URI to
   ``POST /api/oauth/token``. The broker makes the token request to the provider's token
   endpoint (a public client: no secret; the verifier is the proof), checks the access token
   it gets as it checks every token, and answers it to the page. The provider needs no CORS
   for the broker's origin and the page's CSP stays ``'self'``.
4. The page keeps the token in sessionStorage (as the basic-auth credentials are kept, the
   tab's alone) and sends it as ``Authorization: Bearer`` with every API request; every
   request validates it again. Logging out forgets it and, when the provider has an
   end-session endpoint, sends the browser there to end the provider's session too.

The relay is unauthenticated by nature (the user has no token yet): it only ever talks to the
configured token endpoint, with a bounded body and a time bound, and answers only a token that
passes the broker's own checks.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

from broker.auth.oauth import TokenAuth
from broker.auth.throttle import TooManyFailures, admitted, reported
from broker.http.common import MGMT_KEY, MGMT_TAGS, ApiError, bad_request, json_body

routes = web.RouteTableDef()

RELAY_PATH = "/api/oauth/token"
MAX_TOKEN_RESPONSE = 64 * 1024  # bytes of the provider's token response
MAX_FIELD = 4096  # characters of a code, verifier or redirect URI
_UAA_OFF = {"enable_uaa": False, "uaa_client_id": "", "uaa_location": ""}  # RabbitMQ 3.10's keys


def _tokens(request: web.Request) -> TokenAuth | None:
    mgmt = request.app[MGMT_KEY]
    tokens = mgmt.broker.users.tokens
    if not isinstance(tokens, TokenAuth) or "oauth" not in mgmt.broker.users.backends:
        return None
    return tokens


@routes.get("/api/auth")
async def auth_settings(request: web.Request) -> web.Response:
    """The UI's login settings, RabbitMQ's names first (``oauth_enabled``, ...)."""
    tokens = _tokens(request)
    if tokens is None or not tokens.login.client_id or "authorization_endpoint" not in tokens.provider:
        return web.json_response({"oauth_enabled": False, **_UAA_OFF})
    login, provider = tokens.login, tokens.provider
    scopes = [*login.scopes, *(f"{tokens.settings.prefix}tag:{tag}" for tag in sorted(MGMT_TAGS))]
    return web.json_response({
        "oauth_enabled": True,
        "oauth_client_id": login.client_id,
        "oauth_provider_url": tokens.settings.issuer,
        "oauth_scopes": " ".join(dict.fromkeys(scopes)),
        "oauth_provider_name": login.provider_name,
        "oauth_authorization_endpoint": provider.get("authorization_endpoint", ""),
        "oauth_end_session_endpoint": provider.get("end_session_endpoint", ""),
        **_UAA_OFF,
    })


@routes.post(RELAY_PATH)
async def token_relay(request: web.Request) -> web.Response:
    """Exchange an authorization code (with its PKCE verifier) for an access token."""
    tokens = _tokens(request)
    endpoint = tokens.provider.get("token_endpoint") if tokens is not None else None
    if tokens is None or not isinstance(endpoint, str):
        raise ApiError(404, "not_found", "OAuth 2 login is not configured", challenge=False)
    body = await json_body(request, required=("code", "code_verifier", "redirect_uri"))
    fields = {k: body[k] for k in ("code", "code_verifier", "redirect_uri")}
    if not all(isinstance(v, str) and 0 < len(v) <= MAX_FIELD for v in fields.values()):
        raise bad_request(f"code, code_verifier and redirect_uri must be strings of 1 to {MAX_FIELD}")
    form = {"grant_type": "authorization_code", "client_id": tokens.login.client_id, **fields}
    users = request.app[MGMT_KEY].broker.users
    source = request.remote or ""
    try:  # a sign-in is a login: the login throttle bounds how often a source makes us ask
        key = await admitted(users, source, "")
    except TooManyFailures:
        raise ApiError(429, "too_many_requests", "Too many failed logins from this address; retry later",
                       challenge=False) from None
    try:
        answer = await _post_form(endpoint, form, tokens.login.timeout)
    except ApiError as exc:
        reported(users, key, None, f"UI sign-in from {source}: {exc}")
        raise
    access, why = _access_token(answer, tokens)
    user = tokens.user(access) if not why else None
    if reported(users, key, user, f"UI sign-in from {source} refused: {why}") is None or user is None:
        raise ApiError(401, "not_authorized", why, challenge=False)
    return web.json_response({"access_token": access, "user": user.name, "expires_at": user.expires_at})


def _access_token(answer: dict[str, Any], tokens: TokenAuth) -> tuple[str, str]:
    """(the provider's access token, "") when the broker accepts it for the UI, else ("", why)."""
    access = answer.get("access_token")
    if not isinstance(access, str):
        return "", f"the provider gave no token: {str(answer.get('error', '?'))[:200]}"
    try:
        user = tokens.user(access)
    except ValueError as exc:
        return "", f"the provider's token is refused: {exc}"
    if not MGMT_TAGS & set(user.tags):
        return "", "Not management user"
    return access, ""


async def _post_form(url: str, form: dict[str, str], timeout: float) -> dict[str, Any]:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http, \
                http.post(url, data=form, allow_redirects=False) as resp:
            raw = await resp.content.read(MAX_TOKEN_RESPONSE + 1)
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:
        raise ApiError(502, "bad_gateway", f"the provider's token endpoint: {exc or type(exc).__name__}",
                       challenge=False) from None
    try:
        answer = json.loads(raw) if len(raw) <= MAX_TOKEN_RESPONSE else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise ApiError(502, "bad_gateway", "the provider's token endpoint answered no JSON object",
                       challenge=False)
    return answer
