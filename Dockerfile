# mirrord as a sidecar: mirrors committed checkpoints from /primary to /mirror.
#
#   pip wheel --wheel-dir wheels .        # on the host, with Python 3.11 (the image's minor version)
#   docker build -t mirrord .
#   docker run -v ckpt:/primary:ro -v /mnt/mirror:/mirror -p 9108:9108 --stop-timeout 45 mirrord
#
# The image installs only the wheels built on the host (`--no-index`: the registry is never asked),
# so it holds exactly the versions you built and tested, and the build needs no network at all.
# No `# syntax=` line on purpose: it makes BuildKit pull a frontend image from Docker Hub at build
# time (fails offline and in air-gapped clusters); the built-in frontend already supports the one
# feature used here, RUN --mount.
# Base image: python:3.11-slim by default; `--build-arg PYTHON_IMAGE=...` names another one with
# python and pip of the same minor version (the tests pass a Debian-built stand-in this way).
#
# Configuration: MIRRORD_* environment variables (MIRRORD_<KEY>, MIRRORD_<SECTION>__<KEY>)
# override the file named by MIRRORD_CONFIG, /etc/mirrord/mirrord.toml; mount your own file
# there (read-only). Arguments after the image name go to `mirrord run` and override both.
# Mount /primary read-only unless primary pruning is on (prune.primary = true: mirrord then
# deletes old checkpoints there too and needs write access).
# Stopping: mirrord lets in-flight copies finish for up to shutdown_grace_seconds (30 s); give
# the container more than that (`--stop-timeout 45`, compose `stop_grace_period: 45s`).

ARG PYTHON_IMAGE=python:3.11-slim
# The wheels installed, nothing else (no compiler, no source, no torch).
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# --no-index: only the host's wheels can be installed, so nothing unpinned sneaks in. A bind
# mount, not COPY: the wheels never become a layer of the image.
RUN --mount=type=bind,source=wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels /wheels/mirrord-*.whl
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
