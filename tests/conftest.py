"""Shared fixtures. The tiny model is built once per test session (about 5 s) and reused by every
test that needs a real Hugging Face model directory: rollout, sft, rl and eval tests all load it the
way they load Qwen3-14B."""
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny  # noqa: E402  (after the path above)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-model")
    return tiny.build_tiny_model(tiny.TinyConfig(out_dir=str(out), pretrain_steps=0))
