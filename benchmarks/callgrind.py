"""Instructions per message on the hot path, counted by valgrind's callgrind.

CPU time on a shared machine moves by tens of per cent from run to run; an instruction count
does not. Each scenario runs in a child process under ``valgrind --tool=callgrind`` twice, with
``n`` and with ``2 n`` messages, and everything else the same (the frames for ``2 n`` are built
in both runs): the difference of the two totals over ``n`` is the cost of one message, with
interpreter start-up, imports and set-up cancelled out. The scenarios are those of
``benchmarks/hotpath.py``: publish to a queue without consumers (identical messages, a run;
``varied``: every message different), delivery to an autoack consumer, the direct hand-over,
delivery with acks, and a publish through ``amq.topic`` to two queues.

Usage: ``python benchmarks/callgrind.py [-n 2000] [scenario ...]`` (needs valgrind).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pamqp import commands
from pamqp import frame as pframe

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hotpath import handshake, publish_frames  # noqa: E402

SCENARIOS = ("publish", "publish-varied", "deliver-autoack", "direct-autoack", "deliver-ack", "topic")
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


async def _child(scenario: str, n: int, total: int) -> None:
    """Set up a broker, then put ``n`` of ``total`` prepared messages through ``scenario``."""
    from broker.amqp.session import Session
    from broker.config import load_config
    from broker.node import Node

    tmp = Path(tempfile.mkdtemp(prefix="skred-callgrind-"))
    try:
        cfg = load_config(["--data-dir", str(tmp), "--no-sync", "--no-mgmt"], environ={})
        broker = Node(cfg).load(asyncio.get_running_loop())
        pub = Session(broker, ("127.0.0.1", 1), lambda: None)
        handshake(pub)
        pub.receive_data(pframe.marshal(commands.Queue.Declare(queue="hp"), 1))
        frames = publish_frames(total, 16, "hp", scenario == "publish-varied")
        one = len(frames) // total  # identical messages: every frame set the same length
        if scenario == "topic":
            for q in ("t1", "t2"):
                pub.receive_data(pframe.marshal(commands.Queue.Declare(queue=q), 1))
                pub.receive_data(pframe.marshal(commands.Queue.Bind(queue=q, exchange="amq.topic",
                                                                     routing_key="a.*"), 1))
            frames = publish_frames(total, 16, "a.b").replace(
                pframe.marshal(commands.Basic.Publish(exchange="", routing_key="a.b"), 1),
                pframe.marshal(commands.Basic.Publish(exchange="amq.topic", routing_key="a.b"), 1))
            one = len(frames) // total
        pub.out.clear()
        q = broker.vhosts["/"].queues["hp"]
        cons = Session(broker, ("127.0.0.1", 2), lambda: None)
        handshake(cons)
        if scenario in ("deliver-autoack", "deliver-ack"):
            _feed(pub, frames[: one * n])
        if scenario in ("deliver-autoack", "direct-autoack"):
            cons.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", consumer_tag="c",
                                                                    no_ack=True), 1))
        elif scenario == "deliver-ack":
            cons.receive_data(pframe.marshal(commands.Basic.Qos(prefetch_count=1000), 1))
            cons.receive_data(pframe.marshal(commands.Basic.Consume(queue="hp", consumer_tag="c"), 1))
        cons.out.clear()
        if scenario == "publish-varied":
            _feed(pub, _first_messages(frames, n))
        elif scenario in ("publish", "topic", "direct-autoack"):
            _feed(pub, frames[: one * n], cons.out)
        else:
            tag = 0
            while q.message_count:
                q._deliver()
                cons.out.clear()
                if scenario == "deliver-ack":
                    tag = cons.chs[1].next_tag - 1
                    cons.receive_data(pframe.marshal(commands.Basic.Ack(delivery_tag=tag, multiple=True), 1))
        for vh in broker.vhosts.values():
            vh.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _first_messages(frames: bytes, n: int) -> bytes:
    """The first ``n`` publishes (method, header, body frame each) of ``frames``."""
    at = 0
    for _ in range(3 * n):
        size = int.from_bytes(frames[at + 3 : at + 7], "big")
        at += 8 + size
    return frames[:at]


def _feed(session: object, data: bytes, out: bytearray | None = None) -> None:
    chunk = 65536
    for i in range(0, len(data), chunk):
        session.receive_data(data[i : i + chunk])  # type: ignore[attr-defined]
        session.after_batch()  # type: ignore[attr-defined]
        if out is not None:
            out.clear()


def _instructions(scenario: str, n: int, total: int) -> int:
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         __file__, "--child", scenario, str(n), str(total)],
        capture_output=True, text=True, timeout=1800, check=False)
    m = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or m is None:
        raise RuntimeError(f"{scenario}: valgrind failed: {done.stderr[-2000:]}")
    return int(m.group(1))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        asyncio.run(_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="messages in the smaller run")
    ap.add_argument("scenarios", nargs="*", help=f"of {', '.join(SCENARIOS)} (default: all)")
    args = ap.parse_args()
    for scenario in args.scenarios:
        if scenario not in SCENARIOS:
            ap.error(f"no scenario {scenario!r}")
    print(f"{'scenario':18s} instructions/msg")
    for scenario in args.scenarios or SCENARIOS:
        small = _instructions(scenario, args.n, 2 * args.n)
        large = _instructions(scenario, 2 * args.n, 2 * args.n)
        print(f"{scenario:18s} {(large - small) / args.n:12,.0f}", flush=True)


if __name__ == "__main__":
    main()
