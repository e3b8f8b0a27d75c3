"""What ``make setup`` installed, said plainly: which torch build and how large, and which packages import.

``python -m utils.setup_report torch`` prints the torch build (CPU, CUDA x.y or ROCm) and the size on
disk of torch and of the GPU libraries it pulled in; ``python -m utils.setup_report imports REPO``
checks, from outside the repository, that ``import kernel_ladder`` finds REPO's package and that
Hugging Face's Hub-kernel loader (``import kernels``, which transformers requires from 5.25) imports
beside it. Both exit non-zero with the reason when something is not as it should be.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from pathlib import Path

# Distributions a torch install brings that weigh something: the CUDA/ROCm runtime libraries and triton.
_GPU_LIBRARY_PREFIXES = ("nvidia-", "pytorch-triton", "cuda-", "rocm")


def distribution_bytes(name: str) -> int:
    """Bytes on disk of the installed distribution ``name`` (0 if it is not installed)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return 0
    total = 0
    for file in dist.files or ():
        path = Path(dist.locate_file(file))
        if path.is_file():
            total += path.stat().st_size
    return total


def torch_build() -> str:
    """``'CPU'``, ``'CUDA 12.8'`` or ``'ROCm 6.4'``: the build of the torch this Python imports."""
    import torch

    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip}"
    return "CPU"


def torch_report() -> str:
    import torch

    torch_mb = distribution_bytes("torch") / 2**20
    libraries = [d.metadata["Name"] for d in metadata.distributions()
                 if d.metadata["Name"] and d.metadata["Name"].lower().startswith(_GPU_LIBRARY_PREFIXES)]
    libraries_mb = sum(distribution_bytes(name) for name in libraries) / 2**20
    line = f"setup: installed torch {torch.__version__}, {torch_build()} build, {torch_mb:,.0f} MB"
    if libraries:
        line += f", plus {len(libraries)} GPU library packages of {libraries_mb:,.0f} MB"
    return line


def imports_report(repo: Path) -> tuple[bool, str]:
    """Whether ``kernel_ladder`` is ``repo``'s and Hugging Face's ``kernels`` (if installed) imports apart."""
    import kernel_ladder

    where = Path(kernel_ladder.__file__).resolve().parent
    expected = (repo / "kernels" / "kernel_ladder").resolve()
    if where != expected:
        return False, (f"setup: import kernel_ladder finds {where}, not this repository's {expected}: "
                       "another kernel-ladder is installed in this environment (pip uninstall kernel-ladder, "
                       "then make setup again)")
    names = {(d.metadata["Name"] or "").lower() for d in metadata.distributions()}
    if "kernels" not in names:
        return True, f"setup: kernel_ladder imports from {where}"
    try:
        import kernels
    except Exception as error:  # noqa: BLE001 - any failure to import it is the report
        return False, f"setup: Hugging Face's kernels package is installed but does not import: {error!r}"
    hub = Path(kernels.__file__).resolve().parent
    if hub == (repo / "kernels").resolve():
        return False, f"setup: import kernels finds {hub}, this repository's source root, not Hugging Face's package"
    return True, f"setup: kernel_ladder imports from {where}; Hugging Face's kernels from {hub}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torch"]:
        print(torch_report())
        return 0
    if argv[:1] == ["imports"] and len(argv) == 2:
        ok, line = imports_report(Path(argv[1]))
        print(line, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    print("usage: python -m utils.setup_report torch | imports REPO", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
