"""RabbitMQ's OAuth 2 scope format read into grants, and the user store's backend chain, with no
sockets: keys made here, tokens signed with authlib's JOSE (joserfc), checked by ``TokenAuth``."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import jwt as pyjwt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from broker.auth.oauth import OAuthSettings, TokenAuth, read_jwks, token_kid
from broker.auth.oauth_keys import backends
from broker.auth.oauth_scopes import MAX_SCOPES, parse_scopes, scope_list, wildcard
from broker.auth.users import UserStore
from broker.config import ConfigError
from broker.store.sink import NullSink


def test_wildcards_match_whole_names_literally() -> None:
    p = wildcard("q-*.x")
    assert p.fullmatch("q-1.x") and p.fullmatch("q-.x")
    assert not p.fullmatch("q-1.xy") and not p.fullmatch("aq-1.x") and not p.fullmatch("q-1ax")
    assert wildcard("(a+)+$").fullmatch("(a+)+$")  # regex syntax is literal


def test_scopes_grant_what_rabbitmq_reads() -> None:
    g = parse_scopes(scope_list("skred.configure:%2F/q-* skred.write:*/amq.topic/sensors.* "
                                "skred.read:prod/* skred.tag:administrator other.read:*/* "
                                "skred.bogus:*/* skred.read:no-slash skred.configure:a/b/c"), "skred.")
    assert g.tags == ("administrator",)
    assert g.allows("configure", "/", "q-1") and not g.allows("configure", "/", "r-1")
    assert not g.allows("configure", "prod", "q-1")
    assert g.allows("read", "prod", "anything") and not g.allows("read", "/", "anything")
    assert g.vhost_access("/") and g.vhost_access("prod") and g.vhost_access("other-vhost")  # write:*/...
    assert g.has_topic_patterns("/", "amq.topic")
    assert g.topic_allows("write", "/", "amq.topic", "sensors.t1")
    assert not g.topic_allows("write", "/", "amq.topic", "actuators.t1")
    assert len(g.grants) == 3  # the foreign, unknown and malformed scopes grant nothing


def test_scope_list_and_bounds() -> None:
    assert scope_list(["a b", "c", 3]) == ["a", "b", "c"] and scope_list(None) == []
    with pytest.raises(ValueError):
        parse_scopes([f"skred.read:v/{i}" for i in range(MAX_SCOPES + 1)], "skred.")


def test_backends_chain() -> None:
    assert backends("local, oauth") == ("internal", "oauth")
    with pytest.raises(ConfigError):
        backends("internal,ldap")


def _auth() -> tuple[TokenAuth, RSAKey]:
    key = RSAKey.generate_key(2048, parameters={"kid": "k1"})
    auth = TokenAuth(OAuthSettings(issuer="http://idp", resource_server_id="skred", leeway=0))
    auth.set_keys(read_jwks(KeySet([key]).as_dict(private=False)))
    return auth, key


def _token(key: RSAKey, **claims: object) -> str:
    now = int(time.time())
    body = {"iss": "http://idp", "aud": "skred", "exp": now + 60, "sub": "s1", "scope": "skred.read:*/*",
            **claims}
    return jwt.encode({"alg": "RS256", "kid": "k1"}, body, key)


def test_token_user_and_the_store_chain(tmp_path: Path) -> None:
    auth, key = _auth()
    token = _token(key, preferred_username="alice")
    store = UserStore(tmp_path / "users.json", NullSink())
    assert store.authenticate("x", token) is None  # oauth is not in the chain yet
    store.tokens = auth
    assert store.authenticate("x", token) is None
    store.backends = ("internal", "oauth")
    user = store.authenticate("x", token)
    assert user is not None and user.name == "alice" and store.get("alice") is None
    assert store.can_read(user, "/", "q") and not store.can_write(user, "/", "q")
    assert store.authenticate("guest", "guest") is not None  # internal first, still
    # sub when there is no preferred_username; an expired user loses every permission
    user = store.authenticate("x", _token(key, exp=int(time.time()) + 30))
    assert user is not None and user.name == "s1"
    object.__setattr__(user, "expires_at", time.time() - 1)
    assert not store.can_read(user, "/", "q") and not store.has_vhost_access(user, "/")


def test_token_refusals_name_their_reason() -> None:
    auth, key = _auth()
    with pytest.raises(ValueError, match="ExpiredSignature"):
        auth.user(_token(key, exp=int(time.time()) - 5))
    with pytest.raises(ValueError, match="Audience"):
        auth.user(_token(key, aud="other"))
    with pytest.raises(ValueError, match="no key"):
        auth.user(jwt.encode({"alg": "RS256", "kid": "k2"}, {"sub": "x"}, key))
    with pytest.raises(ValueError, match="algorithm"):
        auth.user(pyjwt.encode({"sub": "x"}, "secret-secret-secret-secret-32b!", "HS256", {"kid": "k1"}))


def test_malformed_tokens_are_refusals_never_crashes() -> None:
    """Whatever a client sends as a token, the answer is a refusal (ValueError), never another
    exception: a header nested past the JSON decoder's recursion limit included."""
    auth, key = _auth()
    deep = base64.urlsafe_b64encode(('{"a":' + "[" * 2500 + "]" * 2500 + "}").encode()).decode()
    good = _token(key)
    samples = [deep.rstrip("=") + ".e30.c2ln", "eyJ.x.y", "eyJhbGciOiJSUzI1NiJ9..",
               "eyJ" + "A" * 9000 + ".a.b", good[:-10] + "AAAAAAAAAA", good.replace(".", "..", 1),
               "eyJ!!!.a.b", "eyJhIjoxfQ.%%%.ab"]
    for sample in samples:
        assert token_kid(sample) is None or isinstance(token_kid(sample), str)
        with pytest.raises(ValueError):
            auth.user(sample)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=300), st.binary(max_size=300))
def test_fuzzed_tokens_are_refusals(head: str, tail: bytes) -> None:
    auth, _key = _FUZZ
    token = "eyJ" + head + "." + base64.urlsafe_b64encode(tail).decode() + ".c2ln"
    try:
        auth.user(token)
    except ValueError:
        pass
    else:
        raise AssertionError("a fuzzed token was accepted")


_FUZZ = _auth()
