"""Block interface and the machinery every tier shares: keys, layouts, storage, tiers, jobs, transfers, the stack."""
