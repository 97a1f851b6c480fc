# syntax=docker/dockerfile:1.7
# The vLLM router (PyPI vllm-router, a Python launcher around a Rust extension) that the
# operator puts in front of a ServingPolicy's replicas (docs/architecture.md, "Routing").
# Nothing of this repository goes into it: the build context admits no file
# (router.Dockerfile.dockerignore). Build from the repository root:
#   docker build -f images/router.Dockerfile -t ghcr.io/arc-serving/router:0.1.0 .

# The base: the upstream Python image by default; `make images-local` passes a stand-in built
# from Debian bookworm's own packages where no registry answers (docs/images.md).
ARG PYTHON_IMAGE=docker.io/library/python
ARG PYTHON_TAG=3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE}:${PYTHON_TAG}
# The launcher imports its Python fallback balancer (aiohttp, orjson, uvicorn, fastapi) even
# when it starts the Rust router, so those are installed too, pinned to the versions the tests
# run against.
RUN pip install --no-cache-dir "vllm-router==0.1.17" "setproctitle==1.3.8" \
        "aiohttp==3.14.5" "orjson==3.13.0" "uvicorn==0.54.0" "fastapi==0.136.3" \
        "requests==2.34.2" \
    && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin router
ENV PYTHONUNBUFFERED=1
USER 10001:10001
# 8000: the OpenAI-compatible API and /health; 29000: Prometheus /metrics.
EXPOSE 8000 29000
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# The operator passes every argument (--host, --port, --policy, workers, metrics address).
ENTRYPOINT ["vllm-router"]
CMD ["--help"]
