"""The ``skred`` command: argv -> Config -> logging -> ``broker.node.serve``.

Expected failures end with one line on stderr and an exit status, never a
traceback: a bad option or config file exits 2 (like argparse's own usage
errors), a locked or unusable data directory exits 1.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from broker.config import ConfigError, build_parser, load_config
from broker.errors import DataDirLocked, StoreError

LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    """Log to stderr with timestamp, level and logger name at ``level`` (e.g. ``"info"``)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"skred: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    setup_logging(config.main.log_level)
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))  # parsed fine above
    if args.cluster_status:
        from broker.cluster.status import cluster_status_main

        return cluster_status_main(config, args.json)

    # Imported here so `skred --help` works without loading the whole broker.
    from broker.node import StartupError, serve

    try:
        return serve(config)
    except StartupError as exc:
        print(f"skred: error: {exc}", file=sys.stderr)
        return 1
    except DataDirLocked as exc:
        print(
            f"skred: error: data directory {config.main.data_dir} is in use by another skred process ({exc})",
            file=sys.stderr,
        )
        return 1
    except StoreError as exc:
        print(f"skred: error: data directory {config.main.data_dir} is unusable: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # typically a port already in use
        print(f"skred: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # 128 + SIGINT, the shell convention


if __name__ == "__main__":
    sys.exit(main())
