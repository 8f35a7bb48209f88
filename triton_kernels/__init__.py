"""Triton kernels of the GPU path, installed as selective_ckpt.triton_kernels.

They also run on CPU tensors under TRITON_INTERPRET=1 (set before this package is imported),
which is how the tests exercise them without a GPU.
"""
