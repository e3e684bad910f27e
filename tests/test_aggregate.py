"""Answers of the management API put together from parts (broker/http/aggregate.py): a node's
workers or a cluster's serving nodes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from broker.http.aggregate import merge_exports, merge_metrics

PART = ('# HELP q_messages Messages\n# TYPE q_messages gauge\nq_messages{{queue="{q}"}} {n}\n'
        "# HELP skred_users Users\n# TYPE skred_users gauge\nskred_users 1\n"
        "# HELP skred_process_resident_memory_bytes Memory\n"
        "# TYPE skred_process_resident_memory_bytes gauge\n"
        "skred_process_resident_memory_bytes {n}00\n")


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in found, f"{family.name} in two groups"  # main: its later samples apart
        found[family.name] = [(s.labels, s.value) for s in family.samples]
    return found


def test_a_familys_samples_from_every_part_stay_under_its_type() -> None:
    got = _families(merge_metrics([PART.format(q="a", n=3), PART.format(q="b", n=4)]))
    assert got["q_messages"] == [({"queue": "a"}, 3), ({"queue": "b"}, 4)]
    assert got["skred_users"] == [({}, 1)]  # the node's one users file, not one per part (main: 2)
    assert got["skred_process_resident_memory_bytes"] == [({}, 700)]  # a node's workers add up


def test_across_nodes_a_nodes_own_process_series_are_the_answering_nodes() -> None:
    got = _families(merge_metrics([PART.format(q="a", n=3), PART.format(q="b", n=4)], nodes=True))
    assert got["q_messages"] == [({"queue": "a"}, 3), ({"queue": "b"}, 4)]
    assert got["skred_process_resident_memory_bytes"] == [({}, 300)]


def test_definitions_state_a_vhost_every_part_lists_once() -> None:
    shared = {"users": [{"name": "guest"}], "vhosts": [{"name": "a"}, {"name": "b"}]}
    mine = {**shared, "queues": [{"vhost": "a", "name": "q"}]}
    other = {**shared, "queues": [{"vhost": "b", "name": "q"}]}
    doc = merge_exports(mine, [other])
    assert doc["vhosts"] == [{"name": "a"}, {"name": "b"}]  # every node holds the vhost list
    assert doc["queues"] == [{"vhost": "a", "name": "q"}, {"vhost": "b", "name": "q"}]
    assert doc["users"] == [{"name": "guest"}]
