"""``python -m kernel_ladder.native build|info``: compile the extension now, or say where it lives."""

from __future__ import annotations

import argparse
import sys

from . import NativeBuildError, describe
from ._build import timed_build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernel_ladder.native",
                                     description="The optional C++ extension of kernel_ladder.")
    parser.add_argument("command", choices=("build", "info"),
                        help="build: compile it (cached; nothing to do if built); info: where it lives, its flags")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler's commands and output")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(describe())
        return 0
    print("kernel_ladder.native: building the C++ extension (the first build takes a minute)...", flush=True)
    try:
        library, seconds, compiled = timed_build(verbose=args.verbose)
    except NativeBuildError as error:
        print(error, file=sys.stderr)
        return 1
    what = "built" if compiled else "already built"
    print(f"kernel_ladder.native: {what} {library} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
