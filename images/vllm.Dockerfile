# syntax=docker/dockerfile:1.7
# vLLM (GPU) with the arc-evictor plugin: the official vLLM OpenAI server image, pinned to the
# newest vLLM release the plugin supports (0.33.0; docs/plugin.md), plus the plugin's two
# wheels: arc-evictor, with its policy core compiled by mypyc, and the shared contracts it
# reads. Build from the repository root:
#   docker build -f images/vllm.Dockerfile -t ghcr.io/arc-serving/vllm:0.1.0 .

# Stage 1: the wheels, built on the serving image itself, so the compiled policy core is for
# its Python and its C library whatever they are (the image carries the C compiler that
# torch.compile and Triton need, which mypyc uses too). Installed without dependencies.
FROM docker.io/vllm/vllm-openai:v0.33.0 AS wheel
WORKDIR /src
RUN python3 -m pip install --no-cache-dir "build==1.2.2.post1"
COPY common ./common
COPY arc_evictor ./arc_evictor
RUN python3 -m build --wheel --outdir /dist common \
    && python3 -m build --wheel --outdir /dist arc_evictor

# Stage 2: the serving image. The base brings vllm, torch and prometheus-client.
FROM docker.io/vllm/vllm-openai:v0.33.0
# The wheels are copied from the first stage, not bind-mounted: buildah keys a RUN step's
# cache on its text alone, so a mounted stage that changed would not rebuild it; a COPY is
# keyed on what it copies. The install removes them; their layer keeps about a megabyte.
COPY --from=wheel /dist /tmp/dist
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/dist/*.whl \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin vllm \
    && rm -rf /tmp/dist
# The plugin stays inert unless ARC_EVICTOR_POLICY or ARC_EVICTOR_CONFIG is set (the operator
# sets ARC_EVICTOR_CONFIG). Model downloads go to the user's cache, or a mounted volume.
ENV HOME=/home/vllm \
    HF_HOME=/home/vllm/.cache/huggingface \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/vllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
