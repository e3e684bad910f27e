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
    "shovels": ("/api/shovels", ["vhost", "name", "state", "src_uri", "dest_uri", "messages_transferred",
                                 "reason"]),
}
PER_VHOST = {"queues", "exchanges", "bindings", "connections", "channels", "consumers", "policies", "shovels"}
# add_shovel's options -> the shovel parameter's keys (RabbitMQ's names, docs/shovels.md)
SHOVEL_OPTIONS = ("src_uri", "src_queue", "src_exchange", "src_exchange_key", "src_prefetch_count",
                  "src_delete_after", "dest_uri", "dest_queue", "dest_exchange", "dest_exchange_key",
                  "ack_mode", "reconnect_delay")


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
    for cmd, text in (("add_super_stream", "create a super stream: an exchange and its partition streams"),
                      ("grow_super_stream", "add partitions to a super stream (the total count, or new "
                                            "binding keys)")):
        ss = sub.add_parser(cmd, help=text)
        ss.add_argument("name")
        ss.add_argument("--vhost", default="/")
        how = ss.add_mutually_exclusive_group(required=True)
        how.add_argument("--partitions", type=int, help="partitions NAME-0 .. NAME-(N-1), keys 0 .. N-1")
        how.add_argument("--binding-keys", help="comma-separated keys: partitions NAME-KEY")
        ss.add_argument("--max-age", help="partition retention, e.g. 7D")
        ss.add_argument("--max-length-bytes", type=int, help="partition retention in bytes")
        if cmd == "add_super_stream":
            ss.add_argument("--routing", choices=("key", "hash"), default="key",
                            help="how AMQP publishes pick a partition: by binding key (default) or by "
                                 "MurmurHash3 of the routing key, as the stream clients' hash routing")
    ds = sub.add_parser("delete_super_stream", help="delete a super stream and every partition")
    ds.add_argument("name")
    ds.add_argument("--vhost", default="/")
    ex = sub.add_parser("export_definitions", help="write definitions JSON to FILE (or stdout)")
    ex.add_argument("file", nargs="?", default="-")
    ex.add_argument("--vhost")
    im = sub.add_parser("import_definitions", help="import definitions JSON from FILE ('-': stdin)")
    im.add_argument("file")
    im.add_argument("--vhost")
    sh = sub.add_parser("add_shovel", help="create or replace a dynamic shovel (docs/shovels.md)")
    sh.add_argument("name")
    sh.add_argument("--vhost", default="/")
    for option in SHOVEL_OPTIONS:
        kind = int if option == "src_prefetch_count" else float if option == "reconnect_delay" else str
        sh.add_argument("--" + option.replace("_", "-"), type=kind)
    sh.add_argument("--value", help="the whole parameter value as JSON (the options above override it)")
    for verb in ("delete", "restart", "pause", "resume"):
        one = sub.add_parser(f"{verb}_shovel")
        one.add_argument("name")
        one.add_argument("--vhost", default="/")
    return p


def shovel_value(args: argparse.Namespace) -> dict[str, Any]:
    """``add_shovel``'s parameter value: ``--value`` then each option given (a number-like
    ``--src-delete-after`` is a count)."""
    try:
        value = json.loads(args.value) if args.value else {}
    except ValueError as exc:
        raise CtlError(f"--value is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CtlError("--value must be a JSON object")
    for option in SHOVEL_OPTIONS:
        given = getattr(args, option)
        if given is not None:
            key = option.replace("_", "-")
            value[key] = int(given) if key == "src-delete-after" and str(given).isdigit() else given
    return value


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
    elif cmd in ("add_super_stream", "grow_super_stream"):
        path = f"/api/super-streams/{q(args.vhost)}/{q(args.name)}"
        exists = cmd == "grow_super_stream"
        if exists:
            c.request("GET", path)  # 404 when there is none to grow
        elif _exists(c, path):
            raise CtlError(f"super stream '{args.name}' already exists in vhost '{args.vhost}'")
        body: dict[str, Any] = {"partitions": args.partitions} if args.partitions else \
            {"binding_keys": [k for k in args.binding_keys.split(",") if k]}
        arguments = {"x-max-age": args.max_age, "x-max-length-bytes": args.max_length_bytes}
        body["arguments"] = {k: v for k, v in arguments.items() if v is not None}
        if not exists:
            body["routing"] = args.routing
        c.request("PUT", path, body)
        parts = c.request("GET", path)["partitions"]
        done = f"super stream '{args.name}' has partitions {', '.join(parts)}"
    elif cmd == "delete_super_stream":
        c.request("DELETE", f"/api/super-streams/{q(args.vhost)}/{q(args.name)}")
        done = f"super stream '{args.name}' deleted"
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
    elif cmd == "add_shovel":
        value = shovel_value(args)
        c.request("PUT", f"/api/parameters/shovel/{q(args.vhost)}/{q(args.name)}", {"value": value})
        done = f"shovel '{args.name}' saved"
    elif cmd == "delete_shovel":
        c.request("DELETE", f"/api/parameters/shovel/{q(args.vhost)}/{q(args.name)}")
        done = f"shovel '{args.name}' deleted"
    elif cmd == "restart_shovel":
        c.request("DELETE", f"/api/shovels/vhost/{q(args.vhost)}/{q(args.name)}/restart")
        done = f"shovel '{args.name}' restarted"
    elif cmd in ("pause_shovel", "resume_shovel"):
        verb = cmd.split("_")[0]
        c.request("PUT", f"/api/shovels/{q(args.vhost)}/{q(args.name)}/{verb}")
        done = f"shovel '{args.name}' {verb}d"
    if done is not None:
        print(json.dumps({"ok": True, "message": done}) if args.json else done, file=out)


def _exists(c: Client, path: str) -> bool:
    try:
        c.request("GET", path)
    except CtlError:
        return False
    return True


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
