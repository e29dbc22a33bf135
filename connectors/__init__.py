"""Engine adapters: the plain Python API (api.py); the vLLM connector arrives in its own package."""
