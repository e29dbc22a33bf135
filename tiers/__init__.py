"""One module or package per storage medium, each building a ``kvtier.core.tier.Tier`` over its own
storage and naming its registry entry (``MEDIUM``, a ``kvtier.core.media.Medium``): host memory
(``host``), GPU memory (``gpu``), a local disk slab that survives restarts (``disk``: its format, its
files opened without trusting the directory, its tier), a store shared with other engines
(``remote``), the machine's node daemon's shared slab (``node``). The bytes between tiers move
through ``kvtier.transfers``, and a disk or node slab's through its medium's own backend
(``kvtier.tiers.disk.transfer``, ``kvtier.tiers.node.transfer``)."""

from kvtier.core.media import register_medium
from kvtier.tiers import disk, gpu, host, node, remote

# Every import of kvtier registers the built-in media (the package root builds stacks), so a config that
# names them always validates; fastest first, the order error messages list them in.
for _medium in (gpu.MEDIUM, host.MEDIUM, node.MEDIUM, disk.MEDIUM, remote.MEDIUM):
    register_medium(_medium)
