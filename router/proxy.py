"""Serving one request: route, pick a pair, run the KV connector, stream decode back.

The flow of one attempt:

    pick pair -> count it in flight -> connector.start (prefill, KV handle)
              -> open decode -> relay decode's answer to the client

Failures before the first byte reaches the client are retried per the ModelServer's
trafficPolicy on a freshly picked pair that avoids the failed pod; a decode that fails
after its prefill (its KV was not there) gets one fresh prefill on another pair even with
no retries configured. A retry never goes to an ejected pod (none left: no retry), and
only while the router-wide retry budget allows it; a retry not made ends the request with
the error that prompted it. After the first byte a failure, or a stream that ends without
`[DONE]`, ends the stream with an OpenAI error event and `[DONE]`, never a second,
spliced answer. `trafficPolicy.timeout` bounds the whole request. Failures that blame a
pod feed outlier ejection; a route's `rateLimit` is checked before any pod is picked and
charged the answer's real output tokens as it ends (before its last byte goes out).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_fixed

from kv_connectors import get_connector
from kv_connectors.base import Handoff, KVConnector, PDCall, UpstreamError
from router.errors import (
    APIError,
    bad_gateway,
    gateway_timeout,
    model_not_found,
    service_unavailable,
)
from router.http_client import ConnectionBroken, Response
from router.load import InFlight
from router.metrics import RouterMetrics
from router.relay import StreamRelay
from router.request import ParsedRequest
from router.resilience.config import ResilienceConfig
from router.resilience.ejection import OutlierDetector, without_ejected
from router.resilience.retry_budget import RetryBudget
from router.responder import Responder, stream_error_form
from router.routing import ModelNotFound, NoRoute, RouteDecision, resolve
from router.scheduling import Pick, Scheduler, ScheduleRequest
from router.security.ratelimit import TokenRateLimiter
from router.security.usage import StreamUsage, body_completion_tokens
from router.tracing import Tracing
from router.upstream import MAX_JSON_BODY_BYTES, Upstream
from router.view import ClusterView, Endpoint, ServerPods

log = logging.getLogger("pdgate.proxy")

DEFAULT_TIMEOUT_SECONDS = 600.0
# Client headers worth passing to engines; everything else (hop-by-hop headers, cookies,
# the client's Authorization unless a ModelServer asks for it) stays at the router.
FORWARDED_HEADERS = ("accept", "x-data-parallel-rank", "traceparent", "tracestate")
FORWARD_AUTH_ANNOTATION = "pdgate.io/forward-authorization"
#: A client's X-Request-Id is kept only if it looks like one (it goes to engines and logs).
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: Failures that say nothing about the pod (the client's input, our own config).
_NOT_THE_PODS_FAULT = frozenset(("bad_config",))

@dataclass(slots=True)
class Attempt:
    """What one attempt needs besides the pick; built once per request."""

    parsed: ParsedRequest
    decision: RouteDecision
    connector: KVConnector
    request_id: str
    headers: dict[str, str]  # toward engines
    client_headers: Mapping[str, str]  # as the client sent them (the scheduler reads these)
    deadline: float
    track_usage: bool = False  # the route limits output tokens: read the answer's usage
    usage: StreamUsage | None = None  # the stream's usage watcher (track_usage only)
    output_tokens: int = 0  # a non-streaming answer's completion tokens (track_usage only)
    settled: bool = False  # the output tokens were charged (`Proxy._settle`)
    waiting_on: Endpoint | None = None  # the pod whose answer is awaited (blamed on timeout)
    first_lap: str = "first_token"  # the TTFT phase the first content closes (timing.py)
    pick: Pick | None = None  # the pair of the latest attempt
    failure: UpstreamError | None = None  # the latest attempt's failure
    span: Any = None  # the request's root span (tracing on only)
    attempts: int = 0


class _RetryRefused(Exception):
    """A retry that was not made (budget spent, or only ejected pods left)."""


def request_id_for(client_headers: Mapping[str, str] | None) -> str:
    """The request's id: the client's `x-request-id` when it is a sane token, else a fresh
    one (uuid4().hex's form, a fifth of its cost)."""
    request_id = None if client_headers is None else client_headers.get("x-request-id")
    if request_id is None or not _REQUEST_ID.fullmatch(request_id):
        request_id = os.urandom(16).hex()
    return request_id


class Proxy:
    def __init__(
        self,
        view: ClusterView,
        scheduler: Scheduler,
        inflight: InFlight,
        upstream: Upstream,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
        *,
        outliers: OutlierDetector | None = None,
        limiter: TokenRateLimiter | None = None,
        retry_budget: RetryBudget | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.view = view
        self.scheduler = scheduler
        self.inflight = inflight
        self.upstream = upstream
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.outliers = outliers or OutlierDetector(ResilienceConfig(consecutive_failures=0))
        self.limiter = limiter
        self.retry_budget = retry_budget or RetryBudget()
        self.tracing = tracing

    async def serve(
        self, parsed: ParsedRequest, client_headers: Mapping[str, str], out: Responder
    ) -> None:
        """Answer one request, with the decode pod's answer or an OpenAI error."""
        out.clock.lap("admission")
        out.sse_error = stream_error_form(parsed)
        request_id = request_id_for(client_headers)
        tracing = self.tracing
        if tracing is None:
            await self._serve(parsed, client_headers, out, request_id, None)
            return
        span = tracing.request(client_headers, parsed.path, request_id)
        try:
            await self._serve(parsed, client_headers, out, request_id, span)
        finally:
            span.set_attribute("http.response.status_code", out.status)
            if out.status >= 500:
                tracing.fail(span, f"status {out.status}")
            span.end()

    async def _serve(
        self, parsed: ParsedRequest, client_headers: Mapping[str, str], out: Responder,
        request_id: str, span: Any,
    ) -> None:
        tracing = self.tracing
        route_span = None
        if span is not None and tracing is not None:
            route_span = tracing.child(span, "route", {"gen_ai.request.model": parsed.model})
        try:
            decision = resolve(
                self.view.snapshot, parsed.model, client_headers, parsed.path, self.rng
            )
            if route_span is not None:
                meta = decision.server.server.meta
                route_span.set_attributes({
                    "pdgate.route": f"{decision.route.meta.namespace}/"
                                    f"{decision.route.meta.name}",
                    "pdgate.model_server": f"{meta.namespace}/{meta.name}",
                    "pdgate.upstream_model": decision.upstream_model,
                })
        except ModelNotFound:
            await out.error(model_not_found(parsed.model), request_id)
            return
        except NoRoute as exc:
            await out.error(service_unavailable(f"No route serves model `{parsed.model}`: "
                                                f"{exc.reason}."), request_id)
            return
        finally:
            if route_span is not None:
                route_span.end()
        route = decision.route
        limit = route.rate_limit
        track_usage = False
        if limit is not None and self.limiter is not None:
            if limit.input_tokens_per_unit:
                await self._count_tokens(decision.server, parsed)
            try:
                await self.limiter.admit(route, parsed)
            except APIError as exc:
                await out.error(exc, request_id)
                return
            track_usage = bool(limit.output_tokens_per_unit)
            if track_usage and parsed.stream and parsed.flow == "pd":
                options = parsed.body.get("stream_options") or {}
                parsed.body["stream_options"] = {**options, "include_usage": True}
        server = decision.server.server
        parsed.body["model"] = decision.upstream_model
        try:
            connector = get_connector(
                server.kv_connector, server.inference_engine, server.meta.annotations
            )
        except ValueError as exc:
            log.warning("ModelServer %s/%s: %s", server.meta.namespace, server.meta.name, exc)
            await out.error(service_unavailable(
                f"The server for model `{parsed.model}` is misconfigured."), request_id)
            return
        loop = asyncio.get_running_loop()
        attempt = Attempt(
            parsed=parsed,
            decision=decision,
            connector=connector,
            request_id=request_id,
            headers=_upstream_headers(client_headers, request_id, server.meta.annotations),
            client_headers=client_headers,
            deadline=loop.time() + (server.timeout_s or DEFAULT_TIMEOUT_SECONDS),
            track_usage=track_usage,
            span=span,
        )
        budget = self.retry_budget
        budget.requests += 1
        try:
            async with asyncio.timeout_at(attempt.deadline):
                await self._serve_with_retries(attempt, out)
        except TimeoutError:
            self.metrics.upstream_error("timeout", "request")
            await out.end(gateway_timeout(), request_id)
        except APIError as exc:
            await out.end(exc, request_id)
        finally:
            budget.requests -= 1
            self._settle(attempt)

    def _settle(self, attempt: Attempt) -> None:
        """Charge the answer's output tokens to its route's limit, once. An answer that
        completes is charged just before its last byte goes out, so a client that sends its
        next request the moment it has read this one's end finds the charge made; any other
        ends when the request does."""
        if attempt.settled or not attempt.track_usage or self.limiter is None:
            return
        attempt.settled = True
        usage = attempt.usage
        tokens = usage.charged if usage is not None else attempt.output_tokens
        self.limiter.settle_output(attempt.decision.route, tokens)

    async def _count_tokens(self, server: ServerPods, parsed: ParsedRequest) -> None:
        """The prompt's tokens by the server's tokenizer, once per request (rate limits);
        left unset when it has none, so the limiter estimates instead."""
        prompt_ids = getattr(self.scheduler, "prompt_ids", None)
        if prompt_ids is None or parsed.prompt_tokens is not None:
            return
        prompts = await prompt_ids(server, parsed.path, parsed.body)
        if prompts:
            parsed.tokens = prompts[0]
            parsed.prompt_tokens = sum(len(p) for p in prompts)

    async def _serve_with_retries(self, attempt: Attempt, out: Responder) -> None:
        server = attempt.decision.server
        policy = server.server
        avoid: set[str] = set()
        try:
            await self._attempt(attempt, server, avoid, out)
            return
        except UpstreamError as exc:
            retries = policy.retry_attempts
            if retries < 1 and _kv_lost(exc):
                retries = 1  # the KV was not there: one fresh prefill on another pair
            if out.started or not exc.retryable or retries < 1:
                raise _client_error(exc) from None
            self._note_failure(exc, avoid, attempt)
            attempt.failure = exc
        # Retries only: tenacity stays off the success path (it costs ~20 µs a call).
        retrying = AsyncRetrying(
            stop=stop_after_attempt(retries),
            wait=wait_fixed(policy.retry_interval_s),
            retry=retry_if_exception(
                lambda e: isinstance(e, UpstreamError) and e.retryable and not out.started
            ),
            before_sleep=lambda state: self._note_retry_sleep(state.outcome, avoid, attempt),
            reraise=True,
        )
        await asyncio.sleep(policy.retry_interval_s)
        try:
            async for trial in retrying:
                with trial:
                    await self._retry(attempt, server, avoid, out)
        except UpstreamError as exc:
            raise _client_error(exc) from None
        except _RetryRefused:
            assert attempt.failure is not None
            raise _client_error(attempt.failure) from None

    async def _retry(
        self, attempt: Attempt, server: ServerPods, avoid: set[str], out: Responder
    ) -> None:
        """One retry: on pods that are not ejected, within the router's retry budget."""
        target = without_ejected(server, self.outliers.ejected)
        budget = self.retry_budget
        if target is None:
            budget.refuse("ejected")
            log.info("request %s: no retry, every pod left is ejected", attempt.request_id)
            raise _RetryRefused
        if not budget.try_acquire():
            log.info("request %s: no retry, the retry budget is spent", attempt.request_id)
            raise _RetryRefused
        assert attempt.failure is not None
        self.metrics.retry(attempt.parsed.model, attempt.failure.phase)
        out.clock.retry()
        try:
            await self._attempt(attempt, target, avoid, out)
        except UpstreamError as exc:
            attempt.failure = exc
            raise
        finally:
            budget.release()

    def _note_retry_sleep(self, outcome: Any, avoid: set[str], attempt: Attempt) -> None:
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, UpstreamError):
            self._note_failure(exc, avoid, attempt)

    def _note_failure(self, exc: UpstreamError, avoid: set[str], attempt: Attempt) -> None:
        pod = exc.pod
        if isinstance(pod, Endpoint):
            avoid.add(pod.key)
            if exc.reason == "connect":
                # Its API server is unreachable: so is every rank behind it.
                avoid.update(e.key for e in attempt.decision.server.sharing_server(pod))
        if _kv_lost(exc) and attempt.pick is not None and attempt.pick.prefill is not None:
            avoid.add(attempt.pick.prefill.key)  # its KV went missing: try a whole new pair
        log.info("request %s: %s in %s", attempt.request_id, exc.reason, exc.phase)

    async def _attempt(
        self, attempt: Attempt, server: ServerPods, avoid: set[str], out: Responder
    ) -> None:
        parsed = attempt.parsed
        out.clock.attempt()
        attempt.attempts += 1
        request = ScheduleRequest(parsed.model, parsed.path, parsed.body, attempt.client_headers,
                                  parsed.tokens, flow=parsed.flow,
                                  lora_name=attempt.decision.lora_name)
        tracing = self.tracing
        span = None
        if tracing is not None and attempt.span is not None:
            span = tracing.child(attempt.span, "schedule", {"pdgate.attempt": attempt.attempts,
                                                            "pdgate.flow": parsed.flow})
        try:
            prepare = getattr(self.scheduler, "prepare", None)
            if prepare is not None:
                await prepare(server, request)  # big prompts: tokenized off the event loop
            pick = self.scheduler.pick(server, request, frozenset(avoid))
            parsed.tokens = request.tokens  # a retry does not tokenize again
            if span is not None and pick is not None:
                span.set_attributes(_pick_attributes(pick))
        finally:
            if span is not None:
                span.end()
        if pick is None:
            raise service_unavailable(
                f"No ready pods serve model `{parsed.model}`.", retry_after=1
            )
        attempt.pick = pick
        out.clock.lap("schedule")
        for endpoint in pick.endpoints:
            self.inflight.acquire(endpoint)
        prefill_held = pick.prefill

        decode_held = True

        def release_prefill() -> None:
            # A sequential prefill is over once the handle is back: stop counting it
            # then, or prefill pods look busy for the whole decode.
            nonlocal prefill_held
            if prefill_held is not None:
                self.inflight.release(prefill_held)
                prefill_held = None

        def release() -> None:
            # The answer's end: counted no more before the client can read it (and ask
            # again), not once the engine's connection has also reached EOF after it.
            nonlocal decode_held
            release_prefill()
            if decode_held:
                decode_held = False
                self.inflight.release(pick.decode)

        try:
            await self._run_pick(attempt, pick, out, release_prefill, release)
        except UpstreamError as exc:
            if _clients_fault(exc):
                assert exc.status is not None
                self.metrics.client_error(exc.status, exc.phase)
            else:
                self.metrics.upstream_error(exc.reason, exc.phase)
                self._blame(exc, server)
            raise
        except asyncio.CancelledError:
            # The request's deadline (not the client) cancelled it: the pod awaited hung.
            if attempt.waiting_on is not None and (
                asyncio.get_running_loop().time() >= attempt.deadline
            ):
                self.outliers.record_failure(attempt.waiting_on)
            raise
        finally:
            release()
        outliers = self.outliers
        outliers.record_success(pick.decode)
        if pick.prefill is not None:
            outliers.record_success(pick.prefill)

    def _blame(self, exc: UpstreamError, server: ServerPods) -> None:
        """Count a failure against the pod that caused it, if it was the pod's doing; an
        API server that cannot be reached counts against every rank it serves, so a dead
        data-parallel pod is ejected whole, not one rank at a time."""
        pod = exc.pod
        if not isinstance(pod, Endpoint) or exc.reason in _NOT_THE_PODS_FAULT:
            return
        if exc.reason == "connect":
            for target in server.sharing_server(pod):
                self.outliers.record_failure(target)
        else:
            self.outliers.record_failure(pod)

    async def _run_pick(
        self, attempt: Attempt, pick: Pick, out: Responder, release_prefill: Callable[[], None],
        release: Callable[[], None],
    ) -> None:
        """Prefill (PD), then decode and the relay, each timed on the request's clock.

        With tracing on (`attempt.span`), each step is a span whose context reaches its
        engine in `traceparent`; off, `tracing` is None and no span object is made.
        """
        tracing = self.tracing if attempt.span is not None else None
        parsed = attempt.parsed
        handoff: Handoff | None = None
        clock = out.clock
        started = clock.mark  # the pick's lap
        attempt.first_lap = "first_token"
        if pick.prefill is not None:
            attempt.waiting_on = pick.prefill
            headers = attempt.headers
            span = None
            if tracing is not None:
                span = tracing.child(attempt.span, "prefill", {
                    "pdgate.pod": pick.prefill.label, "server.address": pick.prefill.ip,
                    "server.port": pick.prefill.port, "pdgate.connector": attempt.connector.name,
                }, client=True)
                headers = tracing.headers(headers, span)
            try:
                handoff = await attempt.connector.start(
                    self._pd_call(attempt, pick, headers), self.upstream
                )
            except BaseException as exc:  # an error, or the request was cancelled
                if pick.on_prefill_failed is not None:
                    pick.on_prefill_failed()  # the pod's backlog drops this prefill
                if tracing is not None and isinstance(exc, UpstreamError):
                    tracing.fail(span, exc.reason)
                raise
            finally:
                if span is not None:
                    span.end()
            if handoff.prefill_task is None:
                release_prefill()
                prefill_s = clock.lap("prefill") - started
                self.metrics.phase_done("prefill", prefill_s)
                if pick.on_prefill is not None:
                    pick.on_prefill(prefill_s)  # calibrates the scheduler's TTFT model
            else:  # concurrent: prefill runs beside decode until the first content
                clock.lap("kv_handoff")
                attempt.first_lap = "prefill"
        decode_body = parsed.body if handoff is None else handoff.decode_body
        phase = "aggregated" if pick.prefill is None else "decode"
        attempt.waiting_on = pick.decode
        decode_started = clock.mark
        decode = handoff_span = relay = None
        headers = attempt.headers
        if tracing is not None:
            decode = tracing.child(attempt.span, "decode", {
                "pdgate.pod": pick.decode.label, "server.address": pick.decode.ip,
                "server.port": pick.decode.port, "pdgate.phase": phase,
            }, client=True)
            if handoff is not None:
                handoff_span = tracing.child(attempt.span, "kv_handoff", {
                    "pdgate.connector": attempt.connector.name,
                    "pdgate.concurrent": handoff.prefill_task is not None,
                })
            attempt.headers = tracing.headers(headers, decode)
        try:
            try:
                response = await self._open_decode(attempt, pick, decode_body, handoff)
            finally:
                attempt.headers = headers
                if handoff_span is not None:
                    handoff_span.end()
            if handoff is not None and handoff.prefill_task is None:
                clock.lap("kv_handoff")  # decode accepted the handle (its headers are in)
            if tracing is not None:
                relay = tracing.child(decode, "relay", {"pdgate.stream": parsed.stream})
            try:
                await self._relay(attempt, pick, response, out, release)
            finally:
                if relay is not None:
                    relay.end()
                response.close()
        except UpstreamError as exc:
            if tracing is not None:
                tracing.fail(decode, exc.reason)
            raise
        finally:
            if decode is not None:
                decode.end()
            if handoff is not None and handoff.prefill_task is not None:
                await _finish_prefill(handoff.prefill_task)
        self.metrics.phase_done(phase, time.perf_counter() - decode_started)

    def _pd_call(self, attempt: Attempt, pick: Pick, headers: dict[str, str]) -> PDCall:
        assert pick.prefill is not None
        return PDCall(
            path=attempt.parsed.path,
            body=attempt.parsed.body,
            headers=headers,
            request_id=attempt.request_id,
            prefill=pick.prefill,
            decode=pick.decode,
            deadline=attempt.deadline,
            annotations=attempt.decision.server.server.meta.annotations,
        )

    async def _open_decode(
        self,
        attempt: Attempt,
        pick: Pick,
        body: dict[str, Any],
        handoff: Handoff | None,
    ) -> Response:
        phase = "aggregated" if pick.prefill is None else "decode"
        opening = self.upstream.open(
            pick.decode, attempt.parsed.path, orjson.dumps(body), attempt.headers,
            attempt.deadline, phase,
        )
        prefill_task = handoff.prefill_task if handoff is not None else None
        if prefill_task is None:
            return await opening
        return await _beside_prefill(opening, prefill_task)

    async def _relay(
        self, attempt: Attempt, pick: Pick, response: Response, out: Responder,
        ended: Callable[[], None],
    ) -> None:
        """The engine's answer to the client. `ended` (the pick's pods count the request no
        more) runs as the answer's end is settled, before its last bytes go out: a client
        that asks again the moment it has read the end finds the pods as they are (the
        engine's own EOF may follow [DONE] later, and the relay reads on until it does)."""
        parsed = attempt.parsed
        headers = [
            (b"content-type", response.headers.get("content-type", "application/json").encode()),
            (b"x-request-id", attempt.request_id.encode()),
            (b"x-pdgate-decode-pod", pick.decode.label.encode()),
        ]
        if pick.prefill is not None:
            headers.append((b"x-pdgate-prefill-pod", pick.prefill.label.encode()))
        if not parsed.stream:
            try:
                raw = await response.read(MAX_JSON_BODY_BYTES)
            except ConnectionBroken:
                raise UpstreamError(
                    "disconnect", "The engine dropped the response.", retryable=True,
                    pod=pick.decode, phase="decode",
                ) from None
            if attempt.track_usage:
                attempt.output_tokens = body_completion_tokens(raw) or 0
                self._settle(attempt)
            ended()
            await out.start(response.status, headers)
            await out.body(raw)
            return
        usage = None
        if attempt.track_usage or parsed.include_usage:
            usage = StreamUsage(hide=not parsed.include_usage)
            if attempt.track_usage:
                attempt.usage = usage
        responses = parsed.endpoint is not None and parsed.endpoint.stream_end == "responses"
        track_usage = attempt.track_usage

        def on_end() -> None:
            if track_usage:
                self._settle(attempt)
            ended()

        relay = StreamRelay(self.metrics, parsed.model, out.clock, attempt.first_lap, usage,
                            responses, on_end=on_end)
        try:
            # Through this task until the response has started; then, on the edge's direct
            # path, by callback from the upstream connection (router/relay.py).
            while chunk := await response.readany():
                step = relay.take(chunk)
                if step is None:
                    continue
                if not out.started:
                    await out.start(response.status, headers)
                if out.finished:
                    continue  # after [DONE]: nothing is left to send (the loop reads to EOF)
                if step[1]:
                    await out.body(*step)
                    relay.sent(step[0])
                else:  # the response's last write: the stream's end is settled first
                    relay.last_step(step[0])
                    await out.body(*step)
                if out.direct is not None and not out.finished:
                    await relay.run(response, out, out.direct.flow)
                    break
        except ConnectionBroken:
            if out.finished:
                return  # the engine went away after [DONE]: the client has it all
            if not out.started:
                raise UpstreamError(
                    "disconnect", "The engine dropped the stream.", retryable=True,
                    pod=pick.decode, phase="decode",
                ) from None
            relay.finish(complete=False)
            await self._cut_short(pick, out, "disconnect", "The engine dropped the stream.")
            return
        if usage is not None and (tail := usage.finish()) and not out.finished:
            if not out.started:
                await out.start(response.status, headers)
            await out.body(tail, more=True)
        if not out.started:
            raise UpstreamError(
                "empty_response", "The engine closed the stream without data.",
                retryable=True, pod=pick.decode, phase="decode",
            )
        if not relay.complete:
            relay.finish(complete=False)
            await self._cut_short(pick, out, "truncated", "The engine ended the stream early.")
            return
        if not out.finished:
            relay.finish(complete=True)
            await out.body(b"")

    async def _cut_short(self, pick: Pick, out: Responder, reason: str, message: str) -> None:
        """End a stream the engine broke off: an error event (and `[DONE]` where the API
        has one), nothing spliced."""
        self.metrics.upstream_error(reason, "decode")
        self.outliers.record_failure(pick.decode)
        await out.body(out.sse_error(bad_gateway(message)), more=True)
        await out.body(b"")


def _pick_attributes(pick: Pick) -> dict[str, Any]:
    """A schedule span's attributes: the chosen pods and their costs."""
    attributes: dict[str, Any] = {"pdgate.decode.pod": pick.decode.label}
    if pick.decode_cost is not None:
        attributes["pdgate.decode.cost"] = pick.decode_cost
    if pick.prefill is not None:
        attributes["pdgate.prefill.pod"] = pick.prefill.label
        if pick.prefill_cost is not None:
            attributes["pdgate.prefill.cost"] = pick.prefill_cost
    return attributes


async def _beside_prefill(opening: Awaitable[Response], prefill: asyncio.Future[Any]
                          ) -> Response:
    """Decode's response, opened while its prefill runs (the concurrent rendezvous): a
    failed prefill leaves decode waiting for KV that will never come, so both are watched
    and decode is given up as soon as prefill fails, or the request ends."""
    decode = asyncio.ensure_future(opening)
    try:
        await asyncio.wait({decode, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if prefill.done() and prefill.exception() is not None:
            raise prefill.exception()  # type: ignore[misc]
        return await decode
    except BaseException:
        _give_up(decode)
        raise


def _give_up(opening: asyncio.Future[Response]) -> None:
    """Cancel a response's opening, or close the response if its head is already in (it
    may have come in the loop turn that ended the wait for it)."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result().close()


async def _finish_prefill(task: asyncio.Task[Any]) -> None:
    """Cancel a concurrent prefill still running and wait for it to end. Its failure was
    dealt with (or no longer matters); a cancellation of the request during the wait is
    the request's own and goes on up (awaiting the task itself would have taken it for
    the prefill's and swallowed it)."""
    if not task.done():
        task.cancel()
        await asyncio.wait({task})  # not when done already: no extra turn of the loop
    failure = None if task.cancelled() else task.exception()
    if failure is not None and not isinstance(failure, UpstreamError):
        raise failure


def _kv_lost(exc: UpstreamError) -> bool:
    """Whether decode failed for want of KV (a 503 from decode after its prefill ran)."""
    return exc.phase == "decode" and exc.status == 503


def _clients_fault(exc: UpstreamError) -> bool:
    """Whether the engine refused the client's own input (4xx other than 408/429).

    Such a refusal is a client error: the pod is fine and nothing upstream failed.
    """
    return exc.status is not None and 400 <= exc.status < 500 and not exc.retryable


def _client_error(exc: UpstreamError) -> APIError:
    if exc.reason == "timeout":
        return gateway_timeout(exc.message)
    if _clients_fault(exc):
        assert exc.status is not None
        return APIError(exc.status, exc.message, param=exc.param, code="upstream_rejected")
    return bad_gateway(exc.message, code=exc.reason)


def _upstream_headers(
    client: Mapping[str, str], request_id: str, annotations: Mapping[str, str]
) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-request-id": request_id}
    for name in FORWARDED_HEADERS:
        value = client.get(name)
        if value is not None:
            headers[name] = value
    if annotations.get(FORWARD_AUTH_ANNOTATION) == "true" and "authorization" in client:
        headers["authorization"] = client["authorization"]
    return headers
