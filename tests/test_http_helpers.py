"""Unit tests (no sockets) for the management API's pure helpers and the policy store."""

from __future__ import annotations

import datetime
import decimal
import json
from pathlib import Path

import pytest

from broker.http.common import ApiError, check_name
from broker.http.policies import PolicyStore, validate_policy
from broker.http.render import jsonable, properties_key


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


@pytest.mark.parametrize("bad", ["", "x" * 256, "a\x00b", "..", "a/../b", "./x"])
def test_check_name_rejects(bad: str) -> None:
    with pytest.raises(ApiError) as ei:
        check_name("queue", bad)
    assert ei.value.status == 400


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


def test_policy_store_persists(tmp_path: Path) -> None:
    path = tmp_path / "policies.json"
    store = PolicyStore(path)
    assert store.put(validate_policy("/", "p1", {"pattern": "a", "definition": {"x": 1}}))
    assert not store.put(validate_policy("/", "p1", {"pattern": "b", "definition": {"x": 1}}))
    store.put(validate_policy("v2", "p2", {"pattern": "c", "definition": {"x": 1}}))
    again = PolicyStore(path)
    assert [p["name"] for p in again.list()] == ["p1", "p2"]
    assert again.get("/", "p1")["pattern"] == "b"  # type: ignore[index]
    again.clear_vhost("v2")
    assert [p["name"] for p in PolicyStore(path).list()] == ["p1"]
    assert again.delete("/", "p1") and not again.delete("/", "p1")
