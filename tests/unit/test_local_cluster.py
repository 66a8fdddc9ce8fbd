"""`pdgate up`'s reading of a config directory: one simulated engine process per pod."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine_sim.cli import parse_config
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


def test_ranks_each_behind_a_server_of_their_own_are_refused(tmp_path: Path) -> None:
    notes = ("  annotations:\n    pdgate.io/data-parallel-size: \"2\"\n"
             "    pdgate.io/data-parallel-lb: external\n")
    with pytest.raises(UnsupportedConfig, match="not one a rank"):
        sim_pods(_config(tmp_path, notes))


def test_a_node_of_a_hybrid_deployment_runs_its_own_ranks(tmp_path: Path) -> None:
    """DP 2 over pods of 1: group 1's pods run global rank 1 (their start-rank
    annotation), group 0's rank 0; each simulator is given vLLM's flags for that, and
    they parse to those ranks."""
    notes = ("  annotations:\n    pdgate.io/data-parallel-size: \"2\"\n"
             "    pdgate.io/data-parallel-size-local: \"1\"\n"
             "    pdgate.io/data-parallel-lb: hybrid\n")
    config = _config(tmp_path, notes)
    pods = config / "pods.yaml"
    text = pods.read_text()
    for group in (0, 1):
        for role in ("prefill", "decode"):
            head = f"  name: deepseekv4-pd-{group}-{role}-0\n"
            assert text.count(head) == 1
            text = text.replace(head, head + "  annotations:\n"
                                f"    pdgate.io/data-parallel-start-rank: \"{group}\"\n")
    pods.write_text(text)
    specs = sim_pods(config)
    assert [(s.endpoint.pod_name, s.data_parallel_start_rank) for s in specs] == [
        ("deepseekv4-pd-0-prefill-0", 0), ("deepseekv4-pd-0-decode-0", 0),
        ("deepseekv4-pd-1-prefill-0", 1), ("deepseekv4-pd-1-decode-0", 1),
    ]
    for spec in specs:
        sim = parse_config(["--role", spec.endpoint.role, "--port", "8000", "--model", "m",
                            "--mooncake-master", "127.0.0.1:1",
                            "--metadata-server", "http://127.0.0.1:2/metadata",
                            *spec.data_parallel_flags()])
        start = spec.data_parallel_start_rank
        assert sim.data_parallel_ranks == range(start, start + 1)
        assert spec.endpoint.rank_pin == "0"  # its server's only engine
