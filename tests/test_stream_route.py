"""The stream protocol's login replayed to the node serving a vhost (``broker/cluster/stream_route.py``)
and the cluster leader's carrier saying "moving, retry" (``broker/cluster/elsewhere.py``): sans-IO,
no sockets."""

from __future__ import annotations

import struct

import pytest

from broker import errors
from broker.cluster.elsewhere import Elsewhere
from broker.cluster.proxy import SpliceProxy, Target
from broker.cluster.stream_route import StreamReplay, frames
from broker.cluster.vhost_route import Failed
from broker.streamproto import codec as C
from broker.streamwire import frame


def _request(key: int, corr: int, body: bytes = b"") -> bytes:
    return frame(key, struct.pack(">I", corr) + body)


PEER = _request(C.PEER_PROPERTIES, 1, C.props_bytes({"product": "t"}))
HANDSHAKE = _request(C.SASL_HANDSHAKE, 2)
AUTH = _request(C.SASL_AUTHENTICATE, 3, b"\x00\x05PLAIN\x00\x00\x00\x0c\x00guest\x00guest")
TUNE_OK = C.encode_tune(1048576, 60)  # the client's answer to the leader's Tune
LOGIN = PEER + HANDSHAKE + AUTH + TUNE_OK
OPEN = _request(C.OPEN, 4, b"\x00\x06shard3")
AFTER = _request(C.METADATA, 5, b"\x00\x00\x00\x00")  # pipelined after Open


def _to_auth(rep: StreamReplay) -> None:
    assert rep.start() == PEER
    assert rep.receive(C.response(C.PEER_PROPERTIES, 1, C.OK, C.props_bytes({}))) == HANDSHAKE
    assert rep.receive(C.response(C.SASL_HANDSHAKE, 2, C.OK, b"\x00\x00\x00\x00")) == AUTH


def test_the_login_is_replayed_one_request_at_a_time_then_the_open_goes_and_the_sockets_join() -> None:
    rep = StreamReplay(LOGIN, OPEN + AFTER, 1048576)
    _to_auth(rep)
    answer = C.response(C.SASL_AUTHENTICATE, 3, C.OK)
    tune = C.encode_tune(1048576, 60)
    # the node's Tune split across reads: nothing goes until it is whole
    assert rep.receive(answer + tune[:5]) == b""
    assert not rep.spliced
    assert rep.receive(tune[5:]) == TUNE_OK + OPEN + AFTER
    assert rep.spliced and rep.to_client == b""
    opened = C.response(C.OPEN, 4, C.OK)
    assert rep.receive(opened) == b"" and rep.to_client == opened  # spliced: the node's answer


def test_a_login_the_node_refuses_answers_the_clients_open_with_its_code_and_sends_no_open() -> None:
    rep = StreamReplay(LOGIN, OPEN, 1048576)
    _to_auth(rep)
    with pytest.raises(Failed) as failed:
        rep.receive(C.response(C.SASL_AUTHENTICATE, 3, C.AUTHENTICATION_FAILURE))
    ((key, raw),) = frames(failed.value.answer)
    assert key == C.OPEN | C.RESPONSE
    assert struct.unpack_from(">IH", raw, 8) == (4, C.AUTHENTICATION_FAILURE)  # the Open's corr
    assert not rep.spliced


def test_a_node_offering_a_smaller_frame_max_than_the_client_took_is_not_spliced() -> None:
    rep = StreamReplay(LOGIN, OPEN, 1048576)
    _to_auth(rep)
    with pytest.raises(Failed) as failed:
        rep.receive(C.response(C.SASL_AUTHENTICATE, 3, C.OK) + C.encode_tune(4096, 60))
    assert struct.unpack_from(">IH", failed.value.answer, 8) == (4, C.VHOST_ACCESS_FAILURE)


def test_bad_bytes_from_the_node_fail_the_carry() -> None:
    rep = StreamReplay(LOGIN, OPEN, 0)
    rep.start()
    with pytest.raises(Failed):
        rep.receive(struct.pack(">I", 2) + b"\x00\x00")  # a frame too short for a key
    with pytest.raises(Failed):
        StreamReplay(PEER + HANDSHAKE, OPEN, 0)  # no SaslAuthenticate kept: nothing to replay


def test_a_vhost_closed_here_whose_server_is_not_known_yet_is_retried_not_refused() -> None:
    closed = {"moving"}
    carrier = SpliceProxy("carrier", Target(), False, None)
    where = Elsewhere(lambda v: v == "there", carrier, closed)
    assert where.elsewhere("there") is True
    assert where.elsewhere("here") is False
    with pytest.raises(errors.NotAllowed, match="moving to another node"):
        where.elsewhere("moving")
