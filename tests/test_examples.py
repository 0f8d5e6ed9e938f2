"""The example files in deploy/examples stay valid."""

from __future__ import annotations

from pathlib import Path

from engine_adapter.vllm.settings import VllmAdapterSettings
from scheduler_service.core import Snapshot
from scheduler_service.server.config import ServerConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "deploy" / "examples"


def test_server_config_example_loads_with_documented_values() -> None:
    cfg = ServerConfig.from_file(EXAMPLES / "server.yaml")
    assert cfg.port == 50051 and cfg.metrics_port == 9464 and cfg.default_policy == "slidingserve"


def test_adapter_settings_example_applies() -> None:
    s = VllmAdapterSettings.from_env({"SLIDINGSERVE_CONFIG": str(EXAMPLES / "adapter.yaml")})
    assert s.policy == "slidingserve" and s.deadline_ms == 20.0 and s.params["window"] == "2"


def test_snapshot_example_parses() -> None:
    snap = Snapshot.from_json((EXAMPLES / "snapshot.json").read_text())
    assert len(snap) == 5 and snap.free_kv_tokens == 120000
