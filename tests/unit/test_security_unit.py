"""API keys, token buckets, rate limiting, usage watching, request and header limits."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry

from router.errors import APIError, scrub, upstream_fields
from router.request import MAX_NESTING_DEPTH, parse_request
from router.resources import ModelRoute, ObjectMeta, RateLimit
from router.security.api_keys import APIKeys
from router.security.buckets import LocalBuckets, TokenBucket
from router.security.config import SecurityConfig
from router.security.limits import read_headers
from router.security.ratelimit import TokenRateLimiter, estimate_prompt_tokens
from router.security.usage import MAX_HELD_EVENT_BYTES, StreamUsage, body_completion_tokens

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- API keys -----------------------------------------------------------------------


def test_keys_from_a_file_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha-key\n\n  beta-key  \n")
    keys = APIKeys(path)
    assert keys.count == 2
    keys.check("Bearer alpha-key")
    keys.check("bearer beta-key")
    for bad in (None, "alpha-key", "Bearer ", "Bearer alpha", "Basic alpha-key",
                "Bearer " + "x" * 5000):
        with pytest.raises(APIError) as caught:
            keys.check(bad)
        assert caught.value.status == 401
        assert caught.value.code == "invalid_api_key"
        assert "www-authenticate" in caught.value.headers


def test_keys_from_a_mounted_secret_and_reload(tmp_path: Path) -> None:
    mount = tmp_path / "secret"
    data = tmp_path / "secret" / "..2026_01_01"
    data.mkdir(parents=True)
    (data / "k1").write_text("one\n")
    (data / "k2").write_text("two\nthree\n")
    (mount / "..data").symlink_to(data.name)
    for name in ("k1", "k2"):
        (mount / name).symlink_to(Path("..data") / name)
    registry = CollectorRegistry()
    keys = APIKeys(mount, registry=registry)
    assert keys.count == 3
    keys.check("Bearer three")
    assert not keys.reload()  # nothing changed
    time.sleep(0.01)
    (data / "k1").write_text("four\n")
    assert keys.reload()
    keys.check("Bearer four")
    with pytest.raises(APIError):
        keys.check("Bearer one")
    assert registry.get_sample_value("pdgate_auth_failures_total", {"reason": "invalid"}) == 1


def test_unreadable_keys_keep_the_old_ones(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("k\n")
    keys = APIKeys(path)
    path.unlink()
    assert not keys.reload()
    keys.check("Bearer k")
    with pytest.raises(OSError):
        APIKeys(tmp_path / "missing")


def test_an_empty_key_file_refuses_everyone(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# nobody yet\n")
    with pytest.raises(APIError):
        APIKeys(path).check("Bearer anything")


# --- token buckets ------------------------------------------------------------------


def test_bucket_take_refill_debt_and_reshape() -> None:
    bucket = TokenBucket(rate=1.0, capacity=10.0, now=0.0)
    assert bucket.take(6, 0.0) == 0.0
    assert bucket.take(6, 0.0) == pytest.approx(2.0)  # 4 left, 2 s until 6
    assert bucket.take(6, 2.0) == 0.0
    bucket.charge(5, 2.0)
    assert bucket.credit_wait(2.0) == pytest.approx(6.0)  # -5: 6 s to get above 0
    bucket.reshape(10.0, 100.0, 2.0)  # spent 15 of 10 -> 15 of 100 spent
    assert bucket.tokens == pytest.approx(85.0)
    bucket.reshape(1.0, 5.0, 2.0)
    assert bucket.credit_wait(2.0) > 0


def test_local_buckets_are_bounded_and_forget_routes() -> None:
    clock = Clock()
    buckets = LocalBuckets(clock)
    assert buckets.take("a", 1.0, 2.0, 2) == 0.0
    assert buckets.take("a", 1.0, 2.0, 1) > 0
    buckets.take("b", 1.0, 2.0, 1)
    buckets.retain({"b"})
    assert len(buckets) == 1
    assert buckets.take("a", 1.0, 2.0, 2) == 0.0  # a fresh bucket


# --- rate limiting ------------------------------------------------------------------


def route(limit: RateLimit | None) -> ModelRoute:
    return ModelRoute(ObjectMeta("r", "default"), "m", (), (), rate_limit=limit)


def chat(text: str, **extra: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}],
                         **extra})


async def test_input_tokens_are_taken_up_front() -> None:
    clock, registry = Clock(), CollectorRegistry()
    limiter = TokenRateLimiter(registry=registry, clock=clock)
    limited = route(RateLimit(input_tokens_per_unit=30, unit="minute"))
    request = parse_request(CHAT, chat("x" * 40))  # ~10 tokens
    assert estimate_prompt_tokens(request) == 10
    for _ in range(3):
        await limiter.admit(limited, request)
    with pytest.raises(APIError) as caught:
        await limiter.admit(limited, request)
    assert caught.value.status == 429
    assert caught.value.message == "input token rate limit exceeded"
    assert caught.value.headers["retry-after"] == "20"  # 10 tokens at 0.5 a second
    clock.now += 20
    await limiter.admit(limited, request)
    too_big = parse_request(CHAT, chat("x" * 400))
    with pytest.raises(APIError) as caught:
        await limiter.admit(limited, too_big)
    assert "exceed the limit" in caught.value.message
    assert registry.get_sample_value("pdgate_rate_limited_total", {"kind": "input"}) == 2


async def test_output_tokens_are_charged_after_and_changes_apply_at_once() -> None:
    clock = Clock()
    limiter = TokenRateLimiter(clock=clock)
    request = parse_request(CHAT, chat("hi"))
    limited = route(RateLimit(output_tokens_per_unit=20, unit="minute"))
    await limiter.admit(limited, request)
    limiter.settle_output(limited, 16)
    await limiter.admit(limited, request)  # 4 left: still allowed
    limiter.settle_output(limited, 16)  # -12
    with pytest.raises(APIError) as caught:
        await limiter.admit(limited, request)
    assert caught.value.message == "output token rate limit exceeded"
    raised = route(RateLimit(output_tokens_per_unit=1000, unit="minute"))
    await limiter.admit(raised, request)  # the same route, a bigger limit: at once
    await limiter.admit(route(None), request)  # no limit at all
    lowered = route(RateLimit(output_tokens_per_unit=10, unit="minute"))
    with pytest.raises(APIError):
        await limiter.admit(lowered, request)  # 32 spent of 10


async def test_unreachable_redis_lets_requests_through() -> None:
    registry = CollectorRegistry()
    limiter = TokenRateLimiter(redis_timeout_s=0.2, registry=registry)
    limited = route(RateLimit(input_tokens_per_unit=1, output_tokens_per_unit=1,
                              redis_address="127.0.0.1:1"))
    await limiter.admit(limited, parse_request(CHAT, chat("x")))
    assert (registry.get_sample_value("pdgate_ratelimit_backend_errors_total") or 0) >= 1
    await limiter.close()


def test_prompt_estimates() -> None:
    completion = "/v1/completions"
    assert estimate_prompt_tokens(parse_request(
        completion, b'{"model": "m", "prompt": [1, 2, 3, 4, 5]}')) == 5
    assert estimate_prompt_tokens(parse_request(
        completion, b'{"model": "m", "prompt": "abcdefgh"}')) == 2
    parts = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a" * 12}, {"type": "image_url", "image_url": {}}]}]})
    assert estimate_prompt_tokens(parse_request(CHAT, parts)) == 3


# --- usage --------------------------------------------------------------------------


USAGE = (b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":7,'
         b'"total_tokens":10}}\n\n')
TOKENS = b"".join(
    b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i
    for i in range(7)
)
STREAM = TOKENS + USAGE + b"data: [DONE]\n\n"


@pytest.mark.parametrize("cut", [1, 5, 17, 50, len(TOKENS) + 3, len(TOKENS) + 60])
@pytest.mark.parametrize("hide", [True, False])
def test_stream_usage_is_read_and_hidden_across_any_chunking(cut: int, hide: bool) -> None:
    usage = StreamUsage(hide=hide)
    out = b""
    for start in range(0, len(STREAM), cut):
        out += usage.feed(STREAM[start:start + cut])
    out += usage.finish()
    assert usage.tokens == 7 and usage.charged == 7
    assert out == (TOKENS + b"data: [DONE]\n\n" if hide else STREAM)


def test_stream_without_usage_charges_one_token_per_event() -> None:
    usage = StreamUsage(hide=True)
    assert usage.feed(TOKENS + b"data: [DONE]\n\n") == TOKENS + b"data: [DONE]\n\n"
    assert usage.tokens is None and usage.charged == 7


def test_an_event_that_never_ends_is_passed_on_not_held() -> None:
    usage = StreamUsage(hide=True)
    piece = b"x" * 65_536
    first = b'data: {"choices": [{"text": "' + piece
    fed, passed = len(first), len(usage.feed(first))
    for _ in range(2 * MAX_HELD_EVENT_BYTES // len(piece)):
        fed, passed = fed + len(piece), passed + len(usage.feed(piece))
        assert fed - passed <= MAX_HELD_EVENT_BYTES  # never more held than the bound
    assert passed > MAX_HELD_EVENT_BYTES
    tail = usage.feed(b'"}]}\n\n' + STREAM)  # the event ends: usage is read again after it
    assert usage.tokens == 7 and tail.endswith(b'"}]}\n\n' + TOKENS + b"data: [DONE]\n\n")


def test_body_usage() -> None:
    assert body_completion_tokens(b'{"usage": {"completion_tokens": 4}}') == 4
    for raw in (b"nope", b"[]", b'{"usage": {"completion_tokens": true}}', b'{"usage": 1}'):
        assert body_completion_tokens(raw) is None


# --- request and header limits ---------------------------------------------------------


def test_header_limits() -> None:
    headers = read_headers([(b"Authorization", b"Bearer k"), (b"X-A", b"1")], 10, 1000)
    assert headers == {"authorization": "Bearer k", "x-a": "1"}
    with pytest.raises(APIError) as caught:
        read_headers([(b"x", b"y")] * 11, 10, 1000)
    assert caught.value.status == 431
    with pytest.raises(APIError):
        read_headers([(b"x", b"y" * 2000)], 10, 1000)


@pytest.mark.parametrize(("raw", "status"), [
    (b'{"model":"m","messages":[{"role":"u","content":"\xff"}]}', 400),
    (b'{"model":"m","messages":[{"role":"u","content":"\\udc00"}]}', 400),
    (b'{"model":"m","messages":[{"role":"u","content":'
     + b"[" * MAX_NESTING_DEPTH + b"]" * MAX_NESTING_DEPTH + b"}]}", 400),
    (orjson.dumps({"model": "m" * 257, "messages": [{"role": "u"}]}), 400),
    (b'{"model":"m","messages":[{"role":"u"}]}' + b" " * 100, 413),
])
def test_request_limits(raw: bytes, status: int) -> None:
    with pytest.raises(APIError) as caught:
        parse_request(CHAT, raw, max_body_bytes=len(raw) - 50 if status == 413 else 1 << 20)
    assert caught.value.status == status


def test_nesting_at_the_limit_is_accepted_and_can_be_forwarded() -> None:
    depth = MAX_NESTING_DEPTH - 3  # body, messages, message: three levels used
    raw = (b'{"model":"m","messages":[{"role":"u","content":' + b"[" * depth + b"]" * depth
           + b"}]}")
    parsed = parse_request(CHAT, raw)
    assert orjson.loads(orjson.dumps(parsed.body)) == parsed.body


def test_engine_messages_are_scrubbed() -> None:
    assert scrub("see 10.1.2.3:8000 and http://svc.internal:9/x") == "see <address> and <address>"
    assert scrub("Traceback (most recent call last): ...") is None
    assert scrub("x" * 2000) == "x" * 512
    assert upstream_fields(b'{"error": {"message": "at [fe80::1]:80"}}')[0] == "at <address>"


def test_an_engines_param_is_passed_on_when_it_names_a_field() -> None:
    nested = b'{"error": {"message": "m", "type": "BadRequestError", "param": "max_tokens"}}'
    assert upstream_fields(nested) == ("m", "max_tokens")
    flat = b'{"object": "error", "message": "m", "param": "messages[0]"}'
    assert upstream_fields(flat) == ("m", "messages[0]")
    for body in (b'{"error": {"message": "m", "param": null}}', b'{"error": {"param": 3}}',
                 b'{"error": {"param": "a b <script>"}}', b"not json", b"[]"):
        assert upstream_fields(body)[1] is None



def test_security_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError):
        SecurityConfig(max_body_bytes=0)
    with pytest.raises(ValueError):
        SecurityConfig(redis_timeout_s=0)
