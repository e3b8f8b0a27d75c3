"""Stated rules, checked: what an exercise's spec forbids or requires beyond the right values.

A spec says more than "return these numbers": "a counting sort, no ``argsort``", "tensor ops only",
"stable: equal keys keep their order". :func:`~utils.exercises.check` takes such rules
(``rules=[...]``) and, once a case's values match the reference, holds the candidate's run to each;
a broken rule is a NOT SOLVED verdict whose line names the rule::

    broke a stated rule — the spec asks for a counting sort: the code called torch.argsort

* :func:`forbids` — torch functions or ``Tensor`` methods the candidate must not call, seen as it
  runs twice over: by name (a ``TorchFunctionMode`` around the candidate's call: a call from a
  helper counts too) and by the aten op that runs (a ``TorchDispatchMode``), so that ``torch.sort``
  is caught as ``x.sort()``, ``torch.argsort``, ``torch.msort`` or ``torch.ops.aten.sort.stable``
  alike; a name may carry a condition on the op's arguments, ``"Tensor.index_put_(accumulate=True)"``;
* :func:`no_python_loops` — no ``for``/``while``/comprehension in the candidate's source or in the
  functions of its own module that it calls (``inspect`` + ``ast``); the line is named;
* :func:`tensor_ops_only` — no Python loop, no builtin ``sorted``/``map``/``filter``/``reduce``, no
  round trip through the host (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``int(t)``), no op
  that makes the host wait for the device (``nonzero``, ``masked_select``, ``unique``, ``bincount``,
  ``x[mask]``...), and no ``kernel_ladder`` op or Triton launch doing the work;
* :func:`stable_sorts` — every sort the candidate runs is asked to be stable (``stable=True``);
* :func:`stores_each_output_once` — no Triton launch stores to one output element twice (a
  program that stores, reloads and stores again; two programs on one element), from the tracer;
* :func:`inputs_unchanged` — the arguments come back as they were, in the spec's words (every check
  compares them anyway: listing the rule words its line and names it among the rules kept);
* :func:`holds` — any property of one case's result, ``holds(lambda case, got: None or "what is wrong")``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import re
import textwrap
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Rule", "RuleBroken", "bytes_read", "forbids", "holds", "inputs_unchanged", "no_python_loops",
           "stable_sorts", "stores_each_output_once", "tensor_ops_only", "traced"]

#: What every broken rule's line starts with (a test or a notebook can look for it).
BROKE_A_RULE = "broke a stated rule"


class RuleBroken(Exception):  # noqa: N818  (a verdict, not an error: the name says what happened)
    """Raised by a given wrapper around the candidate (a check's driver) when the run breaks a stated
    rule that only the wrapper can see — "the arguments are left as they were", say. The checker
    turns it into the verdict line ``broke a stated rule — <why>: <what>``, not into "raised ...".
    """

    def __init__(self, why: str, what: str) -> None:
        super().__init__(f"{why}: {what}")
        self.why = why
        self.what = what


@dataclasses.dataclass(frozen=True)
class AtenCall:
    """One aten op the candidate ran: ``aten.sort.stable``, its packet ``sort``, and the non-tensor
    arguments it was given, by their schema names (``{"stable": True}``)."""

    name: str
    packet: str
    arguments: tuple[tuple[str, Any], ...] = ()
    #: Set where the op makes the host wait for the device (:func:`_host_sync`): what the verdict calls it.
    sync: str | None = None

    def argument(self, name: str, default: Any = None) -> Any:
        return dict(self.arguments).get(name, default)


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a rule sees of one case: its arguments, the candidate's result, the reference's, the calls made."""

    candidate: Any
    case: tuple
    got: Any
    expected: Any
    calls: tuple[str, ...]  # torch functions / Tensor methods the candidate called, in first-call order
    args: tuple = ()  # what the candidate got: the case with each tensor a guarded copy (its memory)
    launches: tuple = ()  # the tracer's record of the candidate's Triton launches (utils.trace.Launch)
    aten_calls: tuple[AtenCall, ...] = ()  # the aten ops that ran (each distinct call once, in first-run order)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A stated rule: ``name`` names it in the verdict, ``why`` says where it comes from.

    ``problem(context)`` returns None when the run keeps the rule, else what broke it (one sentence).
    ``records_calls`` asks the checker to record the torch calls (and the aten ops) the candidate makes.
    """

    name: str
    why: str
    problem: Callable[[RunContext], str | None]
    records_calls: bool = False

    def verdict_line(self, context: RunContext) -> str | None:
        """``'broke a stated rule — <why>: <what broke it>'``, or None if the run keeps the rule."""
        found = self.problem(context)
        if found is None:
            return None
        return f"{BROKE_A_RULE} — {self.why}: {found}"


# --------------------------------------------------------------------------------------------
# forbids: torch calls recorded while the candidate runs
# --------------------------------------------------------------------------------------------


def _call_name(func: Any) -> str:
    """``torch.argsort``, ``Tensor.index_add_``, ``torch.nn.functional.softmax`` for a recorded callable."""
    name = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", "") or ""
    if qualname.startswith(("Tensor.", "TensorBase.", "_TensorBase.")):
        return f"Tensor.{name}"
    if getattr(torch.Tensor, name, None) is func:
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._C") or module == "torch._tensor":
        module = "torch"
    return f"{module}.{name}"


def _resolve(name: str) -> set[str]:
    """The call names a forbidden ``name`` stands for: ``torch.sort`` is also the method ``Tensor.sort``."""
    if name.startswith("Tensor."):
        tail = name.removeprefix("Tensor.")
        names = {name}
        if callable(getattr(torch, tail, None)):
            names.add(f"torch.{tail}")
        return names
    if not name.startswith("torch."):
        raise ValueError(f"rules.forbids: {name!r} must name a torch function ('torch.argsort', "
                         "'torch.nn.functional.softmax') or a Tensor method ('Tensor.index_add_')")
    target: Any = torch
    for part in name.split(".")[1:]:
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"rules.forbids: torch has no {name!r}")
    names = {name, _call_name(target)}
    tail = name.rsplit(".", 1)[1]
    if name.count(".") == 1 and callable(getattr(torch.Tensor, tail, None)):
        names.add(f"Tensor.{tail}")  # the method form of the same op
    return names


#: The name :class:`_FunctionRecorder` records for ``one_hot`` called without ``num_classes``.
ONE_HOT_WITHOUT_WIDTH = "torch.nn.functional.one_hot(num_classes=-1)"


class _FunctionRecorder(TorchFunctionMode):
    """Records the name of every torch function and Tensor method called while it is active."""

    def __init__(self, calls: dict[str, None]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.setdefault(_call_name(func), None)
        if func is torch.nn.functional.one_hot:
            # Its width, without num_classes, is the largest value + 1: read on the host (inside, below what a
            # dispatch mode sees as one op).
            classes = args[1] if len(args) > 1 else (kwargs or {}).get("num_classes", -1)
            if classes == -1:
                self.calls.setdefault(ONE_HOT_WITHOUT_WIDTH, None)
        return func(*args, **(kwargs or {}))


_PLAIN = (bool, int, float, str, type(None))

#: aten ops that make the host wait for the device on a GPU, by their packet: an output whose size depends on
#: the values (the host must read them before it can allocate it), or a Python value made from a tensor.
_SYNCING_OPS: dict[str, str] = {
    "nonzero": "nonzero (torch.nonzero, torch.where(mask), argwhere)",
    "masked_select": "masked_select",
    "_unique": "unique", "_unique2": "unique", "unique_dim": "unique", "unique_consecutive": "unique_consecutive",
    "bincount": "bincount (its length is the largest value + 1)",
    "equal": "torch.equal (a Python bool)",
    "allclose": "torch.allclose (a Python bool)",
    "is_nonzero": "a tensor's truth value",
}


def _boolean_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _host_sync(func: Any, packet: str, args: tuple, kwargs: dict) -> str | None:
    """What an aten op that makes the host wait for the device on a GPU is called in a verdict, else None."""
    if packet in _SYNCING_OPS:
        return _SYNCING_OPS[packet]
    if (packet == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor")
            and kwargs.get("output_size") is None):
        return "repeat_interleave with tensor repeats (and no output_size)"
    if packet == "index" and len(args) > 1 and _boolean_index(args[1]):
        return "indexing with a boolean mask (x[mask])"
    if packet in ("index_put", "index_put_", "_index_put_impl_") and len(args) > 2 and _boolean_index(args[1]):
        values, accumulate = args[2], args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        masks = [i for i in args[1] if i is not None]
        # x[mask] = a Python number is a masked_fill on the device; anything else through a mask finds its indices.
        if accumulate or len(masks) != 1 or values.numel() != 1 or values.device.type != "cpu":
            return "assigning through a boolean mask (x[mask] = values)"
    if packet == "histc":
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        if bound.get("min", 0) == bound.get("max", 0):
            return "histc without a range (min == max: the range is read from the values)"
    return None


class _DispatchRecorder(TorchDispatchMode):
    """Records every aten op that runs while it is active, with its plain (non-tensor) arguments."""

    def __init__(self, calls: dict[AtenCall, None]) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            bound = []
            for i, argument in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(argument.name, ...)
                if value is not ... and isinstance(value, _PLAIN):
                    bound.append((argument.name, value))
            packet = func.overloadpacket.__name__
            self.calls.setdefault(AtenCall(str(func), packet, tuple(bound), _host_sync(func, packet, args, kwargs)),
                                  None)
        except Exception:  # an op without a schema to read: recorded by name alone
            self.calls.setdefault(AtenCall(str(func), str(func).split(".")[1] if "." in str(func) else str(func)), None)
        return func(*args, **kwargs)


class _CallRecorder:
    """Records, while the candidate runs, the torch functions and Tensor methods it calls (by name)
    and the aten ops that run (whatever spelling called them: ``torch.ops.aten.sort.stable`` too)."""

    def __init__(self) -> None:
        self.calls: dict[str, None] = {}  # ordered sets
        self.aten: dict[AtenCall, None] = {}
        self._stack: contextlib.ExitStack | None = None

    @property
    def aten_calls(self) -> tuple[AtenCall, ...]:
        return tuple(self.aten)

    def __enter__(self) -> _CallRecorder:
        stack = contextlib.ExitStack()
        stack.enter_context(_FunctionRecorder(self.calls))
        stack.enter_context(_DispatchRecorder(self.aten))
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)


# The aten ops a torch function runs as, where the name differs: argsort and msort are sorts, unique
# has several kernels, an index_put with accumulate=True may run as its implementation.
_ATEN_FORMS: dict[str, tuple[str, ...]] = {
    "argsort": ("sort",),
    "msort": ("sort",),
    "unique": ("_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"),
    "unique_consecutive": ("unique_consecutive", "unique_dim_consecutive"),
    "index_put": ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"),
}

_CONDITIONED = re.compile(r"(?P<name>[\w.]+)(?:\((?P<argument>\w+)=(?P<value>[^)]*)\))?")


def _aten_packets(name: str) -> tuple[str, ...]:
    """The aten overload packets ``torch.sort`` / ``Tensor.index_add_`` run as."""
    tail = name.rsplit(".", 1)[1]
    base = tail.rstrip("_")
    return _ATEN_FORMS.get(base, (base, base + "_"))


def forbids(*names: str, why: str) -> Rule:
    """A rule that the candidate calls none of ``names`` (torch functions or Tensor methods).

    ``"torch.sort"`` also forbids the method ``x.sort()`` and ``"Tensor.argsort"`` the function
    ``torch.argsort`` (the same op); ``"torch.nn.functional.softmax"`` is that function alone. The
    calls are recorded while the candidate runs, from any code it calls, by name and by the aten op
    that runs: ``torch.ops.aten.sort.stable(...)`` is ``torch.sort`` under another spelling.

    A name may carry a condition on one argument, ``"Tensor.index_put_(accumulate=True)"``: then only
    the aten op run with that argument breaks the rule (``x[i] = v`` is an ``index_put_`` too).
    """
    if not names:
        raise ValueError("rules.forbids: name at least one torch function or Tensor method")
    forbidden: dict[str, str] = {}
    conditioned: list[tuple[str, tuple[str, ...], str | None, Any]] = []  # (name, packets, argument, value)
    for spelled in names:
        match = _CONDITIONED.fullmatch(spelled.replace(" ", ""))
        if match is None:
            raise ValueError(f"rules.forbids: {spelled!r} must be a name ('torch.sort') or a name with one "
                             "argument's value ('Tensor.index_put_(accumulate=True)')")
        name, argument = match["name"], match["argument"]
        aliases = _resolve(name)
        value: Any = None
        if argument is not None:
            try:
                value = ast.literal_eval(match["value"])
            except (ValueError, SyntaxError):
                raise ValueError(f"rules.forbids: {spelled!r}: the value must be a Python literal") from None
        else:
            for alias in aliases:
                forbidden.setdefault(alias, name)
        packets = tuple(dict.fromkeys(p for alias in aliases for p in _aten_packets(alias)))
        conditioned.append((spelled, packets, argument, value))

    def problem(context: RunContext) -> str | None:
        called = [c for c in context.calls if c in forbidden]
        if called:
            return "the code called " + ", ".join(called)
        for call in context.aten_calls:
            for spelled, packets, argument, value in conditioned:
                if call.packet not in packets:
                    continue
                if argument is None:
                    return f"the code ran {call.name}, the op behind {spelled} (under another spelling)"
                if call.argument(argument) == value:
                    return f"the code ran {call.name} with {argument}={value!r}"
        return None

    return Rule(name="forbids " + ", ".join(names), why=why, problem=problem, records_calls=True)


def stable_sorts(why: str) -> Rule:
    """A rule that every sort the candidate runs is asked to be stable (``stable=True``).

    Seen at the aten level: ``torch.sort``, ``Tensor.sort``, ``torch.argsort`` without
    ``stable=True`` run ``aten.sort.default``, whose order among equal keys is unspecified (a CPU's
    happens to keep it, a GPU's need not), so the values can match on the CPU and still be wrong.
    """

    def problem(context: RunContext) -> str | None:
        for call in context.aten_calls:
            if call.packet == "sort" and not call.argument("stable", False):
                said = ", ".join(f"{k}={v!r}" for k, v in call.arguments if k in ("dim", "descending"))
                return (f"a sort ran without stable=True ({call.name}{'(' + said + ')' if said else ''}): equal "
                        "keys may come out in any order on a GPU — pass stable=True to torch.sort / torch.argsort")
        return None

    return Rule(name="stable sorts", why=why, problem=problem, records_calls=True)


# --------------------------------------------------------------------------------------------
# no_python_loops: the candidate's source
# --------------------------------------------------------------------------------------------

_LOOPS: dict[type, str] = {
    ast.For: "a Python for loop",
    ast.AsyncFor: "a Python for loop",
    ast.While: "a Python while loop",
    ast.ListComp: "a list comprehension",
    ast.SetComp: "a set comprehension",
    ast.DictComp: "a dict comprehension",
    ast.GeneratorExp: "a generator expression",
}


def _plain_function(candidate: Any) -> types.FunctionType | None:
    """The Python function behind a candidate: a partial's, a bound method's, a ``@triton.jit`` kernel's."""
    seen = 0
    while seen < 8:
        seen += 1
        if isinstance(candidate, functools.partial):
            candidate = candidate.func
        elif isinstance(candidate, types.MethodType):
            candidate = candidate.__func__
        elif hasattr(candidate, "fn") and not isinstance(candidate, types.FunctionType):
            candidate = candidate.fn
        elif isinstance(candidate, types.FunctionType):
            return inspect.unwrap(candidate)
        else:
            return None
    return None


def _structural(expression: ast.AST, allowed: frozenset[str]) -> bool:
    """An expression of literals and the ``allowed`` names alone (``k``, ``k - 1``, ``2``)."""
    return all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop, ast.Load))
               or (isinstance(n, ast.Name) and n.id in allowed) for n in ast.walk(expression))


