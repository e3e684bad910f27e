"""The stream protocol's codec against rstream's own encoder and decoder (no sockets), and the
super-stream helpers' pure parts (layout, MurmurHash3 against the mmh3 package)."""

from __future__ import annotations

import os

import mmh3
import pytest
from rstream import schema
from rstream.constants import OffsetType
from rstream.encoding import decode_frame, encode_frame, encode_publish

from broker.model import superstream
from broker.model.murmur3 import murmur3_32
from broker.streamproto import codec as C
from broker.streamproto.session import as_stream_message, create_arguments


def _body(frame_bytes: bytes) -> bytes:
    """rstream's decode_frame takes a frame without its size prefix."""
    return frame_bytes[4:]


def test_frame_reader_splits_partial_input_and_bounds_size() -> None:
    data = encode_frame(schema.Heartbeat()) + encode_frame(schema.SaslHandshake(correlation_id=5))
    r = C.FrameReader(1024)
    got = []
    for i in range(len(data)):  # one byte at a time: "need more" is no frame, never an error
        got += r.feed(data[i : i + 1])
    assert [(f.key, f.version) for f in got] == [(C.HEARTBEAT, 1), (C.SASL_HANDSHAKE, 1)]
    assert r.buffered == 0
    with pytest.raises(C.FrameTooLarge) as exc:
        C.FrameReader(16).feed(b"\x00\x00\x01\x00\x00\x01\x00\x01")
    assert exc.value.code == C.FRAME_TOO_LARGE
    with pytest.raises(C.Malformed):
        C.FrameReader(16).feed(b"\x00\x00\x00\x02\x00\x01")


def test_requests_rstream_encodes_decode_here() -> None:
    sub = schema.Subscribe(correlation_id=3, subscription_id=2, stream="s",
                           offset_spec=schema.OffsetSpec.from_params(OffsetType.TIMESTAMP, 1700000000000),
                           credit=10, properties=[schema.Property("name", "g")])
    (f,) = C.FrameReader(0).feed(encode_frame(sub))
    s = C.decode_subscribe(f.payload)
    assert (s.corr, s.sub_id, s.stream, s.credit, s.properties) == (3, 2, "s", 10, {"name": "g"})
    assert s.offset == C.OffsetSpec(C.OFFSET_TIMESTAMP, 1700000000000)
    for version, filt in ((1, None), (2, "eu")):
        pub = schema.Publish(publisher_id=4,
                             messages=[schema.Message(9, filt, b"abc"), schema.Message(10, filt, b"")])
        (f,) = C.FrameReader(0).feed(encode_publish(pub, version))
        pub_id, msgs = C.decode_publish(f.payload, f.version)
        assert pub_id == 4 and [(m.publishing_id, m.filter_value, m.data) for m in msgs] == \
            [(9, filt, b"abc"), (10, filt, b"")]
    with pytest.raises(C.Malformed):  # cut short
        C.decode_subscribe(f.payload[:5])


def test_answers_decode_with_rstream() -> None:
    deliver = decode_frame(_body(C.encode_deliver(3, 40, 1234, [b"a", b"bc", b""])))
    assert isinstance(deliver, schema.Deliver)  # rstream checks the CRC and the data length itself
    assert (deliver.subscription_id, deliver.chunk_first_offset, deliver.timestamp) == (3, 40, 1234)
    assert deliver.get_messages() == [b"a", b"bc", b""]
    meta = decode_frame(_body(C.encode_metadata(8, "127.0.0.1", 5552, [("s", True), ("gone", False)])))
    assert isinstance(meta, schema.MetadataResponse)
    assert meta.brokers == [schema.Broker(0, "127.0.0.1", 5552)]
    assert [(m.name, m.response_code, m.leader_ref) for m in meta.metadata] == \
        [("s", C.OK, 0), ("gone", C.STREAM_DOES_NOT_EXIST, 0xFFFF)]
    versions = decode_frame(_body(C.encode_command_versions(2)))
    assert isinstance(versions, schema.ExchangeCommandVersionResponse)
    publish = versions.command_versions[C.PUBLISH - 1]  # rstream reads it by position: key - 1
    assert (publish.key_command, publish.max_version) == (C.PUBLISH, 2)
    confirm = decode_frame(_body(C.encode_confirm(1, [5, 6])))
    assert isinstance(confirm, schema.PublishConfirm) and confirm.publishing_ids == [5, 6]
    err = decode_frame(_body(C.encode_publish_error(1, [(5, C.STREAM_NOT_AVAILABLE)])))
    assert isinstance(err, schema.PublishError) and err.errors[0].response_code == C.STREAM_NOT_AVAILABLE
    upd = decode_frame(_body(C.encode_consumer_update(4, 2, True)))
    assert isinstance(upd, schema.ConsumerUpdateResponse) and (upd.subscription_id, upd.active) == (2, 1)
    tune = decode_frame(_body(C.encode_tune(1 << 20, 60)))
    assert isinstance(tune, schema.Tune) and (tune.frame_max, tune.heartbeat) == (1 << 20, 60)
    close = decode_frame(_body(C.encode_close(1, C.UNKNOWN_FRAME, "bad")))
    assert isinstance(close, schema.Close) and close.reason == "bad"


