"""The issuer's signing keys: OpenID Connect discovery, then its JWKS, cached and refreshed.

Theory of operation
-------------------
At start the node fetches ``<issuer>/.well-known/openid-configuration`` (OpenID Connect
Discovery 1.0) and from it ``jwks_uri`` (or ``[oauth] jwks_uri`` when set, skipping
discovery), and hands the keys to ``TokenAuth``. A provider that cannot be reached at start
is logged, not fatal: the first token asks again. The keys are fetched anew every
``jwks_cache_ttl`` seconds, and on demand when a token names a ``kid`` we do not hold (the
provider rotated its keys): concurrent askers share one fetch, and a fetch happens at most
once per ``jwks_min_refresh`` seconds, so tokens with made-up ``kid`` cannot make us hammer
the provider. Every fetch has a time bound (``fetch_timeout``) and a size bound
(``MAX_DOCUMENT``); a failed fetch keeps the keys we had.

This is the only module of ``broker.auth`` that does IO; the node composes it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from broker.auth.oauth import LoginSettings, OAuthSettings, TokenAuth, read_jwks
from broker.auth.users import BACKENDS, UserStore
from broker.config import Config, ConfigError, OAuthConfig

if TYPE_CHECKING:  # aiohttp is imported on a first fetch: its import builds TLS contexts, a
    import aiohttp  # tenth of a boot's CPU before the client ports open (issue 28)

log = logging.getLogger(__name__)

DISCOVERY_PATH = "/.well-known/openid-configuration"
MAX_DOCUMENT = 1 << 20  # bytes of a discovery or JWKS document


class OAuthKeys:
    def __init__(self, auth: TokenAuth, issuer: str, *, jwks_uri: str = "", cache_ttl: float = 3600,
                 min_refresh: float = 10, timeout: float = 5) -> None:
        self.auth = auth
        self.issuer = issuer.rstrip("/")
        self.jwks_uri = jwks_uri
        self.cache_ttl = cache_ttl
        self.min_refresh = min_refresh
        self.timeout = timeout
        self.discovery: dict[str, Any] = {}  # the provider's metadata (also TokenAuth.provider)
        self.fetches = 0  # JWKS fetches attempted, for tests
        self._last = -float("inf")
        self._inflight: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        auth.refresh = self.refresh

    async def start(self) -> None:
        await self._fetch_logged()
        self._ticker = asyncio.create_task(self._tick())

    async def close(self) -> None:
        for task in (self._ticker, self._inflight):
            if task is not None:
                task.cancel()

    def refresh(self, kid: str) -> asyncio.Future[None] | None:
        """A fetch of the keys for ``kid``'s sake: the one under way, a new one, or None when
        the last fetch was less than ``min_refresh`` seconds ago."""
        if self._inflight is not None and not self._inflight.done():
            return asyncio.shield(self._inflight)
        if time.monotonic() - self._last < self.min_refresh:
            return None
        log.info("OAuth: token signed with unknown key %r: fetching the issuer's keys", kid[:64])
        self._inflight = asyncio.ensure_future(self._fetch_logged())
        return asyncio.shield(self._inflight)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.cache_ttl)
            if self._inflight is None or self._inflight.done():
                self._inflight = asyncio.ensure_future(self._fetch_logged())

    async def _fetch_logged(self) -> None:
        import aiohttp
        self._last = time.monotonic()
        self.fetches += 1
        try:
            async with asyncio.timeout(self.timeout):
                await self._fetch()
        except (TimeoutError, OSError, aiohttp.ClientError, ValueError) as exc:
            log.warning("OAuth: could not fetch the keys of issuer %s: %s", self.issuer,
                        str(exc) or type(exc).__name__)

    async def _fetch(self) -> None:
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as http:
            if not self.discovery:
                self.discovery = self.auth.provider = await _get_json(http, self.issuer + DISCOVERY_PATH)
            uri = self.jwks_uri or self.discovery.get("jwks_uri")
            if not isinstance(uri, str) or not uri:
                raise ValueError("the issuer's discovery document names no jwks_uri")
            keys = read_jwks(await _get_json(http, uri))
        self.auth.set_keys(keys)
        log.info("OAuth: %d signing key(s) of issuer %s: %s", len(keys), self.issuer,
                 ", ".join(sorted(keys)))


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url, allow_redirects=False) as resp:
        if resp.status != 200:
            raise ValueError(f"GET {url}: HTTP {resp.status}")
        body = await resp.content.read(MAX_DOCUMENT + 1)
        if len(body) > MAX_DOCUMENT:
            raise ValueError(f"GET {url}: document larger than {MAX_DOCUMENT} bytes")
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError(f"GET {url}: not a JSON object")
    return document


def backends(text: str) -> tuple[str, ...]:
    """``[main] auth_backends`` as the user store's chain; ConfigError for an unknown backend."""
    names = tuple(dict.fromkeys("internal" if n == "local" else n
                                for n in (p.strip().lower() for p in text.split(",")) if n))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ConfigError(f"[main] auth_backends: unknown backend {', '.join(unknown) or '(none)'} "
                          f"(known: {', '.join(BACKENDS)})")
    return names


def settings(cfg: OAuthConfig) -> OAuthSettings:
    def items(text: str, sep: str = ",") -> tuple[str, ...]:
        return tuple(p.strip() for p in text.split(sep) if p.strip())

    return OAuthSettings(
        issuer=cfg.issuer, resource_server_id=cfg.resource_server_id, audience=items(cfg.audience),
        verify_aud=cfg.verify_aud, scope_prefix=cfg.scope_prefix,
        additional_scopes_key=cfg.additional_scopes_key,
        username_claims=items(cfg.preferred_username_claims) or ("sub",), leeway=cfg.leeway)


async def start_oauth(config: Config, users: UserStore) -> OAuthKeys | None:
    """Set the user store's backend chain; with ``oauth`` in it, fetch the issuer's keys and
    return their source (the node closes it), else None."""
    users.backends = backends(config.main.auth_backends)
    if "oauth" not in users.backends:
        return None
    cfg = config.oauth
    if not cfg.issuer:
        raise ConfigError("[main] auth_backends has oauth but [oauth] issuer is not set")
    if cfg.verify_aud and not (cfg.audience or cfg.resource_server_id):
        raise ConfigError("[oauth] needs resource_server_id or audience (or verify_aud = false)")
    auth = TokenAuth(settings(cfg))
    auth.login = LoginSettings(cfg.client_id, tuple(cfg.ui_scopes.split()),
                               cfg.provider_name or cfg.issuer.split("://", 1)[-1].split("/", 1)[0],
                               cfg.fetch_timeout)
    keys = OAuthKeys(auth, cfg.issuer, jwks_uri=cfg.jwks_uri, cache_ttl=cfg.jwks_cache_ttl,
                     min_refresh=cfg.jwks_min_refresh, timeout=cfg.fetch_timeout)
    users.tokens = auth
    await keys.start()
    return keys