def _over_constants(node: ast.AST, allowed: frozenset[str] = frozenset()) -> bool:
    """A loop over a literal tuple/list or ``range(<literal>)`` — or ``range(k)`` where the spec allows
    loops over ``k`` (``allowed``): structure, not data."""
    iterables: Iterable[ast.AST]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        iterables = [node.iter]
    elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        iterables = [g.iter for g in node.generators]
    else:
        return False
    for iterable in iterables:
        if isinstance(iterable, (ast.Tuple, ast.List)):
            continue
        if (isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) and iterable.func.id == "range"
                and all(_structural(a, allowed) for a in iterable.args) and not iterable.keywords):
            continue
        return False
    return True


# Builtins that run over Python data (a list made from a tensor): what "tensor ops only" rules out.
_PYTHON_DATA_CALLS = {"sorted": "the builtin sorted", "map": "the builtin map", "filter": "the builtin filter",
                      "reduce": "functools.reduce"}


def _loop_target(node: ast.AST) -> str:
    """``' (over range(num_experts))'``: what a loop runs over, as its source says it ("" if unreadable)."""
    iterable = getattr(node, "iter", None)
    if iterable is None and getattr(node, "generators", None):
        iterable = node.generators[0].iter
    if iterable is None:
        return ""  # a while loop
    text = ast.unparse(iterable)
    return f" (over {text if len(text) <= 40 else text[:37] + '...'})"


