"""The ``skred`` command: argv -> Config -> logging -> ``broker.node.serve``.

Expected failures end with one line on stderr and an exit status, never a
traceback: a bad option, flag or config file exits 2 (like argparse's own usage
errors), a locked or unusable data directory, a listener that cannot bind or a
missing dependency exits 1. Each line names the option or path to fix.

Logging: text lines (timestamp, level, logger, message) or JSON objects, one per
line (``[main] log_format``), to stderr or appended to ``[main] log_file``. The
level is re-read on SIGHUP (``broker.node.Reloader``).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker import __version__
from broker.config import Config, ConfigError, build_parser, load_config
from broker.errors import DataDirLocked, ListenError, StoreError

if TYPE_CHECKING:
    from broker.node import NodeHost

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
log = logging.getLogger("skred")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message (+ exception)."""

    def converter(self, seconds: float | None = None) -> time.struct_time:
        return time.gmtime(seconds)

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str, fmt: str = "text", path: str = "") -> None:
    """Log at ``level`` (e.g. ``"info"``) as ``fmt`` (text/json) to ``path`` (empty: stderr).

    Raises ``ConfigError`` naming the option when the log file cannot be opened.
    """
    handler: logging.Handler
    if path:
        try:
            handler = logging.FileHandler(path, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot open log file {path} ([main] log_file / --log-file): "
                              f"{exc.strerror or exc}") from None
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def log_start(config: Config) -> None:
    log.info("skred %s starting (Python %s, pid %d, data dir %s)", __version__, platform.python_version(),
             os.getpid(), config.main.data_dir)


def main(argv: Sequence[str] | None = None, host: NodeHost | None = None) -> int:
    """``host``: how a cluster member builds its brokers (tests pass one that injects faults)."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    try:
        config = load_config(args_list)
        setup_logging(config.main.log_level, config.main.log_format, config.main.log_file)
    except ConfigError as exc:
        print(f"skred: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    args = build_parser().parse_args(args_list)  # parsed fine above
    if args.cluster_status:
        from broker.cluster.status import cluster_status_main

        return cluster_status_main(config, args.json)

    # Imported here so `skred --help` works without loading the whole broker.
    from broker.node import StartupError, serve

    log_start(config)
    try:
        return serve(config, host, lambda: load_config(args_list))
    except ConfigError as exc:  # e.g. a TLS certificate or key that does not load
        print(f"skred: error: {exc}", file=sys.stderr)
        return 2
    except (StartupError, DataDirLocked, ListenError) as exc:  # their messages name path or option
        print(f"skred: error: {exc}", file=sys.stderr)
        return 1
    except StoreError as exc:
        print(f"skred: error: data directory {config.main.data_dir} is unusable: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"skred: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT, the shell convention


if __name__ == "__main__":
    sys.exit(main())
