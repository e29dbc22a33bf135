"""One module per storage medium, each building a ``kvtier.core.tier.Tier`` over its own storage:
host memory (``host``), GPU memory (``gpu``), a local disk slab that survives restarts (``disk``, with
``disk_files`` opening it without trusting the directory and ``compression`` packing its slots). The
bytes between tiers move through ``kvtier.transfers``."""
