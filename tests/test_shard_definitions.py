"""The whole node's definitions from its workers' exports (broker/shards/definitions.py)."""

from __future__ import annotations

from broker.shards.definitions import merge_exports, owners


def test_merge_keeps_shared_keys_once_and_joins_each_workers_vhosts_sorted() -> None:
    users = [{"name": "guest"}]
    w0 = {"product_name": "Skred", "users": users, "permissions": [{"user": "guest", "vhost": "b"}],
          "vhosts": [{"name": "b"}], "queues": [{"vhost": "b", "name": "q2"}, {"vhost": "b", "name": "q9"}],
          "exchanges": [], "bindings": [{"vhost": "b", "source": "x", "destination_type": "queue",
                                          "destination": "q2", "routing_key": "", "arguments": {}}],
          "policies": [{"vhost": "b", "name": "p"}], "parameters": []}
    w1 = {"product_name": "Skred", "users": users, "permissions": [{"user": "guest", "vhost": "b"}],
          "vhosts": [{"name": "a"}], "queues": [{"vhost": "a", "name": "q5"}],
          "exchanges": [{"vhost": "a", "name": "x"}], "bindings": [],
          "policies": [{"vhost": "a", "name": "p"}],
          "parameters": [{"vhost": "a", "component": "c", "name": "n"}]}
    doc = merge_exports(w0, [w1])
    assert doc["users"] == users and doc["permissions"] == w0["permissions"]  # the node's one copy
    assert [v["name"] for v in doc["vhosts"]] == ["a", "b"]
    assert [(q["vhost"], q["name"]) for q in doc["queues"]] == [("a", "q5"), ("b", "q2"), ("b", "q9")]
    assert [p["vhost"] for p in doc["policies"]] == ["a", "b"]
    assert len(doc["bindings"]) == 1 and doc["exchanges"] == w1["exchanges"]
    assert doc["parameters"] == w1["parameters"]
    assert w0["vhosts"] == [{"name": "b"}]  # the parts are not changed


def test_an_import_belongs_to_the_workers_of_the_vhosts_it_names() -> None:
    owner = {"a": 0, "b": 1, "c": 1}.__getitem__
    assert owners({"users": [{"name": "u"}], "global_parameters": []}, owner) == set()
    assert owners({"vhosts": [{"name": "b"}], "queues": [{"vhost": "c", "name": "q"}]}, owner) == {1}
    assert owners({"queues": [{"vhost": "b", "name": "q"}], "permissions": [{"user": "u", "vhost": "a"}]},
                  owner) == {0, 1}
    assert owners({"bindings": [{"vhost": "a"}], "topic_permissions": [{"vhost": "a"}]}, owner) == {0}
    assert owners(["not", "a", "document"], owner) == set()
