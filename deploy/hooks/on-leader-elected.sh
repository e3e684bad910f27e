#!/bin/sh
# Example on_leader_elected hook: Skred runs it (through the shell) when this node becomes
# the cluster leader. It gets SKRED_NODE_ID, SKRED_ADVERTISED_URI and SKRED_ROLE in its
# environment, plus the broker's own environment.
#
# Real deployments put their failover action here, for example point a DNS name or a
# floating IP at this node, or add it to a load balancer pool:
#   nsupdate -k /etc/skred/dns.key <<EOT ... EOT
# Keep it quick and idempotent: it may run again after a restart.
set -eu

line="$(date -u +%Y-%m-%dT%H:%M:%SZ) leader-elected node=${SKRED_NODE_ID:-?} uri=${SKRED_ADVERTISED_URI:-?} role=${SKRED_ROLE:-?}"
echo "skred hook: $line" >&2
# Optional audit trail (the compose tests use it to see which node ran the hook).
if [ -n "${HOOK_LOG_FILE:-}" ]; then
    echo "$line" >> "$HOOK_LOG_FILE"
fi
