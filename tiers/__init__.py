"""One module per storage medium: host memory, GPU memory (disk and remote later)."""
