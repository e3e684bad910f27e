"""The topic exchange's trie (``broker.model.exchange.TopicTrie``) against the matcher it
replaced: for random bindings (added, some removed again) and random routing keys, ``route``
gives the same destinations in the same order as a pattern match of every binding in binding
order (RE2, ``topic_regex``), and each agrees with the word-list reference ``topic_match``
(AMQP's semantics: ``*`` one word, ``#`` zero or more, words split on ``.``)."""

from __future__ import annotations

from functools import lru_cache

from hypothesis import example, given, settings
from hypothesis import strategies as st

from broker.model.exchange import Exchange, TopicTrie, topic_match, topic_regex

# words with the edge cases: empty words, wildcards, and words that only look like them
PATTERN_WORDS = st.sampled_from(["a", "b", "", "*", "#", "a*", "#b", "*#"])
KEY_WORDS = st.sampled_from(["a", "b", "", "*", "#", "c", "a*"])
patterns = st.lists(PATTERN_WORDS, min_size=1, max_size=6).map(".".join)
keys = st.lists(KEY_WORDS, min_size=1, max_size=7).map(".".join)
DESTS = ("q0", "q1", "q2", "q3", "q4")


compiled = lru_cache(maxsize=None)(topic_regex)


def scan(bindings: list[tuple[str, str]], key: str) -> tuple[str, ...]:
    """The matcher the trie replaced: every binding's pattern, in binding order, deduplicated."""
    out: list[str] = []
    for pattern, dest in bindings:
        if dest not in out and compiled(pattern).fullmatch("." + key):
            out.append(dest)
    return tuple(out)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(patterns, st.sampled_from(DESTS), st.booleans()), max_size=25),
    st.lists(st.integers(0, 30), max_size=8),
    st.lists(keys, min_size=1, max_size=12),
)
@example([("#", "q0", False), ("#.#", "q1", False), ("a.#.b", "q2", False), ("*.#", "q3", False)], [],
         ["", "a", "a.b", "a..b", "b.a.b", "#", "*"])
@example([("", "q0", False), ("*", "q1", False), ("#.*.#", "q2", False), ("a.*#", "q3", False)], [1],
         ["", ".", "a", "a.*#", "a.x"])
def test_trie_routes_as_the_pattern_scan(binds: list[tuple[str, str, bool]], unbinds: list[int],
                                        route_keys: list[str]) -> None:
    ex = Exchange("t", "topic")
    kept: list[tuple[str, str, dict[str, int]]] = []
    for i, (pattern, dest, with_args) in enumerate(binds):
        args = {"n": i} if with_args else {}  # the same pattern and queue twice, by arguments
        if ex.bind(dest, pattern, args):
            kept.append((pattern, dest, args))
    for j in unbinds:
        if kept:
            pattern, dest, args = kept.pop(j % len(kept))
            assert ex.unbind(dest, pattern, args)
    order = [(p, d) for p, d, _ in kept]
    for key in route_keys:
        got = tuple(ex.route(key, lambda: None))
        assert got == scan(order, key), (key, order)
        assert set(got) == {d for p, d in order if topic_match(p, key)}
        assert tuple(ex.route(key, lambda: None)) == got  # the cached answer


def test_removed_bindings_leave_no_nodes() -> None:
    trie = TopicTrie()
    for i in range(100):
        trie.add(f"sess.{i}.#", "q")
        trie.add(f"sess.{i}", "q")
    for i in range(100):
        assert trie.remove(f"sess.{i}.#", "q") and trie.remove(f"sess.{i}", "q")
    assert trie.root.empty()
    assert not trie.remove("sess.1", "q")


def test_a_miss_visits_only_the_words_of_the_key() -> None:
    """10,000 literal bindings: a new routing key costs a walk of its own words (a few trie
    states), not one match per binding."""
    trie = TopicTrie()
    for i in range(10_000):
        trie.add(f"sess.{i}", f"q{i}")
    trie.add("sess.*.x", "wild")
    visited: list[int] = []
    real_get = dict.get

    class Counting(dict):  # type: ignore[type-arg]
        def get(self, k: object, default: object = None) -> object:
            visited.append(1)
            return real_get(self, k, default)

    trie.root.words = Counting(trie.root.words)
    sess = trie.root.words["sess"]
    sess.words = Counting(sess.words)
    assert trie.match("sess.new-topic") == ()
    assert trie.match("sess.17") == ("q17",)
    assert trie.match("sess.17.x") == ("wild",)
    assert len(visited) <= 6
