"""Run a function on every rank of a small ``torch.distributed`` world, from a notebook or a test.

Chapter 11 teaches parallelism on real process groups: gloo on one CPU machine (several
processes), NCCL on GPUs. A lesson or a test needs the same function run on every rank and the
results back, and a deadlock must end with an error, not a hang. :class:`World` does that:

    from utils.distributed import World
    from kernel_ladder.distributed import collectives_demo

    with World(4) as world:                       # 4 processes, gloo, a process group each
        results = world.run(collectives_demo.all_reduce_check, 1000)   # one result per rank

* **Workers start once and stay.** Starting a process that imports torch costs about two seconds;
  the world's processes start once (from a ``forkserver`` that imports torch before forking, so
  each start is a fork) and then run any number of calls.
* **Functions travel by name.** The function must live in an importable module (not in the
  notebook: a spawned process cannot import ``__main__``'s cells); arguments and results travel
  pickled (tensors included). Each call gets ``rank`` and ``world_size`` through
  :func:`rank` / :func:`world_size` or ``torch.distributed.get_rank()``.
* **Nothing hangs.** The process group has a short timeout (a collective that waits longer
  raises on its rank), and every call has a deadline after which the whole world is killed and
  :class:`WorldError` names the ranks that had not answered. A rank that raises is reported with
  its traceback; the others, which may be stuck waiting for it, get a short grace period, then
  the world is killed (a later :meth:`World.run` starts a fresh one).

The same worker functions run unchanged under ``torchrun``: they use only ``torch.distributed``,
never this harness. ``python -m utils.distributed module:function args...`` is the entry point
for that — the function on every rank of the world torchrun launched, every rank's result printed
by rank 0::

    torchrun --standalone --nproc-per-node 4 -m utils.distributed solutions.ch11_distributed:world_all_reduce 1000
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["World", "WorldError", "run_world", "rank", "world_size"]

# How long a rank that has not failed may keep a failed call's world alive before it is killed.
_GRACE_S = 3.0


class WorldError(RuntimeError):
    """A call on a :class:`World` failed: a rank raised, died, or missed the deadline."""


def _function_name(fn: Callable) -> tuple[str, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"utils.distributed: {fn!r} must be a module-level function of an importable module "
                        "(workers import it by name); lambdas and nested functions cannot travel")
    if module == "__main__":
        raise TypeError(f"utils.distributed: {qualname} is defined in __main__ (a notebook or script), which the "
                        "workers cannot import; put it in a module "
                        "(e.g. solutions/ or kernels/kernel_ladder/distributed/)")
    return module, qualname


def _resolve(module: str, qualname: str) -> Callable:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_RANK: int | None = None
_WORLD_SIZE: int | None = None


def _initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This worker's rank (inside a function run by :meth:`World.run`, or under torchrun)."""
    if _RANK is None:
        if _initialized():
            return sys.modules["torch.distributed"].get_rank()
        raise RuntimeError("utils.distributed.rank: not inside a World worker or an initialized process group")
    return _RANK


def world_size() -> int:
    """The number of ranks (inside a function run by :meth:`World.run`, or under torchrun)."""
    if _WORLD_SIZE is None:
        if _initialized():
            return sys.modules["torch.distributed"].get_world_size()
        raise RuntimeError("utils.distributed.world_size: not inside a World worker or an initialized process group")
    return _WORLD_SIZE


def _worker(rank_: int, size: int, init_file: str, conn: Connection, timeout_s: float, threads: int) -> None:
    global _RANK, _WORLD_SIZE
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    _RANK, _WORLD_SIZE = rank_, size
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    try:
        while True:
            message = conn.recv()
            if message is None:
                break
            module, qualname, args, kwargs = message
            try:
                result = _resolve(module, qualname)(*args, **kwargs)
                payload = ("ok", pickle.dumps(result))
            except BaseException:
                payload = ("error", traceback.format_exc())
            conn.send(payload)
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


@contextlib.contextmanager
def _main_hidden():
    """Keep ``__main__`` from being re-run in the workers while they start.

    multiprocessing's forkserver and spawn re-import the parent's main module in each child (by
    its ``__spec__`` or its ``__file__``), which runs an unguarded script again, fails for code
    piped into ``python -`` and would re-run a notebook kernel's launcher. The workers import
    their functions by name and never need ``__main__``, so it is hidden from the start-up data.
    """
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__spec__ = None
            main.__dict__.pop("__file__", None)
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


_CONTEXT = None


