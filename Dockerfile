# mirrord as a sidecar: mirrors committed checkpoints from /primary to /mirror (a folder or s3://).
#
#   docker build -t mirrord .
#   docker run -v ckpt:/primary:ro -v /mnt/mirror:/mirror -p 9108:9108 --stop-timeout 45 mirrord
#
# Two stages: `build` makes the wheels of mirrord and its dependencies inside the image's own
# Python (so they fit its platform, whatever the host is); the final stage installs those wheels
# alone (`--no-index`) and carries no source, compiler or pip cache.
# Build arguments:
#   EXTRAS=s3          the package's extras; the default `s3` brings boto3, so an `s3://` mirror works
#                      (30 MB more); `--build-arg EXTRAS=` leaves it out
#   PIP_NO_INDEX=1     build offline: every dependency comes from ./wheels (`pip download --dest wheels
#                      '.[s3]' setuptools` beforehand); by default pip asks the index for what ./wheels lacks
#   PYTHON_IMAGE=...   another base with python and pip of the same minor version (the tests pass a
#                      Debian-built stand-in this way)
# No `# syntax=` line on purpose: it makes BuildKit pull a frontend image from Docker Hub at build
# time (fails offline and in air-gapped clusters); the built-in frontend already supports the one
# feature used here, RUN --mount.
#
# Configuration: MIRRORD_* environment variables (MIRRORD_<KEY>, MIRRORD_<SECTION>__<KEY>)
# override the file named by MIRRORD_CONFIG, /etc/mirrord/mirrord.toml; mount your own file
# there (read-only). Arguments after the image name go to `mirrord run` and override both.
# An S3 mirror: MIRRORD_MIRROR=s3://bucket/prefix, credentials in AWS_ACCESS_KEY_ID and
# AWS_SECRET_ACCESS_KEY, a non-AWS endpoint in MIRRORD_S3__ENDPOINT_URL.
# Mount /primary read-only unless primary pruning is on (prune.primary = true: mirrord then
# deletes old checkpoints there too and needs write access).
# Stopping: mirrord lets in-flight copies finish for up to shutdown_grace_seconds (30 s); give
# the container more than that (`--stop-timeout 45`, compose `stop_grace_period: 45s`).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=s3
ARG PIP_NO_INDEX=0
WORKDIR /src
# The sources .dockerignore lets in, and ./wheels (pre-fetched dependencies, may be absent).
COPY . .
# `.[s3]`, or `.` alone when EXTRAS is empty (pip refuses `.[]`).
RUN pip wheel --no-cache-dir --find-links wheels --wheel-dir /wheels ".${EXTRAS:+[${EXTRAS}]}"

# The wheels installed, nothing else (no compiler, no source, no torch).
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Every wheel the build stage resolved (mirrord, its dependencies and those of EXTRAS), and only those
# (--no-index). A bind mount, not COPY: the wheels never become a layer of the image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels /wheels/*.whl
# A fixed numeric uid/gid so that volume permissions and `runAsNonRoot` checks are predictable.
# /mirror is owned by mirrord so a fresh named volume starts out writable; the placeholder
# config lets the image run on environment variables alone.
RUN groupadd --system --gid 10001 mirrord \
    && useradd --system --uid 10001 --gid mirrord --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin mirrord \
    && mkdir -p /primary /mirror /etc/mirrord \
    && chown mirrord:mirrord /mirror \
    && printf '%s\n' '# Mount your mirrord.toml here. MIRRORD_* environment variables override it.' \
       > /etc/mirrord/mirrord.toml

ENV MIRRORD_CONFIG=/etc/mirrord/mirrord.toml \
    MIRRORD_PRIMARY=/primary \
    MIRRORD_MIRROR=/mirror \
    MIRRORD_METRICS__ADDRESS=0.0.0.0:9108
VOLUME ["/primary", "/mirror"]
EXPOSE 9108
USER 10001:10001

# slim has no curl: ask /healthz with the standard library. A 503 raises, which exits 1.
# /healthz turns 200 after the first reconcile (a scan of both volumes, minutes on very large
# network volumes); failures in the start period do not count, and the first success ends it.
# If you move the metrics port with MIRRORD_METRICS__ADDRESS, override this check too.
HEALTHCHECK --interval=30s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9108/healthz', timeout=4)"]

ENTRYPOINT ["mirrord", "run"]
