"""OAuth 2 access tokens (JWT) as credentials: validation and the user a token stands for.

Theory of operation
-------------------
With ``oauth`` in ``[main] auth_backends`` a client may present an access token wherever it
presents a password (AMQP PLAIN/AMQPLAIN, connection.update-secret, MQTT, LMQ, HTTP basic
auth) and as ``Authorization: Bearer`` on the management API. ``UserStore.authenticate``
walks the backends in their configured order; the first that accepts the credentials
decides (``internal``: the password of a user of ``users.json``; ``oauth``: ``TokenAuth``).

A token is accepted when, in this order:

1. it is a compact JWS of at most ``MAX_TOKEN`` bytes whose header names ``alg`` RS256 or
   ES256 and a ``kid`` (a token without ``kid`` is refused: keys rotate);
2. the issuer's JWKS (``broker.auth.oauth_keys``, found by OpenID Connect discovery) holds a
   key with that ``kid`` of the algorithm's type (RSA, EC P-256), and the signature verifies
   (PyJWT on ``cryptography``: no crypto of ours);
3. ``iss`` is the configured issuer, ``aud`` names the audience (the resource server id
   unless ``audience`` is set; ``verify_aud = false`` skips it), ``exp`` is present and not
   past, ``nbf`` (if present) not ahead, both with ``leeway`` seconds of clock skew;
4. a username claim (``preferred_username_claims``, first present wins) is a non-empty string.

The token's user is a ``User`` that exists only for the connection or request holding it:
not stored, its tags and permissions are those of its scopes (``broker.auth.oauth_scopes``),
and it carries its expiry. ``UserStore`` checks such a user by the grants it carries instead
of looking its name up, and treats it as unknown once expired, so a token's permissions end
with it on every path; AMQP and MQTT connections are closed when it expires (the listeners'
timers), as RabbitMQ does.

A token whose ``kid`` is not among the cached keys asks the key source for a refresh first
(``pending``: the caller awaits it before checking the credentials); refreshes are rate
limited there, so a flood of tokens with made-up ``kid`` costs one fetch per interval.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from broker.auth.oauth_scopes import parse_scopes, scope_list
from broker.auth.users import Fetch, User

if TYPE_CHECKING:  # PyJWT is imported where a key or a token is read: importing it costs a
    import jwt  # tenth of a second of every broker's start, and most brokers take no tokens

log = logging.getLogger(__name__)

ALGORITHMS = {"RS256": "RSA", "ES256": "EC"}  # the algorithms accepted, and their key types
MAX_TOKEN = 8192  # bytes; a token with hundreds of scopes stays well under it
ACCEPTED_CACHE = 1024  # tokens remembered as accepted (each until it expires)


class TokenError(ValueError):
    """A token that is refused; the text is for the log, never for the client."""


class UnknownKey(TokenError):
    """The token's ``kid`` is not among the issuer's keys we hold."""


@dataclass(frozen=True)
class OAuthSettings:
    """The ``[oauth]`` section, as the token check reads it (``broker.config.OAuthConfig``)."""

    issuer: str
    resource_server_id: str
    audience: tuple[str, ...] = ()  # empty: the resource server id
    verify_aud: bool = True
    scope_prefix: str = ""  # empty: "<resource_server_id>."
    additional_scopes_key: str = ""
    username_claims: tuple[str, ...] = ("preferred_username", "sub")
    leeway: int = 5

    @property
    def prefix(self) -> str:
        return self.scope_prefix or f"{self.resource_server_id}."

    @property
    def audiences(self) -> tuple[str, ...]:
        return self.audience or ((self.resource_server_id,) if self.resource_server_id else ())


@dataclass(frozen=True)
class LoginSettings:
    """What the management UI's single sign-on needs of ``[oauth]`` (``broker.http.routes_oauth``)."""

    client_id: str = ""  # empty: no UI login through the provider
    scopes: tuple[str, ...] = ("openid", "profile")
    provider_name: str = ""
    timeout: float = 5


def looks_like_token(secret: str) -> bool:
    """A compact JWS's shape (three base64url parts, a JSON header): cheap, checked first."""
    return secret.startswith("eyJ") and secret.count(".") == 2 and len(secret) <= MAX_TOKEN


def token_header(secret: str) -> dict[str, Any] | None:
    """A token's JOSE header (unverified: only to pick the key), or None when it has none. Read
    here rather than by PyJWT, which decodes the whole token for it."""
    if not looks_like_token(secret):
        return None
    head = secret.split(".", 1)[0]
    try:
        header = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    except (ValueError, RecursionError):  # (binascii.Error is a ValueError) nesting past the limit
        return None
    return header if isinstance(header, dict) else None


