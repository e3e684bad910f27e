"""``skredctl``: a command-line client of the management HTTP API.

Every command of ``lavinmqctl`` under its name and arguments, next to the older
rabbitmqctl-style ones (``broker/ctl/commands.py`` declares them all, ``docs/ctl.md`` lists
them), and ``skredctl tui``, a terminal dashboard (``broker/ctl/tui.py``). Each command is a
few HTTP requests (stdlib ``urllib``, no event loop); ``hash_password`` and ``definitions``
(a stopped node's data directory) need no broker. Output is a table by default and JSON with
``--format json`` (or ``--json``). Failures end with one line on stderr and an exit status a
script can test, never a traceback: 1 the broker refused (401/403/4xx) or the input is
unusable, 2 the broker cannot be reached or the command line is wrong, 3 the broker does not
offer the operation (its API answers 404/405 on the operation's path).

Credentials come from ``--user/--password`` or the environment
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
import os
import sys
import urllib.parse
from collections.abc import Sequence

from broker.config import OneLineErrorParser
from broker.ctl.client import Client, CtlError, q, tls_context
from broker.ctl.commands import COMMANDS, LISTS, UNHEALTHY, Ctx
from broker.ctl.output import Out, table

__all__ = ["COMMANDS", "LISTS", "UNHEALTHY", "Client", "CtlError", "build_parser", "main", "q", "table"]

DEFAULT_URL = "http://127.0.0.1:15672"


def env_defaults() -> tuple[str, str, str]:
    """(url, user, password) defaults: SKREDCTL_*, else the local node's settings, else guest."""
    env = os.environ
    port = env.get("SKRED_MGMT_PORT")
    url = env.get("SKREDCTL_URL") or (f"http://127.0.0.1:{port}" if port else DEFAULT_URL)
    user = env.get("SKREDCTL_USER") or env.get("SKRED_MAIN_DEFAULT_USER") or "guest"
    password = env.get("SKREDCTL_PASSWORD") or env.get("SKRED_MAIN_DEFAULT_PASSWORD") or "guest"
    return url, user, password


def _global_options(p: argparse.ArgumentParser) -> None:
    url, user, password = env_defaults()
    p.add_argument(
        "--url",
        "-U",
        "--uri",
        default=url,
        help=f"management API base URL (default {DEFAULT_URL}; env SKREDCTL_URL, else "
        "SKRED_MGMT_PORT on 127.0.0.1)",
    )
    p.add_argument("--hostname", help="host of the management API (instead of --url)")
    p.add_argument("-P", "--port", type=int, help="port with --hostname (default 15672)")
    p.add_argument("--scheme", choices=("http", "https"), default="http", help="scheme with --hostname")
    p.add_argument(
        "-u",
        "--user",
        default=user,
        help="user (env SKREDCTL_USER, else SKRED_MAIN_DEFAULT_USER, else guest)",
    )
    p.add_argument(
        "-p",
        "--password",
        default=password,
        help="password (env SKREDCTL_PASSWORD, else SKRED_MAIN_DEFAULT_PASSWORD, else guest); "
        "lavinmqctl's -p means --vhost, which here is --vhost only",
    )
    p.add_argument(
        "--vhost",
        dest="global_vhost",
        metavar="VHOST",
        help="the vhost of a vhost-scoped command (also accepted after the command)",
    )
    p.add_argument("-f", "--format", choices=("text", "json"), default="text", help="output format")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="accepted for lavinmqctl's scripts (no banners are printed anyway)",
    )
    p.add_argument("-s", "--silent", action="store_true", help="no table header")
    p.add_argument("-n", "--node", help="accepted for lavinmqctl's scripts and ignored")
    tls = p.add_argument_group("TLS (with an https:// URL)")
    tls.add_argument(
        "--cacert",
        "--ssl-ca-cert-file",
        "--tls-ca-cert-file",
        metavar="FILE",
        help="PEM CA bundle that verifies the broker's certificate (default: the system's; "
        "env SKREDCTL_CACERT)",
    )
    tls.add_argument(
        "--cert",
        "--ssl-cert-file",
        "--tls-cert-file",
        metavar="FILE",
        help="PEM client certificate (chain) to present (env SKREDCTL_CERT)",
    )
    tls.add_argument(
        "--key",
        "--ssl-key-file",
        "--tls-key-file",
        metavar="FILE",
        help="PEM private key of --cert (default: in the --cert file; env SKREDCTL_KEY)",
    )
    tls.add_argument(
        "-k",
        "--insecure",
        action="store_true",
        help="do not verify the broker's certificate or host name (testing only)",
    )


def build_parser() -> argparse.ArgumentParser:
    from broker.ctl import tui

    p = OneLineErrorParser(
        prog="skredctl",
        description="Manage a Skred broker over its HTTP API.",
        epilog="exit status: 0 done; 1 refused by the broker or unusable input; 2 broker "
        "unreachable or bad command line; 3 the broker does not offer the operation",
    )
    _global_options(p)
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    for cmd in COMMANDS.values():
        sp = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        for names, kw in cmd.args:
            sp.add_argument(*names, **kw)
    tui.add_parser(sub)
    return p


def _url(args: argparse.Namespace) -> str:
    if args.hostname:
        host = f"[{args.hostname}]" if ":" in args.hostname else args.hostname
        return f"{args.scheme}://{host}:{args.port or 15672}"
    return str(args.url)


def _tls_files(args: argparse.Namespace) -> tuple[str | None, str | None, str | None]:
    """--cacert, --cert, --key; for an https:// URL, SKREDCTL_CACERT/_CERT/_KEY fill in the ones not
    given (a shell set up for an HTTPS broker still runs commands against a plain one)."""
    if urllib.parse.urlsplit(args.url).scheme != "https":
        return args.cacert, args.cert, args.key
    env = os.environ
    return (
        args.cacert or env.get("SKREDCTL_CACERT"),
        args.cert or env.get("SKREDCTL_CERT"),
        args.key or env.get("SKREDCTL_KEY"),
    )


def client(args: argparse.Namespace) -> Client:
    args.url = _url(args)
    return Client(args.url, args.user, args.password, tls_context(args.url, *_tls_files(args), args.insecure))


def run(args: argparse.Namespace, out: Out) -> None:
    if args.command == "tui":
        from broker.ctl import tui

        tui.run(args, lambda: client(args))
        return
    COMMANDS[args.command].handler(Ctx(args, out, lambda: client(args)))


BROKEN_PIPE_STATUS = 128 + 13  # what a shell reports for a process killed by SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt = "json" if args.json else args.format
    try:
        run(args, Out(sys.stdout, fmt, args.silent))
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
