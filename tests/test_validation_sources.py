"""The rows read from llama.cpp's benchmark pages and community benchmark sets
(validation/llama-cpp-benches.toml, ai-benchmarks.toml, llmfit.toml, ik-llama-cpp.toml) and the
profiles of their machines: each published value is the figure its source line quotes, each
synthetic setting is the test the row names, and the same card in two hosts is the same card."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from daopsim.simulator.hardware import load_profile
from daopsim.simulator.validation import load_table

ROOT = Path(__file__).resolve().parents[1]
FILES = ("llama-cpp-benches.toml", "ai-benchmarks.toml", "llmfit.toml", "ik-llama-cpp.toml")
NEW_PROFILES = (
    "dgx-spark-gb10",
    "rtx4090-265k-pcie4",
    "rtx4070ti-265k-pcie4",
    "rtxa4000-265k-pcie4",
    "rtx3060-265k-pcie4",
    "r9700-265k-pcie5",
    "rtx4090-picm5-pcie3x1",
    "rtx4070ti-picm5-pcie3x1",
    "rtxa4000-picm5-pcie3x1",
    "rtx3060-picm5-pcie3x1",
    "rtx3080ti-picm5-pcie3x1",
    "r9700-picm5-pcie3x1",
    "rtx2080-10900x-pcie3",
    "framework-desktop-395",
)


def _rows(name: str):
    """The rows of one file of the bundled table (read with the whole table: a ranking row may
    name rows of another file)."""
    with open(ROOT / "validation" / name, "rb") as f:
        ids = {raw["id"] for raw in tomllib.load(f)["row"]}
    return [r for r in load_table() if r.id in ids]


@pytest.mark.parametrize("name", FILES)
def test_rows_are_pre_registered_test_rows(name: str) -> None:
    rows = [r for r in _rows(name) if not r.is_ranking]
    assert rows
    for r in rows:
        assert r.role == "test" and r.setting in ("published", "assumed"), r.id
        if r.modelled:
            assert "written down before running it" in r.note, r.id


def _quoted_rate(source: str) -> float:
    """The last 't/s' / 'tokens/s' / 'tok/s' figure a source line quotes."""
    found = re.findall(r"([0-9]+(?:\.[0-9]+)?) (?:t/s|tokens/s|tok/s)", source)
    assert found, source
    return float(found[-1])


@pytest.mark.parametrize("name", FILES)
def test_published_values_are_the_quoted_figures(name: str) -> None:
    """A tokens/s row publishes the rate its source quotes; a prompt-pass row publishes prompt
    tokens / that rate (the simulated prompt is the test's length)."""
    for r in _rows(name):
        if r.is_ranking or not r.modelled:
            continue
        rate = _quoted_rate(r.source)
        synth = r.sim["synth"]
        if r.unit == "tokens/s":
            assert r.published == pytest.approx(rate, rel=1e-6), r.id
        else:
            assert r.unit == "s" and r.metric == "ttft_s", r.id
            assert r.published == pytest.approx(synth["prompt_tokens"] / rate, rel=2e-4), r.id


def test_llama_bench_tests_map_onto_the_synthetic_setting() -> None:
    """tgN @ dD: a D-token prompt (1 at depth 0) then N generated tokens, decode rate; ppN: an
    N-token prompt, the prompt pass."""
    for r in _rows("llama-cpp-benches.toml"):
        if r.is_ranking:
            continue
        synth = r.sim["synth"]
        m = re.search(r"-tg(\d+)(?:-d(\d+))?$", r.id)
        if m:
            assert synth["output_tokens"] == int(m.group(1)), r.id
            assert synth["prompt_tokens"] == max(1, int(m.group(2) or 0)), r.id
            assert r.metric == "decode_tokens_per_s", r.id
        else:
            m = re.search(r"-prefill-(\d+)$", r.id)
            assert m and synth["prompt_tokens"] == int(m.group(1)), r.id
        assert r.sim["policy_options"] == {"ngl": 99}, r.id  # the page's -ngl 99


@pytest.mark.parametrize("profile", NEW_PROFILES)
def test_new_profiles_load_and_describe_their_cpu(profile: str) -> None:
    hw = load_profile(profile)
    assert hw.name == profile
    assert hw.cpu.dram_gbs is not None and hw.cpu.mem_bw_gbs <= hw.cpu.dram_gbs
    assert hw.link.h2d_pageable_gbs < hw.link.h2d_pinned_gbs


@pytest.mark.parametrize("card", ["rtx4090", "rtx4070ti", "rtxa4000", "rtx3060", "r9700"])
def test_a_card_in_two_hosts_is_the_same_card(card: str) -> None:
    """The host-pair ranking groups compare hosts: the card must be identical, the hosts not."""
    desk = load_profile(f"{card}-265k-pcie{5 if card == 'r9700' else 4}")
    pi = load_profile(f"{card}-picm5-pcie3x1")
    assert desk.gpu == pi.gpu
    assert pi.link.h2d_pinned_gbs < desk.link.h2d_pinned_gbs / 10  # one lane against sixteen
    assert pi.cpu.fp32_gflops < desk.cpu.fp32_gflops and pi.cpu.dram_gbs < desk.cpu.dram_gbs


UNIFIED = [("dgx-spark-gb10", 273.0), ("framework-desktop-395", 256.0)]


@pytest.mark.parametrize("profile,bw", UNIFIED)
def test_unified_machine_shares_one_memory(profile: str, bw: float) -> None:
    hw = load_profile(profile)
    assert hw.link.kind == "unified"
    assert hw.link.dram_bw_gbs == hw.gpu.mem_bw_gbs == bw
    assert hw.link.h2d_pinned_gbs == pytest.approx(hw.gpu.mem_bw_gbs / 2)


def test_ranking_groups_name_rows_of_one_source() -> None:
    table = {r.id: r for r in load_table()}
    for name in FILES:
        for r in _rows(name):
            if not r.is_ranking:
                continue
            assert len(r.members) >= 2, r.id
            refs = [table[m.ref] for m in r.members]
            first = refs[0].source.split(":")[0]
            assert all(x.source.split(":")[0] == first for x in refs), r.id
