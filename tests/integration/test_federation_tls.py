"""Federation from an ``amqps://`` upstream that demands a client certificate: the link presents
the one the URI names (aiormq's ``cafile``/``certfile``/``keyfile`` query options) and moves the
upstream queue's messages to the downstream's consumers.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest

from ._support import SkredProcess, free_port, is_external, wait_until
from ._tls import make_pki, tls_args
from .test_federation_failover import _api, _consume, _fill_upstream, _upstream_count
from .test_mgmt_api import http_ready

pytestmark = pytest.mark.skipif(is_external(), reason="starts its own brokers")

N = 50


def test_queue_federation_from_an_amqps_upstream_with_a_client_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    tls_port = free_port()
    up = SkredProcess(tmp_path / "upstream", tls_args(pki, "--amqp-tls-port", str(tls_port),
                                                      "--tls-verify-peer", "--tls-fail-if-no-peer-cert"))
    down = SkredProcess(tmp_path / "downstream", ["--mgmt-metrics-port", str(free_port())])
    up.start()
    try:
        down.start()
        wait_until(lambda: http_ready(down.mgmt_port), 30, "downstream API")
        _fill_upstream(up, "fed.q", N)
        uri = (f"amqps://guest:guest@127.0.0.1:{tls_port}/%2F?cafile={quote(str(pki.ca.cert_path))}"
               f"&certfile={quote(str(pki.client.cert))}&keyfile={quote(str(pki.client.key))}")
        api = _api(down.host, down.mgmt_port)
        value = {"uri": uri, "reconnect-delay": 0.5, "prefetch-count": 20}
        status = api.call("PUT", "/api/parameters/federation-upstream/%2F/up", {"value": value})[0]
        assert status in (201, 204)
        body = {"pattern": "^fed\\.q$", "apply-to": "queues", "definition": {"federation-upstream": "up"}}
        assert api.call("PUT", "/api/policies/%2F/federate", body)[0] in (201, 204)
        got: list[int] = []
        _consume(down.url, "fed.q", got, N)
        assert set(got) == set(range(N)), f"missing: {sorted(set(range(N)) - set(got))[:10]}"
        wait_until(lambda: _upstream_count(up, "fed.q") == 0, 30, "upstream drained")
        (link,) = api.get("/api/federation-links")
        assert link["status"] == "running" and link["uri"].startswith("amqps://"), link
    finally:
        down.close()
        up.close()
