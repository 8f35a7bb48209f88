"""Kernel families: per family one module (ops/<family>.py) with its custom ops (schema, fake,
autograd), argument checks and the public function. The backend (C++ or Triton) is chosen in
selective_ckpt/backend.py. The public functions are exported by the package root
(`selective_ckpt.attention`, ...); `selective_ckpt.ops.<family>` is always the module.
"""