def token_kid(secret: str) -> str | None:
    """The ``kid`` a token's header names (unverified), or None."""
    kid = (token_header(secret) or {}).get("kid")
    return kid if isinstance(kid, str) and kid else None


def read_jwks(document: Any) -> dict[str, jwt.PyJWK]:
    """The signing keys of a JWKS document by ``kid``; keys we cannot use are skipped."""
    import jwt
    keys: dict[str, jwt.PyJWK] = {}
    entries = document.get("keys") if isinstance(document, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("kid"), str):
            continue
        if entry.get("use", "sig") != "sig" or entry.get("kty") not in ALGORITHMS.values():
            continue
        try:
            keys[entry["kid"]] = jwt.PyJWK(entry)
        except jwt.PyJWTError as exc:
            log.warning("OAuth: skipping JWKS key %r: %s", entry["kid"], exc)
    return keys


class TokenAuth:
    """Validates tokens against the keys it is given (``set_keys``) and makes their users.
    ``refresh(kid)`` is the key source's: an awaitable that fetches the JWKS anew (rate limited
    there), or None when no fetch will happen now."""

    def __init__(self, settings: OAuthSettings,
                 refresh: Callable[[str], Fetch | None] | None = None) -> None:
        self.settings = settings
        self.keys: Mapping[str, jwt.PyJWK] = {}
        self.refresh = refresh
        self.provider: dict[str, Any] = {}  # the issuer's discovery document, once fetched
        self.login = LoginSettings()
        # tokens accepted, until they expire: an HTTP client sends its token with every request
        self._accepted: OrderedDict[str, User] = OrderedDict()

    def set_keys(self, keys: Mapping[str, jwt.PyJWK]) -> None:
        if set(keys) != set(self.keys):
            self._accepted.clear()  # a key withdrawn: what it signed is checked afresh
        self.keys = dict(keys)

    def pending(self, secret: str) -> Fetch | None:
        """What to await before checking ``secret``: a key refresh when it is a token whose
        ``kid`` we do not hold; None otherwise."""
        kid = token_kid(secret)
        if kid is None or kid in self.keys or self.refresh is None:
            return None
        return self.refresh(kid)

    def user(self, secret: str) -> User:
        """The user ``secret`` (a token) stands for; TokenError when it is refused."""
        user = self._accepted.get(secret)
        if user is not None and not user.expired():
            self._accepted.move_to_end(secret)
            return user
        try:
            user = self._user(secret)
        except TokenError:
            self._accepted.pop(secret, None)
            raise
        self._accepted[secret] = user
        if len(self._accepted) > ACCEPTED_CACHE:
            self._accepted.popitem(last=False)
        return user

    def _user(self, secret: str) -> User:
        claims = self.claims(secret)
        s = self.settings
        name = next((claims[c] for c in s.username_claims if isinstance(claims.get(c), str) and claims[c]),
                    None)
        if name is None:
            raise TokenError(f"no username claim ({', '.join(s.username_claims)})")
        scopes = scope_list(claims.get("scope"))
        if s.additional_scopes_key:
            scopes += scope_list(claims.get(s.additional_scopes_key))
        try:
            grants = parse_scopes(scopes, s.prefix)
        except ValueError as exc:
            raise TokenError(str(exc)) from None
        return User(name=name, password_hash="", tags=grants.tags, grants=grants,
                    expires_at=float(claims["exp"]) + s.leeway)

    def claims(self, secret: str) -> dict[str, Any]:
        """The verified claims of a token (steps 1 to 3 above); TokenError otherwise."""
        header = token_header(secret)
        if header is None:
            raise TokenError(f"not a JWT (or longer than {MAX_TOKEN} bytes)")
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in ALGORITHMS:
            raise TokenError(f"algorithm {alg!r} not accepted (RS256, ES256)")
        if not isinstance(kid, str) or not kid:
            raise TokenError("the token names no key (kid)")
        key = self.keys.get(kid)
        if key is None:
            raise UnknownKey(f"no key {kid!r} in the issuer's JWKS")
        if key.algorithm_name != alg:
            raise TokenError(f"key {kid!r} is not an {alg} key")
        s = self.settings
        import jwt
        try:
            return jwt.decode(
                secret, key.key, algorithms=[alg], audience=list(s.audiences) if s.verify_aud else None,
                issuer=s.issuer, leeway=s.leeway,
                options={"require": ["exp", "iss"], "verify_aud": s.verify_aud})
        except (jwt.PyJWTError, ValueError, TypeError, RecursionError) as exc:
            raise TokenError(f"{type(exc).__name__}: {exc}") from None

