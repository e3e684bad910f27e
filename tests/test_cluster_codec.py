"""Replication codec and file application, without sockets."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker.cluster import codec
from broker.cluster.files import is_replicated
from broker.cluster.follower import Applier
from broker.cluster.leader import FileIndex


def test_hello_round_trip_and_partial_input() -> None:
    raw = codec.encode_hello(b"s" * 32, "node-1")
    for cut in range(len(raw)):
        assert codec.parse_hello(raw[:cut]) is None
    hello, used = codec.parse_hello(raw + b"extra") or (None, 0)
    assert hello == codec.Hello(codec.VERSION, b"s" * 32, "node-1")
    assert used == len(raw)


def test_hello_with_wrong_magic_is_refused() -> None:
    with pytest.raises(codec.CodecError):
        codec.parse_hello(b"AMQP\x00\x00\x09\x01")
    with pytest.raises(codec.CodecError):
        codec.parse_hello(b"X")


def test_welcome_round_trip() -> None:
    ports = (5672, 15672, 5671, 15671, 9980, 18800, 1883, 8883, 5552, 5551)
    w = codec.parse_welcome(codec.encode_welcome(codec.OK, ports))
    assert w == codec.Welcome(codec.OK, ports)
    assert w.ports[codec.LMQ_RPC_PORT] == 18800 and codec.PORT_NAMES[codec.AMQPS_PORT] == "amqps"
    assert w.ports[codec.MQTT_PORT] == 1883 and codec.PORT_NAMES[codec.MQTT_PORT] == "mqtt"
    assert w.ports[codec.MQTTS_PORT] == 8883 and codec.PORT_NAMES[codec.MQTTS_PORT] == "mqtts"
    assert w.ports[codec.STREAM_PORT] == 5552 and codec.PORT_NAMES[codec.STREAM_PORT] == "stream"
    assert w.ports[codec.STREAMS_PORT] == 5551 and codec.PORT_NAMES[codec.STREAMS_PORT] == "streams"
    assert codec.parse_welcome(codec.encode_welcome(codec.BAD_SECRET)).status == codec.BAD_SECRET


def test_tunnel_hello_round_trip_partial_input_and_dispatch() -> None:
    raw = codec.encode_tunnel_hello(b"s" * 32, codec.LMQ_HTTP_PORT, ("2001:db8::7", 40000))
    for cut in range(len(raw)):
        assert codec.parse_opening(raw[:cut]) is None
    hello, used = codec.parse_opening(raw + b"client bytes") or (None, 0)
    assert hello == codec.TunnelHello(codec.VERSION, b"s" * 32, codec.LMQ_HTTP_PORT, ("2001:db8::7", 40000))
    assert used == len(raw)
    with pytest.raises(codec.CodecError):  # a replication follower's parser refuses a tunnel
        codec.parse_hello(raw)
    opened = codec.parse_opening(codec.encode_hello(b"s" * 32, "n1"))
    assert opened is not None and opened[0] == codec.Hello(codec.VERSION, b"s" * 32, "n1")
    with pytest.raises(codec.CodecError):
        codec.parse_opening(codec.encode_tunnel_hello(b"s", codec.CLIENT_PORTS, ("1.2.3.4", 1)))


def test_tunnel_hello_carries_the_clients_tls_bounded() -> None:
    tlv = b"\x20\x00\x05\x01\x00\x00\x00\x00"  # what broker.tls.carried writes; opaque here
    raw = codec.encode_tunnel_hello(b"s" * 32, codec.AMQP_PORT, ("10.0.0.1", 5000), tls=tlv)
    for cut in range(len(raw)):
        assert codec.parse_opening(raw[:cut]) is None
    hello, used = codec.parse_opening(raw + b"AMQP") or (None, 0)
    assert isinstance(hello, codec.TunnelHello) and hello.tls == tlv and used == len(raw)
    with pytest.raises(ValueError):
        codec.encode_tunnel_hello(b"s", codec.AMQP_PORT, ("10.0.0.1", 1), tls=bytes(codec.MAX_TUNNEL_TLS + 1))
    long = raw[:-len(tlv) - 2] + (codec.MAX_TUNNEL_TLS + 1).to_bytes(2, "big")
    with pytest.raises(codec.CodecError):
        codec.parse_opening(long)
    # a client of one of the follower's Unix sockets (version 7); any other name is refused
    unix = codec.parse_opening(codec.encode_tunnel_hello(b"s", codec.MQTT_PORT, (codec.UNIX_CLIENT, 0)))
    assert unix is not None and unix[0].client == ("unix", 0)  # type: ignore[union-attr]
    with pytest.raises(codec.CodecError):
        codec.parse_opening(codec.encode_tunnel_hello(b"s", codec.MQTT_PORT, ("localhost", 0)))


def test_messages_split_at_every_byte_boundary() -> None:
    msgs = [
        codec.encode_append("a/b", b"xyz"),
        codec.encode_replace("meta", b"\x00" * 28),
        codec.encode_delete("a/c"),
        codec.encode_file_list([codec.FileInfo("a/b", 3, hashlib.sha1(b"xyz").digest())]),
        codec.encode(codec.BULK_DONE, b""),
        codec.encode_ack(12345),
    ]
    stream = b"".join(msgs)
    for cut in range(len(stream) + 1):
        r = codec.MessageReader()
        got = r.feed(stream[:cut]) + r.feed(stream[cut:])
        assert [m.size for m in got] == [len(m) for m in msgs]
    r = codec.MessageReader()
    got = r.feed(stream)
    assert codec.parse_path_data(got[0].payload) == ("a/b", b"xyz")
    assert codec.parse_path_data(got[1].payload) == ("meta", b"\x00" * 28)
    assert codec.parse_delete(got[2].payload) == "a/c"
    assert codec.parse_file_list(got[3].payload) == [codec.FileInfo("a/b", 3, hashlib.sha1(b"xyz").digest())]
    assert got[4].kind == codec.BULK_DONE
    assert codec.parse_ack(got[5].payload) == 12345


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/\0"])
def test_unsafe_paths_are_refused(path: str) -> None:
    raw = path.encode()
    payload = len(raw).to_bytes(2, "big") + raw + b"data"
    with pytest.raises(codec.CodecError):
        codec.parse_path_data(payload)


def test_oversized_message_is_refused() -> None:
    head = bytes([codec.APPEND]) + (codec.MAX_PAYLOAD + 1).to_bytes(4, "big")
    with pytest.raises(codec.CodecError):
        codec.MessageReader().feed(head)


@given(st.lists(st.binary(max_size=3000), max_size=20), st.integers(min_value=1, max_value=97))
def test_compressed_stream_survives_any_chunking(batches: list[bytes], chunk: int) -> None:
    c, d = codec.StreamCompressor(), codec.StreamDecompressor()
    wire = b"".join(c.compress(b) for b in batches)
    out = b"".join(d.decompress(wire[i:i + chunk]) for i in range(0, len(wire), chunk))
    assert out == b"".join(batches)


def test_each_batch_is_decodable_on_arrival() -> None:
    c, d = codec.StreamCompressor(), codec.StreamDecompressor()
    for i in range(50):
        data = os.urandom(10) + b"a" * (i * 37)
        assert d.decompress(c.compress(data)) == data


def test_corrupt_frame_is_a_codec_error() -> None:
    frame = codec.StreamCompressor().compress(b"hello world" * 10)
    bad = frame[:4] + b"\xff" * (len(frame) - 4)
    with pytest.raises(codec.CodecError):
        codec.StreamDecompressor().decompress(bad)


def test_local_files_are_not_replicated() -> None:
    assert not is_replicated(".node_id")
    assert not is_replicated(".lock")
    assert not is_replicated("transient/abc/msgs.0000000001")
    assert not is_replicated("users.json.tmp")
    assert is_replicated("users.json")
    assert is_replicated("abc/def/msgs.0000000001")


def _apply_all(applier: Applier, raw: bytes) -> list[str] | None:
    request = None
    for m in codec.MessageReader().feed(raw):
        r = applier.apply(m)
        if r is not None:
            request = r
    applier.finish_batch()
    return request


def test_follower_bulk_sync_and_stream_reproduce_the_leader(tmp_path: Path) -> None:
    leader_dir, follower_dir = tmp_path / "l", tmp_path / "f"
    (leader_dir / "q").mkdir(parents=True)
    follower_dir.mkdir()
    (leader_dir / "users.json").write_bytes(b'{"a": 1}')
    (leader_dir / "q" / "msgs.1").write_bytes(b"HEAD" + b"r1")
    (leader_dir / ".node_id").write_text("leader")
    # The follower has a stale copy, a file the leader lacks, and its own node id.
    (follower_dir / "users.json").write_bytes(b'{"a": 0}')
    (follower_dir / "gone.json").write_bytes(b"x")
    (follower_dir / ".node_id").write_text("follower")

    index = FileIndex(leader_dir)
    index.scan()
    assert set(index.files) == {"users.json", "q/msgs.1"}
    # Logical lengths drive the checksums: an append extends the running hash.
    index.append("q/msgs.1", b"r2")
    (leader_dir / "q" / "msgs.1").write_bytes(b"HEADr1r2" + b"\0" * 100)  # preallocated tail
    snap = index.snapshot()
    info = {f.path: f for f in snap}
    assert info["q/msgs.1"].length == 8
    assert info["q/msgs.1"].sha1 == hashlib.sha1(b"HEADr1r2").digest()

    applier = Applier(follower_dir)
    request = _apply_all(applier, codec.encode_file_list(snap))
    assert sorted(request or []) == ["q/msgs.1", "users.json"]
    assert not (follower_dir / "gone.json").exists()
    assert (follower_dir / ".node_id").read_text() == "follower"

    data = b"".join(
        codec.encode_file_data(p, (leader_dir / p).read_bytes()[:info[p].length], True) for p in request or []
    )
    stream = data + codec.encode(codec.BULK_DONE, b"") + b"".join([
        codec.encode_append("q/msgs.1", b"r3"),
        codec.encode_replace("q/meta", b"M" * 28),
        codec.encode_append("q/acks.1", b"\0\0\0\1"),
        codec.encode_delete("q/acks.1"),
    ])
    assert _apply_all(applier, stream) is None
    assert (follower_dir / "users.json").read_bytes() == b'{"a": 1}'
    assert (follower_dir / "q" / "msgs.1").read_bytes() == b"HEADr1r2r3"
    assert (follower_dir / "q" / "meta").read_bytes() == b"M" * 28
    assert not (follower_dir / "q" / "acks.1").exists()
    total = len(codec.encode_file_list(snap)) + len(stream)
    assert applier.applied == total  # the ack counter covers every byte the leader sent
    applier.close()

    # A second sync against the same index requests nothing but the diverged file.
    index.append("q/msgs.1", b"r3")
    index.replace("q/meta", b"M" * 28)
    applier = Applier(follower_dir)
    assert _apply_all(applier, codec.encode_file_list(index.snapshot())) == []
    applier.close()


def test_welcome_status_codes_are_distinct() -> None:
    assert len({codec.OK, codec.BAD_VERSION, codec.BAD_SECRET}) == 3
    for status in (codec.OK, codec.BAD_VERSION, codec.BAD_SECRET):
        assert codec.parse_welcome(codec.encode_welcome(status)).status == status


def test_heartbeat_is_a_counted_message() -> None:
    """A heartbeat is acked like data (so a silent link shows as missing acks on the leader)."""
    msg = codec.encode(codec.HEARTBEAT, b"")
    [m] = codec.MessageReader().feed(msg)
    assert m.kind == codec.HEARTBEAT and m.size == len(msg) > 0


@pytest.mark.parametrize("host", ["not-an-ip", "10.0.0.1\nforged log line", ""])
def test_tunnel_hello_names_its_client_by_an_ip_address(host: str) -> None:
    """The client address becomes the connection's peer on the leader (logs, the loopback rule
    of guest): anything but an IP address is refused before any of that sees it."""
    with pytest.raises(codec.CodecError):
        codec.parse_opening(codec.encode_tunnel_hello(b"s" * 32, codec.AMQP_PORT, (host, 1)))


def test_merge_acks_round_trip() -> None:
    positions = struct.pack("<3I", 8, 100, 4000)
    msg = codec.encode_merge_acks("vh/q/acks.0000000001", 5000, b"h" * 20, positions)
    [m] = codec.MessageReader().feed(msg)
    assert m.kind == codec.MERGE_ACKS
    assert codec.parse_merge_acks(m.payload) == ("vh/q/acks.0000000001", 5000, b"h" * 20, [8, 100, 4000])
    with pytest.raises(codec.CodecError):
        codec.parse_merge_acks(m.payload[:-1])  # not whole u32 entries


def test_a_tunnel_may_name_the_metrics_port_which_no_welcome_tells() -> None:
    # the cluster leader's metrics port asks each serving node's (http/forward.py); a follower
    # proxies only the ports a Welcome tells, and the Welcome's size is unchanged
    raw = codec.encode_tunnel_hello(b"s" * 32, codec.METRICS_PORT, ("10.0.0.1", 5000))
    opened = codec.parse_opening(raw)
    assert opened is not None and opened[0].port == codec.METRICS_PORT  # type: ignore[union-attr]
    assert codec.PORT_NAMES[codec.METRICS_PORT] == "metrics"
    assert codec.WELCOME_PORTS == codec.METRICS_PORT and codec.WELCOME_SIZE == 1 + 2 * codec.WELCOME_PORTS
    with pytest.raises(codec.CodecError):
        codec.parse_opening(codec.encode_tunnel_hello(b"s", codec.CLIENT_PORTS, ("1.2.3.4", 1)))
