"""Policies and operator policies as the management API sees them.

Theory of operation: there is no store here. The vhost model owns its policies
(``VHost.set_policy/delete_policy/policies``, persisted per vhost in its
``policies.json`` and applied live to existing queues and exchanges); this
module validates the HTTP/definitions body shape (RabbitMQ's fields
``pattern``, ``definition``, ``priority``, ``apply-to``) and maps the API's
calls onto the vhost, so a policy set over HTTP takes effect at once. A
node-wide ``policies.json`` left by an older version is imported into the
vhosts once at boot and then removed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.auth.names import MAX_NAME_BYTES
from broker.model import policy as model_policy

if TYPE_CHECKING:
    from broker.views import BrokerView

log = logging.getLogger(__name__)

APPLY_TO = model_policy.APPLY_TO
# Every policy key RabbitMQ 3.10-4.x (with its bundled plugins) recognises; the API refuses others
# with 400 as RabbitMQ does, so a typo is not silently ignored. Skred applies a subset (the rest are
# accepted and stored, as on a RabbitMQ without the plugin that acts on them).
RABBITMQ_POLICY_KEYS = frozenset((
    "alternate-exchange", "dead-letter-exchange", "dead-letter-routing-key", "dead-letter-strategy",
    "message-ttl", "expires", "max-length", "max-length-bytes", "max-in-memory-length",
    "max-in-memory-bytes", "delivery-limit", "overflow", "queue-mode", "queue-version",
    "queue-master-locator", "queue-leader-locator", "initial-cluster-size", "max-age",
    "stream-max-segment-size-bytes", "stream-filter-size-bytes", "consumer-timeout",
    "ha-mode", "ha-params", "ha-sync-mode", "ha-sync-batch-size", "ha-promote-on-shutdown",
    "ha-promote-on-failure", "federation-upstream", "federation-upstream-set",
    "federation-upstream-pattern", "target-group-size", "single-active-consumer",
))


def validate_policy(vhost: str, name: str, body: Any, known_keys_only: bool = False) -> dict[str, Any]:
    """The normalised form of a PUT body; raises ValueError naming the bad field. With
    ``known_keys_only`` (the API's PUT, as RabbitMQ's) a definition key no RabbitMQ knows is
    refused too; a definitions import keeps what a plugin's policy may carry."""
    if not name or len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError("policy name must be 1 to 255 bytes")
    if not isinstance(body, dict):
        raise ValueError("policy body must be a JSON object")
    unknown = set(body) - {"pattern", "definition", "priority", "apply-to", "vhost", "name"}
    if unknown:
        raise ValueError(f"unknown policy fields: {', '.join(sorted(unknown))}")
    priority = body.get("priority", 0)
    if isinstance(priority, str) and priority.lstrip("-").isdigit():
        priority = int(priority)
    doc = {"vhost": vhost, "name": name, "pattern": body.get("pattern"),
           "apply-to": body.get("apply-to", "all"), "definition": body.get("definition"),
           "priority": priority}
    definition = doc["definition"]
    if known_keys_only and isinstance(definition, dict):
        unknown_keys = sorted(set(definition) - RABBITMQ_POLICY_KEYS)
        if unknown_keys:
            raise ValueError(f"{', '.join(unknown_keys)} are not recognised policy keys")
    # The model's own validation (regex, apply-to, definition keys and values).
    model_policy.make_policy(name, doc["pattern"], doc["definition"], priority, doc["apply-to"])
    return doc


class PolicyApi:
    """The management API's view of every vhost's policies (or operator policies)."""

    def __init__(self, broker: BrokerView, operator: bool = False) -> None:
        self.broker = broker
        self.operator = operator

    def list(self, vhost: str | None = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for name in sorted(self.broker.vhosts):
            if vhost is None or name == vhost:
                out.extend(self.broker.vhosts[name].policies(self.operator))
        return out

    def get(self, vhost: str, name: str) -> dict[str, Any] | None:
        for p in self.list(vhost):
            if p["name"] == name:
                return p
        return None

    def put(self, doc: dict[str, Any]) -> bool:
        """Set a validated policy on its vhost (applied live); True when it is new."""
        vh = self.broker.vhosts[doc["vhost"]]
        new = self.get(doc["vhost"], doc["name"]) is None
        vh.set_policy(doc["name"], doc["pattern"], doc["definition"], doc["priority"],
                      doc["apply-to"], operator=self.operator)
        return new

    def delete(self, vhost: str, name: str) -> bool:
        vh = self.broker.vhosts.get(vhost)
        return vh is not None and vh.delete_policy(name, operator=self.operator)

    def clear_vhost(self, vhost: str) -> None:
        """Nothing to do: a vhost's policies live (and die) in its own directory."""


def import_legacy(path: Path, api: PolicyApi) -> None:
    """Move policies from an old node-wide ``policies.json`` into their vhosts, then remove it."""
    data = model_policy.read_legacy(path)
    if data is None:
        return
    for entry in data.get("policies", []) if isinstance(data, dict) else []:
        try:
            if entry.get("vhost") in api.broker.vhosts:
                api.put(validate_policy(entry["vhost"], entry["name"],
                                        {k: v for k, v in entry.items() if k not in ("vhost", "name")}))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            log.warning("dropping legacy policy %r: %s", entry, exc)
    path.unlink(missing_ok=True)
