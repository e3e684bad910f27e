"""Auth: RabbitMQ-compatible password hashes, users.json/vhosts.json, permissions, loopback rule."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from broker.auth.passwords import HASHING_ALGORITHM, check_password, hash_password
from broker.auth.users import FULL_ACCESS, UserStore, is_loopback
from broker.auth.vhosts import VHostStore
from broker.errors import StoreError
from broker.store.sink import NullSink

# The worked example of RabbitMQ's password guide: salt 908DC60A, password "test12", SHA-256.
RABBIT_SHA256_TEST12 = "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR"
# The same guide's older MD5 example: salt CAD5089B, password "simon".
RABBIT_MD5_SIMON = "ytUIm8s3AnKsXQjptplKFytfVxI="


class RecordingSink(NullSink):
    """Records whole-file replacements, as the cluster's sink would replicate them."""

    active = True

    def __init__(self) -> None:
        self.replaced: list[tuple[Path, bytes]] = []

    def replace(self, path: Path, data: bytes) -> None:
        self.replaced.append((path, data))


# -- passwords ------------------------------------------------------------------------------------
def test_hash_round_trip_and_random_salt() -> None:
    first, second = hash_password("s3cret"), hash_password("s3cret")
    assert first != second  # fresh salt each time
    for h in (first, second):
        assert check_password("s3cret", h)
        assert not check_password("s3cret ", h)
        assert not check_password("", h)
        assert len(base64.b64decode(h)) == 4 + 32


def test_known_rabbitmq_vector() -> None:
    assert hash_password("test12", bytes.fromhex("908DC60A")) == RABBIT_SHA256_TEST12
    assert check_password("test12", RABBIT_SHA256_TEST12)
    assert not check_password("test13", RABBIT_SHA256_TEST12)


def test_vector_computed_from_the_scheme() -> None:
    salt = bytes.fromhex("01020304")
    expected = base64.b64encode(salt + hashlib.sha256(salt + "pässword".encode()).digest()).decode()
    assert check_password("pässword", expected)
    assert not check_password("password", expected)
    assert hash_password("pässword", salt) == expected


def test_other_rabbitmq_algorithms() -> None:
    assert check_password("simon", RABBIT_MD5_SIMON, "rabbit_password_hashing_md5")
    assert not check_password("simon", RABBIT_MD5_SIMON)  # not a SHA-256 hash
    salt = b"abcd"
    sha512 = base64.b64encode(salt + hashlib.sha512(salt + b"pw").digest()).decode()
    assert check_password("pw", sha512, "rabbit_password_hashing_sha512")
    assert not check_password("pw", sha512, "no_such_algorithm")


@pytest.mark.parametrize("bad", ["", "not base64!", "AAAA", base64.b64encode(b"x" * 40).decode()])
def test_malformed_hashes_never_match(bad: str) -> None:
    assert not check_password("", bad)
    assert not check_password("x", bad)


