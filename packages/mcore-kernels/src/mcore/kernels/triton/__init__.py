"""Triton kernels behind the public ops of :mod:`mcore.kernels`.

Each module here pairs the ``@triton.jit`` kernels of one op family with the Python wrappers that pick
block sizes and launch them. The public modules (``mcore.kernels.norms`` and friends) import these
lazily, only when the Triton backend is chosen, so importing ``mcore.kernels`` never imports Triton.
Under ``TRITON_INTERPRET=1`` (read by Triton when a kernel module is first imported) the same kernels
run on CPU tensors through Triton's interpreter, which is how the CPU test suite checks them.
"""
