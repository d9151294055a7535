"""How the requests of a serving run arrive and are batched: :class:`ServingConfig` (the
batch's size and kind, and the serving options as declared in simulator/run_params.py) and
:func:`serving_config`, which makes it from ``daopsim run``'s serving options (docs/serving.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from daopsim.simulator.errors import UserError
from daopsim.simulator.run_params import ServingOptions, ServingRequest, run_params


@dataclass(frozen=True, kw_only=True)
class ServingConfig(ServingOptions):
    """How requests arrive and are batched: the batch's size and kind, and the serving
    options as declared (:class:`~daopsim.simulator.run_params.ServingOptions`: arrivals,
    KV-cache reserve, SLOs, chunked prefill, preemption, static prefill), each checked as
    declared."""

    #: most requests decoding together
    batch: int = 1
    #: continuous (iteration-level) batching; False: static batches
    continuous: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arrival_rate is not None and self.arrivals is not None:
            raise UserError("give --arrival-rate or --arrivals, not both")
        if self.static_prefill is not None:
            if self.continuous:
                raise UserError(
                    "--static-prefill applies to static batches (--batch), not to continuous "
                    "batching"
                )
            if self.static_prefill == "batched" and self.extended:
                raise UserError(
                    "--static-prefill batched is not modelled with --prefill-chunk or --preempt "
                    "(their prompts prefill one request at a time); use --static-prefill "
                    "per-request or drop them"
                )

    @property
    def extended(self) -> bool:
        """Chunked prefill or preemption: the schedule of :func:`plan_steps`."""
        return self.prefill_chunk is not None or self.preempt

    @property
    def batched_prefill(self) -> bool:
        """A static batch's prompts prefill together in one step (docs/serving.md)."""
        return not self.continuous and not self.extended and self.static_prefill != "per-request"

    @property
    def timed_arrivals(self) -> bool:
        """Requests arrive over time (the schedule then depends on the simulated clock)."""
        return self.arrival_rate is not None or self.arrivals is not None


#: The ``--static-prefill`` choices (docs/serving.md, "Static batches prefill together").
STATIC_PREFILL: tuple[str, ...] = next(
    p.choices or () for p in run_params("serving") if p.name == "static_prefill"
)


#: Most requests decoding together when requests arrive over time and no size is given.
DEFAULT_MAX_BATCH = 8


def serving_config(**options: Any) -> ServingConfig | None:
    """The serving configuration of ``run``'s serving options (the keywords are the fields of
    :class:`~daopsim.simulator.run_params.ServingRequest`), or None when none is given.

    ``batch=B``: static batches; ``max_batch=B``: continuous batching; neither: continuous
    batching of up to :data:`DEFAULT_MAX_BATCH` when requests arrive over time, else one
    request at a time.
    """
    try:
        req = ServingRequest(**options)
    except TypeError as exc:
        raise TypeError(str(exc).replace("ServingRequest.__init__()", "serving_config()")) from None
    given = [f.name for f in fields(req) if getattr(req, f.name) != f.default]
    if given in ([], ["static_prefill"]):
        if given:
            raise UserError("--static-prefill needs static batches (--batch B)")
        return None
    if req.batch is not None and req.max_batch is not None:
        raise UserError("give --batch (static batches) or --max-batch (continuous), not both")
    timed = req.arrival_rate is not None or req.arrivals is not None
    size = req.batch if req.batch is not None else req.max_batch
    if size is None:
        size = DEFAULT_MAX_BATCH if timed else 1
    shared = {f.name: getattr(req, f.name) for f in fields(ServingOptions)}
    return ServingConfig(
        batch=size, continuous=req.batch is None and (req.max_batch is not None or timed), **shared
    )
