"""Fixtures of the GPU path tests: every test here takes ``device``, "cpu" always and "cuda"
(marked ``gpu``) where CUDA is, so the CPU variant proves each test sound on any machine.

``pytest -m gpu tests/gpu`` runs only the CUDA variants (``bash tests/gpu/run.sh`` on a GPU
machine); without CUDA they skip with the reason.
"""

from __future__ import annotations

import pytest
import torch

NO_CUDA = "CUDA is not available (torch.cuda.is_available() is false)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip(NO_CUDA)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    """Where the caller's buffers live: host memory, or CUDA memory (skipped without CUDA)."""
    return str(request.param)
