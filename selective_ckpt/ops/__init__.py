"""Op families (kernel families): per op family one module (ops/<op family>.py) with its custom ops (schema, fake,
autograd), argument checks and the public function. The backend (C++ or Triton) is chosen in
selective_ckpt/backend.py. The public functions are exported by the package root
(`selective_ckpt.attention`, ...); `selective_ckpt.ops.<op family>` is always the module.
"""
