"""A follower opens its client port proxies once synced (``broker/cluster/runner.py``): the AMQP
port's last, so that once it answers every other port does too, as on a leader (``node.start``:
"once the AMQP port answers, everything answers"). Tests and operators wait on the AMQP port,
then use the management, MQTT, stream or LMQ ports at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker.cluster.proxy import SpliceProxy
from broker.cluster.runner import ClusterRunner
from broker.config import load_config
from broker.node import NodeHost


def test_a_followers_amqp_proxy_opens_after_every_other(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(["--data-dir", str(tmp_path / "data"), "--clustering",
                       "--clustering-etcd-endpoints", "127.0.0.1:1",
                       "--amqp-unix-path", str(tmp_path / "amqp.sock"),
                       "--mgmt-unix-path", str(tmp_path / "mgmt.sock")], environ={})
    opened: list[str] = []

    async def start(self: SpliceProxy, bind: str, port: int) -> int:  # the order, not the sockets
        opened.append(self.name)
        return port

    async def start_unix(self: SpliceProxy, path: str, mode: int) -> None:
        opened.append(self.name)

    monkeypatch.setattr(SpliceProxy, "start", start)
    monkeypatch.setattr(SpliceProxy, "start_unix", start_unix)
    asyncio.run(ClusterRunner(cfg, NodeHost(cfg))._start_proxies())
    assert "HTTP" in opened and "MQTT" in opened and "AMQP (Unix socket)" in opened, opened
    assert opened[-1] == "AMQP" and opened.count("AMQP") == 1, opened
