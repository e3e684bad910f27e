"""Exchange routing (broker/model/exchange.py): topic patterns, headers matching, bindings."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import errors
from broker.model.exchange import Exchange, args_key, headers_match, topic_match, topic_regex

HYPO = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def regex_match(pattern: str, key: str) -> bool:
    return topic_regex(pattern).fullmatch("." + key)


def no_headers() -> dict[str, Any] | None:
    return None


# -------------------------------------------------------------- topic
# RabbitMQ tutorial 5 bindings and the routing it documents.
TUTORIAL = [
    ("quick.orange.rabbit", {"Q1", "Q2"}),
    ("lazy.orange.elephant", {"Q1", "Q2"}),
    ("quick.orange.fox", {"Q1"}),
    ("lazy.brown.fox", {"Q2"}),
    ("lazy.pink.rabbit", {"Q2"}),  # matches two Q2 bindings, delivered once
    ("quick.brown.fox", set()),
    ("orange", set()),
    ("quick.orange.new.rabbit", set()),
    ("lazy.orange.new.rabbit", {"Q2"}),
    ("lazy", {"Q2"}),
]


@pytest.mark.parametrize("key,expected", TUTORIAL)
def test_topic_tutorial_examples(key: str, expected: set[str]) -> None:
    ex = Exchange("logs", "topic")
    ex.bind("Q1", "*.orange.*")
    ex.bind("Q2", "*.*.rabbit")
    ex.bind("Q2", "lazy.#")
    routed = list(ex.route(key, no_headers))
    assert len(routed) == len(set(routed))
    assert set(routed) == expected


@pytest.mark.parametrize(
    "pattern,key,expected",
    [
        ("#", "", True),
        ("#", "a", True),
        ("#", "a.b.c", True),
        ("#.#", "", True),
        ("#.#", "a.b", True),
        ("#.a", "a", True),
        ("#.a", "x.y.a", True),
        ("#.a", "a.x", False),
        ("a.#", "a", True),
        ("a.#", "a.b.c", True),
        ("a.#", "b.a", False),
        ("a.#.b", "a.b", True),
        ("a.#.b", "a.x.y.b", True),
        ("a.#.b", "a.x.y", False),
        ("a.#.#.b", "a.b", True),
        ("*", "a", True),
        ("*", "a.b", False),
        ("*.*", "a", False),
        ("a.*", "a.", True),  # an empty last word is still a word
        ("a.*", "a", False),
        ("*.b", ".b", True),
        ("a..b", "a..b", True),
        ("a..b", "a.b", False),
        ("#.*", "a", True),
        ("*.#", "a.b.c", True),
        ("#.*.#", "", True),
        ("a", "a", True),
        ("a", "ab", False),
        ("a", "A", False),
        ("a+b", "a+b", True),  # regex metacharacters are literal
        ("a+b", "aab", False),
        ("(.*)", "(x)", False),
        ("[a]", "[a]", True),
        ("", "", True),
        ("", "a", False),
        ("a*", "ab", False),  # * only as a whole word is a wildcard
        ("a*", "a*", True),
        ("a#", "a.b", False),
        ("a\nb", "a\nb", True),
    ],
)
def test_topic_cases(pattern: str, key: str, expected: bool) -> None:
    assert topic_match(pattern, key) is expected
    assert regex_match(pattern, key) is expected


words = st.sampled_from(["a", "b", "c", "", "ab", "*x", "x#", "+", "\n"])
pattern_words = st.one_of(words, st.sampled_from(["*", "#", "#", "*"]))


@HYPO
@given(
    pattern=st.lists(pattern_words, min_size=1, max_size=6).map(".".join),
    key=st.lists(words, min_size=1, max_size=7).map(".".join),
)
def test_topic_regex_agrees_with_reference(pattern: str, key: str) -> None:
    assert regex_match(pattern, key) == topic_match(pattern, key)


@settings(HYPO, max_examples=60)
@given(key=st.lists(words, min_size=1, max_size=6).map(".".join))
def test_topic_literal_pattern_matches_only_itself(key: str) -> None:
    literal = key.replace("*", "x").replace("#", "x")
    assert regex_match(literal, literal)
    assert topic_match(literal, literal)
    assert not regex_match(literal, literal + ".z")


@settings(HYPO, max_examples=60)
@given(key=st.lists(words, min_size=1, max_size=6).map(".".join))
def test_hash_matches_everything(key: str) -> None:
    assert regex_match("#", key) and topic_match("#", key)
    assert regex_match("#.#", key) and topic_match("#.#", key)


def test_topic_route_cache_is_invalidated_by_bind_and_unbind() -> None:
    ex = Exchange("t", "topic")
    ex.bind("q1", "a.*")
    assert list(ex.route("a.b", no_headers)) == ["q1"]
    ex.bind("q2", "#")
    assert list(ex.route("a.b", no_headers)) == ["q1", "q2"]
    ex.unbind("q1", "a.*")
    assert list(ex.route("a.b", no_headers)) == ["q2"]


def test_topic_route_with_many_distinct_keys_stays_correct() -> None:
    ex = Exchange("t", "topic")
    ex.bind("even", "*.0")
    ex.bind("all", "k.#")
    for i in range(5000):  # more keys than the memo holds
        key = f"k.{i % 2}" if i % 3 else f"k.{i}.x"
        expected = ["all", "even"] if key == "k.0" else ["all"]
        assert sorted(ex.route(key, no_headers)) == expected, key


# ------------------------------------------------------------ headers
@pytest.mark.parametrize(
    "binding,headers,expected",
    [
        ({"x-match": "all", "a": 1, "b": "x"}, {"a": 1, "b": "x", "c": 2}, True),
        ({"x-match": "all", "a": 1, "b": "x"}, {"a": 1}, False),
        ({"x-match": "all", "a": 1, "b": "x"}, {"a": 1, "b": "y"}, False),
        ({"a": 1, "b": "x"}, {"a": 1, "b": "x"}, True),  # all is the default
        ({"a": 1, "b": "x"}, {"b": "x"}, False),
        ({"x-match": "any", "a": 1, "b": "x"}, {"b": "x"}, True),
        ({"x-match": "any", "a": 1, "b": "x"}, {"a": 2, "b": "y"}, False),
        ({"x-match": "any", "a": 1}, {}, False),
        ({"x-match": "any", "a": 1}, None, False),
        ({"x-match": "all", "a": 1}, None, False),
        ({"x-match": "all"}, None, True),  # nothing to check: all of nothing holds
        ({"x-match": "any"}, {"a": 1}, False),  # any of nothing does not
        ({}, {"a": 1}, True),
        # plain all/any ignore x- binding keys ...
        ({"x-match": "all", "x-tag": "t", "a": 1}, {"a": 1}, True),
        ({"x-match": "any", "x-tag": "t"}, {"x-tag": "t"}, False),
        # ... the -with-x variants compare them
        ({"x-match": "all-with-x", "x-tag": "t", "a": 1}, {"a": 1}, False),
        ({"x-match": "all-with-x", "x-tag": "t", "a": 1}, {"a": 1, "x-tag": "t"}, True),
        ({"x-match": "any-with-x", "x-tag": "t", "a": 1}, {"x-tag": "t"}, True),
        ({"x-match": "any-with-x", "x-tag": "t"}, {"x-tag": "u"}, False),
        # void-valued binding arguments match on presence only
        ({"x-match": "all", "a": None}, {"a": "anything"}, True),
        ({"x-match": "all", "a": None}, {"a": None}, True),
        ({"x-match": "all", "a": None}, {"b": 1}, False),
        ({"x-match": "any", "a": None, "b": 2}, {"a": 0}, True),
        ({"x-match": "all", "a": None, "b": 2}, {"a": 0, "b": 3}, False),
        # x-match given as bytes (longstr decoded without utf-8 guess)
        ({"x-match": b"any", "a": 1, "b": 2}, {"b": 2}, True),
        # nested values compare structurally
        ({"a": {"k": [1, 2]}}, {"a": {"k": [1, 2]}}, True),
        ({"a": {"k": [1, 2]}}, {"a": {"k": [2, 1]}}, False),
        # values are typed: a boolean header is not the integer 1 (True == 1 in Python)
        ({"x-match": "all", "a": 1}, {"a": True}, False),
        ({"x-match": "all", "a": True}, {"a": 1}, False),
        # a missing header is not the same as a void one
        ({"x-match": "all", "a": 1}, {"a": None}, False),
    ],
)
def test_headers_match(binding: dict[str, Any], headers: dict[str, Any] | None, expected: bool) -> None:
    assert headers_match(binding, headers) is expected


def test_headers_exchange_routes_once_per_destination() -> None:
    ex = Exchange("h", "headers")
    ex.bind("q1", "", {"x-match": "any", "a": 1})
    ex.bind("q1", "", {"x-match": "all", "b": 2})
    ex.bind("q2", "", {"x-match": "all", "a": 1, "b": 2})
    calls = []

    def headers_of() -> dict[str, Any] | None:
        calls.append(1)
        return {"a": 1, "b": 2}

    assert sorted(ex.route("ignored", headers_of)) == ["q1", "q2"]
    assert calls == [1]  # headers decoded once per publish
    assert list(ex.route("", lambda: {"b": 2})) == ["q1"]
    assert list(ex.route("", lambda: None)) == []


def test_headers_exchange_without_bindings_never_decodes() -> None:
    ex = Exchange("h", "headers")

    def boom() -> dict[str, Any] | None:
        raise AssertionError("headers decoded with no bindings")

    assert list(ex.route("k", boom)) == []


def test_other_types_never_decode_headers() -> None:
    def boom() -> dict[str, Any] | None:
        raise AssertionError("headers decoded")

    for t in ("direct", "fanout", "topic"):
        ex = Exchange("e", t)
        ex.bind("q", "k")
        assert list(ex.route("k", boom)) == ["q"]


# ----------------------------------------------------------- bindings
def test_unknown_exchange_type() -> None:
    with pytest.raises(errors.CommandInvalid) as info:
        Exchange("e", "x-bogus")
    assert info.value.reply_code == 503


def test_direct_routing() -> None:
    ex = Exchange("d", "direct")
    assert ex.bind("q1", "a")
    assert ex.bind("q2", "a")
    assert ex.bind("q1", "b")
    assert list(ex.route("a", no_headers)) == ["q1", "q2"]
    assert list(ex.route("b", no_headers)) == ["q1"]
    assert list(ex.route("c", no_headers)) == []
    assert list(ex.route("A", no_headers)) == []
    assert ex.unbind("q2", "a")
    assert list(ex.route("a", no_headers)) == ["q1"]


def test_fanout_routing_ignores_key() -> None:
    ex = Exchange("f", "fanout")
    assert list(ex.route("x", no_headers)) == []
    ex.bind("q1", "a")
    ex.bind("q2", "")
    ex.bind("q1", "b")
    assert sorted(ex.route("anything", no_headers)) == ["q1", "q2"]
    ex.unbind("q1", "a")
    assert sorted(ex.route("", no_headers)) == ["q1", "q2"]  # still bound with "b"
    ex.unbind("q1", "b")
    assert list(ex.route("", no_headers)) == ["q2"]


def test_duplicate_binding_is_idempotent() -> None:
    ex = Exchange("d", "direct")
    assert ex.bind("q", "k", {"a": 1})
    assert not ex.bind("q", "k", {"a": 1})
    assert len(ex.bindings()) == 1
    assert list(ex.route("k", no_headers)) == ["q"]
    assert ex.unbind("q", "k", {"a": 1})
    assert not ex.unbind("q", "k", {"a": 1})
    assert not ex.has_bindings()
    assert list(ex.route("k", no_headers)) == []


def test_bindings_with_differing_args_are_distinct() -> None:
    ex = Exchange("d", "direct")
    assert ex.bind("q", "k")
    assert ex.bind("q", "k", {"a": 1})
    assert ex.bind("q", "k", {"a": 2})
    assert ex.bind("q", "k", {"a": True})  # a bool is not the integer 1
    assert not ex.bind("q", "k", {})  # empty args are the same as none
    assert len(ex.bindings()) == 4
    assert list(ex.route("k", no_headers)) == ["q"]
    assert ex.unbind("q", "k", {"a": 1})
    assert not ex.unbind("q", "k", {"a": 3})
    assert list(ex.route("k", no_headers)) == ["q"]
    assert ex.unbind("q", "k")
    assert ex.unbind("q", "k", {"a": 2})
    assert ex.unbind("q", "k", {"a": True})
    assert list(ex.route("k", no_headers)) == []


def test_args_key_is_order_independent() -> None:
    assert args_key({"a": 1, "b": 2}) == args_key({"b": 2, "a": 1})
    assert args_key(None) == args_key({}) == ""
    assert args_key({"a": 1}) != args_key({"a": "1"})


def test_headers_bindings_with_differing_args_route_separately() -> None:
    ex = Exchange("h", "headers")
    ex.bind("q1", "", {"a": 1})
    ex.bind("q2", "", {"a": 2})
    assert list(ex.route("", lambda: {"a": 2})) == ["q2"]
    ex.unbind("q2", "", {"a": 2})
    assert list(ex.route("", lambda: {"a": 2})) == []
    assert list(ex.route("", lambda: {"a": 1})) == ["q1"]


@pytest.mark.parametrize("type_", ["direct", "fanout", "topic", "headers"])
def test_unbind_all(type_: str) -> None:
    ex = Exchange("e", type_)
    q1, q2 = object(), object()
    ex.bind(q1, "k", {"a": 1})
    ex.bind(q1, "k")
    ex.bind(q1, "j")
    ex.bind(q2, "k")
    assert ex.unbind_all(q1) == 3
    assert ex.unbind_all(q1) == 0
    assert [d for d, _, _ in ex.bindings()] == [q2]
    routed = list(ex.route("k", lambda: {}))
    assert q1 not in routed
    if type_ != "headers":
        assert routed == [q2]


def test_unbind_all_matches_destinations_like_bind_does() -> None:
    # bind/unbind compare destinations by equality (dict keys), so unbind_all
    # must too: an equal but distinct destination object is the same destination.
    ex = Exchange("d", "direct")
    ex.bind(("vhost", "queue"), "k")
    assert ex.unbind(tuple(["vhost", "queue"]), "k")
    ex.bind(("vhost", "queue"), "k")
    assert ex.unbind_all(tuple(["vhost", "queue"])) == 1
    assert not ex.has_bindings()


def test_exchange_attributes() -> None:
    ex = Exchange(
        "e", "topic", durable=False, auto_delete=True, internal=True, arguments={"alternate-exchange": "ae"}
    )
    assert (ex.durable, ex.auto_delete, ex.internal, ex.alternate) == (False, True, True, "ae")
    assert Exchange("e", "direct").alternate is None


def test_a_binding_key_cannot_make_routing_backtrack() -> None:
    """A binding key is client input run on every publish: `#.#.#.#.#.x` against a 60-word key
    took 1.5 s per publish with Python's backtracking `re`; on RE2 it is linear."""
    import time

    key = ".".join(["a"] * 250)[:255]
    t0 = time.process_time()
    for _ in range(100):
        assert not regex_match("#.#.#.#.#.#.#.#.x", key)
    assert time.process_time() - t0 < 1.0
