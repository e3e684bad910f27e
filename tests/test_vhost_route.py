"""The AMQP vhost routing machines (``broker/cluster/vhost_route.py``), with no sockets: a client's
handshake read up to ``connection.open`` and replayed to the vhost's owner, byte for byte."""

from __future__ import annotations

import pytest
from pamqp import commands, frame, heartbeat

from broker.cluster.vhost_route import (
    MAX_INPUT,
    PROTOCOL_HEADER,
    Failed,
    Limits,
    OpenReader,
    Replay,
)

LIMITS = Limits(channel_max=2047, frame_max=131072, heartbeat=60)
PROPS = {"product": "Skred", "capabilities": {"publisher_confirms": True}}


def m(value: object, channel: int = 0) -> bytes:
    return frame.marshal(value, channel)  # type: ignore[arg-type]


START_OK = m(commands.Connection.StartOk(client_properties={"product": "t"}, mechanism="PLAIN",
                                         response="\0guest\0guest", locale="en_US"))
TUNE_OK = m(commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=60))
OPEN = m(commands.Connection.Open(virtual_host="v1"))
CHANNEL_OPEN = m(commands.Channel.Open(), 1)


def decode(data: bytes) -> list[object]:
    out = []
    while data:
        used, _ch, value = frame.unmarshal(data)
        out.append(value)
        data = data[used:]
    return out


def read_open(*chunks: bytes) -> tuple[OpenReader, bytes]:
    """The client's side up to open, the owner admitting its login as soon as it is asked."""
    reader = OpenReader(LIMITS, PROPS)
    said = b""
    for c in chunks:
        said += reader.receive(c)
        if reader.login is not None and reader.opened is None and not reader.admitted:
            said += reader.admit()
    return reader, said


def owner_login() -> tuple[Replay, bytes]:
    """A replay of START_OK to an owner that accepts it (its start and tune went no further)."""
    replay = Replay(START_OK)
    assert replay.start() == PROTOCOL_HEADER
    owner_start = m(commands.Connection.Start(server_properties=PROPS, mechanisms="PLAIN AMQPLAIN"))
    assert replay.receive(owner_start) == START_OK
    owner_tune = m(commands.Connection.Tune(channel_max=2047, frame_max=131072, heartbeat=60))
    return replay, owner_tune


def test_the_handshake_is_read_up_to_open_and_kept_as_it_arrived() -> None:
    wire = PROTOCOL_HEADER + START_OK + TUNE_OK + m(heartbeat.Heartbeat()) + OPEN + CHANNEL_OPEN
    reader, said = read_open(*(wire[i:i + 7] for i in range(0, len(wire), 7)))  # any split
    start, tune = decode(said)
    assert isinstance(start, commands.Connection.Start) and start.server_properties == PROPS
    assert isinstance(tune, commands.Connection.Tune) and tune.frame_max == LIMITS.frame_max
    opened = reader.opened
    assert opened is not None and opened.vhost == "v1"
    assert (opened.start_ok, opened.tune_ok, opened.open) == (START_OK, TUNE_OK, OPEN)
    assert opened.rest == CHANNEL_OPEN  # pipelined after open: kept for the owner
    reader.receive(b"more")
    assert opened.rest == CHANNEL_OPEN + b"more"


def test_the_client_is_tuned_only_once_an_owner_accepted_its_login() -> None:
    """A direct broker answers bad credentials right after start-ok, before tune; so must a
    routed one (pika tells "authentication" from "access denied" by that step)."""
    reader = OpenReader(LIMITS, PROPS)
    said = reader.receive(PROTOCOL_HEADER + START_OK)
    assert [type(f) for f in decode(said)] == [commands.Connection.Start]
    assert reader.login == START_OK and reader.opened is None
    assert reader.receive(m(heartbeat.Heartbeat())) == b""  # nothing more until admitted
    (tune,) = decode(reader.admit())
    assert isinstance(tune, commands.Connection.Tune)
    assert reader.receive(TUNE_OK + OPEN) == b"" and reader.opened is not None


def test_the_owner_gets_the_clients_frames_and_the_client_the_owners_answer() -> None:
    reader, _said = read_open(PROTOCOL_HEADER + START_OK + TUNE_OK + OPEN + CHANNEL_OPEN)
    assert reader.opened is not None
    replay, owner_tune = owner_login()
    assert replay.receive(owner_tune) == b"" and replay.admitted and not replay.spliced
    open_ok = m(commands.Connection.OpenOk())
    replay.receive(open_ok[:5])  # open-ok split across reads (an owner answering early)
    sent = replay.finish(reader.opened)
    assert sent == TUNE_OK + OPEN + CHANNEL_OPEN and replay.spliced
    replay.receive(open_ok[5:])
    assert replay.to_client == open_ok  # the owner's start and tune went no further


def test_an_owner_refusing_the_credentials_is_heard_by_the_client_before_tune() -> None:
    replay = Replay(START_OK)
    replay.receive(m(commands.Connection.Start(server_properties=PROPS)))
    close = m(commands.Connection.Close(403, "ACCESS_REFUSED - Login was refused", 0, 0))
    assert replay.receive(close) == b"" and replay.spliced and not replay.admitted
    assert replay.to_client == close


def test_an_owner_with_lower_limits_fails_the_route_with_320() -> None:
    reader, _said = read_open(PROTOCOL_HEADER + START_OK + TUNE_OK + OPEN)
    assert reader.opened is not None
    replay, _tune = owner_login()
    replay.receive(m(commands.Connection.Tune(channel_max=2047, frame_max=8192, heartbeat=60)))
    with pytest.raises(Failed) as err:
        replay.finish(reader.opened)
    (close,) = decode(err.value.answer)
    assert isinstance(close, commands.Connection.Close) and close.reply_code == 320


def test_bad_input_ends_the_handshake_with_the_protocols_answer() -> None:
    with pytest.raises(Failed) as err:
        read_open(b"GET / HTTP/1.1\r\n")
    assert err.value.answer == PROTOCOL_HEADER  # spec 4.2.2
    huge = bytes((1, 0, 0)) + (MAX_INPUT + 1).to_bytes(4, "big") + b"\0" * 16
    with pytest.raises(Failed):
        read_open(PROTOCOL_HEADER + huge)
    with pytest.raises(Failed):  # open before start-ok and tune-ok
        read_open(PROTOCOL_HEADER + OPEN)
    with pytest.raises(Failed):  # a handshake that never ends
        read_open(PROTOCOL_HEADER, *([m(heartbeat.Heartbeat())] * (MAX_INPUT // 8 + 1)))
