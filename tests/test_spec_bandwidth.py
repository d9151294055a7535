"""The GPU's spec bandwidth, ``gpu.spec_mem_bw_gbs`` (docs/hardware-profiles.md; docs/cost-model.md,
"GPU stream efficiency").

A runtime's ``gpu_stream_efficiency`` is a share of the card's spec bandwidth, and its GPU work
streams at ``min(gpu.mem_bw_gbs, efficiency x spec)``. On a profile whose ``mem_bw_gbs`` is a
measured rate (rtx4090-pcie4: 912 measured, 1008 spec) that is not ``efficiency x 912``; with
efficiency 1.0 the spec figure must change nothing. A spec below ``mem_bw_gbs`` is refused in
one line, and a child profile naming another card's bandwidth must not inherit the spec figure.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path

import pytest

from daopsim.simulator.costs import cost_model
from daopsim.simulator.errors import ProfileError
from daopsim.simulator.hardware import bundled_profiles, list_profiles, load_profile, read_profile

MEASURED = "rtx4090-pcie4"  # gpu.mem_bw_gbs 912 measured, gpu.spec_mem_bw_gbs 1008


def _with_gpu(hw_name: str, **changes: object):  # type: ignore[no-untyped-def]
    """The bundled profile with some GPU fields replaced."""
    hw = load_profile(hw_name)
    return dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, **changes))


def _gpu_costs(c) -> list[float]:  # type: ignore[no-untyped-def]
    """Memory-bound and compute-bound GPU costs the stream rate could touch."""
    return [
        c.gpu_expert_s(1),
        c.fused_gpu_expert_s(1),
        c.fused_gpu_expert_s(64),
        c.nonexpert_layer_s(1, 0),
        c.nonexpert_layer_s(1, 700),
        c.nonexpert_batch_layer_s(8, 8 * 65),
        c.nonexpert_mixed_layer_s(16, 32, 3, 99),
        c.nonexpert_layer_s(512, 0),
    ]


def test_measured_profiles_state_their_spec() -> None:
    """Every bundled profile whose gpu.mem_bw_gbs comment tags it a measurement ([R]) states a
    spec above it, and the rtx4090/rtx3090 children with the same GPU inherit it."""
    tagged = 0
    for name, path in bundled_profiles().items():
        text = path.read_text()
        gpu_part = re.split(r"^\[(?!gpu\])", text.split("[gpu]", 1)[-1], flags=re.M)[0]
        line = re.search(r"^mem_bw_gbs\s*=.*$", gpu_part, flags=re.M)
        hw = read_profile(path)
        if line is not None and "[R]" in line.group(0):
            tagged += 1
            assert hw.gpu.spec_mem_bw_gbs is not None, name
            assert hw.gpu.spec_mem_bw_gbs > hw.gpu.mem_bw_gbs, name
    assert tagged >= 8  # the seven cards of the brief, L4 twice
    for child in ("rtx3090-3700x-pcie4", "2x-rtx3090-nvlink", "4x-rtx3090-nvlink"):
        assert load_profile(child).gpu.spec_bw_gbs == 936.0
    for child in ("rtx4090-9950x-pcie4", "rtx4090-990pro-pcie4", "2x-rtx4090-pcie4"):
        assert load_profile(child).gpu.spec_bw_gbs == 1008.0
    # children that name another card's bandwidth over rtx4090-pcie4 do not inherit its 1008
    for child in ("rtx4080-pcie4", "rtx4070-pcie4", "rtx4060ti-pcie4x8", "rtx3060-pcie4"):
        gpu = load_profile(child).gpu
        assert gpu.spec_mem_bw_gbs is None and gpu.spec_bw_gbs == gpu.mem_bw_gbs, child


@pytest.mark.parametrize("dtype", ["bf16"])
def test_efficiency_one_ignores_the_spec(dtype: str) -> None:
    """With efficiency 1.0 a measured-rate profile costs exactly what it costs without its spec
    figure, for a format with no share of its own (GGUF's share is of the spec since issue 30:
    test_gguf_expert_takes_the_lower_of_format_rule_and_runtime_rate)."""
    shape = cost_model(MEASURED, "mixtral-8x7b").model.with_dtype(dtype)
    with_spec = cost_model(MEASURED, shape, gpu_stream_efficiency=1.0)
    without = cost_model(_with_gpu(MEASURED, spec_mem_bw_gbs=None), shape)
    assert with_spec.hw.gpu.spec_mem_bw_gbs == 1008.0
    assert _gpu_costs(with_spec) == _gpu_costs(without)
    # and the decode term streams at the measured 912, not the spec
    kv = with_spec.nonexpert_layer_s(1, 700) - with_spec.nonexpert_layer_s(1, 0)
    kv_bytes = with_spec.model.kv_bytes_per_token / with_spec.model.moe_layers * 700
    assert kv == pytest.approx(kv_bytes / 912e9, rel=1e-9)


@pytest.mark.parametrize("eff", [0.3, 0.5, 0.58, 0.9, 0.95])
def test_rate_is_min_of_measured_and_efficiency_times_spec(eff: float) -> None:
    """On rtx4090-pcie4 the runtime streams at min(912, eff x 1008): the same costs as a card
    whose own bandwidth is that rate, run at efficiency 1.0."""
    rate = min(912.0, eff * 1008.0)
    got = cost_model(MEASURED, "mixtral-8x7b", gpu_stream_efficiency=eff)
    same = cost_model(_with_gpu(MEASURED, mem_bw_gbs=rate, spec_mem_bw_gbs=None), "mixtral-8x7b")
    assert _gpu_costs(got) == pytest.approx(_gpu_costs(same), rel=1e-12)
    # not the double discount eff x 912 (where eff x 1008 is below 912 the two differ)
    if eff * 1008.0 < 912.0:
        double = _with_gpu(MEASURED, mem_bw_gbs=eff * 912.0, spec_mem_bw_gbs=None)
        slow = cost_model(double, "mixtral-8x7b")
        assert got.nonexpert_layer_s(1, 700) < slow.nonexpert_layer_s(1, 700)


def test_llama_cpp_on_the_4090_streams_at_its_calibration_rate() -> None:
    """The constant was read off 589 GB/s on an RTX 4090: on rtx4090-pcie4 the llama.cpp
    decode term now streams at 0.58 x 1008 = 584.6 GB/s, not 0.58 x 912 = 529."""
    c = cost_model(MEASURED, "mixtral-8x7b", gpu_stream_efficiency=0.58)
    kv = c.nonexpert_layer_s(1, 700) - c.nonexpert_layer_s(1, 0)
    kv_bytes = c.model.kv_bytes_per_token / c.model.moe_layers * 700
    assert kv_bytes / kv / 1e9 == pytest.approx(0.58 * 1008, rel=1e-9)


def test_gguf_expert_takes_the_lower_of_format_rule_and_runtime_rate() -> None:
    """A GGUF expert on the 4090 streams at min(912, min(0.78, eff) x 1008): both shares are of
    the spec bandwidth (issue 30), so the lower binds."""
    gguf = cost_model(MEASURED, "mixtral-8x7b").model.with_dtype("q4_0")
    at = {e: cost_model(MEASURED, gguf, gpu_stream_efficiency=e) for e in (1.0, 0.85, 0.5)}
    # 0.85 x 1008 = 856.8 > 0.78 x 1008 = 786.2: the format rule binds
    assert at[0.85].fused_gpu_expert_s(1) == at[1.0].fused_gpu_expert_s(1)
    ratio = at[0.5].fused_gpu_expert_s(1) / at[1.0].fused_gpu_expert_s(1)
    assert ratio == pytest.approx(0.78 / 0.5, rel=1e-12)


def test_no_efficiency_streams_faster_than_the_measured_rate() -> None:
    """Physical invariant, tried on every profile and a grid of efficiencies: the runtime's
    rate never beats gpu.mem_bw_gbs (no cost below the efficiency-1.0 cost) and a lower
    efficiency never makes GPU work cheaper."""
    effs = (1.0, 0.99, 0.9, 0.8, 0.75, 0.58, 0.2)
    for hw in list_profiles():
        rows = [_gpu_costs(cost_model(hw, "mixtral-8x7b", gpu_stream_efficiency=e)) for e in effs]
        for hi, lo in itertools.pairwise(rows):
            assert all(a <= b for a, b in zip(hi, lo, strict=True)), hw.name


def _write(tmp_path: Path, name: str, gpu_lines: str, extends: str = MEASURED) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(
        f'extends = "{extends}"\nname = "{name}"\ndescription = "test"\n\n[gpu]\n{gpu_lines}\n'
    )
    return p


@pytest.mark.parametrize("spec", [911.9, 1.0, 0.5])
def test_spec_below_mem_bw_is_refused_in_one_line(tmp_path: Path, spec: float) -> None:
    """A spec below gpu.mem_bw_gbs is a one-line ProfileError naming the file and the key."""
    p = _write(tmp_path, "low", f"spec_mem_bw_gbs = {spec}")
    with pytest.raises(ProfileError) as err:
        read_profile(p)
    msg = str(err.value)
    assert "\n" not in msg and str(p) in msg and "gpu.spec_mem_bw_gbs" in msg
    # below the floor every bandwidth has (MIN_VALUES), that bound is the one named
    assert (">= gpu.mem_bw_gbs" if spec >= 1.0 else "below the physical bound") in msg


@pytest.mark.parametrize("bad", ["0", "-1.0", "1e300", '"fast"', "nan"])
def test_bad_spec_values_are_refused(tmp_path: Path, bad: str) -> None:
    """Non-positive, absurd, non-numeric or NaN specs are refused naming the key."""
    p = _write(tmp_path, "bad", f"spec_mem_bw_gbs = {bad}")
    with pytest.raises(ProfileError, match=r"gpu\.spec_mem_bw_gbs"):
        read_profile(p)


def test_extends_drops_the_spec_with_a_new_bandwidth(tmp_path: Path) -> None:
    """A child that restates gpu.mem_bw_gbs alone does not keep the base's spec; one that
    states both keeps its own; one that restates neither inherits the base's."""
    own_bw = read_profile(_write(tmp_path, "a", "mem_bw_gbs = 500.0"))
    assert own_bw.gpu.spec_mem_bw_gbs is None and own_bw.gpu.spec_bw_gbs == 500.0
    both = read_profile(_write(tmp_path, "b", "mem_bw_gbs = 500.0\nspec_mem_bw_gbs = 600.0"))
    assert both.gpu.spec_bw_gbs == 600.0
    neither = read_profile(_write(tmp_path, "c", 'name = "renamed RTX 4090"'))
    assert neither.gpu.mem_bw_gbs == 912.0 and neither.gpu.spec_bw_gbs == 1008.0
    assert math.isclose(
        cost_model(neither, "mixtral-8x7b", gpu_stream_efficiency=0.58).nonexpert_layer_s(1, 0),
        cost_model(MEASURED, "mixtral-8x7b", gpu_stream_efficiency=0.58).nonexpert_layer_s(1, 0),
        rel_tol=0,
    )