def _loops_in(function: types.FunctionType, depth: int, seen: set[int], python_data: bool = False,
              allowed: frozenset[str] = frozenset()) -> str | None:
    """The first loop in ``function`` or a same-module function it calls: ``'a Python for loop at line
    N of f (over range(n))'``; with ``python_data``, a call of ``sorted``/``map``/``filter``/``reduce`` too.
    A loop over ``range(<literals and the allowed names>)`` is not one."""
    if id(function) in seen:
        return None
    seen.add(id(function))
    try:
        lines, start = inspect.getsourcelines(function)
    except (OSError, TypeError):
        return None  # no source to read (a builtin, a function made by exec): nothing to hold it to
    try:
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except SyntaxError:
        return None
    body = tree.body[0] if tree.body else tree
    called: list[str] = []
    for node in ast.walk(body):
        kind = _LOOPS.get(type(node))
        if kind is not None and not _over_constants(node, allowed):
            return f"{kind} at line {start + node.lineno - 1} of {function.__name__}{_loop_target(node)}"
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else (
                node.func.attr if isinstance(node.func, ast.Attribute) and node.func.attr == "reduce" else None)
            if python_data and callee in _PYTHON_DATA_CALLS:
                return (f"a call of {_PYTHON_DATA_CALLS[callee]} (Python data, not tensor ops) at line "
                        f"{start + node.lineno - 1} of {function.__name__}")
            if isinstance(node.func, ast.Name):
                called.append(node.func.id)
    if depth <= 0:
        return None
    namespace = dict(function.__globals__)
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            namespace[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    for name in called:
        helper = namespace.get(name)
        if isinstance(helper, types.FunctionType) and helper.__module__ == function.__module__:
            found = _loops_in(inspect.unwrap(helper), depth - 1, seen, python_data, allowed)
            if found is not None:
                return found
    return None


def _source_rule(name: str, why: str, function: Any, python_data: bool, records_calls: bool = False,
                 extra: Callable[[RunContext], str | None] | None = None, loops_over: Sequence[str] = ()) -> Rule:
    """A rule on the candidate's source (its loops; with ``python_data`` its builtins), then ``extra``."""
    cache: dict[int, str | None] = {}
    allowed = frozenset(loops_over)

    def problem(context: RunContext) -> str | None:
        target = context.candidate if function is None else function
        key = id(target)
        if key not in cache:
            plain = _plain_function(target)
            cache[key] = None if plain is None else _loops_in(plain, depth=3, seen=set(), python_data=python_data,
                                                              allowed=allowed)
        if cache[key] is not None:
            return cache[key]
        return extra(context) if extra is not None else None

    return Rule(name=name, why=why, problem=problem, records_calls=records_calls)


def no_python_loops(why: str, function: Any = None, loops_over: Sequence[str] = ()) -> Rule:
    """A rule that the candidate's source has no ``for``/``while`` loop or comprehension over data.

    The candidate's own source is read (``inspect``, ``ast``) — or that of ``function``, where the
    check's candidate is a given driver around the exercise's function (a fold over tiles, say) —
    and so is that of every function of its own module it calls by name (three calls deep). A loop
    over a literal tuple or list, or over ``range(<literal>)``, is structure and allowed; so is one
    over ``range(k)`` (``range(k - 1)``, ``range(1, k)``) where ``loops_over`` names ``k``: a small
    number of rounds the spec allows, each a tensor op over all the data. Code without readable source
    keeps the rule. The verdict names the loop, what it runs over and its line.
    """
    return _source_rule("no Python loops", why, function, python_data=False, loops_over=loops_over)


#: Calls that bring a tensor's values to the host, as Python data or numpy: a GPU waits for each.
HOST_ROUND_TRIPS: dict[str, str] = {
    "Tensor.item": ".item()", "Tensor.tolist": ".tolist()", "Tensor.numpy": ".numpy()", "Tensor.cpu": ".cpu()",
    "Tensor.__array__": "numpy.asarray(tensor)", "Tensor.__int__": "int(tensor)", "Tensor.__float__": "float(tensor)",
    "Tensor.__index__": "a tensor used as a Python int", "Tensor.__bool__": "a tensor's truth value (if tensor:)",
}


def _host_waits(context: RunContext) -> str | None:
    """The calls that took values to the host, and the ops that made it wait for the device, in words."""
    trips = list(dict.fromkeys(HOST_ROUND_TRIPS[c] for c in context.calls if c in HOST_ROUND_TRIPS))
    if trips:
        return ("the code took values to the host: " + ", ".join(trips)
                + " (on a GPU each waits for the device; tensor ops keep the data where it is)")
    syncs = list(dict.fromkeys(call.sync for call in context.aten_calls if call.sync))
    if ONE_HOT_WITHOUT_WIDTH in context.calls:
        syncs.append("one_hot without num_classes (its width is the largest value + 1)")
    if syncs:
        return ("the code made the host wait for the device: " + ", ".join(syncs) + " — on a GPU the host stops "
                "until the device has computed what it needs to read (an output's size, a range, a Python value), "
                "as .item() does; ops whose shapes are known in advance (masks, torch.where(mask, a, b), gather, "
                "topk) do not wait")
    return None


def _library_work(context: RunContext) -> str | None:
    """A kernel_ladder op (a ``kernel_ladder::`` custom op) or a Triton launch the candidate ran, in words."""
    ops = list(dict.fromkeys(call.name.split(".")[1] for call in context.aten_calls
                             if call.name.startswith("kernel_ladder.")))
    if ops:
        return (f"the code called kernel_ladder's op {', '.join('kernel_ladder::' + op for op in ops)}: "
                "the exercise asks for the computation itself, in tensor ops")
    kernels = list(dict.fromkeys(str(getattr(launch, "kernel", "a kernel")) for launch in context.launches))
    if kernels:
        return (f"the code launched the Triton kernel {', '.join(kernels)}: the exercise asks for the computation in "
                "tensor ops")
    return None


def tensor_ops_only(why: str, function: Any = None, loops_over: Sequence[str] = ()) -> Rule:
    """A rule that the candidate is tensor ops only: what :func:`no_python_loops` holds it to (with
    ``loops_over`` the same), no call of the builtins ``sorted``/``map``/``filter``/``reduce`` (they run
    over Python data), and nothing that makes the host wait for the device, seen as the candidate runs
    (a helper's call counts too):

    * a round trip through the host — ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``int(t)``,
      ``float(t)``, ``if t:``;
    * an op whose output's size depends on the values, which the host must read to allocate it —
      ``nonzero`` (``torch.where(mask)``, ``argwhere``), ``masked_select``, ``unique``, ``bincount``,
      ``repeat_interleave`` with tensor repeats and no ``output_size``, ``one_hot`` without ``num_classes``,
      ``x[mask]``, ``x[mask] = values`` (a Python number through a mask is a ``masked_fill``, and allowed),
      ``histc`` without a range — or that returns a Python value (``torch.equal``, ``torch.allclose``);

    and no kernel doing the work for it: a ``kernel_ladder`` op (a ``kernel_ladder::`` custom op, seen on
    any device) or a Triton launch (seen by the tracer, in the interpreter). With ``function`` (the check's
    candidate is a given driver around it) the source rule reads ``function``, and launches and library
    ops, which the driver may make itself, are not held against it. A sort done in numpy, or by ``sorted``
    over ``t.tolist()``, breaks it.
    """

    def extra(context: RunContext) -> str | None:
        waits = _host_waits(context)
        if waits is not None:
            return waits
        return _library_work(context) if function is None else None

    return _source_rule("tensor ops only", why, function, python_data=True, records_calls=True, extra=extra,
                        loops_over=loops_over)


# --------------------------------------------------------------------------------------------
# traced: a property of what the tracer saw
# --------------------------------------------------------------------------------------------


def bytes_read(launches: Iterable[Any], tensor: Any) -> int:
    """Bytes the traced ``launches`` read from ``tensor``'s memory (any kernel argument inside it)."""
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
        return 0
    start = tensor.data_ptr()
    end = start + (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))) * tensor.element_size()
    total = 0
    for launch in launches:
        for name, (low, high) in (getattr(launch, "spans", None) or {}).items():
            if low < end and start < high:
                total += int(launch.per_tensor[name].bytes_read)
    return total


