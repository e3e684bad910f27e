#!/bin/sh
# Issue 31's latency, cold-queue and topic cells, Skred against RabbitMQ 3.10 in one run, on a
# quiet machine (about 9 minutes on 2 cores); prints one markdown table. Extra arguments go to
# benchmarks/quiet_latency.py (--quick for a smoke test, --baseline REV, --runs N, ...).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/skred-quiet.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$here/.."
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/quiet_latency.py --work "$work" "$@"