def _context():
    """A forkserver context that imports torch once, so that each worker start is a fork."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed"])
    return _CONTEXT


class World:
    """``size`` gloo processes on this machine, each in one process group, running calls on demand.

    Args:
        size: the number of ranks (processes), at least 1.
        timeout: seconds a collective may wait for its peers before it raises (the process group's
            timeout), and the default deadline of each :meth:`run`.
        threads: torch threads per worker (1: several ranks share a laptop's cores).

    Use it as a context manager, or call :meth:`close` (the processes are killed at exit
    anyway).
    """

    def __init__(self, size: int, timeout: float = 30.0, threads: int = 1) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"utils.distributed.World: size must be an int >= 1, got {size!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"utils.distributed.World: timeout must be a positive number of seconds, got {timeout!r}")
        self.size, self.timeout, self.threads = size, float(timeout), threads
        self._procs: list = []
        self._conns: list[Connection] = []
        self._dir: tempfile.TemporaryDirectory | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def start(self) -> World:
        """Start the processes and wait for every rank's process group (done by :meth:`run` if needed)."""
        if self.started:
            return self
        ctx = _context()
        self._dir = tempfile.TemporaryDirectory(prefix="kernel-ladder-world-")
        init_file = os.path.join(self._dir.name, "rendezvous")
        with _main_hidden():
            for r in range(self.size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(r, self.size, init_file, child, self.timeout, self.threads),
                                   daemon=True, name=f"kernel-ladder-rank-{r}")
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        replies = self._collect(time.monotonic() + max(60.0, self.timeout), "starting the world")
        failed = {r: text for r, (kind, text) in replies.items() if kind != "ready"}
        if failed:
            self.kill()
            raise WorldError(self._describe("starting the world", failed))
        return self

    def close(self) -> None:
        """Ask every rank to leave its process group and exit; kill any that does not."""
        if not self.started:
            return
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate every process now (a hung collective included)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> World:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.kill()
        except Exception:
            pass

    # -- calls -------------------------------------------------------------------------------

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank at once; returns the results in rank order.

        ``fn`` must be a module-level function of an importable module. Raises :class:`WorldError`
        if a rank raises (its traceback included), dies, or has not answered within ``timeout``
        seconds (default: the world's timeout); the world is then killed, and the next call starts
        a fresh one.
        """
        module, qualname = _function_name(fn)
        self.start()
        label = f"{qualname}"
        for conn in self._conns:
            conn.send((module, qualname, args, kwargs))
        replies = self._collect(time.monotonic() + (self.timeout if timeout is None else timeout), label)
        failed = {r: text for r, (kind, text) in replies.items() if kind != "ok"}
        if failed:
            self.kill()
            raise WorldError(self._describe(label, failed))
        return [pickle.loads(replies[r][1]) for r in range(self.size)]

    def _collect(self, deadline: float, label: str) -> dict[int, tuple[str, Any]]:
        replies: dict[int, tuple[str, Any]] = {}
        by_conn = {conn: r for r, conn in enumerate(self._conns)}
        while len(replies) < self.size:
            pending = [c for c, r in by_conn.items() if r not in replies]
            now = time.monotonic()
            # Once a rank has failed, the others get a short grace (they may be waiting for it).
            if any(kind != "ok" and kind != "ready" for kind, _ in replies.values()):
                deadline = min(deadline, now + _GRACE_S)
            if now >= deadline:
                for c in pending:
                    replies[by_conn[c]] = ("timeout", None)
                break
            for conn in wait(pending, timeout=min(0.5, deadline - now)):
                r = by_conn[conn]
                try:
                    replies[r] = conn.recv()
                except (EOFError, OSError):
                    code = self._procs[r].exitcode
                    replies[r] = ("died", f"the process exited (exit code {code})")
            for c in pending:  # a process that died without closing its pipe
                r = by_conn[c]
                if r not in replies and not self._procs[r].is_alive():
                    replies[r] = ("died", f"the process exited (exit code {self._procs[r].exitcode})")
        return replies

    def _describe(self, label: str, failed: dict[int, Any]) -> str:
        lines = [f"utils.distributed: {label} failed on rank(s) {sorted(failed)} of a world of {self.size}"]
        hung = [r for r, text in failed.items() if text is None]
        if hung:
            lines.append(f"  rank(s) {hung} did not answer in time: a collective or a recv waiting for a peer that "
                         "never sent (a deadlock, or a rank that raised first); the world was killed")
        for r, text in sorted(failed.items()):
            if text:
                lines.append(f"  --- rank {r} ---\n{text.rstrip()}")
        return "\n".join(lines)


def run_world(fn: Callable, size: int, *args: Any, timeout: float = 30.0, **kwargs: Any) -> list[Any]:
    """One call of ``fn`` on a fresh world of ``size`` ranks (started, used once, closed)."""
    with World(size, timeout=timeout) as world:
        return world.run(fn, *args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Under torchrun: python -m utils.distributed module:function args...
# ----------------------------------------------------------------------------------------------


def _argument(text: str) -> Any:
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: a string


def main(argv: list[str] | None = None) -> int:
    """Run ``module:function`` on every rank of the world torchrun launched; rank 0 prints each
    rank's result. Arguments are Python literals (``1000``, ``True``, ``'zigzag'``; a bare word is
    a string)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m utils.distributed",
        description="Run a worker function of the course on every rank of a torchrun world.")
    parser.add_argument("function", help="module:function, e.g. solutions.ch11_distributed:world_all_reduce")
    parser.add_argument("args", nargs="*", help="its arguments, as Python literals")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may wait")
    options = parser.parse_args(argv)
    module, sep, qualname = options.function.partition(":")
    if not sep or not module or not qualname:
        parser.error(f"function must be module:function, got {options.function!r}")
    if "RANK" not in os.environ:
        parser.error("no torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR): launch it with torchrun, "
                     "e.g. torchrun --standalone --nproc-per-node 4 -m utils.distributed " + options.function)
    import torch.distributed as dist

    fn = _resolve(module, qualname)
    dist.init_process_group(options.backend, timeout=datetime.timedelta(seconds=options.timeout))
    try:
        result = fn(*map(_argument, options.args))
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        if dist.get_rank() == 0:
            import pprint

            print(f"{options.function} on {dist.get_world_size()} ranks ({options.backend}):")
            for r, value in enumerate(results):
                print(f"rank {r}: {pprint.pformat(value, width=110, compact=True)}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
