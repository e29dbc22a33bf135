"""Stand-in for sgl_kernel's compiled ``common_ops`` extension (CUDA only), empty on purpose.

``import sgl_kernel`` loads its CUDA ops library first; without an NVIDIA driver that fails (``libcuda.so.1``) and
sgl_kernel falls back to a plain ``import common_ops``, raising if that fails too. The spawned scheduler process
imports sgl_kernel (with ``sglang.srt.managers.scheduler``) before it runs SGLang's plugins, so a plugin cannot
provide this module in time: it is a top-level module of the stand-ins' distribution, importable from the start.
Being empty is enough on CPU: SGLang with ``--device cpu`` calls none of the CUDA ops it would register
(torch.ops.sgl_kernel stays empty).
"""
