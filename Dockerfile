# The pdgate router image. Build from the repository root:
#   docker build -t pdgate:0.1.0 .
# The build stage turns the package and all its dependencies into wheels, so the runtime
# stage installs offline and carries no source tree, compiler or pip cache.
FROM python:3.11-slim AS build
# A C compiler for the mypyc-compiled scheduling hot path (setup.py); without one the
# wheel would be pure Python, slower. Only this stage has it.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY router ./router
COPY kv_connectors ./kv_connectors
COPY engine_sim ./engine_sim
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 pdgate \
    && useradd --system --uid 10001 --gid pdgate --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin pdgate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels /wheels/pdgate-*.whl \
    && rm -rf /wheels
# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["pdgate"]
CMD ["serve", "--kubernetes"]