def test_messages_of_other_protocols_become_amqp_1_0_data_sections() -> None:
    from rstream import amqp_decoder
    for body in (b"short", os.urandom(300)):
        msg = amqp_decoder(as_stream_message(b"\x10\x00\x02", body))  # AMQP 0-9-1 properties
        assert bytes(msg.body) == body


def test_create_arguments_map_rabbitmq_names() -> None:
    assert create_arguments({"max-length-bytes": "100", "max-age": "1h", "queue-leader-locator": "x"}) == \
        {"x-queue-type": "stream", "x-max-length-bytes": 100, "x-max-age": "1h"}
    with pytest.raises(ValueError):
        create_arguments({"max-length-bytes": "lots"})


def test_super_stream_layout_and_hash() -> None:
    assert superstream.layout("s", partitions=3) == [("s-0", "0"), ("s-1", "1"), ("s-2", "2")]
    assert superstream.layout("s", binding_keys=["eu", "us"]) == [("s-eu", "eu"), ("s-us", "us")]
    for bad in ({"partitions": 0}, {"binding_keys": ["a", "a"]}, {"partitions": 2, "binding_keys": ["a"]},
                {"partitions": superstream.MAX_PARTITIONS + 1}):
        with pytest.raises(ValueError):
            superstream.layout("s", **bad)  # type: ignore[arg-type]
    for n in range(200):
        data = os.urandom(n % 41)
        assert murmur3_32(data) == mmh3.hash(data, 104729, signed=False)
    assert superstream.partition_for_key("hello", 3) == mmh3.hash(b"hello", 104729, signed=False) % 3


def test_publish_with_sub_entries_unpacks_plain_and_gzip_and_bounds_them() -> None:
    import gzip
    import struct

    def sub(records: list[bytes], gz: bool, kind: int | None = None, raw_size: int | None = None) -> bytes:
        raw = b"".join(struct.pack(">I", len(r)) + r for r in records)
        data = gzip.compress(raw) if gz else raw
        head = 0x80 | ((1 if gz else 0) << 4) if kind is None else kind
        return struct.pack(">BHII", head, len(records), len(raw) if raw_size is None else raw_size,
                           len(data)) + data

    simple = struct.pack(">Qi", 3, 2) + b"m3"
    payload = bytes([4]) + struct.pack(">i", 3) + struct.pack(">Q", 1) + sub([b"a", b"bb"], False) \
        + struct.pack(">Q", 2) + sub([b"c" * 100] * 3, True) + simple
    b = C.decode_publish_batch(payload, 1)
    assert (b.pub_id, b.ids, b.groups) == (4, [1, 2, 3], [[b"a", b"bb"], [b"c" * 100] * 3, [b"m3"]])
    for bad in (sub([b"x"], False, kind=0x80 | (2 << 4)),  # snappy
                sub([b"x"], True, raw_size=C.SUB_ENTRY_MAX + 1),  # more than we inflate
                sub([b"x"], True, raw_size=2),  # inflates to other than it said
                sub([b"x"], False)[:-1]):  # cut
        with pytest.raises(C.Malformed):
            C.decode_publish_batch(bytes([4]) + struct.pack(">iQ", 1, 1) + bad, 1)
