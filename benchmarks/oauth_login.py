#!/usr/bin/env python3
"""What a login costs: an OAuth 2 access token against a stored password, in one process.

Measures CPU time (``time.process_time``, steadier than wall time on a shared machine) per
check of ``UserStore.authenticate``: an internal user's password (the stored hash), an RS256
and an ES256 token seen for the first time (signature, claims, scopes into RE2), and a token
seen before (``TokenAuth`` remembers accepted tokens until they expire: an HTTP client sends
its token with every request). Keys are made here with joserfc; no sockets.

    python benchmarks/oauth_login.py [--n 300]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from joserfc import jwt  # noqa: E402
from joserfc.jwk import ECKey, KeySet, RSAKey  # noqa: E402

from broker.auth.oauth import OAuthSettings, TokenAuth, read_jwks  # noqa: E402
from broker.auth.users import UserStore  # noqa: E402
from broker.store.sink import NullSink  # noqa: E402

SCOPES = " ".join(["skred.tag:administrator"] + [f"skred.{a}:%2F/app-{i}-*" for i in range(10)
                                                 for a in ("configure", "write", "read")])


def per_call_us(fn: Callable[[], object], n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="checks per row")
    n = parser.parse_args().n
    rsa = RSAKey.generate_key(2048, parameters={"kid": "r"})
    ec = ECKey.generate_key("P-256", parameters={"kid": "e"})
    auth = TokenAuth(OAuthSettings(issuer="http://idp", resource_server_id="skred"))
    auth.set_keys(read_jwks(KeySet([rsa, ec]).as_dict(private=False)))
    with tempfile.TemporaryDirectory() as tmp:
        users = UserStore(Path(tmp) / "users.json", NullSink(), default_user="u", default_password="p")
        users.tokens, users.backends = auth, ("internal", "oauth")
        body = {"iss": "http://idp", "aud": "skred", "exp": int(time.time()) + 3600, "scope": SCOPES}
        counter = iter(range(10**9))

        def fresh(key: RSAKey | ECKey, alg: str) -> Callable[[], object]:
            tokens = [jwt.encode({"alg": alg, "kid": key.kid}, {**body, "sub": f"s{i}"}, key)
                      for i in range(n)]
            return lambda: users.login("x", tokens[next(counter) % n], "127.0.0.1")

        seen = jwt.encode({"alg": "RS256", "kid": "r"}, {**body, "sub": "again"}, rsa)
        rows = [("internal password (stored hash)", lambda: users.login("u", "p", "127.0.0.1")),
                ("RS256 token, first time", fresh(rsa, "RS256")),
                ("ES256 token, first time", fresh(ec, "ES256")),
                ("token seen before (cached)", lambda: users.login("x", seen, "127.0.0.1"))]
        base = None
        print("| check | CPU us per check | vs password |\n| --- | --- | --- |")
        for label, fn in rows:
            fn()  # warm
            us = per_call_us(fn, n)
            base = base or us
            print(f"| {label} | {us:,.0f} | {us / base:.2f}x |")


if __name__ == "__main__":
    main()
