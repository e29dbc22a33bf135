"""How bytes move between tiers: one transfer backend per kind of copy.

- ``cpu``: memmove on a thread pool, host memory to host memory (and CPU tensors standing in for a GPU);
- ``cuda`` (with ``cuda_driver``): GPU <-> host copies on CUDA streams, batched or by a copy kernel;
- ``disk``: positioned reads and writes between host memory and a disk tier's slab file.

Every backend implements ``kvtier.core.transfer.TransferBackend``; the stack and the vLLM worker drive
them through that interface only.
"""