def traced(check: Callable[[tuple, Sequence[Any]], Any], name: str) -> Rule:
    """A rule on what the tracer saw of the candidate's Triton launches: ``check(args, launches)``.

    ``args`` are the case's arguments as the candidate got them (each tensor the checker's copy, so
    that :func:`bytes_read` finds its traffic; ``out=True`` outputs are not among them), ``launches``
    the tracer's ``utils.trace.Launch`` records. It returns None (or True) when the rule holds, else
    what broke it: "read the table row once per token" is ``bytes_read(launches, cos) <= tokens * row``.
    """

    def problem(context: RunContext) -> str | None:
        if not context.launches:
            return None  # compiled kernels (or no tracer): nothing seen, nothing to hold them to
        try:
            answer = check(context.args, context.launches)
        except Exception as error:
            return f"checking it raised {type(error).__name__}: {error}"
        if answer is None or answer is True:
            return None
        return "it does not hold" if answer is False else str(answer)

    return Rule(name=name, why=name, problem=problem)


def _site(stores: Any, index: int) -> str:
    sites = list(getattr(stores, "sites", None) or [])
    function, line = sites[index] if 0 <= index < len(sites) else ("?", 0)
    return f"the store at line {line} of {function}" if line else "a store"


def stores_each_output_once(why: str) -> Rule:
    """A rule that no launch stores to one element of an output twice (one program's two stores, or
    two programs'), seen in the tracer's store maps.

    A kernel that stores a value, then loads it back to finish it (renormalising, say) and stores
    again, gets the right values in the interpreter, which runs one program at a time; on a GPU a
    load need not see the same program's earlier store to global memory without a barrier, and two
    programs' stores to one element race. Keep the values in registers and store each element once.
    """

    def problem(context: RunContext) -> str | None:
        for launch in context.launches:
            for name, stores in (getattr(launch, "store_maps", None) or {}).items():
                overwrites = getattr(stores, "self_overwrites", None) or {}
                if overwrites:
                    (earlier, later), (count, element, program) = max(overwrites.items(), key=lambda i: i[1][0])
                    return (f"{launch.kernel} stored {count} element{'s' if count != 1 else ''} of {name} twice in one "
                            f"launch (program {program}: {_site(stores, earlier)}, then {_site(stores, later)}; first "
                            f"at element {element}) — what a program stored to global memory and reads back or "
                            "stores again has no guarantee on a GPU: keep the values in registers, store each once")
                first, last = getattr(stores, "first", None), getattr(stores, "last", None)
                if first is not None and last is not None:
                    shared = (first >= 0) & (first != last)
                    if shared.any():
                        element = int(shared.nonzero()[0][0])
                        return (f"{launch.kernel}'s programs {int(first[element])} and {int(last[element])} both "
                                f"stored element {element} of {name}: two programs' stores to one element race on "
                                "a GPU — each element belongs to one program")
        return None

    return Rule(name="each output stored once", why=why, problem=problem)


