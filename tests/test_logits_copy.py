"""Logits to the host: a llama.cpp-family run whose output matrix is on the GPU ends every
forward pass with the copy of the logits (vocab x 4 B) to pinned host memory
(docs/cost-model.md, "Logits to the host")."""

from __future__ import annotations

import pytest

from daopsim import cost_model, get_runtime, simulate
from daopsim.simulator.runtime_profiles import with_costs


def test_the_copy_is_the_vocabulary_in_fp32_over_the_pinned_d2h_link() -> None:
    # GPT-OSS-20B: 201,088 rows in its embedding; the Pi CM5's PCIe 3.0 x1 at 0.79 GB/s
    c = cost_model("rtx4090-picm5-pcie3x1", "gpt-oss-20b")
    assert c.vocab == 201_088
    assert c.logits_copy_s() == pytest.approx(6e-6 + 201_088 * 4 / 0.79e9, rel=1e-12)
    assert c.logits_copy_s() == pytest.approx(1.0242e-3, rel=1e-4)
    # the same card in a PCIe 4.0 x16 desktop: 28x faster
    desk = cost_model("rtx4090-265k-pcie4", "gpt-oss-20b")
    assert desk.logits_copy_s() < c.logits_copy_s() / 25


def test_only_the_llama_cpp_family_samples_on_the_host() -> None:
    for name in ("llama.cpp", "llama.cpp-eager", "ik_llama.cpp", "ik_llama.cpp-rtr"):
        assert get_runtime(name).logits_to_host, name
    for name in ("hf-eager", "cuda-graph", "ktransformers", "moe-infinity", "ideal"):
        assert not get_runtime(name).logits_to_host, name


def _run(hw: str, runtime: object, ngl: int) -> dict[str, float]:
    r = simulate(
        policy="llama-cpp-layers",
        policy_options={"ngl": ngl},
        hw=hw,
        trace="olmoe-1b-7b",
        sequences=1,
        runtime=runtime,
        record=False,
    )
    return r.metrics


def test_each_decode_token_waits_for_its_logits_when_the_gpu_holds_the_output() -> None:
    # OLMoE (50,304 rows) whole on the GPU behind a PCIe 3.0 x1 link: the decode is
    # graph-replayed and the host waits for each pass's end, so every token takes the copy more
    hw = "rtx4090-picm5-pcie3x1"
    llama = get_runtime("llama.cpp")
    without = with_costs(llama, logits_to_host=False)
    copy = cost_model(hw, "olmoe-1b-7b").logits_copy_s()
    assert copy == pytest.approx(6e-6 + 50_304 * 4 / 0.79e9)
    on, off = _run(hw, llama, 99), _run(hw, without, 99)
    assert on["tpot_mean_s"] - off["tpot_mean_s"] == pytest.approx(copy, rel=1e-6)


def test_no_copy_when_the_output_matrix_stays_on_the_cpu() -> None:
    # -ngl 0: every layer (and the output matrix) on the CPU, the logits are in host memory
    hw = "rtx4090-picm5-pcie3x1"
    llama = get_runtime("llama.cpp")
    on = _run(hw, llama, 0)
    off = _run(hw, with_costs(llama, logits_to_host=False), 0)
    assert on["tpot_mean_s"] == off["tpot_mean_s"]


@pytest.mark.reference
def test_both_engines_charge_the_copy_alike() -> None:
    kw = dict(
        policy="llama-cpp-layers",
        policy_options={"ngl": 99},
        hw="rtx4090-picm5-pcie3x1",
        trace="olmoe-1b-7b",
        sequences=1,
        record=False,
    )
    fast, ref = simulate(**kw), simulate(**kw, engine="reference")
    assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9)
    assert fast.metrics["tpot_mean_s"] == pytest.approx(ref.metrics["tpot_mean_s"], abs=1e-9)
