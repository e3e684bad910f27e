# Skred container image: one broker node.
#
#   docker build -t skred:0.1.0 .
#   docker run -p 127.0.0.1:5672:5672 -p 127.0.0.1:15672:15672 \
#       -e SKRED_MAIN_DEFAULT_USER=admin -e SKRED_MAIN_DEFAULT_PASSWORD=change-me skred:0.1.0
#
# Configuration is by SKRED_<SECTION>_<OPTION> environment variables or an ini
# file passed with `-c` (see `skred --help`). The listeners bind 0.0.0.0 here
# because a container's loopback is not reachable from outside it.
#
# BASE_IMAGE is any image with Python 3.11+ (and its venv module), groupadd and
# useradd: the official python:3.11-slim by default; CI, which reaches no image
# registry, builds a Debian one with debootstrap (.ci/images.sh) and passes
# --build-arg BASE_IMAGE=localhost/skred-base:bookworm.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# No .pyc files in the read-only image layers, unbuffered logs for `docker logs`.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric uid/gid so Kubernetes' runAsNonRoot/fsGroup can refer to it.
RUN groupadd --system --gid 10001 skred \
    && useradd --system --uid 10001 --gid skred --home-dir /var/lib/skred --no-create-home \
        --shell /usr/sbin/nologin skred \
    && mkdir -p /var/lib/skred /etc/skred \
    && chown skred:skred /var/lib/skred

WORKDIR /src
# Only what `pip install .` needs (see .dockerignore); the source tree is removed after.
# A virtualenv, so the install never mixes with (or is refused by) the base image's own
# Python packages; its bin directory comes first on PATH (skred, skredctl, python).
COPY pyproject.toml README.md ./
COPY broker ./broker
RUN python3 -m venv /opt/skred && /opt/skred/bin/pip install . && rm -rf /src
ENV PATH=/opt/skred/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

WORKDIR /var/lib/skred

ENV SKRED_MAIN_DATA_DIR=/var/lib/skred \
    SKRED_AMQP_BIND=0.0.0.0 \
    SKRED_MGMT_BIND=0.0.0.0 \
    SKRED_MGMT_METRICS_BIND=0.0.0.0 \
    SKRED_CLUSTERING_BIND=0.0.0.0 \
    SKRED_LMQ_BIND=0.0.0.0 \
    SKRED_MQTT_BIND=0.0.0.0 \
    SKRED_STREAM_BIND=0.0.0.0

# AMQP, management HTTP API, Prometheus /metrics (no auth), cluster replication, MQTT, stream protocol.
EXPOSE 5672 15672 15692 5679 1883 5552
VOLUME ["/var/lib/skred"]

USER 10001:10001

# The RabbitMQ-compatible aliveness test (declares, publishes to and consumes from
# a test queue in vhost "/"), by `skredctl aliveness`: it runs inside the container,
# so it talks to 127.0.0.1 (SKRED_MGMT_PORT, else 15672), where even the
# loopback-only default user "guest" may log in; it uses SKRED_MAIN_DEFAULT_USER/
# PASSWORD when set. Plain words, no shell and no quoting: engines that split a
# healthcheck into words (podman's Docker API) run it unchanged. A follower
# answers only after its first sync with the leader, which is what "healthy"
# should mean in a cluster.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["skredctl", "aliveness"]

ENTRYPOINT ["skred"]
CMD []
