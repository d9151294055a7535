"""The reference engine: daopsim's timing rules as plain SimPy processes, written apart from the
fast engine so that the equivalence tests check it (docs/architecture.md, "The reference
engine").

Select it with ``simulate(engine="reference")`` or ``daopsim run --engine reference``.
"""

from simulator.reference.engine import ReferenceEngine


class MultiGpuReference(ReferenceEngine):
    """The reference engine over several GPUs (``placement`` and ``budgets`` required)."""


__all__ = ["MultiGpuReference", "ReferenceEngine"]
