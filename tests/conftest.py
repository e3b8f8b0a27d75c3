"""Shared test set-up: the runtime mode first, gpu-marked tests skipped without a GPU, and the fixtures
every kernel test uses (``gen``: fresh, printed, replayable seeds; ``poisoned``: NaN-filled buffers).

Helpers that are not fixtures (tolerances, ``assert_matches``, ``make_input``) are in ``tests/helpers.py``.
"""

from __future__ import annotations

import os
import secrets
import tempfile

import pytest
import torch

# Inductor's on-disk graph cache does not know when a custom op's definition changes: a graph
# compiled by an earlier run (with an op since renamed or re-faked) would be reused. One fresh
# cache per test run.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="kernel-ladder-inductor-"))

import kernel_ladder  # noqa: F401,E402  (sets the interpreter mode before any test module defines a kernel)
from kernel_ladder import _launch

#: Set to an integer to replay the inputs of a failed run (its seed is printed with the failure).
SEED_ENV = "KERNEL_LADDER_SEED"


# Under pytest-xdist (``make test`` runs two workers on two cores) each worker's torch keeps to one
# thread, so the workers do not fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The longest tests first (the notebooks, then the rest marked slow): the files holding them are
    # handed out first, so that two workers finish together instead of one waiting on the last notebook.
    # (nbval's cells of a chapter notebook count as a notebook; the sort is stable, so they stay in order.)
    notebook = ("test_notebooks.py", ".ipynb::")
    items.sort(key=lambda item: 0 if any(n in item.nodeid for n in notebook) else 1 if "slow" in item.keywords else 2)
    compiled = torch.cuda.is_available() and not kernel_ladder.runtime.INTERPRETER
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
    return kernel_ladder.runtime.DEVICE


def test_seed() -> int:
    """The seed of this test's inputs: ``KERNEL_LADDER_SEED`` if set, else a fresh random one."""
    forced = os.environ.get(SEED_ENV, "").strip()
    return int(forced) if forced else secrets.randbits(31)


test_seed.__test__ = False  # a helper, not a test


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fresh seed, printed (pytest shows it with a failure); replay it with
    ``KERNEL_LADDER_SEED=<seed> pytest ...``. Draw on the CPU, then ``.to(device)``."""
    seed = test_seed()
    print(f"input seed: {seed} (replay: {SEED_ENV}={seed})")
    return torch.Generator().manual_seed(seed)


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t
    value = float("nan") if t.dtype.is_floating_point else torch.iinfo(t.dtype).min
    # Test instrumentation, not the op's work: hidden from dispatch modes (utils.trace counts the
    # torch ops a kernel_ladder op runs inside, and would count this fill as one of them).
    with torch.utils._python_dispatch._disable_current_modes():
        return t.fill_(value)


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the ops allocate (``kernel_ladder._launch.empty``, the one allocation hook) starts as
    NaN (floats) or the smallest integer, so an element a kernel forgets to write shows up.

    ``raising=True``: if the hook is renamed, every test that relies on poisoning fails loudly
    instead of silently testing unpoisoned memory.
    """
    real = _launch.empty

    def empty(shape, dtype, device):
        return _poison(real(shape, dtype, device))

    monkeypatch.setattr(_launch, "empty", empty, raising=True)
    return empty
