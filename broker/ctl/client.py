"""The management API client of ``skredctl``: one blocking HTTP request per call (stdlib
``urllib``, no event loop), errors as ``CtlError`` carrying the exit status a script sees."""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

TIMEOUT = 10.0

# Exit statuses (docs/ctl.md): 0 done; 1 the broker refused (4xx/5xx) or the input is unusable;
# 2 the broker cannot be reached, or the command line is wrong (argparse's own 2);
# 3 the broker does not offer the operation (its API answers 404/405 on the operation's path).
REFUSED, UNREACHABLE, UNSUPPORTED = 1, 2, 3


class CtlError(Exception):
    def __init__(self, message: str, status: int = REFUSED, http_status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.http_status = http_status


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def tls_context(
    url: str, cacert: str | None, cert: str | None, key: str | None, insecure: bool
) -> ssl.SSLContext | None:
    """The client TLS context for ``url`` (None for http://); CtlError for unusable files."""
    if urllib.parse.urlsplit(url).scheme != "https":
        if cacert or cert or key or insecure:
            raise CtlError("--cacert, --cert, --key and --insecure need an https:// --url", status=2)
        return None
    if key and not cert:
        raise CtlError("--key needs --cert", status=2)
    try:
        ctx = ssl.create_default_context(cafile=cacert or None)
        if cert:
            ctx.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as exc:
        raise CtlError(f"cannot load TLS files: {exc}", status=2) from None
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class Client:
    def __init__(
        self, url: str, user: str, password: str, tls: ssl.SSLContext | None = None, timeout: float = TIMEOUT
    ) -> None:
        self.url = url.rstrip("/")
        self.user = user
        self.tls = tls
        self.timeout = timeout
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.auth = f"Basic {token}"

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", self.auth)
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.tls) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                reason = json.loads(detail).get("reason", detail)
            except (ValueError, AttributeError):
                reason = detail or exc.reason
            code = exc.code
            if code == 401:
                raise CtlError(
                    f"authentication failed for user '{self.user}' ({reason})", http_status=code
                ) from None
            if code == 403:
                raise CtlError(f"permission denied: {reason}", http_status=code) from None
            if code == 404:
                raise CtlError(f"not found: {method} {path}", http_status=code) from None
            raise CtlError(f"{method} {path} failed with HTTP {code}: {reason}", http_status=code) from None
        except (urllib.error.URLError, OSError) as exc:
            why = getattr(exc, "reason", exc)
            raise CtlError(f"cannot connect to {self.url}: {why}", status=UNREACHABLE) from None
        return json.loads(raw) if raw.strip() else None

    def feature(self, what: str, method: str, path: str, body: Any = None) -> Any:
        """``request`` for an operation this broker may not offer yet: 404/405 on its path (or
        a parameters component it does not know) end with exit status 3 (UNSUPPORTED) and say
        so, which a script can tell apart from a refusal (1)."""
        try:
            return self.request(method, path, body)
        except CtlError as exc:
            no_component = exc.http_status == 400 and "component '" in str(exc) and "not found" in str(exc)
            if exc.http_status in (404, 405) or no_component:
                raise CtlError(
                    f"this broker does not offer {what} ({method} {path} answered HTTP {exc.http_status})",
                    status=UNSUPPORTED,
                    http_status=exc.http_status,
                ) from None
            raise
