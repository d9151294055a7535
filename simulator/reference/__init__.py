"""The reference engine: daopsim's timing rules as plain SimPy processes, written apart from the
fast engine so that the equivalence tests check it (docs/architecture.md, "The reference
engine").

* :mod:`daopsim.simulator.reference.engine`: the step loop, plans into operations, every operation
  as a SimPy process, one GPU or several;
* :mod:`daopsim.simulator.reference.resources`: serial lanes, counted pools, the shared host CPU,
  the runtime's host thread;
* :mod:`daopsim.simulator.reference.memory`: residency as policies see it, host memory over a drive;
* :mod:`daopsim.simulator.reference.serving`: the serving loop.

Select it with ``simulate(engine="reference")`` or ``daopsim run --engine reference``.
"""

from __future__ import annotations

from typing import Any

from daopsim.simulator.reference.engine import ReferenceEngine


class MultiGpuReference(ReferenceEngine):
    """The reference engine over several GPUs
    (``daopsim.simulator.multigpu.engine_for("reference")``): the same constructor with the
    ``placement`` and per-GPU ``budgets`` required."""

    def __init__(self, *args: Any, placement: Any, budgets: list[int], **kw: Any) -> None:
        super().__init__(*args, placement=placement, budgets=budgets, **kw)


__all__ = ["MultiGpuReference", "ReferenceEngine"]
