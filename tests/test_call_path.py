"""utils.call_path: the calls inside a package that receive one watched object, in order."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import kernel_ladder
from utils.call_path import ArgumentPath, Step, argument_path


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A two-module package: ``api.run`` hands its argument to ``helpers`` and back, and a copy elsewhere."""
    package = tmp_path / "toy_path_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text(textwrap.dedent("""
        def check(value):
            return value

        def check_all(values):
            return values

        def unrelated(other):
            return other
    """))
    (package / "api.py").write_text(textwrap.dedent("""
        from . import helpers

        def run(x):
            helpers.check(x)
            helpers.check_all([1, x])
            helpers.unrelated(list(x))  # a copy: not the watched object
            return finish(value=x)

        def finish(value):
            return helpers.check(value)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_path_pkg.api

    yield toy_path_pkg
    for name in [n for n in sys.modules if n.startswith("toy_path_pkg")]:
        del sys.modules[name]


def test_steps_are_the_calls_that_receive_the_object_in_order(toy):
    x = [1.0, 2.0]
    path = argument_path(toy.api.run, x, watch=x, package=toy)
    assert [str(step) for step in path] == [
        "api.py:run", "helpers.py:check", "helpers.py:check_all", "api.py:finish", "helpers.py:check",
    ]
    assert path.files == ["api.py", "helpers.py"]
    assert path.visits("api.py") == 2 and path.visits("helpers.py") == 2  # runs of consecutive steps count once
    assert isinstance(path, ArgumentPath) and path[0] == Step("api.py", "run")


def test_identity_not_equality(toy):
    x, equal = [1.0, 2.0], [1.0, 2.0]
    assert len(argument_path(toy.api.run, x, watch=equal, package=toy)) == 0


def test_the_previous_profiler_is_restored(toy):
    events = []
    previous = lambda frame, event, arg: events.append(event)  # noqa: E731
    sys.setprofile(previous)
    try:
        argument_path(toy.api.run, [1.0], watch=None, package=toy)
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)


def test_kernel_ladder_is_the_default_package():
    x = torch.randn(4, 8)
    path = argument_path(kernel_ladder.add, x, x, watch=x)
    assert path[0] == Step("ops/add.py", "add"), str(path)
    assert all(not step.file.startswith("/") for step in path)
