"""The built wheel, installed as a user installs it: whole, alone, and beside the newest transformers.

The wheel is built from this checkout, installed into a fresh virtual environment together with the
newest ``transformers`` from the package index (and so with Hugging Face's Hub-kernel loader, whose
import name is ``kernels``), and used from a folder outside the repository, where nothing of the
checkout can be imported by accident: every subpackage imports, an op runs against torch, a tiny
Llama is patched and run, loaded with ``attn_implementation="kernel_ladder"`` and kernelized from the
layer repository the wheel ships, the optional C++ extension (``kernel_ladder.native``) is built from the
sources the wheel ships where a compiler is (else its error says what to install), and the Hub loader
still imports.

The fresh environment gets the torch build this one has (``torch==<this version>``), so that the
test does not download a multi-gigabyte CUDA build on a machine without a GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kernels" / "kernel_ladder"

# What runs inside the fresh environment, from a folder outside the repository.
USER_SCRIPT = textwrap.dedent(
    """
    import importlib, pathlib, pkgutil, sys
    import torch
    import kernel_ladder

    here = pathlib.Path(kernel_ladder.__file__).resolve()
    assert "site-packages" in here.parts, f"kernel_ladder imported from {here}, not the installed wheel"
    names = sorted(m.name for m in pkgutil.walk_packages(kernel_ladder.__path__, "kernel_ladder."))
    for name in names:
        importlib.import_module(name)
    print("imported", len(names) + 1, "modules")

    x, w = torch.randn(5, 48, dtype=torch.float64), torch.randn(48, dtype=torch.float64)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    got = kernel_ladder.rms_norm(x.float(), w.float(), 1e-6).double()
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    print("rms_norm matches")

    from transformers import LlamaConfig, LlamaForCausalLM
    from kernel_ladder.patch import patch_model, unpatch_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        reference = model(ids).logits
        patch_model(model)
        patched = model(ids).logits
        unpatch_model(model)
    error = ((patched - reference).abs().max() / reference.abs().max()).item()
    assert error < 1e-4, error
    print("patched Llama matches transformers")

    import kernel_ladder.hf

    kernel_ladder.hf.register()  # attn_implementation="kernel_ladder", no patching
    torch.manual_seed(0)
    by_name = LlamaForCausalLM._from_config(config, attn_implementation="kernel_ladder").eval()
    by_name.load_state_dict(model.state_dict())
    kernel_ladder.hf.kernelize(by_name)  # the layer repository shipped in the wheel
    with torch.no_grad(), torch.profiler.profile() as prof:
        error = ((by_name(ids).logits - reference).abs().max() / reference.abs().max()).item()
    assert error < 1e-4, error
    ran = {e.name for e in prof.events()}
    for op in ("kernel_ladder::flash_attention", "kernel_ladder::rms_norm", "kernel_ladder::rope"):
        assert op in ran, (op, sorted(n for n in ran if "kernel_ladder" in n))
    print("attn_implementation='kernel_ladder' and kernelize match transformers")

    import os, tempfile
    import kernel_ladder.native as native

    # The optional C++ extension, from the sources the wheel shipped, into a fresh cache (no stale build).
    csrc = native._build.CSRC
    assert "site-packages" in csrc.parts and (csrc / "ops.cpp").exists(), csrc
    os.environ["KERNEL_LADDER_NATIVE_DIR"] = tempfile.mkdtemp()
    if native.available():
        library = native.build()
        assert "site-packages" not in library.parts, library
        got = native.rms_norm(x.float(), w.float(), 1e-6).double()
        assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
        print("native: built from the wheel's sources and matches")
    else:
        try:
            native.load()
        except native.NativeBuildError as error:
            assert "install" in str(error), error
            print("native: not built (no compiler or ninja here), with an error saying what to install")
        else:
            raise AssertionError("native.load() built without a compiler")

    import kernels  # Hugging Face's Hub-kernel loader, which transformers requires
    assert hasattr(kernels, "kernelize"), kernels.__file__
    assert pathlib.Path(kernels.__file__).resolve().parent != here.parent / "kernels"
    print("Hugging Face's kernels imports beside kernel_ladder")
    """
)


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({done.returncode}):\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _tracked_files() -> list[str]:
    """The files a clean checkout has: git's tracked and untracked-but-not-ignored ones (no build output)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from the repository's files as a clean checkout has them: setuptools builds in place and never empties
    # a ./build left by an earlier build, whose stale modules (a file since moved) would otherwise ship.
    source = tmp_path_factory.mktemp("source")
    for name in _tracked_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)], cwd=out)
    (built,) = out.glob("kernel_ladder-*.whl")
    return built


def test_the_wheel_holds_the_whole_package_and_nothing_else(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}
    sources = {str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert sources, "no sources found"
    # the optional C++ extension's sources (compiled on the user's machine: kernel_ladder.native)
    native = {str(p.relative_to(PACKAGE.parent)) for p in (PACKAGE / "native" / "csrc").rglob("*")
              if p.suffix in (".cpp", ".h", ".cu", ".cuh")}
    assert "kernel_ladder/native/csrc/ops.cpp" in native and "kernel_ladder/native/csrc/cpu/rows.h" in native
    sources |= native
    missing = sorted(sources - shipped)
    assert not missing, f"the wheel leaves out {missing}"
    extra = sorted(name for name in shipped if not name.startswith("kernel_ladder/"))
    assert not extra, f"the wheel ships files outside kernel_ladder/: {extra}"
    stale = sorted(name for name in shipped if name.endswith(".py") and name not in sources)
    assert not stale, f"the wheel ships modules the source tree no longer has: {stale}"
    for subpackage in ("ops", "models", "distributed"):
        assert f"kernel_ladder/{subpackage}/__init__.py" in shipped


def test_the_negative_control_a_wheel_without_a_subpackage_is_caught(wheel: Path, tmp_path: Path) -> None:
    """The check above must fail on a wheel that leaves a subpackage out (as the old flat layout did)."""
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(broken, "w") as target:
        for item in source.infolist():
            if not item.filename.startswith("kernel_ladder/ops/"):
                target.writestr(item, source.read(item.filename))
    with pytest.raises(AssertionError, match="the wheel leaves out"):
        test_the_wheel_holds_the_whole_package_and_nothing_else(broken)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_installed_wheel_works_beside_the_newest_transformers(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, f"torch=={torch.__version__.split('+')[0]}"], cwd=tmp_path, timeout=900)
    _run([*pip, str(wheel), "transformers"], cwd=tmp_path, timeout=900)
    versions = _run([str(python), "-c", "import transformers, importlib.metadata as m; "
                     "print(transformers.__version__, m.version('kernels'))"], cwd=tmp_path)
    outside = tmp_path / "user_project"
    outside.mkdir()
    (outside / "use_it.py").write_text(USER_SCRIPT)
    printed = _run([str(python), "use_it.py"], cwd=outside, timeout=900)
    for line in ("rms_norm matches", "patched Llama matches transformers", "kernelize match transformers",
                 "native: ", "Hugging Face's kernels imports"):
        assert line in printed, printed
    print(f"transformers, kernels: {versions.strip()}\n{printed}")
