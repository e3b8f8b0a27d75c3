"""Shared test set-up: the runtime mode first, gpu-marked tests skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (sets the interpreter mode before any test module defines a kernel)


def pytest_collection_modifyitems(config, items):
    compiled = torch.cuda.is_available() and not kernels.runtime.INTERPRETER
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (sizes too large for the interpreter)")
    skip_interpreter = pytest.mark.skip(reason="counts or diagnoses through Triton's interpreter; kernels compile here")
    for item in items:
        if "gpu" in item.keywords and not compiled:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and compiled:
            item.add_marker(skip_interpreter)


@pytest.fixture
def device() -> torch.device:
    """Where tensors go: the GPU when kernels compile, else the CPU."""
    return kernels.runtime.DEVICE
