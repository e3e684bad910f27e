"""What firehose tracing costs the publish path, in instructions per message (callgrind).

Feeds pre-encoded publishes into a ``Session`` (as ``hotpath.py`` does: a real vhost on real
segment files, no sockets) and exits. Run it under callgrind twice with different counts; the
difference of the two instruction totals over the difference of the counts is the cost of one
message, free of start-up. ``--compare DIR`` runs the same with the broker package from DIR
(another checkout, e.g. main's) for a before/after table:

    python benchmarks/trace_cost.py --callgrind [--compare /tmp/main-checkout]

Without ``--callgrind`` it runs one publish loop in-process (the unit callgrind measures).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pamqp import commands
from pamqp import frame as pframe

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


async def publish(n: int, varied: bool, tracing: bool) -> None:
    from hotpath import handshake, publish_frames

    from broker.amqp.session import Session
    from broker.config import load_config
    from broker.node import Node

    tmp = Path(tempfile.mkdtemp(prefix="skred-trace-cost-"))
    try:
        cfg = load_config(["--data-dir", str(tmp), "--no-sync", "--no-mgmt"], environ={})
        broker = Node(cfg).load(asyncio.get_running_loop())
        if tracing:
            broker.vhosts["/"].meta.update(tracing=True)
        s = Session(broker, ("127.0.0.1", 1), lambda: None)
        handshake(s)
        s.receive_data(pframe.marshal(commands.Queue.Declare(queue="tc"), 1))
        s.out.clear()
        data = publish_frames(n, 16, "tc", varied)
        for i in range(0, len(data), 65536):
            s.receive_data(data[i:i + 65536])
            s.after_batch()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def instructions(n: int, varied: bool, tracing: bool, pythonpath: Path) -> int:
    """Total instructions (Ir) of one run under callgrind."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d, "cg.out")
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                str(Path(__file__)), "-n", str(n)] + (["--varied"] if varied else []) \
            + (["--tracing"] if tracing else [])
        env = dict(os.environ, PYTHONPATH=str(pythonpath), PYTHONHASHSEED="0")
        subprocess.run(argv, env=env, check=True, capture_output=True, timeout=1800)
        text = out.read_text(errors="replace")
    m = re.search(r"^(?:summary|totals):\s*(\d+)", text, re.M)
    assert m is not None, "no totals in the callgrind output"
    return int(m.group(1))




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=10_000, help="messages (one in-process run)")
    ap.add_argument("--varied", action="store_true", help="every message different: single publishes")
    ap.add_argument("--tracing", action="store_true", help="tracing on for the vhost")
    ap.add_argument("--callgrind", action="store_true", help="the table: instructions per message")
    ap.add_argument("--compare", type=Path, help="a checkout whose broker package is 'before'")
    ap.add_argument("--lo", type=int, default=2_000)
    ap.add_argument("--hi", type=int, default=12_000)
    ap.add_argument("--which", choices=("runs", "varied", "both"), default="both")
    ap.add_argument("--jobs", type=int, default=6, help="callgrind runs at once")
    args = ap.parse_args()
    if not args.callgrind:
        asyncio.run(publish(args.n, args.varied, args.tracing))
        return
    cases = []
    for varied, what in ((False, "identical publishes (runs)"), (True, "varied publishes (one by one)")):
        if args.which != "both" and varied != (args.which == "varied"):
            continue
        if args.compare:
            cases.append((what, "before (--compare)", varied, False, args.compare))
        cases.append((what, "tracing off", varied, False, ROOT))
        cases.append((what, "tracing on", varied, True, ROOT))
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own valgrind process
        futures = [(case, pool.submit(instructions, n, case[2], case[3], case[4]))
                   for case in cases for n in (args.lo, args.hi)]
        totals = [(case, f.result()) for case, f in futures]
    print("| publishes | broker | instructions per message |\n| --- | --- | ---: |")
    for i in range(0, len(totals), 2):
        (what, who, *_), lo_ir = totals[i]
        hi_ir = totals[i + 1][1]
        print(f"| {what} | {who} | {(hi_ir - lo_ir) / (args.hi - args.lo):,.0f} |")


if __name__ == "__main__":
    main()
