"""The Mooncake trace workload: loading, bucket spreading, exact text blocks, the window's
best hit rate, and the open-loop replay at the trace's times (on a tiny trace written here)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import orjson
import pytest
import yaml
from aiohttp import web

from benchmarks.loadgen import LoadLimits, run_at
from benchmarks.targets import HTTPTarget
from benchmarks.trace import (
    BlockTexts,
    TraceError,
    TraceOptions,
    arrivals,
    best_hit_rate,
    best_within,
    load_trace,
    spread_buckets,
    trace_window,
)
from benchmarks.trace_bench import (
    _HEADER,
    DEFAULT_POLICIES,
    LENGTH_FACTOR,
    TRACE_POLICIES,
    TraceBenchConfig,
    TraceRun,
    TraceSLO,
    add_arguments,
    options_of,
    render,
    shape_for,
    specs_for,
)
from benchmarks.words import sim_tokenizer
from router.scheduling.config import key_settings, parse_scheduler_config
from tests.local_http import serve

RECORDS = [  # two conversations: ids 1,2 then 1,2,3 (a prefix hit of 2 blocks), and 7
    {"timestamp": 0, "input_length": 1000, "output_length": 40, "hash_ids": [1, 2]},
    {"timestamp": 0, "input_length": 300, "output_length": 10, "hash_ids": [7]},
    {"timestamp": 3000, "input_length": 1400, "output_length": 99, "hash_ids": [1, 2, 3]},
    {"timestamp": 6000, "input_length": 512, "output_length": 5, "hash_ids": [9]},
]


def _write(tmp_path: Path, records: list[dict[str, object]]) -> Path:
    path = tmp_path / "tiny_trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return path


def test_load_a_window(tmp_path: Path) -> None:
    path = _write(tmp_path, RECORDS)
    assert [r.hash_ids for r in load_trace(path)] == [(1, 2), (7,), (1, 2, 3), (9,)]
    window = load_trace(path, start=1, window=2)
    assert [r.input_length for r in window] == [300, 1400]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1"):
        load_trace(bad)


def test_buckets_are_spread_to_the_next_timestamp() -> None:
    assert spread_buckets([0.0, 0.0, 0.0, 3.0, 6.0]) == [0.0, 1.0, 2.0, 3.0, 6.0]
    assert spread_buckets([0.0, 3.0, 3.0]) == [0.0, 3.0, 4.5]  # last bucket: the mean gap
    assert spread_buckets([]) == []


def test_arrivals_are_relative_scaled_and_spread(tmp_path: Path) -> None:
    requests = load_trace(_write(tmp_path, RECORDS), start=2)
    assert arrivals(requests, 0.5) == [0.0, 1.5]
    assert arrivals(load_trace(_write(tmp_path, RECORDS)), 1.0) == [0.0, 1.5, 3.0, 6.0]


def test_blocks_are_exact_deterministic_and_prefix_consistent() -> None:
    texts = BlockTexts(128, seed=0)
    full = texts.prompt([1, 2, 3], 3 * 128)
    longer = BlockTexts(128, seed=0).prompt([1, 2, 3, 4], 4 * 128)
    assert longer.startswith(full + " ")  # equal ids, equal text: a reusable prefix
    assert texts.prompt([1, 2], 200) == full[: len(" abc") * 200]  # a cut last block
    assert texts.prompt([5], 128) != texts.prompt([6], 128)
    tokenizer = sim_tokenizer()
    ids = tokenizer.request_ids("completion", {"prompt": full})[0]
    bos = len(tokenizer.request_ids("completion", {"prompt": " abc"})[0]) - 1
    assert len(ids) - bos == 3 * 128  # every word one token: blocks are exact


def test_best_hit_rate_counts_leading_blocks_seen_before(tmp_path: Path) -> None:
    requests = load_trace(_write(tmp_path, RECORDS))
    # Only the third request hits: its first two blocks (2 x 512 tokens) of 1400.
    assert best_hit_rate(requests, TraceOptions()) == pytest.approx(1024 / (1000 + 300 + 1400
                                                                            + 512))
    # Token scale 0.25: blocks of 128 tokens, lengths scaled alike.
    assert best_hit_rate(requests, TraceOptions(token_scale=0.25)) == pytest.approx(
        256 / (250 + 75 + 350 + 128)
    )


def test_best_within_is_the_share_any_router_could_bring_under_a_prefill_budget(
    tmp_path: Path,
) -> None:
    requests = load_trace(_write(tmp_path, RECORDS))
    # Computed with an infinite shared cache: 1000, 300, 1400 - 1024 = 376 and 512 tokens.
    assert best_within(requests, TraceOptions(), 512) == 0.75  # all but the first
    assert best_within(requests, TraceOptions(), 375) == 0.25  # the 300-token one only
    assert best_within(requests, TraceOptions(), 1000) == 1.0
    # Without the cached prefix the third request (1400 tokens) would miss 1000.
    assert best_within(requests[2:3], TraceOptions(), 1000) == 0.0
    window = trace_window(_write(tmp_path, RECORDS), TraceOptions(), "m")
    assert window.best_within(window.input_quantile(0.25)) == 0.75  # 512 tokens
    # The same computed tokens, ordered: 300, 376, 512, 1000.
    assert [window.best_uncached_quantile(q) for q in (0.0, 0.3, 0.6, 0.9)] == [
        300, 376, 512, 1000]


def test_trace_window_builds_one_request_per_record(tmp_path: Path) -> None:
    window = trace_window(_write(tmp_path, RECORDS),
                          TraceOptions(token_scale=0.25, max_output_tokens=16), "m")
    bodies = [orjson.loads(spec.body) for spec in window.specs]
    assert [b["max_tokens"] for b in bodies] == [16, 10, 16, 5]
    words = [len(b["messages"][0]["content"].split()) for b in bodies]
    assert words == [250, 75, 350, 128]
    assert window.unique_tokens() == 5 * 128 and window.duration_s == 6.0


def test_the_engines_own_cache_is_the_share_of_distinct_tokens_asked_for(
    tmp_path: Path,
) -> None:
    """`--trace-cache-share`: each prefill engine's KV cache (in 16-token blocks) is that
    share of the window's distinct prompt tokens; the default is `TraceBenchConfig`'s."""
    long = [{"timestamp": 0, "input_length": 200 * 512, "output_length": 4,
             "hash_ids": list(range(200))}]
    path = _write(tmp_path, long)
    window = trace_window(path, TraceOptions(token_scale=1.0), "m")

    def prefill_blocks(*argv: str) -> int:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        _, _, config = options_of(parser.parse_args(["--trace", str(path), *argv]))
        flags = shape_for(window, config)[0].prefill_flags
        return int(flags[flags.index("--kv-capacity-blocks") + 1])

    assert prefill_blocks() == int(0.15 * 200 * 512 / 16)
    assert prefill_blocks("--trace-cache-share", "0.05") == int(0.05 * 200 * 512 / 16)
    with pytest.raises(SystemExit):
        prefill_blocks("--trace-cache-share", "0")


ARRIVED = web.AppKey("arrived", list[float])


async def _answer(request: web.Request) -> web.StreamResponse:
    arrived = request.app[ARRIVED]
    arrived.append(time.perf_counter())
    await request.read()
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n')
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[float]]]:
    app = web.Application()
    app[ARRIVED] = []
    app.router.add_post("/v1/chat/completions", _answer)
    runner, port = await serve(app)
    try:
        yield f"http://127.0.0.1:{port}", app[ARRIVED]
    finally:
        await runner.cleanup()


async def test_replay_is_open_loop_at_the_trace_times(
    server: tuple[str, list[float]], tmp_path: Path
) -> None:
    base, arrived = server
    window = trace_window(_write(tmp_path, RECORDS), TraceOptions(time_scale=0.05,
                                                                  token_scale=0.05), "m")
    began = time.perf_counter()
    load = await run_at(HTTPTarget("t", base), [(s,) for s in window.specs], window.offsets,
                        LoadLimits(10.0, 5.0))
    assert [r.ok for r in load.results] == [True] * 4
    offsets = sorted(t - began for t in arrived)
    for got, want in zip(offsets, window.offsets, strict=True):  # 0, 0.075, 0.15, 0.3 s
        assert want - 0.01 <= got <= want + 0.1


def test_every_trace_policy_loads_and_only_the_seeded_one_keys_by_engine_hashes() -> None:
    """The policies' YAML goes through the router's own loader; the seeded precise policy
    tells it the engines' seed, which lets its index key blocks by the engines' hashes."""
    modes = {}
    for name, body in TRACE_POLICIES.items():
        config = parse_scheduler_config(yaml.safe_load(_HEADER + body), name)
        modes[name] = key_settings(config.precise_index).mode
    assert modes.pop("global-precise-seeded") == "hashes"
    assert set(modes.values()) == {"tokens"}
    assert set(DEFAULT_POLICIES) == set(modes)  # the seeded one is opt-in


def test_the_length_aware_slo_holds_long_prompts_to_their_own_prefill(
    tmp_path: Path,
) -> None:
    window = trace_window(_write(tmp_path, RECORDS), TraceOptions(), "m")
    slo = TraceSLO.of(window, per_token_ms=1.0)
    # Prompts of 1000, 300, 1400 and 512 tokens: the p90 one is 1400 tokens.
    assert slo.flat_tokens == 1400 and slo.flat_s == pytest.approx(1.405)
    assert slo.targets[1] == slo.flat_s  # 300 tokens: held to the flat target
    assert slo.targets[0] == pytest.approx(LENGTH_FACTOR * 1.005)  # 2 x its own 1.005 s
    assert min(slo.targets) >= slo.flat_s
    # The gate of `global-slo` uses the same k.
    (spec,) = specs_for(TraceBenchConfig(policies=("global-slo",), peers=()), 1.0, 1.405)
    config = parse_scheduler_config(yaml.safe_load(spec.scheduler_yaml or ""))
    assert config.slo.enabled and config.slo.length_factor == LENGTH_FACTOR
    assert config.slo.ttft_target_s == pytest.approx(1.405, abs=1e-3)


def test_the_report_states_both_slos_and_the_refusals() -> None:
    setup = {"trace": "t", "start": 0, "requests": 4, "duration_s": 6.0, "time_scale": 1.0,
             "token_scale": 1.0, "groups": 2, "prefill_ms_per_token": 1.0, "slo_s": 1.405,
             "slo_ceiling": 0.75, "length_factor": 2.0, "best_hit_rate": 0.2,
             "p90_floor_s": 1.005,
             "sim_flags": "", "prefill_flags": ""}
    run = TraceRun(trace="t", router="pdgate (global-slo)", requests=4, ok=3,
                   ttfts=[0.5, 1.0, 1.9], slo_s=1.405, within_length_slo=0.75, refused=1,
                   local_hit=0.1, store_hit=0.1, best_hit=0.2, router_cpu_s=1.0,
                   main_cpu_s=0.6, peak_rss=None, wall_s=6.0, load_before=0.0,
                   load_after=0.0,
                   prediction={"cpu_kv_events": 0.25, "cpu_tokenize": 0.15, "fit_samples": 3})
    text = render([(setup, [run])])
    assert "no router can bring more than 75.0%" in text
    assert "2x the request's own uncached prefill" in text
    assert "TTFT p90 floor 1.00 s" in text
    row = next(line for line in text.splitlines() if line.startswith("| pdgate"))
    # within the flat SLO: 2 of 4 (the 429 counts as a miss); length-aware 75%; 1 refused
    assert "| 50.0% | 75.0% |" in row and "| 3/4 | 1 |" in row
    # CPU: router 1.0 s, its loop 0.6 (KV events 0.25 of it), other threads 0.4 (tokenizing
    # 0.15 of them)
    cpu = [line for line in text.splitlines() if line.startswith("| pdgate")][-1]
    assert cpu == "| pdgate (global-slo) | 1.00 | 0.60 | 0.25 | 0.40 | 0.15 |"


@pytest.mark.parametrize(("budget", "runs"), [(None, True), (10.0, False)])
async def test_only_a_budget_given_on_the_command_line_skips_the_trace_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: float | None, runs: bool
) -> None:
    """A slower machine spends the default budget on the phases before the trace; `make
    bench` must still give the trace tables. A budget the user gave is kept to."""
    from benchmarks import cli
    from benchmarks.phases import Bench

    replayed: list[list[Path]] = []

    async def replay(paths: list[Path], *_: object) -> None:
        replayed.append(paths)

    monkeypatch.setattr(cli.trace_bench, "run_traces", replay)
    trace = _write(tmp_path, RECORDS)
    args = cli.parse_args(
        ["--trace", str(trace)] + ([] if budget is None else ["--time-budget", str(budget)])
    )
    spent = Bench(config=cast(Any, None), lineup=cast(Any, None), work_dir=tmp_path / "raw",
                  deadline=time.monotonic() - 1.0, reporter=cast(Any, None))
    await cli._trace(spent, args)
    assert replayed == ([[trace]] if runs else [])
    assert ("trace" in spent.skipped) is not runs
