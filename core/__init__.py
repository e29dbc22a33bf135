"""The block interface and what every tier and connector stands on: keys, layouts, storage, the tier,
jobs and fences, the transfer spec and its registry, routes, the planner and the loop that runs its
plans' copies, the stack, configuration (with the slot geometry it counts disk capacities by), errors
and metrics. Of kvtier it imports only the policies."""
