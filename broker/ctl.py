"""``skredctl``: a command-line client of the management HTTP API.

Every command is one or two HTTP requests (stdlib ``urllib``, no event loop).
Output is a plain table by default and the API's JSON with ``--json``.
Connection and auth failures end with one line on stderr and exit status 2
(cannot reach the broker) or 1 (the broker refused: 401/403/4xx), never a
traceback. Credentials come from ``--user/--password`` or the environment
(``SKREDCTL_USER``, ``SKREDCTL_PASSWORD``, ``SKREDCTL_URL``), else the node's own settings
where skredctl runs next to the node, as in its container (``SKRED_MAIN_DEFAULT_USER``,
``SKRED_MAIN_DEFAULT_PASSWORD``, ``SKRED_MGMT_PORT`` on 127.0.0.1), else guest on 15672.

``skredctl aliveness`` is the container health command (the image's HEALTHCHECK, the compose
file's healthcheck, the Helm chart's readiness probe): one word-safe argv that needs no shell
and no quoting, so an engine that splits a healthcheck command into words (docker-compose 1.29
on podman's API does) still runs it unchanged. It exits 0 when the aliveness test passes and
1 when it fails or the broker cannot be reached (a healthcheck's exit status 2 is reserved).

HTTPS: an ``https://`` URL verifies the broker's certificate and host name
against ``--cacert`` (else the system's CAs); ``--cert``/``--key`` present a
client certificate (for ``tls_verify_peer`` brokers). The names of
rabbitmqadmin (``--ssl-ca-cert-file``, ``--ssl-cert-file``, ``--ssl-key-file``)
and of its successor (``--tls-...``) are accepted too. Verification is only
turned off by an explicit ``--insecure``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from broker.config import OneLineErrorParser

DEFAULT_URL = "http://127.0.0.1:15672"
UNHEALTHY = 1  # the one failure status of a container healthcheck (Docker reserves 2)
TIMEOUT = 10.0

LIST_COLUMNS: dict[str, tuple[str, list[str]]] = {
    "queues": ("/api/queues", ["vhost", "name", "durable", "messages_ready", "messages_unacknowledged",
                               "consumers"]),
    "exchanges": ("/api/exchanges", ["vhost", "name", "type", "durable", "auto_delete", "internal"]),
    "bindings": ("/api/bindings", ["vhost", "source", "destination", "destination_type", "routing_key"]),
    "connections": ("/api/connections", ["name", "user", "vhost", "channels"]),
    "channels": ("/api/channels", ["name", "user", "vhost", "consumer_count", "messages_unacknowledged"]),
    "consumers": ("/api/consumers", ["queue.vhost", "queue.name", "consumer_tag", "ack_required"]),
    "users": ("/api/users", ["name", "tags"]),
    "vhosts": ("/api/vhosts", ["name", "messages"]),
    "permissions": ("/api/permissions", ["user", "vhost", "configure", "write", "read"]),
    "policies": ("/api/policies", ["vhost", "name", "pattern", "apply-to", "priority"]),
}
PER_VHOST = {"queues", "exchanges", "bindings", "connections", "channels", "consumers", "policies"}


class CtlError(Exception):
    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def q(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def tls_context(url: str, cacert: str | None, cert: str | None, key: str | None,
                insecure: bool) -> ssl.SSLContext | None:
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
    def __init__(self, url: str, user: str, password: str, tls: ssl.SSLContext | None = None) -> None:
        self.url = url.rstrip("/")
        self.user = user
        self.tls = tls
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        self.auth = f"Basic {token}"

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", self.auth)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT, context=self.tls) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                reason = json.loads(detail).get("reason", detail)
            except ValueError:
                reason = detail or exc.reason
            if exc.code == 401:
                raise CtlError(f"authentication failed for user '{self.user}' ({reason})") from None
            if exc.code == 403:
                raise CtlError(f"permission denied: {reason}") from None
            if exc.code == 404:
                raise CtlError(f"not found: {method} {path}") from None
            raise CtlError(f"{method} {path} failed with HTTP {exc.code}: {reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            why = getattr(exc, "reason", exc)
            raise CtlError(f"cannot connect to {self.url}: {why}", status=2) from None
        return json.loads(raw) if raw.strip() else None


def _cell(item: Any, col: str) -> str:
    for part in col.split("."):
        item = item.get(part) if isinstance(item, dict) else None
    if isinstance(item, list):
        return ",".join(str(x) for x in item)
    if isinstance(item, bool):
        return "true" if item else "false"
    return "" if item is None else str(item)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[_cell(r, c) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def env_defaults() -> tuple[str, str, str]:
    """(url, user, password) defaults: SKREDCTL_*, else the local node's settings, else guest."""
    env = os.environ
    port = env.get("SKRED_MGMT_PORT")
    url = env.get("SKREDCTL_URL") or (f"http://127.0.0.1:{port}" if port else DEFAULT_URL)
    user = env.get("SKREDCTL_USER") or env.get("SKRED_MAIN_DEFAULT_USER") or "guest"
    password = env.get("SKREDCTL_PASSWORD") or env.get("SKRED_MAIN_DEFAULT_PASSWORD") or "guest"
    return url, user, password


