"""Client regexes on RE2 (broker/patterns.py) and client JSON with bounded nesting
(broker/jsonbody.py): no sockets."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import re2

from broker import jsonbody
from broker.auth.throttle import login_key
from broker.auth.users import Permission, UserStore
from broker.model.policy import PolicySet
from broker.patterns import MAX_PATTERN, PatternError, compile_pattern
from broker.store.sink import NullSink


def test_a_catastrophic_pattern_runs_in_linear_time() -> None:
    p = compile_pattern("^(a+)+$")
    t0 = time.process_time()
    for _ in range(100):
        assert not p.search("a" * 24 + "!")
        assert not p.search("a" * 255 + "!")
    assert time.process_time() - t0 < 0.5  # Python's re: seconds for ONE search of the first


@pytest.mark.parametrize("bad", ["(a)\\1", "(?=a)", "(?<!a)b", "(", "[z-a]", "a" * (MAX_PATTERN + 1),
                                 "a{1000}{1000}"])
def test_patterns_re2_cannot_run_are_refused(bad: str) -> None:
    with pytest.raises(PatternError):
        compile_pattern(bad)


def test_search_and_fullmatch() -> None:
    p = compile_pattern("^lmq-.*")
    assert p.search("lmq-1") and not p.search("x-lmq-1")
    assert compile_pattern("b").search("abc") and not compile_pattern("b").fullmatch("abc")
    assert compile_pattern("ü+").fullmatch("üü")


@pytest.mark.parametrize("pattern", [".*", "^.*", "^.*$", ".*$", "", "^$", ".+"])
def test_search_answers_as_re2_with_and_without_the_match_anything_shortcut(pattern: str) -> None:
    """``.*`` is answered without RE2 (issue 31: the first publish of every connection); the
    answer must be RE2's for every text, newlines, the empty name and non-ASCII included."""
    fast = compile_pattern(pattern)
    slow = compile_pattern(pattern)
    slow._anything = False  # the shortcut forced off
    for text in ("", "amq.default", "a\nb", "\n", "ü-queue", "x" * 255):
        assert fast.search(text) == slow.search(text) == (re2.search(pattern, text) is not None), text


def test_permissions_are_re2_and_refuse_backreferences() -> None:
    assert Permission("^$", "^$", "^$").allows("read", "q") is False
    assert Permission(".*", "^amq\\.default$", "^q").allows("write", "") is True
    with pytest.raises(ValueError):
        Permission("(a)\\1", ".*", ".*")


def test_json_nesting_is_bounded() -> None:
    assert jsonbody.loads(b'{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    doc: object = 1
    for _ in range(64):
        doc = [doc]
    assert jsonbody.loads(json.dumps(doc)) == doc
    for raw in (json.dumps([doc]), "[" * 100_000 + "]" * 100_000, b"\xff", "{"):
        with pytest.raises(jsonbody.JSONBodyError):
            jsonbody.loads(raw)


def test_login_key_is_per_source_and_user_with_unknown_users_pooled() -> None:
    assert login_key("10.0.0.1", "guest", True) != login_key("10.0.0.1", "alice", True)
    assert login_key("10.0.0.1", "guest", True) != login_key("10.0.0.2", "guest", True)
    assert login_key("10.0.0.1", "x1", False) == login_key("10.0.0.1", "x2", False)


def test_stored_patterns_re2_refuses_load_without_granting_or_crashing(tmp_path: Path) -> None:
    """A users.json or policies.json written before RE2 may hold a lookahead: the broker still
    starts; the permission grants nothing and the policy is not applied, and both stay in their
    files (re-exported unchanged)."""
    users = UserStore(tmp_path / "users.json", NullSink())
    users.set_permissions("guest", "/", ".*", ".*", ".*")
    doc = json.loads((tmp_path / "users.json").read_text())
    doc["permissions"][0]["read"] = "^(?!amq\\.).*"
    (tmp_path / "users.json").write_text(json.dumps(doc))
    again = UserStore(tmp_path / "users.json", NullSink())
    assert not again.can_read("guest", "/", "q") and not again.can_write("guest", "/", "q")
    again.add_user("other", "pw")  # rewrites the file: the refused text is kept
    assert "^(?!amq\\\\.).*" in (tmp_path / "users.json").read_text()

    (tmp_path / "policies.json").write_text(json.dumps({"version": 1, "policies": [
        {"name": "p", "pattern": "(?=x)", "definition": {"max-length": 1}, "priority": 0,
         "apply-to": "all"}]}))
    ps = PolicySet(tmp_path / "policies.json", NullSink())
    assert ps.policies == {}
    ps.save()
    assert "(?=x)" in (tmp_path / "policies.json").read_text()
