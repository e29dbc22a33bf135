"""Running a plan's copies on transfer backends: the one loop ``TierStack`` and the vLLM workers share.

A plan's stages run one after the other and the copies inside a stage at once. A block lost in one
stage is left out of the later ones (a staged load: into host memory, then into the caller's blocks;
a write-through store: into host memory, then on to disk). A copy that cannot start (no backend for
its devices, a closed backend, a storage this process lacks) fails whole, so every run ends with a
result for every block: which failed, which of those a destination refused for good, which failed
in the first stage (what landed there is whole), and which a backend quarantined (a remote store's
call past its deadline may still touch their memory; ``when_lifted`` says when it no longer can).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvtier.core.errors import ClosedError, TransferError
from kvtier.core.jobs import WorkerReport
from kvtier.core.planner import Copy
from kvtier.core.storage import BlockStorage
from kvtier.core.transfer import OnComplete, Quarantine, Transfer


class Submits(Protocol):
    """Where a run sends its copies: a ``TransferRegistry``, or a stand-in that passes them on to one."""

    def submit(self, transfer: Transfer, on_complete: OnComplete) -> None: ...


class StagedRun:
    """One plan's stages of copies between ``storages`` (by endpoint name: a tier's, or the caller's
    blocks under ``ENGINE``), on ``transfers``.

    ``done(run)`` runs once, after the last stage, on whichever thread finished it. ``refused(keys)``
    says which of a copy's failed keys its destination refused for good (a disk slab names them).
    ``on_stage(k)`` runs before stage k starts, and with ``len(stages)`` at the end: after it, no
    copy reads the stages before k again. The copies of later stages go to ``later`` where given: they
    are submitted from the completion of the stage before, on a thread that has nothing else to do
    (``CopiesHere`` runs them right there).
    """

    def __init__(
        self,
        stages: Sequence[Sequence[Copy]],
        num_blocks: int,
        storages: Mapping[str | None, BlockStorage],
        transfers: Submits,
        done: Callable[[StagedRun], None],
        refused: Callable[[list[bytes]], set[bytes]] = lambda keys: set(),
        on_stage: Callable[[int], None] = lambda k: None,
        later: Submits | None = None,
    ) -> None:
        self.stages = stages
        self.num_blocks = num_blocks
        self.storages = storages
        self.transfers = transfers
        self.later = later or transfers
        self.failed: set[int] = set()  # lost in some stage (an error or a refusal)
        self.refused: set[int] = set()  # of those, refused for good by their destination
        self.first_stage_failed: set[int] = set()
        self.quarantined: set[int] = set()  # of the failed, those whose memory may still be touched
        self.start_errors: list[Exception] = []  # why copies could not start (their blocks failed)
        self._quarantines: list[Quarantine] = []
        self._done = done
        self._refused = refused
        self._on_stage = on_stage
        self._lock = threading.Lock()

    def start(self) -> None:
        """Submit the first stage (the later ones follow from completions); returns at once."""
        self._run(0)

    def report(self, job_id: int) -> WorkerReport:
        """The run's result as the report of one worker for job ``job_id``."""
        report = WorkerReport()
        report.add(job_id, self.failed - self.refused, self.refused, self.first_stage_failed, self.quarantined)
        return report

    def when_lifted(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once no quarantine of this run holds any more: only for a run that reported
        quarantined blocks, after its report (see ``WorkerReport.lift``)."""
        pending = [len(self._quarantines)]
        lock = threading.Lock()

        def one_lifted() -> None:
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                callback()

        for quarantine in self._quarantines:
            quarantine.when_lifted(one_lifted)

    def _run(self, k: int) -> None:
        """Start stage ``k`` (skipping stages whose blocks all failed); finish after the last."""
        copies: list[Copy] = []
        while k < len(self.stages):
            alive = set(range(self.num_blocks)) - self.failed
            copies = [part for c in self.stages[k] if (part := c.only(alive)) is not None]
            if copies:
                break
            k += 1
        self._on_stage(k)
        if k >= len(self.stages):
            self._done(self)
            return
        pending = [len(copies)]

        def copied(copy: Copy, lost: set[int], quarantine: Quarantine | None = None) -> None:
            refused = self._refused([copy.keys[j] for j in lost]) if lost else set()
            with self._lock:
                if quarantine is not None:
                    self._quarantines.append(quarantine)
                    self.quarantined.update(copy.blocks[j] for j in quarantine.blocks)
                    lost = lost | quarantine.blocks
                self.failed.update(copy.blocks[j] for j in lost)
                self.refused.update(copy.blocks[j] for j in lost if copy.keys[j] in refused)
                if k == 0:
                    self.first_stage_failed.update(copy.blocks[j] for j in lost)
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self._run(k + 1)

        transfers = self.later if k else self.transfers
        for copy in copies:
            self._submit(transfers, copy, functools.partial(copied, copy))

    def _submit(self, transfers: Submits, copy: Copy, on_complete: Callable[..., None]) -> None:
        """Hand one copy to the backend for its two sides' devices; a copy that cannot start fails whole."""
        try:
            transfer = Transfer(
                self.storages[copy.src.tier],
                copy.src.slots or (),
                self.storages[copy.dst.tier],
                copy.dst.slots or (),
                copy.keys,
            )
            transfers.submit(transfer, on_complete)
        except (TransferError, ClosedError, KeyError) as exc:
            self.start_errors.append(exc)
            on_complete(set(range(len(copy.blocks))))
