"""Instructions per record of the stream protocol's consume path, counted by callgrind, A/B.

The chunk path a subscription takes (``StreamQueue`` -> ``StreamStore.read_run`` ->
``Subscription.deliver_run`` -> ``codec.encode_deliver_run``), no sockets: a stream queue on
real segment files in a temp dir holds ``n`` records published as the stream protocol stores a
batch (runs of ``--batch`` records of ``--size`` bytes, one head each), and one subscription
with ample credit reads all of them into a buffer. Each tree (this checkout, and any other
given with ``--base``, e.g. an older commit unpacked by ``git archive``) runs twice under
``valgrind --tool=callgrind``: publish only, then publish and consume; the difference over
``n`` is the consume cost of one record (start-up, imports and publishing cancel out).

Usage: ``python benchmarks/stream_consume_cost.py [-n 40000] [--size 16] [--batch 500]
[--base DIR]`` (needs valgrind).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_TOTALS = re.compile(r"^(?:summary|totals):\s*(\d+)", re.M)


def _child(n: int, size: int, batch: int, consume: bool) -> None:
    from broker.model.fastpaths import FastPaths
    from broker.model.stream import StreamQueue
    from broker.store import segment as fmt
    from broker.store.stream_store import StreamStore
    from broker.streamproto import codec as C
    from broker.streamproto.session import _PLAIN_PROPS, StreamSession, Subscription

    class Out:
        writable = True

        def __init__(self) -> None:
            self.n = 0
            self.soon_calls: list[object] = []

        def write(self, data: bytes) -> None:
            self.n += len(data)

        def close(self) -> None:
            pass

        def soon(self, fn: object) -> None:
            self.soon_calls.append(fn)

    with tempfile.TemporaryDirectory(prefix="skred-scc-") as tmp:
        pending: list[object] = []
        q = StreamQueue("/", "s", arguments={"x-queue-type": "stream"}, stream=StreamStore(Path(tmp) / "s"),
                        schedule=pending.append, on_unused=lambda q: None, on_dirty=lambda s: None)
        q.fast = FastPaths()
        q.fast.on = True
        exrk = fmt.short_pair(b"", b"s")
        for i in range(0, n, batch):
            k = min(batch, n - i)
            q.publish_run(1_700_000_000_000, b"", b"s", [_PLAIN_PROPS] * k,
                          [b"%0*d" % (size, i + j) for j in range(k)], True, exrk, True)
        if consume:
            out = Out()
            session = StreamSession.__new__(StreamSession)
            session.out = out  # type: ignore[assignment]
            session.closed = False
            sub = Subscription(session, 1, q, 1 << 30, {})
            sub.start(C.OffsetSpec(C.OFFSET_FIRST, 0))
            while pending or out.soon_calls:
                (pending or out.soon_calls).pop(0)()  # type: ignore[operator]
            assert sub.consumed == n, (sub.consumed, n)
        q.close()


def _count(tree: Path, n: int, size: int, batch: int, consume: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="skred-scc-cg-") as work:
        out = Path(work) / "cg.out"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                        __file__, "--child", str(n), str(size), str(batch), "1" if consume else "0"],
                       check=True, env=env, cwd=work, capture_output=True, timeout=900)
        m = _TOTALS.search(out.read_text(errors="replace"))
        assert m is not None
        return int(m.group(1))


def per_record(tree: Path, n: int, size: int, batch: int) -> float:
    return (_count(tree, n, size, batch, True) - _count(tree, n, size, batch, False)) / n


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        sys.path.insert(0, os.environ["PYTHONPATH"])
        _child(*(int(a) for a in sys.argv[2:5]), consume=sys.argv[5] == "1")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=40_000)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--base", type=Path, help="another tree (holding broker/) to compare")
    a = ap.parse_args()
    trees = [("this", REPO_ROOT)] + ([("base", a.base.resolve())] if a.base else [])
    print(f"stream consume, {a.n} records of {a.size} B in runs of {a.batch}: instructions per record")
    got = {}
    for name, tree in trees:
        got[name] = per_record(tree, a.n, a.size, a.batch)
        print(f"  {name:5} {got[name]:8.0f}   ({tree})", flush=True)
    if "base" in got:
        print(f"  this/base {got['this'] / got['base']:.2f}")


if __name__ == "__main__":
    main()
