"""The softmax kernels compile for a Hopper GPU (sm_90): every variant, at the sizes the launch rule
picks, without register spills, vectorized on contiguous rows and coalesced on transposed ones.

No GPU is needed: Triton compiles ahead of time for a named target down to PTX and a cubin. This
proves on a CPU-only machine what the interpreter cannot:

* every kernel variant (softmax / log-softmax, forward / backward, one-block / online, linear or
  per-row row offsets, int32 or int64 column offsets, fp32 / fp16 / bf16) is valid compiled Triton;
* at the largest one-block sizes :func:`kernels.softmax.softmax_launch_config` chooses (32768
  columns forward, 16384 backward, 32 warps) and for the online chunks, ptxas allocates the
  registers without spilling to local memory (the reason for the limits);
* rows whose columns are contiguous get 128-bit loads and stores (``ld.global.v4``);
* when the rows are contiguous instead (a softmax over a non-innermost dim), the loads and stores
  are laid out along the rows (``order = [0, 1]``): neighbouring threads touch neighbouring addresses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, re, subprocess, sys, tempfile
    os.environ["KERNEL_LADDER_INTERPRET"] = "0"  # compiled mode: real @triton.jit kernels
    import importlib
    import torch, triton
    import triton.backends.nvidia as nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sm = importlib.import_module("kernels.softmax")
    CUOBJDUMP = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    SIZE_ARGS = ("n_rows", "size1", "size2")

    def compile_variant(fn, dtype, config, log, layout, linear_rows, index_64):
        signature, constexprs = {}, {"LOG": log, "BLOCK": config.block, "ROWS_PER_PROGRAM": config.rows_per_program,
                                     "LINEAR_ROWS": linear_rows, "INDEX_64": index_64}
        for i, name in enumerate(fn.arg_names):
            if fn.params[i].is_constexpr:
                signature[name] = "constexpr"
            elif name.endswith("_ptr"):
                signature[name] = "*" + TYPES[dtype]
            elif (layout == "contiguous" and name.endswith("_col_stride")) or \\
                    (layout == "transposed" and name.endswith("_stride2")):
                signature[name], constexprs[name] = "constexpr", 1  # what Triton specializes for a stride of 1
            else:
                signature[name] = "i32"
        # What Triton's launcher specializes for torch allocations and sizes divisible by 16.
        attrs = {} if layout == "general" else {
            (i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if signature[name] != "constexpr" and name not in SIZE_ARGS}
        source = ASTSource(fn=fn, signature=signature, attrs=attrs, constexprs=constexprs)
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})

    def spilled_bytes(compiled):
        if not os.path.exists(CUOBJDUMP):
            return None
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        found = re.search(r"REG:(\\d+) STACK:(\\d+) SHARED:\\d+ LOCAL:(\\d+)", usage)
        return int(found.group(2)) + int(found.group(3)), int(found.group(1))

    def access_orders(ttgir):
        layouts = dict(re.findall(r"^(#blocked\\d*) = #ttg\\.blocked<\\{.*?order = \\[([\\d, ]+)\\]", ttgir, re.M))
        accesses = re.findall(r"tt\\.(?:load|store) [^:]*: tensor<[^,]+, (#blocked\\d*)>", ttgir)
        return {layouts[name] for name in accesses}

    failures, rows = [], []
    KERNELS = [(sm.softmax_kernel, False, 32768), (sm.softmax_online_kernel, False, 100_000),
               (sm.softmax_backward_kernel, True, 16384), (sm.softmax_backward_online_kernel, True, 100_000)]
    for fn, backward, n_cols in KERNELS:
        for log in (False, True):
            variants = [
                # the largest size of this kernel's path, contiguous rows
                ("contiguous", torch.bfloat16 if log else torch.float32, n_cols, True, False),
                # a softmax over a non-innermost dim, with int64 column offsets
                ("transposed", torch.float16, 1000 if not fn.__name__.endswith("online_kernel") else n_cols,
                 True, True),
            ]
            if not log:  # per-row offsets, no specialization at all
                variants.append(("general", torch.float32, 300 if "online" not in fn.__name__ else n_cols,
                                 False, False))
            for layout, dtype, cols, linear_rows, index_64 in variants:
                config = sm.softmax_launch_config(cols, dtype, transposed=layout == "transposed", backward=backward)
                assert config.online == ("online" in fn.__name__), (fn.__name__, config)
                name = f"{fn.__name__} LOG={log} {layout} {TYPES[dtype]} {tuple(config)}"
                try:
                    compiled = compile_variant(fn, dtype, config, log, layout, linear_rows, index_64)
                except Exception as error:  # report every variant, not just the first
                    failures.append(f"{name}: does not compile: {error}")
                    continue
                ptx = compiled.asm["ptx"]
                usage = spilled_bytes(compiled)
                registers, spilled = (usage[1], usage[0]) if usage else ("?", "?")
                rows.append(f"{name}: registers {registers}, spilled bytes {spilled}")
                if usage is not None and usage[0]:
                    failures.append(f"{name}: spills {usage[0]} bytes to local memory")
                if layout == "contiguous" and not ("ld.global.v4" in ptx and "st.global.v4" in ptx):
                    failures.append(f"{name}: contiguous rows not vectorized")
                orders = access_orders(compiled.asm["ttgir"])
                if layout == "transposed" and orders != {"0, 1"}:
                    failures.append(f"{name}: accesses not laid out along the rows: {orders}")
    print("\\n".join(rows))
    print("\\n".join(failures) or "ok")
    sys.exit(1 if failures else 0)
    """
)


@pytest.mark.slow
def test_softmax_kernels_compile_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    # This process runs the interpreter (TRITON_INTERPRET=1); the child must not inherit it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
