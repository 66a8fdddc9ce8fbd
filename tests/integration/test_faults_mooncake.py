"""The Mooncake master restarted during traffic: requests fail cleanly or succeed, none hangs.

The module runs its own master (the session's is shared by other tests) and restarts it on
the same ports while four clients keep sending. Every request must end within the
trafficPolicy timeout (plus slack) with a 200 or an OpenAI error, and traffic must succeed
again once the master is back.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from engine_sim.mooncake_master import MooncakeMaster
from tests.integration.harness import SimCluster, free_port, write_yaml
from tests.integration.test_faults_kit import (
    FaultCluster,
    assert_no_leak,
    metric_sum,
    pd_specs,
    server_manifests,
    wait_for,
)

pytestmark = pytest.mark.integration

MODEL = "mc-restart-model"
TIMEOUT_S = 4.0
SLACK_S = 2.0


@pytest.fixture
def own_master(mooncake_master: object, tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test's own (`mooncake_master` only makes the test skip without one)."""
    master = MooncakeMaster(log_path=tmp_path / "master.log").start()
    try:
        yield master
    finally:
        master.stop()


async def test_master_restart_fails_cleanly_or_succeeds(own_master: MooncakeMaster,
                                                        tmp_path: Path) -> None:
    specs = pd_specs("mc")
    port = free_port([s.ip for s in specs])
    cluster = FaultCluster(SimCluster(own_master, tmp_path / "cluster"), port, specs)
    restarted: MooncakeMaster | None = None
    try:
        cluster.start_pods(MODEL, ["--fast"])
        write_yaml(cluster.sim.config_dir / "server.yaml", server_manifests(
            "mc", MODEL, app="mc", port=port, timeout=f"{TIMEOUT_S:.0f}s"))
        router = cluster.start_router(["--health-check-interval", "0.5"])
        outcomes: list[tuple[float, int | str, float]] = []
        stop = asyncio.Event()

        async def client(i: int) -> None:
            n = 0
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    began = time.monotonic()
                    body = {"model": MODEL, "max_tokens": 4, "messages": [
                        {"role": "user", "content": f"client {i} question {n} " * 12}]}
                    try:
                        async with session.post(
                            f"{router.url}/v1/chat/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S + SLACK_S),
                        ) as response:
                            raw = await response.read()
                            status: int | str = response.status
                    except (TimeoutError, aiohttp.ClientError) as exc:
                        raw, status = b"", f"hung or broken: {exc!r}"
                    if status != 200:
                        assert_no_leak(raw.decode(errors="replace"))
                        if isinstance(status, int):
                            assert json.loads(raw)["error"]["message"]
                    outcomes.append((time.monotonic(), status, time.monotonic() - began))
                    n += 1

        clients = [asyncio.create_task(client(i)) for i in range(4)]
        await asyncio.sleep(1.5)
        stopped_at = time.monotonic()
        ports = (own_master.rpc_port, own_master.metadata_port, own_master.metrics_port)
        own_master.stop()
        await asyncio.sleep(2.0)
        restarted = MooncakeMaster(rpc_port=ports[0], metadata_port=ports[1],
                                   metrics_port=ports[2],
                                   log_path=tmp_path / "master-restarted.log").start()
        back_at = time.monotonic()

        def recovered() -> bool:
            recent = [s for t, s, _ in outcomes if t > back_at + TIMEOUT_S]
            return len(recent) >= 20 and all(s == 200 for s in recent[-20:])

        try:
            await asyncio.to_thread(wait_for, recovered, 25.0, 0.2)
        finally:
            stop.set()
            await asyncio.gather(*clients)
        statuses = Counter(s for _, s, _ in outcomes)
        during = Counter(s for t, s, _ in outcomes if stopped_at <= t < back_at + TIMEOUT_S)
        print(f"\nmaster restart: {sum(statuses.values())} requests, {dict(statuses)}; "
              f"while down or recovering: {dict(during)}; "
              f"slowest {max(d for _, _, d in outcomes):.2f} s")
        assert set(statuses) <= {200, 502, 503, 504}, statuses  # no hang, no broken answer
        assert max(d for _, _, d in outcomes) < TIMEOUT_S + SLACK_S
        wait_for(lambda: metric_sum(router.metrics(), "pdgate_inflight_requests") == 0, 5)
    finally:
        cluster.stop()
        if restarted is not None:
            restarted.stop()
