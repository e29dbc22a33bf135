"""The block interface and what every tier and connector stands on: keys, layouts, storage, the tier,
jobs and fences, the transfer spec and its registry, routes, the planner and the loop that runs its
plans' copies, the stack, configuration (the stack's schema; the keys every tier's model builds on), errors
and metrics. Of kvtier it imports only the policies."""
