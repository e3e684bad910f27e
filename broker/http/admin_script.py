#!/usr/bin/env python3
"""rabbitmqadmin-compatible command line for Skred's management API (served at /cli/rabbitmqadmin).

Skred's own script, written for the commands scripts and Dockerfiles fetch ``/cli/rabbitmqadmin``
for: ``list``, ``show overview``, ``declare``, ``delete``, ``purge``, ``close``, ``publish``,
``get``, ``export`` and ``import``, with rabbitmqadmin's options (``-H -P -u -p -V -s -k -f -q
-U``, ``--ssl-ca-cert-file``, ``--ssl-cert-file``, ``--ssl-key-file``) and ``key=value``
arguments. Python 3.8+, standard library only. RabbitMQ's own rabbitmqadmin works against Skred
too.
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, NoReturn

VHOST_KINDS = ("exchanges", "queues", "bindings", "policies", "operator_policies", "connections",
               "channels", "consumers", "vhost_limits")
DECLARE = {  # kind -> (path template, keys in the path, mandatory keys in the body)
    "exchange": ("exchanges/{vhost}/{name}", ("name",), ("type",)),
    "queue": ("queues/{vhost}/{name}", ("name",), ()),
    "binding": ("bindings/{vhost}/e/{source}/{dt}/{destination}", ("source", "destination"), ()),
    "vhost": ("vhosts/{name}", ("name",), ()),
    "user": ("users/{name}", ("name",), ()),
    "permission": ("permissions/{vhost}/{user}", ("user",), ("configure", "write", "read")),
    "topic_permission": ("topic-permissions/{vhost}/{user}", ("user",), ("exchange", "write", "read")),
    "policy": ("policies/{vhost}/{name}", ("name",), ("pattern", "definition")),
    "operator_policy": ("operator-policies/{vhost}/{name}", ("name",), ("pattern", "definition")),
    "vhost_limit": ("vhost-limits/{vhost}/{name}", ("name",), ("value",)),
    "user_limit": ("user-limits/{user}/{name}", ("user", "name"), ("value",)),
    "global_parameter": ("global-parameters/{name}", ("name",), ("value",)),
}
DELETE = {
    "exchange": "exchanges/{vhost}/{name}", "queue": "queues/{vhost}/{name}",
    "binding": "bindings/{vhost}/e/{source}/{dt}/{destination}/{properties_key}",
    "vhost": "vhosts/{name}", "user": "users/{name}", "permission": "permissions/{vhost}/{user}",
    "topic_permission": "topic-permissions/{vhost}/{user}", "policy": "policies/{vhost}/{name}",
    "operator_policy": "operator-policies/{vhost}/{name}", "vhost_limit": "vhost-limits/{vhost}/{name}",
    "user_limit": "user-limits/{user}/{name}", "parameter": "parameters/{component}/{vhost}/{name}",
    "global_parameter": "global-parameters/{name}", "connection": "connections/{name}",
}
JSON_KEYS = ("arguments", "definition", "properties", "value")  # given as JSON text
INT_KEYS = ("priority", "count", "truncate")


def die(msg: str) -> NoReturn:
    sys.stderr.write(f"*** {msg}\n")
    sys.exit(2)


class Api:
    def __init__(self, o: argparse.Namespace) -> None:
        scheme = "https" if o.ssl else "http"
        self.base = (o.base_uri or f"{scheme}://{o.host}:{o.port}").rstrip("/") + "/api/"
        self.auth = "Basic " + base64.b64encode(f"{o.username}:{o.password}".encode()).decode()
        self.ctx = ssl.create_default_context(cafile=o.ssl_ca_cert_file)
        if o.ssl_cert_file:
            self.ctx.load_cert_chain(o.ssl_cert_file, o.ssl_key_file)
        if o.ssl_insecure:
            self.ctx.check_hostname = False
            self.ctx.verify_mode = ssl.CERT_NONE

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", self.auth)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60, context=self.ctx) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            if exc.code == 401:
                die(f"Access refused: {path}")
            if exc.code == 404:
                die(f"Not found: {path}")
            die(f"{exc.code} {exc.reason}: {detail}")
        except OSError as exc:
            die(f"Could not connect: {exc}")
        return json.loads(text) if text.strip() else None


def q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def parse_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            die(f"Argument '{pair}' is not of the form key=value")
        if key in JSON_KEYS:
            try:
                out[key] = json.loads(value)
            except ValueError:
                die(f"Argument '{key}' is not valid JSON")
        elif key in INT_KEYS:
            out[key] = int(value)
        elif value.lower() in ("true", "false") and key not in ("name", "password", "payload"):
            out[key] = value.lower() == "true"
        else:
            out[key] = value
    return out


def path_of(template: str, args: dict[str, Any], vhost: str) -> str:
    fields = {k: q(str(v)) for k, v in args.items()}
    fields.setdefault("vhost", q(vhost))
    fields["dt"] = "q" if args.get("destination_type", "queue") == "queue" else "e"
    try:
        return template.format(**fields)
    except KeyError as exc:
        die(f"Mandatory argument {exc} not specified")


def show(rows: Any, fmt: str, columns: list[str]) -> None:
    if fmt in ("raw_json", "pretty_json"):
        print(json.dumps(rows, indent=2 if fmt == "pretty_json" else None, sort_keys=True))
        return
    items = rows if isinstance(rows, list) else [rows]
    cols = columns or sorted({k for it in items for k, v in it.items() if not isinstance(v, (dict, list))})
    table = [[("" if it.get(c) is None else str(it.get(c))) for c in cols] for it in items]
    if fmt == "tsv":
        print("\t".join(cols))
        for row in table:
            print("\t".join(row))
    elif fmt == "kvp":
        for row in table:
            print(" ".join(f'{c}="{row[i]}"' for i, c in enumerate(cols)))
    else:  # table
        widths = [max([len(c)] + [len(r[i]) for r in table]) for i, c in enumerate(cols)]
        line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
        print(line)
        print("|" + "|".join(f" {c:<{widths[i]}} " for i, c in enumerate(cols)) + "|")
        print(line)
        for row in table:
            print("|" + "|".join(f" {v:<{widths[i]}} " for i, v in enumerate(row)) + "|")
        print(line)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="rabbitmqadmin", description=__doc__)
    p.add_argument("-H", "--host", default="localhost")
    p.add_argument("-P", "--port", type=int, default=15672)
    p.add_argument("-U", "--base-uri", default=None)
    p.add_argument("-u", "--username", default="guest")
    p.add_argument("-p", "--password", default="guest")
    p.add_argument("-V", "--vhost", default=None)
    p.add_argument("-s", "--ssl", action="store_true")
    p.add_argument("-k", "--ssl-insecure", action="store_true")
    p.add_argument("--ssl-ca-cert-file", default=None)
    p.add_argument("--ssl-cert-file", default=None)
    p.add_argument("--ssl-key-file", default=None)
    p.add_argument("-f", "--format", default="table",
                   choices=("table", "tsv", "kvp", "raw_json", "pretty_json"))
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("command")
    p.add_argument("rest", nargs="*")
    o = p.parse_args(argv)
    api, rest, vhost = Api(o), list(o.rest), o.vhost or "/"

    def done(what: str) -> None:
        if not o.quiet:
            print(what)

    cmd = o.command
    if cmd == "list":
        if not rest:
            die("list what?")
        kind = rest.pop(0)
        path = kind.replace("_", "-")
        if o.vhost and kind in VHOST_KINDS:
            path += "/" + q(o.vhost)
        show(api.call("GET", path), o.format, rest)
    elif cmd == "show" and rest[:1] == ["overview"]:
        show(api.call("GET", "overview"), o.format, rest[1:])
    elif cmd == "declare" and rest and rest[0] in DECLARE:
        template, in_path, required = DECLARE[rest[0]]
        args = parse_args(rest[1:])
        for key in (*in_path, *required):
            if key not in args:
                die(f"Mandatory argument '{key}' not specified")
        body = {k: v for k, v in args.items() if k not in in_path}
        if rest[0] == "queue" and "queue_type" in body:
            body.setdefault("arguments", {})["x-queue-type"] = body.pop("queue_type")
        method = "POST" if rest[0] == "binding" else "PUT"
        api.call(method, path_of(template, args, vhost), body)
        done(f"{rest[0]} declared")
    elif cmd == "delete" and rest and rest[0] in DELETE:
        args = parse_args(rest[1:])
        if rest[0] == "binding":
            args.setdefault("properties_key", "~")
        api.call("DELETE", path_of(DELETE[rest[0]], args, vhost))
        done(f"{rest[0]} deleted")
    elif cmd == "close" and rest[:1] == ["connection"]:
        api.call("DELETE", path_of(DELETE["connection"], parse_args(rest[1:]), vhost))
        done("connection closed")
    elif cmd == "purge" and rest[:1] == ["queue"]:
        api.call("DELETE", path_of("queues/{vhost}/{name}/contents", parse_args(rest[1:]), vhost))
        done("queue purged")
    elif cmd == "publish":
        args = parse_args(rest)
        if "payload" not in args:
            args["payload"] = sys.stdin.read()
        body = {"routing_key": args.get("routing_key", ""), "payload": args["payload"],
                "payload_encoding": args.get("payload_encoding", "string"),
                "properties": args.get("properties", {})}
        exchange = args.get("exchange", "amq.default") or "amq.default"
        routed = api.call("POST", f"exchanges/{q(vhost)}/{q(exchange)}/publish", body)
        done("Message published" if routed.get("routed") else "Message published but NOT routed")
    elif cmd == "get":
        args = parse_args(rest)
        body = {"count": args.get("count", 1), "ackmode": args.get("ackmode", "ack_requeue_true"),
                "encoding": args.get("encoding", "auto")}
        show(api.call("POST", path_of("queues/{vhost}/{queue}/get", args, vhost), body), o.format, [])
    elif cmd == "export" and rest:
        path = "definitions" + (f"/{q(o.vhost)}" if o.vhost else "")
        with open(rest[0], "w", encoding="utf-8") as f:
            json.dump(api.call("GET", path), f, indent=2)
        done(f"Exported definitions to \"{rest[0]}\"")
    elif cmd == "import" and rest:
        with open(rest[0], encoding="utf-8") as f:
            doc = json.load(f)
        api.call("POST", "definitions" + (f"/{q(o.vhost)}" if o.vhost else ""), doc)
        done(f"Uploaded definitions from \"{rest[0]}\"")
    else:
        die(f"unknown command: {' '.join([cmd, *rest[:1]])} (see --help; RabbitMQ's rabbitmqadmin "
            "also works against this broker)")


if __name__ == "__main__":
    main(sys.argv[1:])