# lavinmqctl's queue actions: the command ``<action>_queue`` PUTs ``/api/queues/{vhost}/{name}/<action>``
QUEUE_ACTIONS = {"pause": "paused", "resume": "resumed", "restart": "restarted"}


def build_parser() -> argparse.ArgumentParser:
    url, user, password = env_defaults()
    p = OneLineErrorParser(prog="skredctl", description="Manage a Skred broker over its HTTP API.")
    p.add_argument("--url", default=url,
                   help=f"management API base URL (default {DEFAULT_URL}; env SKREDCTL_URL, else "
                        "SKRED_MGMT_PORT on 127.0.0.1)")
    p.add_argument("-u", "--user", default=user,
                   help="user (env SKREDCTL_USER, else SKRED_MAIN_DEFAULT_USER, else guest)")
    p.add_argument("-p", "--password", default=password,
                   help="password (env SKREDCTL_PASSWORD, else SKRED_MAIN_DEFAULT_PASSWORD, else guest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    tls = p.add_argument_group("TLS (with an https:// URL)")
    tls.add_argument("--cacert", "--ssl-ca-cert-file", "--tls-ca-cert-file", metavar="FILE",
                     help="PEM CA bundle that verifies the broker's certificate (default: the system's; "
                          "env SKREDCTL_CACERT)")
    tls.add_argument("--cert", "--ssl-cert-file", "--tls-cert-file", metavar="FILE",
                     help="PEM client certificate (chain) to present (env SKREDCTL_CERT)")
    tls.add_argument("--key", "--ssl-key-file", "--tls-key-file", metavar="FILE",
                     help="PEM private key of --cert (default: in the --cert file; env SKREDCTL_KEY)")
    tls.add_argument("-k", "--insecure", action="store_true",
                     help="do not verify the broker's certificate or host name (testing only)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="node overview")
    al = sub.add_parser("aliveness", help="the aliveness test (declare, publish, get) in a vhost; "
                                          "exit 0 when it passes, 1 otherwise: a container health command")
    al.add_argument("--vhost", default="/")
    ls = sub.add_parser("list", help="list objects")
    ls.add_argument("what", choices=sorted(LIST_COLUMNS))
    ls.add_argument("--vhost", help="only this vhost")
    au = sub.add_parser("add_user", help="create or update a user")
    au.add_argument("name")
    au.add_argument("new_password", metavar="password")
    au.add_argument("--tags", default="", help="comma-separated tags, e.g. administrator")
    du = sub.add_parser("delete_user")
    du.add_argument("name")
    sp = sub.add_parser("set_permissions")
    sp.add_argument("target_user", metavar="user")
    sp.add_argument("configure")
    sp.add_argument("write")
    sp.add_argument("read")
    sp.add_argument("--vhost", default="/")
    av = sub.add_parser("add_vhost")
    av.add_argument("name")
    dv = sub.add_parser("delete_vhost")
    dv.add_argument("name")
    dq = sub.add_parser("declare_queue")
    dq.add_argument("name")
    dq.add_argument("--vhost", default="/")
    dq.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True)
    dq.add_argument("--auto-delete", action="store_true")
    xq = sub.add_parser("delete_queue")
    xq.add_argument("name")
    xq.add_argument("--vhost", default="/")
    pq = sub.add_parser("purge_queue")
    pq.add_argument("name")
    pq.add_argument("--vhost", default="/")
    for action in QUEUE_ACTIONS:
        qa = sub.add_parser(f"{action}_queue", help=f"{action} a queue (LavinMQ's {action}_queue)")
        qa.add_argument("name")
        qa.add_argument("--vhost", "-p", default="/")
    for flag in ("on", "off"):
        tr = sub.add_parser(f"trace_{flag}", help=f"firehose tracing {flag} for a vhost "
                            "(publish.<exchange> and deliver.<queue> copies to amq.rabbitmq.trace)")
        tr.add_argument("--vhost", "-p", default="/")
    ex = sub.add_parser("export_definitions", help="write definitions JSON to FILE (or stdout)")
    ex.add_argument("file", nargs="?", default="-")
    ex.add_argument("--vhost")
    im = sub.add_parser("import_definitions", help="import definitions JSON from FILE ('-': stdin)")
    im.add_argument("file")
    im.add_argument("--vhost")
    return p


def _tls_files(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """--cacert, --cert, --key; for an https:// URL, SKREDCTL_CACERT/_CERT/_KEY fill in the ones not
    given (a shell set up for an HTTPS broker still runs commands against a plain one)."""
    if urllib.parse.urlsplit(args.url).scheme != "https":
        return args.cacert, args.cert, args.key
    env = os.environ
    return (args.cacert or env.get("SKREDCTL_CACERT"), args.cert or env.get("SKREDCTL_CERT"),
            args.key or env.get("SKREDCTL_KEY"))


def run(args: argparse.Namespace, out: Any) -> None:
    c = Client(args.url, args.user, args.password, tls_context(args.url, *_tls_files(args), args.insecure))
    cmd = args.command
    done: str | None = None
    if cmd == "status":
        ov = c.request("GET", "/api/overview")
        if args.json:
            print(json.dumps(ov, indent=2), file=out)
            return
        totals = ov.get("object_totals", {})
        qt = ov.get("queue_totals", {})
        product = f"{ov.get('product_name')} {ov.get('product_version')}"
        print(f"node: {ov.get('node')}  product: {product}", file=out)
        for key in ("connections", "channels", "queues", "consumers", "exchanges"):
            print(f"{key}: {totals.get(key, 0)}", file=out)
        print(f"messages: {qt.get('messages', 0)} (ready {qt.get('messages_ready', 0)}, "
              f"unacked {qt.get('messages_unacknowledged', 0)})", file=out)
        for lst in ov.get("listeners", []):
            print(f"listener: {lst.get('protocol')} {lst.get('ip_address')}:{lst.get('port')}", file=out)
        return
    if cmd == "aliveness":
        try:
            result = c.request("GET", f"/api/aliveness-test/{q(args.vhost)}")
        except CtlError as exc:
            raise CtlError(str(exc), status=UNHEALTHY) from None
        if not isinstance(result, dict) or result.get("status") != "ok":
            raise CtlError(f"aliveness test of vhost '{args.vhost}' failed: {result!r}", status=UNHEALTHY)
        print(json.dumps(result) if args.json else "ok", file=out)
        return
    if cmd == "list":
        path, columns = LIST_COLUMNS[args.what]
        if args.vhost:
            if args.what not in PER_VHOST:
                raise CtlError(f"--vhost does not apply to {args.what}")
            path = f"{path}/{q(args.vhost)}" if args.what != "connections" and args.what != "channels" \
                else f"/api/vhosts/{q(args.vhost)}/{args.what}"
        rows = c.request("GET", path)
        print(json.dumps(rows, indent=2) if args.json else table(rows, columns), file=out)
        return
    if cmd == "add_user":
        tags = [t for t in args.tags.split(",") if t]
        c.request("PUT", f"/api/users/{q(args.name)}", {"password": args.new_password, "tags": tags})
        done = f"user '{args.name}' saved"
    elif cmd == "delete_user":
        c.request("DELETE", f"/api/users/{q(args.name)}")
        done = f"user '{args.name}' deleted"
    elif cmd == "set_permissions":
        c.request("PUT", f"/api/permissions/{q(args.vhost)}/{q(args.target_user)}",
                  {"configure": args.configure, "write": args.write, "read": args.read})
        done = f"permissions of '{args.target_user}' on vhost '{args.vhost}' set"
    elif cmd == "add_vhost":
        c.request("PUT", f"/api/vhosts/{q(args.name)}")
        done = f"vhost '{args.name}' created"
    elif cmd == "delete_vhost":
        c.request("DELETE", f"/api/vhosts/{q(args.name)}")
        done = f"vhost '{args.name}' deleted"
    elif cmd == "declare_queue":
        c.request("PUT", f"/api/queues/{q(args.vhost)}/{q(args.name)}",
                  {"durable": args.durable, "auto_delete": args.auto_delete})
        done = f"queue '{args.name}' declared"
    elif cmd == "delete_queue":
        c.request("DELETE", f"/api/queues/{q(args.vhost)}/{q(args.name)}")
        done = f"queue '{args.name}' deleted"
    elif cmd == "purge_queue":
        c.request("DELETE", f"/api/queues/{q(args.vhost)}/{q(args.name)}/contents")
        done = f"queue '{args.name}' purged"
    elif cmd.endswith("_queue") and cmd[:-6] in QUEUE_ACTIONS:
        action = cmd[:-6]
        c.request("PUT", f"/api/queues/{q(args.vhost)}/{q(args.name)}/{action}")
        done = f"queue '{args.name}' {QUEUE_ACTIONS[action]}"
    elif cmd in ("trace_on", "trace_off"):
        c.request("PUT", f"/api/vhosts/{q(args.vhost)}", {"tracing": cmd == "trace_on"})
        done = f"tracing {cmd[6:]} for vhost '{args.vhost}'"
    elif cmd == "export_definitions":
        path = "/api/definitions" + (f"/{q(args.vhost)}" if args.vhost else "")
        text = json.dumps(c.request("GET", path), indent=2) + "\n"
        if args.file == "-":
            out.write(text)
            return
        with open(args.file, "w", encoding="utf-8") as fh:
            fh.write(text)
        done = f"definitions written to {args.file}"
    elif cmd == "import_definitions":
        try:
            if args.file == "-":
                raw = sys.stdin.read()
            else:
                with open(args.file, encoding="utf-8") as fh:
                    raw = fh.read()
            doc = json.loads(raw)
        except (OSError, ValueError) as exc:
            raise CtlError(f"cannot read definitions from {args.file}: {exc}") from None
        path = "/api/definitions" + (f"/{q(args.vhost)}" if args.vhost else "")
        c.request("POST", path, doc)
        done = f"definitions imported from {args.file}"
    if done is not None:
        print(json.dumps({"ok": True, "message": done}) if args.json else done, file=out)


BROKEN_PIPE_STATUS = 128 + 13  # what a shell reports for a process killed by SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args, sys.stdout)
        sys.stdout.flush()
    except CtlError as exc:
        print(f"skredctl: error: {exc}", file=sys.stderr)
        return exc.status
    except BrokenPipeError:
        # The reader went away (`skredctl list queues | head`): stop quietly, as `cat` would.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_STATUS
    return 0


if __name__ == "__main__":
    sys.exit(main())
