"""Engine adapters: the vLLM KV connector (``vllm``: scheduler and worker sides), kvtier inside vLLM's own
tiered offloading (``vllm_tiering``) and SGLang's HiCache storage backend (``sglang``). The plain Python API
any engine can call (``KVTier``: store, look up and load by token ids or keys) is ``kvtier.api``."""
