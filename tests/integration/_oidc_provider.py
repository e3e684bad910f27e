"""A real OpenID Connect provider for the OAuth tests, served over HTTP on loopback.

Theory of operation: an aiohttp application on its own event loop in a thread, on a free port
of 127.0.0.1, serving what a broker and a browser use of a provider: the discovery document
(``/.well-known/openid-configuration``), the JWKS, the authorization endpoint (a login page
with a form; the authorization-code flow with PKCE, S256 only), the token endpoint and an
end-session endpoint. Keys are generated and tokens signed with authlib's JOSE library
(joserfc, which authlib builds on), and PKCE is checked with authlib's S256 helper: nothing in the
broker's path is a canned answer. Tests mint tokens with any claims (``token``), rotate
the published keys (``rotate``) and read how often the JWKS was fetched (``jwks_fetches``).
"""

from __future__ import annotations

import asyncio
import html
import secrets
import threading
import time
import urllib.parse
from typing import Any

from aiohttp import web
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet, RSAKey

Key = RSAKey | ECKey


class Provider:
    def __init__(self, audience: str = "skred", client_id: str = "skred-ui") -> None:
        self.audience = audience
        self.client_id = client_id
        self.keys: dict[str, Key] = {
            "rsa-1": RSAKey.generate_key(2048, parameters={"kid": "rsa-1"}),
            "ec-1": ECKey.generate_key("P-256", parameters={"kid": "ec-1"}),
        }
        self.published = ["rsa-1", "ec-1"]  # kids in the JWKS
        self.jwks_fetches = 0
        self.last_fetch = 0.0  # time.monotonic() of the last JWKS fetch
        self.logins: dict[str, tuple[str, list[str]]] = {}  # user -> (password, scopes), for the login page
        self.codes: dict[str, dict[str, Any]] = {}
        self.issuer = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="oidc-provider", daemon=True)
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------------ life
    def start(self) -> Provider:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        self.issuer = f"http://127.0.0.1:{port}"
        return self

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self._discovery)
        app.router.add_get("/jwks", self._jwks)
        app.router.add_get("/authorize", self._authorize_page)
        app.router.add_post("/authorize", self._authorize)
        app.router.add_post("/token", self._token)
        app.router.add_get("/logout", self._logout)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    # ------------------------------------------------------------------ tokens
    def token(self, name: str = "alice", scopes: list[str] | tuple[str, ...] = (), *, kid: str = "rsa-1",
              key: Key | None = None, lifetime: float = 600, nbf_in: float | None = None,
              aud: str | None = None, iss: str | None = None, header: dict[str, Any] | None = None,
              **claims: Any) -> str:
        """A signed access token: ``key`` (default: the key ``kid``) signs; claims as given."""
        now = int(time.time())
        body: dict[str, Any] = {
            "iss": self.issuer if iss is None else iss, "aud": self.audience if aud is None else aud,
            "sub": f"sub-{name}", "preferred_username": name, "iat": now, "exp": int(now + lifetime),
            "scope": " ".join(scopes), "client_id": self.client_id, **claims,
        }
        if nbf_in is not None:
            body["nbf"] = int(now + nbf_in)
        signer = key if key is not None else self.keys[kid]
        alg = "ES256" if isinstance(signer, ECKey) else "RS256"
        hdr = {"alg": alg, "kid": kid, "typ": "JWT"} if header is None else header
        return jwt.encode(hdr, body, signer)

    def rotate(self, kid: str) -> None:
        """Publish a new RSA key ``kid`` (the provider's key rotation); the old ones stay."""
        self.keys[kid] = RSAKey.generate_key(2048, parameters={"kid": kid})
        self.published.append(kid)

    # ------------------------------------------------------------------ endpoints
    async def _discovery(self, request: web.Request) -> web.Response:
        i = self.issuer
        return web.json_response({
            "issuer": i, "jwks_uri": f"{i}/jwks", "authorization_endpoint": f"{i}/authorize",
            "token_endpoint": f"{i}/token", "end_session_endpoint": f"{i}/logout",
            "response_types_supported": ["code"], "grant_types_supported": ["authorization_code"],
            "code_challenge_methods_supported": ["S256"], "id_token_signing_alg_values_supported": ["RS256"],
            "subject_types_supported": ["public"],
        })

    async def _jwks(self, request: web.Request) -> web.Response:
        self.jwks_fetches += 1
        self.last_fetch = time.monotonic()
        keys = KeySet([self.keys[k] for k in self.published])
        return web.json_response(keys.as_dict(private=False))

    async def _authorize_page(self, request: web.Request) -> web.Response:
        q = request.query
        if q.get("response_type") != "code" or q.get("client_id") != self.client_id:
            return web.Response(status=400, text="unsupported response_type or unknown client")
        if q.get("code_challenge_method") != "S256" or not q.get("code_challenge"):
            return web.Response(status=400, text="PKCE (S256) is required")
        hidden = "".join(f'<input type="hidden" name="{html.escape(k)}" value="{html.escape(v)}">'
                         for k, v in q.items())
        page = (f"<!doctype html><title>Test IdP login</title><h1>Test IdP</h1>"
                f'<form method="post" action="/authorize">{hidden}'
                '<input id="idp-username" name="username"><input id="idp-password" name="password" '
                'type="password"><button id="idp-login" type="submit">Sign in</button></form>')
        return web.Response(text=page, content_type="text/html")

    async def _authorize(self, request: web.Request) -> web.Response:
        form = await request.post()
        user, password = str(form.get("username", "")), str(form.get("password", ""))
        known = self.logins.get(user)
        if known is None or known[0] != password:
            return web.Response(status=401, text="wrong user name or password")
        code = secrets.token_urlsafe(24)
        self.codes[code] = {"user": user, "scopes": known[1], "redirect_uri": str(form["redirect_uri"]),
                            "challenge": str(form["code_challenge"]), "client_id": str(form["client_id"])}
        query = urllib.parse.urlencode({"code": code, "state": str(form.get("state", ""))})
        raise web.HTTPFound(f"{form['redirect_uri']}?{query}")

    async def _token(self, request: web.Request) -> web.Response:
        form = await request.post()
        grant = self.codes.pop(str(form.get("code", "")), None)  # a code is good once
        if form.get("grant_type") != "authorization_code" or grant is None:
            return web.json_response({"error": "invalid_grant"}, status=400)
        if form.get("client_id") != grant["client_id"] or form.get("redirect_uri") != grant["redirect_uri"]:
            return web.json_response({"error": "invalid_grant"}, status=400)
        if create_s256_code_challenge(str(form.get("code_verifier", ""))) != grant["challenge"]:
            return web.json_response({"error": "invalid_grant", "error_description": "PKCE"}, status=400)
        token = self.token(grant["user"], grant["scopes"])
        return web.json_response({"access_token": token, "token_type": "Bearer", "expires_in": 600})

    async def _logout(self, request: web.Request) -> web.Response:
        target = request.query.get("post_logout_redirect_uri")
        if target:
            raise web.HTTPFound(target)
        return web.Response(text="logged out")
