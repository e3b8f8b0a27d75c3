"""One module per op: its Triton kernels at the top, then the launcher, the custom op and its autograd.

The public functions are re-exported by :mod:`kernels` (``kernels.softmax`` is the function,
``kernels.ops.softmax`` the module that defines it, its kernels and its launch rule).
:mod:`kernels.ops.norm` holds what the three norm ops share (their launch rule and the second
stage of their weight gradients).
"""
