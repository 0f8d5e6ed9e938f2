"""vLLM scheduler tests: CPU only, a config.json-only model folder, no hub access."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from .support import model_dir


@pytest.fixture(scope="session")
def mdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return model_dir(tmp_path_factory.mktemp("vllm-model"))
