"""Unit tests (no sockets) for the management API's pure helpers and the policy view."""

from __future__ import annotations

import datetime
import decimal
import json
import types
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands

from broker import properties
from broker.http.common import ApiError, check_name
from broker.http.policies import PolicyApi, validate_policy
from broker.http.render import jsonable, payload_json, properties_json, properties_key


def test_properties_key_is_rabbitmq_style() -> None:
    assert properties_key("", {}) == "~"
    assert properties_key("a.b", {}) == "a.b"
    assert properties_key("a/b", {}) == "a%2Fb"
    with_args = properties_key("rk", {"x-match": "all"})
    assert with_args.startswith("rk~") and len(with_args) > 3
    assert with_args != properties_key("rk", {"x-match": "any"})


def test_jsonable_converts_amqp_values() -> None:
    value = {"b": b"text", "bin": b"\xff\x00", "d": decimal.Decimal("1.5"),
             "t": datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC), "n": [b"x", {"k": 1}]}
    out = jsonable(value)
    json.dumps(out)  # must not raise
    assert out["b"] == "text" and out["d"] == 1.5 and out["t"] == 1577836800 and out["n"] == ["x", {"k": 1}]
    assert out["bin"] == "/wA="


@pytest.mark.parametrize("bad", ["", "x" * 256, "..", "a/../b", "./x"])
def test_check_name_rejects(bad: str) -> None:
    with pytest.raises(ApiError) as ei:
        check_name("queue", bad)
    assert ei.value.status == 400


def test_check_name_takes_control_characters_in_queue_names_only() -> None:
    assert check_name("queue", "a\x00b") == "a\x00b"  # RabbitMQ takes them (tests/test_names.py)
    with pytest.raises(ApiError):
        check_name("vhost", "a\x00b")


def test_check_name_accepts_slashes_and_unicode() -> None:
    assert check_name("vhost", "/") == "/"
    assert check_name("queue", "a/b.c-ü") == "a/b.c-ü"


def test_validate_policy() -> None:
    good = validate_policy("/", "p", {"pattern": "^a", "definition": {"max-length": 1}})
    assert good == {"vhost": "/", "name": "p", "pattern": "^a", "apply-to": "all",
                    "definition": {"max-length": 1}, "priority": 0}
    for body in ({"pattern": "(", "definition": {"a": 1}}, {"pattern": "a", "definition": {}},
                 {"pattern": "a", "definition": {"a": 1}, "priority": "high"},
                 {"pattern": "a", "definition": {"a": 1}, "apply-to": "x"},
                 {"pattern": "a", "definition": {"a": 1}, "extra": 1}, []):
        with pytest.raises(ValueError):
            validate_policy("/", "p", body)


def _vhosts(tmp_path: Path) -> Any:
    from broker.model.vhost import VHost
    from broker.store.sink import NULL_SINK

    def make(name: str) -> VHost:
        return VHost(name, tmp_path / "data", segment_size=1 << 20, sink=NULL_SINK,
                     schedule=lambda f: None, mark_dirty=lambda x: None,
                     transient_root=tmp_path / "transient")

    return types.SimpleNamespace(vhosts={"/": make("/"), "v2": make("v2")}), make


def test_policy_api_uses_the_vhost_model(tmp_path: Path) -> None:
    broker, make = _vhosts(tmp_path)
    api = PolicyApi(broker)
    assert api.put(validate_policy("/", "p1", {"pattern": "a", "definition": {"max-length": 1}}))
    assert not api.put(validate_policy("/", "p1", {"pattern": "b", "definition": {"max-length": 2}}))
    api.put(validate_policy("v2", "p2", {"pattern": "c", "definition": {"max-length": 1}}))
    op = PolicyApi(broker, operator=True)
    op.put(validate_policy("/", "o1", {"pattern": "c", "definition": {"max-length": 1}}))
    assert [p["name"] for p in api.list()] == ["p1", "p2"] and [p["name"] for p in op.list()] == ["o1"]
    assert broker.vhosts["/"].policy_set.policies["p1"].pattern == "b"  # the model holds it
    broker.vhosts = {"/": make("/")}  # reloaded from the vhost's own policies.json
    again = PolicyApi(broker)
    assert again.get("/", "p1")["definition"] == {"max-length": 2}  # type: ignore[index]
    assert again.delete("/", "p1") and not again.delete("/", "p1")


def _page(path: str, objects: list[Any], rendered: list[str]) -> Any:
    from aiohttp.test_utils import make_mocked_request

    from broker.http.common import paginate_objects

    def render(o: Any) -> dict[str, Any]:
        rendered.append(o.name)
        return {"name": o.name, "vhost": o.vhost, "messages": o.messages}
    resp = paginate_objects(make_mocked_request("GET", path), objects, render,
                            lambda o: o.name, {"name": lambda o: o.name, "vhost": lambda o: o.vhost})
    return json.loads(resp.body)


def test_paging_renders_only_the_page() -> None:
    """Filter and page on the objects: a page of a 10k-queue list renders that page only
    (sorting by a rendered field renders the filtered ones, no more)."""
    objects = [types.SimpleNamespace(name=f"q{i:05d}", vhost="/", messages=i % 7) for i in range(10_000)]
    rendered: list[str] = []
    doc = _page("/api/queues?page=2&page_size=50&sort=name&sort_reverse=true&name=q0.*5$&use_regex=true",
                objects, rendered)
    matching = [o.name for o in objects if o.name.startswith("q0") and o.name.endswith("5")]
    assert doc["total_count"] == 10_000 and doc["filtered_count"] == len(matching)
    assert [i["name"] for i in doc["items"]] == sorted(matching, reverse=True)[50:100]
    assert sorted(rendered) == sorted(i["name"] for i in doc["items"])  # the page, nothing else
    rendered.clear()
    doc = _page("/api/queues?page=1&page_size=10&sort=messages&name=q000", objects, rendered)
    assert len(rendered) == 100 and [i["messages"] for i in doc["items"]] == [0] * 10
    rendered.clear()
    doc = _page("/api/queues?name=q0000&columns=name", objects, rendered)  # no page: every match
    assert doc == [{"name": f"q0000{i}"} for i in range(10)] and len(rendered) == 10


def test_messages_render_alike_for_queue_get_and_the_stream_reader() -> None:
    """One rendering of a message's properties and payload for ``POST .../get`` and the stream
    reader: management API property names, only those set, UTF-8 text or base64."""
    raw = properties.encode(commands.Basic.Properties(
        message_type="order", content_type="text/plain", headers={"k": "v"}))
    assert properties_json(raw) == {"type": "order", "content_type": "text/plain", "headers": {"k": "v"}}
    assert properties_json(b"\x00\x00") == {} and properties_json(b"\xff\xff\x01") == {}
    assert payload_json("é".encode(), "auto") == {"payload": "é", "payload_encoding": "string"}
    assert payload_json(b"\xff", "auto") == {"payload": "/w==", "payload_encoding": "base64"}
    assert payload_json(b"hi", "base64") == {"payload": "aGk=", "payload_encoding": "base64"}
