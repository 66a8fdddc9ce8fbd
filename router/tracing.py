"""OpenTelemetry traces of each request, exported over OTLP/HTTP when configured.

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set
and the `tracing` extra is installed; `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` turn it off again. When off, `tracing_from_env` returns None
and the proxy's only cost is a few `is not None` tests: no span object is made, and a
client's `traceparent` still goes to the engines untouched.

When on, the usual variables apply because the SDK reads them: `OTEL_SERVICE_NAME`
(default `pdgate`), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` and `_ARG`,
`OTEL_EXPORTER_OTLP_HEADERS`/`_TIMEOUT`/`_COMPRESSION`, `OTEL_BSP_*` (batching).
One request is one trace (or continues the client's, from its W3C `traceparent`):

    pdgate.request            the whole request, as the client saw it (SERVER)
      route                   model -> ModelRoute -> ModelServer
      schedule                one per attempt: the chosen pods and their costs
      prefill                 PD only: the prefill call (its `traceparent` goes along)
      kv_handoff              PD only: from the KV handle to decode's response headers
      decode                  the decode (or single-pod) call; its `traceparent` goes along
        relay                 the answer streamed to the client

Spans are passed explicitly (no context variables on the data path) and the provider
belongs to the router's state, not to the process-global OpenTelemetry API.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("pdgate.tracing")

SERVICE_NAME = "pdgate"
INSTRUMENTATION = "pdgate.router"


def tracing_enabled(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint, not switched off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


class Tracing:
    """A tracer with its own provider and exporter, and the W3C propagator."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import (
            TraceContextTextMapPropagator,
        )

        self._provider = provider
        self._tracer = provider.get_tracer(INSTRUMENTATION)
        self._propagator = TraceContextTextMapPropagator()
        self._in_context = set_span_in_context
        self._server_kind = SpanKind.SERVER
        self._client_kind = SpanKind.CLIENT
        self._internal_kind = SpanKind.INTERNAL
        self._status = Status
        self._error_code = StatusCode.ERROR

    def request(self, headers: Mapping[str, str], path: str, request_id: str) -> Any:
        """The root span; a valid incoming `traceparent` (and `tracestate`) is continued."""
        parent = self._propagator.extract(headers) if "traceparent" in headers else None
        return self._tracer.start_span(
            "pdgate.request", context=parent, kind=self._server_kind,
            attributes={"http.request.method": "POST", "http.route": path,
                        "pdgate.request_id": request_id},
        )

    def child(self, parent: Any, name: str, attributes: Mapping[str, Any] | None = None,
              client: bool = False) -> Any:
        """A span under `parent`; `client` marks a call to an engine (kind CLIENT)."""
        return self._tracer.start_span(
            name, context=self._in_context(parent),
            kind=self._client_kind if client else self._internal_kind, attributes=attributes,
        )

    def headers(self, base: Mapping[str, str], span: Any) -> dict[str, str]:
        """`base` with `span` as the W3C parent: what an engine call carries."""
        out = dict(base)
        out.pop("traceparent", None)
        out.pop("tracestate", None)
        self._propagator.inject(out, context=self._in_context(span))
        return out

    def fail(self, span: Any, reason: str) -> None:
        span.set_status(self._status(self._error_code, reason))

    def shutdown(self) -> None:
        """Flush what is batched and stop the exporter (at router shutdown)."""
        self._provider.shutdown()


def tracing_from_env(environ: Mapping[str, str] | None = None) -> Tracing | None:
    """A `Tracing` exporting over OTLP/HTTP when the environment asks for it, else None."""
    env = os.environ if environ is None else environ
    if not tracing_enabled(env):
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the tracing extra is not "
                    "installed (pip install 'pdgate[tracing]'): no traces")
        return None
    resource = Resource.create(
        {} if env.get("OTEL_SERVICE_NAME") else {"service.name": SERVICE_NAME}
    )
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing: exporting spans over OTLP/HTTP")
    return Tracing(provider)
