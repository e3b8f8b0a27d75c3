"""One module per op: its Triton kernels at the top, then the launcher, the custom op and its autograd.
Flash attention, whose concerns fill several modules, is the subpackage :mod:`kernel_ladder.ops.attention`
(one module per concern: the ops, the checks and plan, the launches, the tile configs, the kernels).

The public functions are re-exported by :mod:`kernel_ladder` (``kernel_ladder.softmax`` is the function,
``kernel_ladder.ops.softmax`` the module that defines it, its kernels and its launch rule).
:mod:`kernel_ladder.ops.norm` holds what the three norm ops share (their one validation-and-plan step,
their launch and launch rule, and the second stage of their weight gradients).
"""