# --------------------------------------------------------------------------------------------
# inputs_unchanged: the check's own comparison of the arguments, in the spec's words
# --------------------------------------------------------------------------------------------

#: The name of :func:`inputs_unchanged`'s rule, and the words of the check's line where no exercise states it.
INPUTS_UNCHANGED = "inputs left unchanged"
INPUTS_UNCHANGED_WHY = "the inputs are the caller's and come back as they were"


def inputs_unchanged(why: str) -> Rule:
    """The rule that the candidate leaves its arguments as it got them, stated in the spec's words.

    Every check holds every candidate to it, listed or not: :func:`~utils.exercises.check` compares each
    argument before and after each call (tensors: values, NaN equal to NaN, shape and strides; lists,
    tuples, dicts and sets) and a change is ``broke a stated rule — <why>: the code changed q_nope, q_pe
    in place (...)``, whatever the values. Listing this rule gives that line the exercise's ``why``
    instead of the general one, and names it among the rules a SOLVED verdict says were kept; the
    comparison itself is the check's, so the rule has nothing more to find.
    """
    return Rule(name=INPUTS_UNCHANGED, why=why, problem=lambda context: None)


# --------------------------------------------------------------------------------------------
# holds: any property of a case's result
# --------------------------------------------------------------------------------------------


def _positional_count(function: Callable[..., Any]) -> int:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def holds(check: Callable[..., Any], name: str) -> Rule:
    """A rule that ``check(case, got)`` (or ``check(case, got, expected)``) finds nothing wrong.

    ``check`` returns None (or True) when the property holds, else a sentence saying what is wrong
    (False: "it does not"). ``name`` states the property, as the verdict names it:
    ``holds(stable_ties, name="stable: equal keys keep their order")``.
    """
    takes_expected = _positional_count(check) >= 3

    def problem(context: RunContext) -> str | None:
        try:
            answer = check(context.case, context.got, context.expected) if takes_expected \
                else check(context.case, context.got)
        except Exception as error:  # a result the property cannot even be computed on breaks it
            return f"checking it raised {type(error).__name__}: {error}"
        if answer is None or answer is True:
            return None
        if answer is False:
            return "it does not hold"
        return str(answer)

    return Rule(name=name, why=name, problem=problem)