# -- users ----------------------------------------------------------------------------------------
def test_first_start_creates_default_user(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    store = UserStore(path, NullSink())
    guest = store.authenticate("guest", "guest")
    assert guest is not None
    assert guest.tags == ("administrator",)
    assert guest.permissions == {"/": FULL_ACCESS}
    assert store.authenticate("guest", "wrong") is None
    assert store.authenticate("nobody", "guest") is None
    document = json.loads(path.read_text())
    assert [u["name"] for u in document["users"]] == ["guest"]
    assert document["users"][0]["hashing_algorithm"] == HASHING_ALGORITHM
    assert document["permissions"] == [
        {"user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}
    ]


def test_configured_default_user(tmp_path: Path) -> None:
    store = UserStore(tmp_path / "users.json", NullSink(), default_user="admin", default_password="pw")
    assert [u.name for u in store.list()] == ["admin"]
    assert store.authenticate("admin", "pw") is not None
    assert store.authenticate("guest", "guest") is None


def test_changes_persist_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    store = UserStore(path, NullSink())
    store.add_user("alice", "a-pass", ["management", "monitoring"])
    store.set_permissions("alice", "/", "^alice\\..*", ".*", "amq\\.gen-.*|alice\\..*")
    store.set_permissions("alice", "other", "", "", ".*")
    store.add_user("bob", "b-pass")
    store.set_password("bob", "b-new")
    store.set_tags("bob", ["policymaker"])
    store.delete_user("guest")

    reopened = UserStore(path, NullSink())  # must not recreate guest: the file exists
    assert [u.name for u in reopened.list()] == ["alice", "bob"]
    alice = reopened.get("alice")
    assert alice is not None
    assert alice.tags == ("management", "monitoring")
    assert set(alice.permissions) == {"/", "other"}
    assert reopened.can_configure("alice", "/", "alice.q1")
    assert reopened.authenticate("alice", "a-pass") is not None
    assert reopened.authenticate("bob", "b-pass") is None
    assert reopened.authenticate("bob", "b-new") is not None
    bob = reopened.get("bob")
    assert bob is not None and bob.tags == ("policymaker",)
    assert reopened.authenticate("guest", "guest") is None


def test_every_change_goes_to_the_sink(tmp_path: Path) -> None:
    sink = RecordingSink()
    path = tmp_path / "users.json"
    store = UserStore(path, sink)
    store.add_user("carol", "pw")
    assert len(sink.replaced) == 2  # default user on first start, then carol
    assert all(p == path for p, _ in sink.replaced)
    assert sink.replaced[-1][1] == path.read_bytes()


def test_user_errors(tmp_path: Path) -> None:
    store = UserStore(tmp_path / "users.json", NullSink())
    with pytest.raises(ValueError, match="already exists"):
        store.add_user("guest", "x")
    with pytest.raises(ValueError):
        store.add_user("", "x")
    with pytest.raises(KeyError):
        store.delete_user("nobody")
    with pytest.raises(KeyError):
        store.set_permissions("nobody", "/", ".*", ".*", ".*")
    with pytest.raises(ValueError, match="invalid configure regex"):
        store.set_permissions("guest", "/", "(", ".*", ".*")
    # A failed change leaves the old permissions in place.
    assert store.can_configure("guest", "/", "anything")


def test_imported_hash_and_passwordless_user(tmp_path: Path) -> None:
    store = UserStore(tmp_path / "users.json", NullSink())
    store.add_user("imported", password_hash=RABBIT_SHA256_TEST12)
    assert store.authenticate("imported", "test12") is not None
    store.add_user("service")  # no password: cannot log in with any
    assert store.authenticate("service", "") is None


def test_permission_regexes_search_like_rabbitmq(tmp_path: Path) -> None:
    store = UserStore(tmp_path / "users.json", NullSink())
    store.add_user("app", "pw")
    store.set_permissions("app", "/", "^app\\..*", "^(app\\.x|amq\\.default)$", "")
    assert store.can_configure("app", "/", "app.orders")
    assert not store.can_configure("app", "/", "xapp.orders")  # anchored with ^
    assert not store.can_configure("app", "/", "orders")
    assert store.can_write("app", "/", "app.x")
    assert not store.can_write("app", "/", "app.xy")
    # Unanchored patterns match anywhere in the name, as in RabbitMQ.
    store.set_permissions("app", "/", "orders", "", "")
    assert store.can_configure("app", "/", "app.orders.v2")
    store.set_permissions("app", "/", "^app\\..*", "^(app\\.x|amq\\.default)$", "")
    assert store.can_write("app", "/", "")  # the default exchange is checked as amq.default
    assert not store.can_read("app", "/", "app.orders")  # "" grants nothing
    assert not store.can_read("app", "/", "")
    # Other vhosts and unknown users get nothing.
    assert not store.can_configure("app", "other", "app.orders")
    assert not store.has_vhost_access("app", "other")
    assert store.has_vhost_access("app", "/")
    assert not store.can_read("ghost", "/", "app.orders")
    # A User object that was deleted loses access too.
    user = store.get("app")
    assert user is not None
    store.clear_permissions("app", "/")
    assert not store.has_vhost_access(user, "/")
    assert not store.can_configure(user, "/", "app.orders")


def test_clear_vhost_drops_grants(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    store = UserStore(path, NullSink())
    store.set_permissions("guest", "tmp", ".*", ".*", ".*")
    store.clear_vhost("tmp")
    assert not store.has_vhost_access("guest", "tmp")
    assert not UserStore(path, NullSink()).has_vhost_access("guest", "tmp")


def test_topic_permissions_and_user_limits(tmp_path: Path) -> None:
    """RabbitMQ's topic authorisation: only where a topic permission exists; search semantics;
    '' is ^$; {username}/{vhost} expand. Kept in users.json with the user limits."""
    path = tmp_path / "users.json"
    sink = RecordingSink()
    store = UserStore(path, sink)
    store.add_user("ann", "pw")
    assert store.topic_allows("ann", "/", "amq.topic", "write", "anything")  # none set: allowed
    store.set_topic_permission("ann", "/", "amq.topic", r"^{username}\.{vhost}", "")
    store.set_topic_permission("ann", "v2", "x", "b", "c")
    assert store.topic_allows("ann", "/", "amq.topic", "write", "ann./.x")
    assert not store.topic_allows("ann", "/", "amq.topic", "write", "bob./.x")
    assert store.topic_allows("ann", "/", "amq.topic", "read", "")  # '' is ^$
    assert not store.topic_allows("ann", "/", "amq.topic", "read", "k")
    assert store.topic_allows("ann", "v2", "x", "write", "abc")  # anywhere in the key
    assert store.topic_allows("ann", "/", "other", "write", "k")  # another exchange
    assert not store.topic_allows("nobody", "/", "amq.topic", "write", "k")
    with pytest.raises(ValueError):
        store.set_topic_permission("ann", "/", "amq.topic", "(", "")
    store.set_limit("ann", "max-connections", 2)
    with pytest.raises(ValueError):
        store.set_limit("ann", "max-queues", 2)  # a vhost limit, not a user's
    with pytest.raises(ValueError):
        store.set_limit("ann", "max-channels", True)  # type: ignore[arg-type]
    assert sink.replaced[-1][1] == path.read_bytes()

    reopened = UserStore(path, NullSink())
    ann = reopened.get("ann")
    assert ann is not None and dict(ann.limits) == {"max-connections": 2}
    assert set(ann.topic_permissions) == {("/", "amq.topic"), ("v2", "x")}
    assert not reopened.topic_allows("ann", "/", "amq.topic", "write", "bob./.x")
    reopened.clear_vhost("v2")
    assert not reopened.has_topic_permission("ann", "v2", "x")
    assert reopened.clear_topic_permissions("ann", "/") and not reopened.clear_topic_permissions("ann", "/")
    assert reopened.clear_limit("ann", "max-connections")
    assert not reopened.clear_limit("ann", "max-connections")
    assert UserStore(path, NullSink()).get("ann") == reopened.get("ann")


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("192.168.1.5", False),
        ("::ffff:10.0.0.1", False),
        ("2001:db8::1", False),
        ("not-an-ip", False),
        ("", False),
    ],
)
def test_guest_only_from_loopback(tmp_path: Path, peer: str, loopback: bool) -> None:
    store = UserStore(tmp_path / "users.json", NullSink())
    store.add_user("remote", "pw")
    assert is_loopback(peer) is loopback
    assert store.allowed_from("guest", peer) is loopback
    guest = store.get("guest")
    assert guest is not None
    assert store.allowed_from(guest, peer) is loopback
    assert store.allowed_from("remote", peer)  # other users may log in from anywhere


def test_malformed_users_file(tmp_path: Path) -> None:
    path = tmp_path / "users.json"
    path.write_text('{"users": [{"nom": "x"}]}')
    with pytest.raises(StoreError, match="malformed users file"):
        UserStore(path, NullSink())
    path.write_text("{not json")
    with pytest.raises(StoreError):
        UserStore(path, NullSink())


# -- vhosts ---------------------------------------------------------------------------------------
def test_vhosts_default_and_persistence(tmp_path: Path) -> None:
    path = tmp_path / "vhosts.json"
    store = VHostStore(path, NullSink())
    assert store.list() == ["/"]
    assert store.exists("/")
    store.add("prod")
    store.add("dev")
    with pytest.raises(ValueError, match="already exists"):
        store.add("prod")
    with pytest.raises(ValueError):
        store.add("")
    store.delete("/")
    with pytest.raises(KeyError):
        store.delete("/")
    reopened = VHostStore(path, NullSink())
    assert reopened.list() == ["dev", "prod"]
    assert not reopened.exists("/")
    assert json.loads(path.read_text())["vhosts"] == [{"name": "dev"}, {"name": "prod"}]


def test_vhost_changes_go_to_the_sink(tmp_path: Path) -> None:
    sink = RecordingSink()
    store = VHostStore(tmp_path / "vhosts.json", sink)
    store.add("a")
    assert [json.loads(data)["vhosts"] for _, data in sink.replaced] == [
        [{"name": "/"}],
        [{"name": "/"}, {"name": "a"}],
    ]


def test_login_refusal_says_why(tmp_path: Path) -> None:
    store = UserStore(tmp_path / "users.json", NullSink())
    assert store.login_refusal("guest", "guest", "127.0.0.1") is None
    assert store.login_refusal("guest", "nope", "127.0.0.1") == "wrong password"
    assert store.login_refusal("nobody", "guest", "127.0.0.1") == "unknown user"
    remote = store.login_refusal("guest", "guest", "192.0.2.7")
    assert remote is not None and "loopback" in remote and "192.0.2.7" in remote
