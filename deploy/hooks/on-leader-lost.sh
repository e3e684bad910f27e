#!/bin/sh
# Example on_leader_lost hook: Skred runs it when this node stops being the leader (lost
# its etcd lease or shut down). Undo here what on-leader-elected.sh did, e.g. drain this
# node from a load balancer. Same environment as on-leader-elected.sh.
set -eu

line="$(date -u +%Y-%m-%dT%H:%M:%SZ) leader-lost node=${SKRED_NODE_ID:-?} uri=${SKRED_ADVERTISED_URI:-?} role=${SKRED_ROLE:-?}"
echo "skred hook: $line" >&2
if [ -n "${HOOK_LOG_FILE:-}" ]; then
    echo "$line" >> "$HOOK_LOG_FILE"
fi
