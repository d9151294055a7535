"""Framework weight offload: the accelerate and vllm-cpu-offload policies' core rules by hand.

accelerate: the leading ``budget // E - 1`` layers resident, each routed expert of an offloaded
layer copied to a temporary buffer (pageable) and dropped. vllm-cpu-offload: the leading layers
offloaded (the fewest that fit beside two layers of buffers, or ``offload_layers``), every
expert of an offloaded layer copied at every pass, the buffers of the layer streamed two
layers earlier freed first. Also Mixtral-offloading's prefill swap with write-back.
"""

from __future__ import annotations

import numpy as np
import pytest

from daopsim.policies.accelerate import AcceleratePolicy
from daopsim.policies.base import Action, SetupContext, View
from daopsim.policies.vllm_cpu_offload import VllmCpuOffloadPolicy
from daopsim.simulator.errors import DoesNotFit, UserError
from daopsim.simulator.runner import simulate
from daopsim.simulator.testing import decode_view, setup_context

FETCH, TEMP = Action.FETCH, Action.TEMP


def _ctx(moe_layers: int, experts: int, budget: int) -> SetupContext:
    return setup_context(moe_layers, experts, budget)


def _view(layer: int, experts: list[int], resident: np.ndarray) -> View:
    return decode_view(layer, experts, resident)


def test_accelerate_keeps_leading_layers_and_copies_routed_experts() -> None:
    pol = AcceleratePolicy()
    # 30 slots of 8 experts: 3 whole layers, one of which is the execution buffer
    slots = list(pol.setup(_ctx(6, 8, 30)))
    assert slots == [(layer, e) for layer in range(2) for e in range(8)]
    res = np.zeros((6, 8), dtype=bool)
    assert pol.decode_layer(_view(1, [3, 5], res)).actions is None  # all on the GPU
    plan = pol.decode_layer(_view(2, [3, 5], res))
    assert plan.actions == {3: TEMP, 5: TEMP}
    assert not plan.prefetch and not plan.evict
    assert pol.resources().host_memory == "pageable"


def test_accelerate_whole_model_fits() -> None:
    pol = AcceleratePolicy()
    assert len(list(pol.setup(_ctx(4, 8, 32)))) == 32  # no buffer reserved when nothing offloads


def test_vllm_offloads_fewest_leading_layers_and_streams_all_experts() -> None:
    pol = VllmCpuOffloadPolicy()
    # 6 layers x 4 experts, 23 slots: 2 layers of buffers (8) leave 15, 3 whole resident layers
    slots = list(pol.setup(_ctx(6, 4, 23)))
    assert pol.offload == 3
    assert slots == [(layer, e) for layer in range(3, 6) for e in range(4)]
    res = np.zeros((6, 4), dtype=bool)
    res[3:] = True
    assert pol.decode_layer(_view(3, [0, 1], res)).actions is None
    p0 = pol.decode_layer(_view(0, [1, 3], res))
    assert p0.actions == {1: FETCH, 3: FETCH}
    assert p0.prefetch == [(0, 0, None), (0, 2, None)]
    assert not p0.evict
    res[0] = True
    assert not pol.decode_layer(_view(1, [2, 0], res)).evict
    res[1] = True
    # the third streamed layer first frees the oldest buffers (layer 0's copies)
    p2 = pol.decode_layer(_view(2, [2, 3], res))
    assert p2.evict == [(0, e) for e in range(4)]
    assert p2.actions == {2: FETCH, 3: FETCH}


def test_vllm_whole_model_fits() -> None:
    pol = VllmCpuOffloadPolicy()
    assert len(list(pol.setup(_ctx(6, 4, 24)))) == 24 and pol.offload == 0


def test_vllm_offload_layers_option_and_refusals() -> None:
    pol = VllmCpuOffloadPolicy(offload_layers=5)
    slots = list(pol.setup(_ctx(6, 4, 23)))
    assert pol.offload == 5 and slots == [(5, e) for e in range(4)]
    with pytest.raises(DoesNotFit):
        VllmCpuOffloadPolicy(offload_layers=2).setup(_ctx(6, 4, 23))  # 4 resident do not fit
    with pytest.raises(UserError, match="offload_layers"):
        VllmCpuOffloadPolicy(offload_layers=-1).setup(_ctx(6, 4, 24))
    everything = VllmCpuOffloadPolicy(offload_layers=9)  # more than the model has
    assert list(everything.setup(_ctx(6, 4, 24))) == [] and everything.offload == 6


def test_mixtral_offloading_prefill_swaps_with_writeback() -> None:
    """A prompt routing to all 8 experts with 3 resident: 5 swaps per layer, no temp copies."""
    res = simulate(
        "mixtral-offloading",
        hw="a6000-pcie4",
        trace="ci-small",
        gpu_experts=96,
        sequences=1,
        policy_options={"experts_per_layer": 3},
        record=False,
    )
    m = res.metrics
    assert m["temp_copies"] == 0
    # every copy in is a swap: one eviction and one write-back of the same size per fetch
    assert m["fetches"] == m["evictions"] > 0
    assert m["d2h_bytes"] == m["h2d_bytes"] > 0


def test_new_policies_run_end_to_end() -> None:
    for name in ("accelerate", "vllm-cpu-offload"):
        r = simulate(name, hw="a6000-pcie4", trace="ci-small", sequences=1, record=False)
        assert r.metrics["decode_tokens_per_s"] > 0
