# One image for every role of voice-tools: the command names the role (web, mcp, writes, reads,
# callbacks, worker-metrics, beat, flower, migrate, run; docs/operations.md, "Containers").
#
#   podman build -t voice-tools .        (or docker build; both read this file)
#
# Built on Debian bookworm's slim image and its own Python (3.11), from requirements.lock with hashes.
# A build behind a TLS-intercepting proxy gives pip the proxy's CA from outside, never in the image:
#   podman build -v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro --build-arg PIP_CERT=/run/host-ca.crt .
# To pin the base by digest: --build-arg BASE=docker.io/library/debian:bookworm-slim@sha256:...

ARG BASE=docker.io/library/debian:bookworm-slim

# -- build: the virtualenv, from the lock, and the prepared embedding model -------------------------
FROM ${BASE} AS build
ARG PIP_CERT=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY requirements.lock /src/requirements.lock
RUN [ -n "$PIP_CERT" ] && export PIP_CERT || unset PIP_CERT; \
    python3 -m venv /opt/voice-tools \
 && /opt/voice-tools/bin/pip install --only-binary :all: --require-hashes -r /src/requirements.lock
# what the wheel is built from, and nothing else: a change to the image's command alone rebuilds no stage here
COPY setup.cfg pyproject.toml README.md celeryconfig.py alembic.ini Procfile Procfile.local /src/
COPY app /src/app
COPY tasks /src/tasks
COPY models /src/models
COPY migrations /src/migrations
COPY voice_tools /src/voice_tools
COPY voice_tools_tracing /src/voice_tools_tracing
COPY voice_tools_backends /src/voice_tools_backends
RUN [ -n "$PIP_CERT" ] && export PIP_CERT || unset PIP_CERT; \
    /opt/voice-tools/bin/pip install --no-deps /src \
 && /opt/voice-tools/bin/python -m compileall -q -j 0 /opt/voice-tools/lib
# The offline embedding model, rewritten and quantized once here (voice_tools_backends/embeddings.py,
# prepared_model): every pod finds it intact at start and writes nothing.
ENV VOICE_TOOLS_DATA_DIR=/var/lib/voice-tools
RUN /opt/voice-tools/bin/python -c "from voice_tools_backends import embeddings; print(embeddings.prepared_model())"

# -- the image: Python, the virtualenv, the model; no compiler, no pip cache, no source tree -----------
FROM ${BASE}
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=https://example.invalid/voice-tools
LABEL org.opencontainers.image.title="voice-tools" \
      org.opencontainers.image.description="Runs the tool calls of a voice assistant as Celery chains with PostgreSQL as the source of truth" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log \
 && groupadd --system --gid 10001 voice-tools \
 && useradd --system --uid 10001 --gid voice-tools --home-dir /var/lib/voice-tools --shell /usr/sbin/nologin voice-tools \
 && install -d -o voice-tools -g voice-tools -m 0750 /var/lib/voice-tools
COPY --from=build /opt/voice-tools /opt/voice-tools
COPY --from=build --chown=root:root /var/lib/voice-tools/embedding-models /var/lib/voice-tools/embedding-models
COPY Procfile /etc/voice-tools/Procfile
COPY deploy/image/voice-tools-role /usr/local/bin/voice-tools-role
ENV PATH=/opt/voice-tools/bin:$PATH \
    VOICE_TOOLS_DATA_DIR=/var/lib/voice-tools \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8 \
    HOST=0.0.0.0
USER 10001:10001
WORKDIR /var/lib/voice-tools
EXPOSE 8000 8001 5555 9101
# tini is PID 1: it reaps, and hands SIGTERM to the role's process (exec'd by voice-tools-role), so a
# worker's SIGTERM is Celery's warm shutdown (its links finish within their hard time limits)
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/voice-tools-role"]
CMD ["help"]
