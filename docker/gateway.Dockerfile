# The gateway image: `pip install loragate` (no engine, no torch), run as a non-root user. It also runs
# `loragate vllm-agent`, the sidecar beside a vLLM server.
#   docker build -f docker/gateway.Dockerfile -t loragate-gateway .
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY loragate ./loragate
COPY loragate_common ./loragate_common
COPY gateway ./gateway
COPY vllm_agent ./vllm_agent
COPY engine ./engine
COPY loragate_kernels ./loragate_kernels
# Wheels of loragate and of its base dependencies only (the engine extra is not installed).
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin loragate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels loragate && rm -rf /wheels
COPY policies /etc/loragate/policies
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["loragate"]
CMD ["gateway", "--policy", "/etc/loragate/policies/default.yaml", "--host", "0.0.0.0", "--port", "8000", \
     "--upstream-dns", "loragate-engine:8001"]
