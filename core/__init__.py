"""The block interface and what every tier and connector stands on: keys, layouts, storage, the tier,
jobs and fences, the transfer spec and its registry, routes, the planner and the loop that runs its
plans' copies, the stack, putting a tier's kept blocks back (restore), the registry of media and the
names of devices, configuration (the stack's schema; the keys every tier's model builds on), what
``kvtier doctor`` reports (checks), errors and metrics. Of kvtier it imports only the policies."""
