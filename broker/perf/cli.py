"""``skred-perf``: command line of the load generator (modelled on lavinmqperf)."""

from __future__ import annotations

import argparse
import signal
import sys

from broker.perf.handshake import PerfError

DEFAULT_URI = "amqp://guest:guest@127.0.0.1:5672/"


def _positive(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skred-perf",
        description="AMQP 0-9-1 load generator and resource probe for Skred (works with any broker).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser(
        "throughput",
        help="publish and consume as fast as possible; print rates every second and a summary",
        description=(
            "Publish and consume as fast as possible; print published/consumed msg/s and the tool's "
            "own CPU use every second, then a summary. Each producer and consumer is its own process "
            "and connection. The run is bounded by -z and/or -C (default -z 10)."
        ),
    )
    t.add_argument("--uri", default=DEFAULT_URI, help=f"broker URI (default {DEFAULT_URI})")
    t.add_argument("-x", "--producers", type=_positive, default=1, help="number of producers (default 1)")
    t.add_argument(
        "-y",
        "--consumers",
        type=_positive,
        default=1,
        help="number of consumers (default 1); with --fanout-queues: consumers per queue",
    )
    t.add_argument("-s", "--size", type=_positive, default=16, help="message body size in bytes (default 16)")
    t.add_argument(
        "-z",
        "--time",
        type=float,
        default=0.0,
        dest="seconds",
        help="run for this many seconds (hard limit for producers and consumers)",
    )
    t.add_argument(
        "-C",
        "--pmessages",
        type=_positive,
        default=0,
        dest="count",
        help="messages to publish per producer; consumers then stop when all are consumed",
    )
    t.add_argument(
        "-a",
        "--ack",
        type=_positive,
        default=0,
        dest="ack_every",
        help="manual ack: basic.ack(multiple=true) every N deliveries (default 0 = autoack)",
    )
    t.add_argument(
        "-P",
        "--prefetch",
        type=_positive,
        default=None,
        help="basic.qos prefetch count (default 1000 with manual ack, none with autoack)",
    )
    t.add_argument(
        "-c",
        "--max-unconfirmed",
        type=_positive,
        default=0,
        dest="confirm",
        help="publisher confirms with at most N unconfirmed messages per producer (0 = off)",
    )
    t.add_argument(
        "-p",
        "--persistent",
        action="store_true",
        help="delivery_mode 2 (persistent) messages; the queue is declared durable",
    )
    t.add_argument(
        "-u",
        "--queue",
        default="",
        help="queue name (default: a unique name, deleted afterwards); with --fanout-queues: name prefix",
    )
    t.add_argument("--queue-durable", action="store_true", help="declare the queue(s) durable")
    t.add_argument(
        "--message-ids",
        action="store_true",
        help="give every message its own message-id property, as many client libraries do; "
        "consecutive publishes then differ in more than their bodies",
    )
    t.add_argument(
        "--no-declare",
        action="store_true",
        help="do not declare anything: -u must name an existing queue (passive check)",
    )
    t.add_argument(
        "-e", "--exchange", default="", help="exchange to publish to (default: the default exchange)"
    )
    t.add_argument("-t", "--exchange-type", default="direct", help="type for declaring -e (default direct)")
    t.add_argument("-k", "--routing-key", default="", help="routing key (default: the queue name)")
    t.add_argument(
        "--fanout-queues",
        type=_positive,
        default=0,
        metavar="N",
        help="declare a fanout exchange (-e or a unique name) with N bound queues, each with -y consumers",
    )
    t.add_argument(
        "--prefill",
        type=_positive,
        default=0,
        metavar="N",
        help="publish N messages (to each queue) before the run; consumers then drain them",
    )
    t.add_argument(
        "-l",
        "--latency",
        action="store_true",
        help="measure end-to-end latency (p50/p95/p99) from a timestamp in each body (-s >= 8)",
    )
    t.add_argument(
        "-j", "--json", action="store_true", help="print a JSON summary on stdout (rate lines go to stderr)"
    )
    t.add_argument(
        "--idle-stop",
        type=float,
        default=5.0,
        metavar="SEC",
        help="count-bounded runs: stop consumers after SEC s without messages once "
        "producers are done (default 5)",
    )
    t.add_argument(
        "--batch-bytes",
        type=int,
        default=65536,
        metavar="N",
        help="bytes of pre-encoded messages per send() (default 65536)",
    )
    t.add_argument(
        "--interval", type=float, default=1.0, metavar="SEC", help="seconds between rate lines (default 1)"
    )

    q = sub.add_parser(
        "queue-count",
        help="declare N queues and report the broker's memory",
        description="Declare N queues (pipelined) and report broker RSS before and after.",
    )
    c = sub.add_parser(
        "connection-count",
        help="open N idle connections and report the broker's memory",
        description="Open N idle connections (each with one channel) and report broker RSS.",
    )
    for p in (q, c):
        p.add_argument("count", type=_positive, help="how many queues / connections")
        p.add_argument("--uri", default=DEFAULT_URI, help=f"broker URI (default {DEFAULT_URI})")
        p.add_argument(
            "--pid", type=int, default=0, help="broker process id: read VmRSS from /proc/PID/status"
        )
        p.add_argument(
            "--mgmt-uri",
            default="",
            help="management API base, e.g. http://guest:guest@127.0.0.1:15672 "
            "(reads mem_used from GET /api/nodes)",
        )
        p.add_argument(
            "--hold",
            type=float,
            default=0.0,
            metavar="SEC",
            help="keep them for SEC seconds after measuring (default 0)",
        )
        p.add_argument("-j", "--json", action="store_true", help="print a JSON summary on stdout")
    q.add_argument("--durable", action="store_true", help="declare durable queues")
    q.add_argument("--keep", action="store_true", help="do not delete the queues afterwards")
    c.add_argument("--concurrency", type=int, default=200, help="handshakes in flight at once (default 200)")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Ctrl-C and SIGTERM both end a run early with a summary and the queues cleaned up; set the
    # handlers explicitly because a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.command == "throughput":
            return _throughput(args)
        from broker.perf.counts import connection_count, queue_count

        if args.command == "queue-count":
            return queue_count(
                args.uri,
                args.count,
                pid=args.pid,
                mgmt_uri=args.mgmt_uri,
                durable=args.durable,
                keep=args.keep,
                hold=args.hold,
                as_json=args.json,
            )
        return connection_count(
            args.uri,
            args.count,
            pid=args.pid,
            mgmt_uri=args.mgmt_uri,
            concurrency=args.concurrency,
            hold=args.hold,
            as_json=args.json,
        )
    except PerfError as exc:
        print(f"skred-perf: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _throughput(args: argparse.Namespace) -> int:
    from broker.perf.throughput import ThroughputOptions, throughput

    seconds = args.seconds
    if not seconds and not args.count and not args.prefill:
        seconds = 10.0  # every run is bounded
    prefetch = args.prefetch
    if prefetch is None:
        prefetch = 1000 if args.ack_every else 0
    ack_every = args.ack_every
    if ack_every and prefetch and ack_every > prefetch:
        print(
            f"note: -a {ack_every} > prefetch {prefetch} would stall; acking every {prefetch}",
            file=sys.stderr,
        )
        ack_every = prefetch
    if args.latency and args.size < 8:
        raise PerfError("-l needs -s 8 or more (the body carries an 8-byte timestamp)")
    if args.no_declare and not args.queue:
        raise PerfError("--no-declare needs -u QUEUE")
    opts = ThroughputOptions(
        uri=args.uri,
        producers=args.producers,
        consumers=args.consumers,
        size=args.size,
        seconds=seconds,
        count=args.count,
        ack_every=ack_every,
        prefetch=prefetch,
        confirm=args.confirm,
        persistent=args.persistent,
        queue=args.queue,
        queue_durable=args.queue_durable,
        no_declare=args.no_declare,
        exchange=args.exchange,
        routing_key=args.routing_key,
        exchange_type=args.exchange_type,
        fanout_queues=args.fanout_queues,
        prefill=args.prefill,
        latency=args.latency,
        json=args.json,
        idle_stop=args.idle_stop,
        interval=args.interval,
        batch_bytes=max(1, args.batch_bytes),
        message_ids=args.message_ids,
    )
    return throughput(opts)


if __name__ == "__main__":
    sys.exit(main())
