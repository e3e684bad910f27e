"""``skred`` whose fsync stalls while a file exists: a test-owned composition root.

Usage: ``python tests/integration/_stalling_node.py STALL_FILE [skred options...]``.
The broker is the real one; only the host that builds the cluster leader is wrapped:
every group commit of the leader also "fsyncs" an object whose ``sync()`` blocks in the
fsync worker thread while ``STALL_FILE`` exists, which is what a stuck disk looks like
to the broker (the disk-stall watchdog must then give up the lease). Production code
reads no test hook; the fault enters through ``broker.cluster.host.Host``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

from broker import cli
from broker.config import Config
from broker.metrics import ClusterInfo
from broker.node import Node, NodeHost
from broker.store.sink import ReplicationSink
from broker.syncer import Syncable


class _StallWhileFileExists:
    def __init__(self, path: Path) -> None:
        self.path = path

    def sync(self, full: bool = False, fsync: bool = True) -> None:
        while self.path.exists():
            time.sleep(0.05)  # runs in the fsync worker thread, as a stuck fsync would


class StallingHost(NodeHost):
    def __init__(self, stall_file: Path) -> None:
        self.stall = _StallWhileFileExists(stall_file)

    def leader_broker(self, config: Config, sink: ReplicationSink, cluster: ClusterInfo,
                      replicated: Callable[[list[Syncable]], asyncio.Future[None]]) -> Node:
        nodes: list[Node] = []

        def stalling(dirty: list[Syncable]) -> asyncio.Future[None]:
            broker = nodes[0].broker
            if broker is not None:
                broker.syncer.mark_dirty(self.stall)  # before the Syncer takes its dirty set
            return replicated(dirty)

        node = super().leader_broker(config, sink, cluster, stalling)
        nodes.append(node)
        return node


if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:], host=StallingHost(Path(sys.argv[1]))))
