# syntax=docker/dockerfile:1.7
# The arc-serving kopf operator: the operator's wheel and the shared contracts, nothing of the
# vLLM plugin. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t ghcr.io/arc-serving/operator:0.1.0 .

# The base: the upstream Python image by default; `make images-local` passes a stand-in built
# from Debian bookworm's own packages where no registry answers (docs/images.md).
ARG PYTHON_IMAGE=docker.io/library/python
ARG PYTHON_TAG=3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE}:${PYTHON_TAG} AS wheel
WORKDIR /src
RUN pip install --no-cache-dir "build==1.2.2.post1"
COPY common ./common
COPY operator ./operator
RUN python -m build --wheel --outdir /dist common \
    && python -m build --wheel --outdir /dist operator

FROM ${PYTHON_IMAGE}:${PYTHON_TAG}
# The operator's dependencies, pinned to the versions the tests run against.
# The wheels are copied from the first stage, not bind-mounted: buildah keys a RUN step's
# cache on its text alone, so a mounted stage that changed would not rebuild it; a COPY is
# keyed on what it copies. The install removes them; their layer keeps about a megabyte.
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-cache-dir /tmp/dist/*.whl \
        "kopf==1.45.2" "pydantic==2.14.4" "PyYAML==6.0.4" "aiohttp==3.14.5" \
        "prometheus-client==0.26.0" \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin arc-operator \
    && rm -rf /tmp/dist
ENV PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
# kopf with the operator's handlers (python -m arc_operator). The chart passes its own arguments
# (namespaces, log level, the release's Lease for leader election); these run one copy with no
# election.
ENTRYPOINT ["arc-operator"]
CMD ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]
