"""`pdgate up`'s reading of a config directory: one simulated engine process per pod."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from router.local_cluster import UnsupportedConfig, sim_pods

CONFIG = Path(__file__).resolve().parents[2] / "config"


def _config(tmp_path: Path, annotations: str = "") -> Path:
    """The repository's example config, its ModelServer given `annotations` (YAML lines)."""
    for name in ("kthena-pd-example.yaml", "pods.yaml"):
        shutil.copy(CONFIG / name, tmp_path / name)
    example = tmp_path / "kthena-pd-example.yaml"
    text = example.read_text()
    head = "  name: deepseekv4-pd\n  namespace: default\n"
    assert text.count(head) == 1
    example.write_text(text.replace(head, head + annotations))
    return tmp_path


def test_one_process_a_pod(tmp_path: Path) -> None:
    specs = sim_pods(_config(tmp_path))
    assert [(s.endpoint.pod_name, s.data_parallel_size) for s in specs] == [
        ("deepseekv4-pd-0-prefill-0", 1), ("deepseekv4-pd-0-decode-0", 1),
        ("deepseekv4-pd-1-prefill-0", 1), ("deepseekv4-pd-1-decode-0", 1),
    ]


def test_a_data_parallel_pod_is_one_process_with_its_ranks(tmp_path: Path) -> None:
    ranks = "  annotations:\n    pdgate.io/data-parallel-size: \"2\"\n"
    specs = sim_pods(_config(tmp_path, ranks))
    assert len(specs) == 4 and {s.data_parallel_size for s in specs} == {2}
    assert {s.endpoint.dp_rank for s in specs} == {0}


@pytest.mark.parametrize("layout", [
    "    pdgate.io/data-parallel-lb: external\n",
    "    pdgate.io/data-parallel-lb: hybrid\n    pdgate.io/data-parallel-size-local: \"1\"\n",
])
def test_ranks_not_all_behind_one_api_server_are_refused(tmp_path: Path, layout: str) -> None:
    notes = "  annotations:\n    pdgate.io/data-parallel-size: \"2\"\n" + layout
    with pytest.raises(UnsupportedConfig, match="one simulator serving all its ranks"):
        sim_pods(_config(tmp_path, notes))
