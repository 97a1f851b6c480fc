# syntax=docker/dockerfile:1.7
# The Locust trace replay (arc-serving-loadtest); the chart's Job runs
#   locust -f /app/loadtest/locustfile.py --headless --host URL --trace PATH ...
# Build from the repository root:
#   docker build -f images/loadtest.Dockerfile -t ghcr.io/arc-serving/loadtest:0.1.0 .

# The base: the upstream Python image by default; `make images-local` passes a stand-in built
# from Debian bookworm's own packages where no registry answers (docs/images.md).
ARG PYTHON_IMAGE=docker.io/library/python
ARG PYTHON_TAG=3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE}:${PYTHON_TAG} AS wheel
WORKDIR /src
RUN pip install --no-cache-dir "build==1.2.2.post1"
COPY common ./common
COPY loadtest ./loadtest
RUN python -m build --wheel --outdir /dist common \
    && python -m build --wheel --outdir /dist loadtest

FROM ${PYTHON_IMAGE}:${PYTHON_TAG}
# The wheels are copied from the first stage, not bind-mounted: buildah keys a RUN step's
# cache on its text alone, so a mounted stage that changed would not rebuild it; a COPY is
# keyed on what it copies. The install removes them; their layer keeps about a megabyte.
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-cache-dir /tmp/dist/*.whl "locust==2.47.0" "requests==2.34.2" \
        "numpy==2.3.5" \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin locust \
    && rm -rf /tmp/dist
# The locustfile at the path the chart's Job names; it imports the installed arc_loadtest.
COPY loadtest/src/arc_loadtest/locustfile.py /app/loadtest/locustfile.py
ENV HOME=/home/locust \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/locust
# Master/worker traffic; 8089 is the web UI when run without --headless.
EXPOSE 5557 8089
# A batch process, not a server: Kubernetes Job status says whether it worked.
HEALTHCHECK NONE
ENTRYPOINT ["locust", "-f", "/app/loadtest/locustfile.py"]
CMD ["--help"]
