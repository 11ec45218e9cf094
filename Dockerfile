# The one image every specsplit pod runs: coordinator, target, draft (`specsplit ...`) and the operator
# (`kopf run ...`, the chart overrides the command).
#
#   CPU:  docker build -t specsplit:0.1.0 .
#   CUDA: docker build -t specsplit:0.1.0-cu130 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 .
#
# Base images are pinned to an exact tag, never `latest`.

FROM python:3.12.8-slim-bookworm AS build

# torch comes from its own index so the build picks the CPU or the CUDA wheels; everything else from PyPI.
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY specsplit/ specsplit/
COPY proto/ proto/
COPY services/ services/
COPY kernels/ kernels/
COPY operator/ operator/
# Extras: metrics and traces for the services, kopf for the operator.
RUN pip install ".[observability,operator]"


FROM python:3.12.8-slim-bookworm

# A fixed numeric uid/gid so Kubernetes `runAsNonRoot` can verify it without reading /etc/passwd.
RUN groupadd --gid 10001 specsplit \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin specsplit \
 && mkdir -p /models \
 && chown 10001:10001 /models

COPY --from=build /opt/venv /opt/venv

# The root filesystem is read-only in the cluster: every cache goes to /models (a volume) or /tmp (an emptyDir).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECSPLIT_CACHE=/models \
    HF_HOME=/models/huggingface \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/inductor

USER 10001:10001
WORKDIR /tmp
VOLUME ["/models"]
# A worker's gRPC, round channel and metrics; co-located (`specsplit target --coordinate`), the coordinator's gRPC, HTTP
# API and metrics too (a separate coordinator uses 50051, 8000 and 9090).
EXPOSE 50051 50061 9090 50050 8000 9091

# Kubernetes probes the gRPC health service; a Docker HEALTHCHECK would only duplicate it.
HEALTHCHECK NONE

ENTRYPOINT ["specsplit"]
CMD ["--help"]
