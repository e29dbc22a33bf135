"""An eviction policy for tests that admits a block only the second time it is asked about it: what
an admission filter does with a block seen once, made deterministic."""

from __future__ import annotations

from kvtier.policies.lru import LRUPolicy


class AdmitOnSecondAsk(LRUPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.asked: set[object] = set()

    def admit(self, key) -> bool:
        if key in self.asked:
            return True
        self.asked.add(key)
        return False
