"""Failed-login throttling on a real broker: a burst of wrong passwords is slowed per source
address, the burst is logged once, no password reaches the log, and other sources are not slowed.

Logins are raw AMQP handshakes (header, start, start-ok PLAIN, then tune or a 403 close) from a
socket bound to a chosen loopback address, so two "sources" exist on one machine. Timing
assertions are lower bounds (the delays the throttle must have imposed) or generous upper bounds
for the source that must not be delayed, so machine load cannot make them flaky.
"""

from __future__ import annotations

import base64
import socket
import struct
import time
import urllib.error
import urllib.request

import pytest
from pamqp import commands
from pamqp import frame as pframe

from ._support import SkredProcess, wait_until

pytestmark = pytest.mark.timeout(120)

WRONG = "not-the-password-7f3a"


def amqp_login(port: int, user: str, password: str, source: str = "127.0.0.1",
               timeout: float = 20.0) -> bool:
    """One AMQP login; True when the broker answers connection.tune, False on 403/close."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as s:
        s.sendall(b"AMQP\x00\x00\x09\x01")
        _read_frame(s)  # connection.start
        start_ok = commands.Connection.StartOk(
            client_properties={}, mechanism="PLAIN", response=f"\0{user}\0{password}", locale="en_US")
        s.sendall(pframe.marshal(start_ok, 0))
        try:
            payload = _read_frame(s)
        except ConnectionError:
            return False
        class_id, method_id = struct.unpack_from(">HH", payload)
        return (class_id, method_id) == (10, 30)  # tune; (10, 50) is close 403


def _read_frame(s: socket.socket) -> bytes:
    head = _recv(s, 7)
    _type, _ch, size = struct.unpack(">BHI", head)
    return _recv(s, size + 1)[:-1]


def _recv(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def test_burst_of_wrong_passwords_is_slowed_per_source_and_logged_once(broker: SkredProcess) -> None:
    attempts = 12
    t0 = time.monotonic()
    for _ in range(attempts):
        assert not amqp_login(broker.port, "guest", WRONG)
    burst = time.monotonic() - t0
    # 5 free failures, then waits of 0.05, 0.1, 0.2, 0.4, 0.8, 1.6 s (doubling): >= 3.15 s in all.
    # Without the throttle the 12 attempts take a few milliseconds each.
    assert burst >= 3.0, f"12 wrong passwords took only {burst:.2f}s: not throttled"

    # Another source is not delayed, even while 127.0.0.1's next check is seconds away...
    t1 = time.monotonic()
    assert amqp_login(broker.port, "guest", "guest", source="127.0.0.2")  # 127/8 is loopback: guest may
    other = time.monotonic() - t1
    assert other < 1.5, f"a login from another source waited {other:.2f}s"
    # ...while the throttled source waits its turn even with the right password (the
    # throttle cannot know a guess is right before checking it), and then gets in.
    t2 = time.monotonic()
    assert amqp_login(broker.port, "guest", "guest")
    same = time.monotonic() - t2
    # (its next slot: 1.6 s doubled, capped at 2 s, after the last failure; minus the time since)
    assert same >= 1.0, f"the throttled source was checked after only {same:.2f}s"

    log = broker.log_text()
    assert log.count("slowing down further attempts from it") == 1, log
    assert log.count("login refused for user 'guest' from 127.0.0.1") == 5  # the free ones, one line each
    assert WRONG not in log


def test_http_basic_auth_is_throttled_too(broker: SkredProcess) -> None:
    def get(password: str) -> int:
        req = urllib.request.Request(f"http://127.0.0.1:{broker.mgmt_port}/api/whoami")
        req.add_header("Authorization", "Basic " + base64.b64encode(f"guest:{password}".encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=20) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)

    wait_until(lambda: get("guest") == 200, 10, "management API")
    t0 = time.monotonic()
    codes = [get(WRONG) for _ in range(10)]
    burst = time.monotonic() - t0
    assert codes == [401] * 10
    assert burst >= 0.7, f"10 wrong HTTP passwords took only {burst:.2f}s"  # waits 0.05+0.1+0.2+0.4
    assert WRONG not in broker.log_text()
