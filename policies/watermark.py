"""When a tier makes room: above the high mark, free blocks in the background until usage is at the low mark."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Watermark:
    """High and low marks as fractions of capacity, ``0 < low < high <= 1``."""

    high: float = 0.95
    low: float = 0.85

    def __post_init__(self) -> None:
        if not 0.0 < self.low < self.high <= 1.0:
            raise ValueError(f"watermark needs 0 < low < high <= 1, got high={self.high} low={self.low}")

    def excess(self, used: int, capacity: int) -> int:
        """Blocks to free now: 0 at or below the high mark, else enough to come down to the low mark."""
        if capacity <= 0 or used <= self.high * capacity:
            return 0
        return used - int(self.low * capacity)
