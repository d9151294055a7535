"""Energy: GPU, CPU package and DRAM at device level, platform and power supply at the wall."""

from __future__ import annotations

from pathlib import Path

import pytest

from daopsim.simulator.errors import ProfileError
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.hardware_spec import (
    CONTEXT_STEP_W,
    DEFAULT_DRAM_W,
    DEFAULT_PLATFORM_W,
    DEFAULT_PSU_EFFICIENCY,
)
from daopsim.simulator.results import energy_breakdown
from daopsim.simulator.runner import simulate


def test_breakdown_by_hand_on_a100() -> None:
    """A100 (measured 80 W with a context held): every part by its own formula."""
    hw = load_profile("a100-40g-pcie4")
    e2e, gpu_busy, cpu_busy = 10.0, 4.0, 2.0
    e = energy_breakdown(hw, e2e, gpu_busy, cpu_busy)
    p = hw.power
    gpu = 80.0 * e2e + (p.gpu_busy_w - 80.0) * gpu_busy
    wait = p.cpu_idle_w + (p.cpu_busy_w - p.cpu_idle_w) * 2 / hw.cpu.cores_used
    cpu = wait * e2e + (p.cpu_busy_w - wait) * cpu_busy
    assert e["energy_gpu_j"] == pytest.approx(gpu)
    assert e["energy_cpu_j"] == pytest.approx(cpu)
    assert e["energy_dram_j"] == pytest.approx(DEFAULT_DRAM_W * e2e)
    assert e["energy_j"] == pytest.approx(gpu + cpu)
    device = gpu + cpu + DEFAULT_DRAM_W * e2e
    assert e["energy_device_j"] == pytest.approx(device)
    assert e["energy_wall_j"] == pytest.approx((device + DEFAULT_PLATFORM_W * e2e) / 0.90)


def test_waiting_gpu_draws_more_than_bare_idle() -> None:
    """A run that only waits on copies still pays the context-holding GPU power."""
    hw = load_profile("rtx4090-pcie4")  # no measured active idle: the default step applies
    waiting = energy_breakdown(hw, 1.0, 0.0, 0.0)["energy_gpu_j"]
    assert waiting == pytest.approx(hw.power.gpu_idle_w + CONTEXT_STEP_W)
    assert waiting > hw.power.gpu_idle_w


def test_levels_are_ordered_for_every_profile() -> None:
    """GPU + CPU <= device <= wall, and all positive, on every bundled machine."""
    from daopsim.simulator.hardware import list_profiles

    for hw in list_profiles():
        e = energy_breakdown(hw, 5.0, 2.0, 1.0)
        assert 0 < e["energy_j"] < e["energy_device_j"] < e["energy_wall_j"], hw.name
        assert e["energy_j"] == pytest.approx(e["energy_gpu_j"] + e["energy_cpu_j"])


def test_run_json_reports_the_breakdown() -> None:
    r = simulate(policy="lru", hw="a6000-pcie4", trace="ci-small", sequences=1, record=False)
    doc = r.to_dict()
    en = doc["energy"]
    assert set(en) == {"gpu_j", "cpu_j", "dram_j", "device_j", "wall_j"}
    assert en["device_j"] == pytest.approx(en["gpu_j"] + en["cpu_j"] + en["dram_j"])
    m = r.metrics
    assert m["tokens_per_kj_wall"] < m["tokens_per_kj_device"] < m["tokens_per_kj"]
    assert m["tokens_per_kj_wall"] == pytest.approx(
        m["decode_tokens"] / (m["energy_wall_j"] / 1000)
    )


def test_no_power_section_gives_nan(tmp_path: Path) -> None:
    base = load_profile("a6000-pcie4")
    from dataclasses import replace

    e = energy_breakdown(replace(base, power=None), 1.0, 0.5, 0.5)
    assert all(v != v for v in e.values())


def test_power_fields_are_checked(tmp_path: Path) -> None:
    p = tmp_path / "box.toml"
    p.write_text(
        'extends = "a6000-pcie4"\nname = "box"\ndescription = "d"\n'
        "[power]\ngpu_active_idle_w = 500.0\n"
    )
    with pytest.raises(ProfileError, match="gpu_active_idle_w"):
        load_profile(p)
    p.write_text(
        'extends = "a6000-pcie4"\nname = "box"\ndescription = "d"\n[power]\npsu_efficiency = 1.5\n'
    )
    with pytest.raises(ProfileError, match="psu_efficiency"):
        load_profile(p)
    assert DEFAULT_PSU_EFFICIENCY == 0.90


def test_cpu_workers_spin_after_each_call_at_busy_power() -> None:
    """Issue 30: after each CPU expert call the worker threads spin for cpu_spin_ms (libgomp's
    default spin count at Skylake-and-later PAUSE latency: 14 ms) at busy power; the spin that
    the next call cuts short is busy time already, and nothing exceeds the run."""
    from daopsim.simulator.hardware_spec import DEFAULT_CPU_SPIN_MS

    assert abs(DEFAULT_CPU_SPIN_MS - 14.0) < 1e-9
    hw = load_profile("a6000-pcie4")
    p = hw.power.resolved(hw.cpu.cores_used)
    none = energy_breakdown(hw, 10.0, 1.0, 2.0, cpu_calls=0)
    some = energy_breakdown(hw, 10.0, 1.0, 2.0, cpu_calls=100)
    assert some["energy_cpu_j"] - none["energy_cpu_j"] == pytest.approx(
        (p.cpu_busy_w - p.cpu_wait_w) * 100 * 0.014
    )
    # calls every few milliseconds keep the package busy for the whole run, no more
    many = energy_breakdown(hw, 10.0, 1.0, 2.0, cpu_calls=10_000)
    assert many["energy_cpu_j"] == pytest.approx(p.cpu_busy_w * 10.0)
    assert some["energy_gpu_j"] == none["energy_gpu_j"]


def test_fiddler_run_spends_more_cpu_energy_per_token_than_lru() -> None:
    """A run whose CPU computes experts every layer (Fiddler) keeps the package busy between
    the calls; an LRU run (no CPU experts) pays only the driving level."""
    kw = dict(hw="a6000-pcie4", trace="ci-small", sequences=1, record=False)
    fid = simulate(policy="fiddler", **kw).metrics
    lru = simulate(policy="lru", cache_ratio=0.25, **kw).metrics
    hw = load_profile("a6000-pcie4")
    p = hw.power.resolved(hw.cpu.cores_used)
    assert fid["energy_cpu_j"] / fid["e2e_s"] > 0.9 * p.cpu_busy_w
    assert lru["energy_cpu_j"] / lru["e2e_s"] == pytest.approx(p.cpu_wait_w)
