"""A deduplicating exchange's cache alone, in memory or on disk (broker/model/dedup_cache.py).

``n`` distinct keys go through ``seen`` one by one and ``write`` every 1,000 (a run), into a
cache large enough never to evict; the garbage collector is off (a full collection falling in
one run and not in another moves a count by thousands of instructions per key). Run it under
callgrind with ``n`` and ``2n`` keys and divide the difference by ``n``: the instructions of one
key (imports and start-up cancel out), as docs/benchmarks.md reports them.

Usage: ``valgrind --tool=callgrind python benchmarks/dedup_cache_cost.py memory|disk N``
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

from broker.model.dedup_cache import DedupCache, DurableDedupCache
from broker.store.queue_store import QueueStore

RUN = 1000


def main() -> None:
    gc.disable()
    mode, n = sys.argv[1], int(sys.argv[2])
    keys = [f"q.0.0.{i}" for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="skred-dcc-") as tmp:
        cache = DedupCache(10 * n, None) if mode == "memory" else \
            DurableDedupCache(10 * n, None, QueueStore(Path(tmp) / "c"))
        for at in range(0, n, RUN):
            seen = cache.seen
            for k in keys[at:at + RUN]:
                seen(k, None, 1)
            cache.write()
        cache.close()


if __name__ == "__main__":
    main()
