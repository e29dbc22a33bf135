"""Engine adapters: the plain Python API any engine can call (``api``: store, look up and load by token
ids or keys) and the vLLM KV connector (the ``vllm`` package: scheduler and worker sides)."""
