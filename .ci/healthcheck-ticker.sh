#!/usr/bin/env bash
# Run the healthchecks of every running podman container, every few seconds, forever.
#
# podman schedules HEALTHCHECKs with systemd timers; a CI machine without systemd never runs
# them, so a container stays "starting" and `depends_on: condition: service_healthy` (and
# docker-compose's wait) never proceeds. This loop is that timer. .ci/run starts it in the
# background next to `podman system service` and stops it by PID at exit.
set -u
interval="${1:-3}"
while true; do
    for id in $(podman ps -q --filter health=starting; podman ps -q --filter health=healthy;
                podman ps -q --filter health=unhealthy); do
        podman healthcheck run "$id" >/dev/null 2>&1 || true
    done
    sleep "$interval"
done
