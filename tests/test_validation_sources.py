"""The rows read from llama.cpp's benchmark pages, community benchmark sets and benchmark threads
(validation/llama-cpp-benches.toml, ai-benchmarks.toml, llmfit.toml, ik-llama-cpp.toml,
ik-llama-cpp-threads.toml, published-2026.toml, published-2026b.toml) and the
profiles of their machines: each published value is the figure its source line quotes, each
synthetic setting is the test the row names, and the same card in two hosts is the same card."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from daopsim.simulator.costs import cpu_family_stream_gbs
from daopsim.simulator.hardware import load_profile
from daopsim.simulator.validation import load_table

ROOT = Path(__file__).resolve().parents[1]
FILES = (
    "llama-cpp-benches.toml",
    "ai-benchmarks.toml",
    "llmfit.toml",
    "ik-llama-cpp.toml",
    "ik-llama-cpp-threads.toml",
    "published-2026.toml",
    "published-2026b.toml",
)
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
    "xeon6138x2-rtx4060ti-pcie3",
    "epyc7773x-cpu",
    "rtx4080-5975wx-pcie4",
    "rtxpro4000sff-pcie5",
    "rx7900xt-pcie4",
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
        assert r.setting in ("published", "assumed"), r.id
        if r.modelled:
            assert "written down before running it" in r.note, r.id
        # a row whose setting changed after its first run is no longer a test: it says why
        assert r.role == "test" or (r.role == "calibration" and "after" in r.calibrated), r.id


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
    assert hw.cpu.dram_gbs is not None
    for family in ("torch_bf16", "ggml"):  # what a CPU streams never beats its DRAM
        assert 0 < cpu_family_stream_gbs(hw.cpu, family) <= hw.cpu.dram_gbs, family
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


def test_sweep_bench_rows_map_onto_the_synthetic_setting() -> None:
    """ik_llama.cpp threads: a sweep-bench TG N at N_KV = 0 (llama-bench tgN) is one prompt
    token and N generated; its PP N (ppN) an N-token prompt pass; llama-cli's run its prompt and
    its response; a CPU-only post runs every layer on the CPU without op offload, a full-GPU one
    every layer on the GPU, --cpu-moe every routed expert on the CPU, and the hybrid split of
    #357 the experts of as many blocks as its -ot pattern names."""
    for r in _rows("ik-llama-cpp-threads.toml"):
        if r.is_ranking:
            continue
        synth, src = r.sim["synth"], r.source
        if r.id.startswith("ik223-"):  # llama-cli: a 500-token prompt and 300 generated tokens
            assert (synth["prompt_tokens"], synth["output_tokens"]) == (500, 300), r.id
        elif r.metric == "ttft_s":
            n = re.search(r"(?:PP (\d+) at N_KV = 0|pp(\d+) )", src)
            assert n, r.id
            assert synth["prompt_tokens"] == int(n.group(1) or n.group(2)), r.id
            assert synth["output_tokens"] == 2, r.id
            assert r.id.endswith(f"-prefill-{synth['prompt_tokens']}"), r.id
        else:
            assert r.metric == "decode_tokens_per_s", r.id
            n = re.search(r"(?:TG (\d+) at N_KV = 0|tg(\d+) )", src)
            assert n, r.id
            assert synth["output_tokens"] == int(n.group(1) or n.group(2)), r.id
            assert synth["prompt_tokens"] == 1, r.id
        opts = r.sim["policy_options"]
        if "cpu-only" in r.id:
            assert r.sim["policy"] == "llama-cpp-layers", r.id
            assert opts == {"ngl": 0, "prefill_offload": False}, r.id
        elif "full-gpu" in r.id:
            assert r.sim["policy"] == "llama-cpp-layers" and opts == {"ngl": 99}, r.id
        elif "-cpu-moe-" in r.id:
            assert "--cpu-moe" in src + r.system and r.sim["policy"] == "llama-cpp-cpu-moe", r.id
            assert opts == {"n_cpu_moe": -1}, r.id
        else:
            assert "hybrid-14cpu" in r.id and r.sim["policy"] == "llama-cpp-cpu-moe", r.id
            assert opts["n_cpu_moe"] == _OT_BLOCKS, r.id
            extra = {k: v for k, v in opts.items() if k != "n_cpu_moe"}
            if r.metric != "ttft_s":
                assert extra == {}, r.id  # decode: no copies, so nothing else matters
            elif r.sim.get("runtime") == "ik_llama.cpp-rtr":
                # -rtr's repacked CPU weights: no CUDA kernel for them at that date, no offload
                assert "-rtr" in src + r.system + r.note and extra == {"prefill_offload": False}
            else:
                # mainline's -ot ...=CPU tensors: the plain CPU buffer (mmap'd), pageable
                assert "-ot" in r.note and extra == {"host_memory": "pageable"}, r.id


def _ot_blocks(pattern: str, n_blocks: int = 48) -> int:
    """Blocks of a model with ``n_blocks`` an -ot pattern blk\\.D[a-b]\\.ffn=CPU,... names."""
    found = {
        10 * int(d) + k
        for d, a, b in re.findall(r"(\d)\[(\d)-(\d)\]", pattern)
        for k in range(int(a), int(b) + 1)
    }
    return len({x for x in found if x < n_blocks})


_OT_BLOCKS = 14


def test_the_hybrid_split_is_the_posts_pattern() -> None:
    """#357's -ot pattern names blocks 34-39 and 40-47: 14 of 48 blocks' FFN on the CPU."""
    rows = {r.id: r for r in _rows("ik-llama-cpp-threads.toml")}
    src = rows["ik357-qwen3-30b-iq4xs-llamacpp-hybrid-14cpu-4080"].source
    pattern = src.split("-ot ")[1].split(",", 2)
    assert _ot_blocks(",".join(pattern[:2])) == _OT_BLOCKS


def test_a_two_socket_host_is_modelled_as_one_socket() -> None:
    """2 x Xeon Gold 6138 with 12 channels of DDR4-2666 in all: the profile is one socket's 20
    cores and 6 channels, the threads the posts ran."""
    hw = load_profile("xeon6138x2-rtx4060ti-pcie3")
    assert hw.cpu.cores_used == 20
    assert hw.cpu.dram_gbs == pytest.approx(6 * 2666 * 8 / 1000, rel=1e-3)
    assert hw.gpu.memory_gb == pytest.approx(8 * 2**30 / 1e9, rel=1e-3)  # an 8 GiB card
    epyc = load_profile("epyc7773x-cpu")
    assert epyc.cpu.cores_used == 63 and epyc.cpu.dram_gbs == pytest.approx(8 * 3200 * 8 / 1000)


def _full_gpu_run(hw: str, synth: dict, dtype: str, nonexpert: str) -> dict:
    from daopsim.simulator.runner import simulate
    from daopsim.simulator.trace_cache import synth_trace

    spec = {"sequences": 1, "prompt_tokens": 8, "output_tokens": 8, "seed": 0, **synth}
    result = simulate(
        policy="llama-cpp-layers",
        policy_options={"ngl": 99},
        hw=hw,
        trace=str(synth_trace(spec)),
        dtype=dtype,
        nonexpert_dtype=nonexpert,
        sequences=1,
        record=False,
    )
    return result.metrics


def test_a_whole_gpu_run_does_not_read_the_host(tmp_path, monkeypatch) -> None:
    """The labels of the whole-GPU llama.cpp rows rest on this: with every layer on the GPU the
    host CPU and its memory do not enter the run, and the link enters only through each pass's
    copy of the logits to the host (docs/cost-model.md, "Logits to the host"): one card in
    four hosts, down to a one-lane PCIe 3.0 link and four Cortex-A76 cores, gives the same
    prompt pass and the same decode step once that copy is taken out."""
    from daopsim import cost_model

    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path))
    hosts = (
        "rtx4090-pcie4",
        "rtx4090-265k-pcie4",
        "rtx4090-epyc9654-pcie4",
        "rtx4090-picm5-pcie3x1",
    )
    runs = [_full_gpu_run(h, {"model": "gpt-oss-20b"}, "mxfp4", "q8_0") for h in hosts]
    copies = [cost_model(h, "gpt-oss-20b").logits_copy_s() for h in hosts]
    for metric in ("ttft_s", "tpot_mean_s"):  # each holds one pass's copy
        less = [r[metric] - c for r, c in zip(runs, copies, strict=True)]
        assert less == pytest.approx([less[0]] * len(less), rel=1e-9), metric
    # the Pi CM5's one lane makes the copy a visible part of the step; a x16 link does not
    assert runs[3]["decode_tokens_per_s"] < 0.9 * runs[0]["decode_tokens_per_s"]


def test_a_whole_gpu_decode_does_not_depend_on_the_routing(tmp_path, monkeypatch) -> None:
    """The Qwen3-Coder decode rows of the DGX Spark page are published on this: at one sequence
    with every expert resident, which experts a token routes to does not change the decode rate
    (each token reads its top-k experts' bytes whichever they are)."""
    monkeypatch.setenv("DAOPSIM_CACHE", str(tmp_path))
    routings = (
        {"preset": "qwen3-30b-a3b"},
        {"model": "qwen3-30b-a3b"},
        {"preset": "qwen3-30b-a3b", "seed": 7},
    )
    rates = [
        _full_gpu_run("dgx-spark-gb10", r, "q8_0", "q8_0")["decode_tokens_per_s"] for r in routings
    ]
    assert rates[0] > 0
    assert rates == pytest.approx([rates[0]] * len(rates), rel=1e-12)  # summation order only


def test_prompts_longer_than_the_u_batch_run_in_u_batches() -> None:
    """llama.cpp splits a prompt into u-batches of n_ubatch tokens, each a forward pass that
    attends to the ones before it: a row whose source states a u-batch shorter than its prompt
    runs the prompt in chunks of that size (``prefill_chunk``), never as one pass."""
    seen = 0
    for r in _rows("llama-cpp-benches.toml"):
        m = re.search(r"n_ubatch = (\d+)", r.note)
        if r.metric != "ttft_s" or m is None:
            continue
        ubatch, prompt = int(m.group(1)), r.sim["synth"]["prompt_tokens"]
        if prompt > ubatch:
            assert r.sim.get("prefill_chunk") == ubatch, r.id
            seen += 1
        else:
            assert "prefill_chunk" not in r.sim, r.id
    assert seen == 6


def test_whole_gpu_llama_bench_rows_map_onto_their_tests() -> None:
    """published-2026b.toml: llama-bench ppN is an N-token prompt pass (in u-batches of the
    printed 2048 when longer), tgN one prompt token and N generated; every row runs every layer
    on the GPU of a profile whose host is a stand-in, so the host CPU must be the stand-in the
    file says (rtx4090-pcie4's) and the card its own."""
    rows = [r for r in _rows("published-2026b.toml") if not r.is_ranking]
    assert len(rows) == 11
    base = load_profile("rtx4090-pcie4")
    for r in rows:
        synth, sim = r.sim["synth"], r.sim
        assert sim["policy"] == "llama-cpp-layers" and sim["policy_options"] == {"ngl": 99}, r.id
        test = re.search(r"(pp|tg)(\d+) [0-9.]+ t/s$", r.source)
        assert test, r.id
        n = int(test.group(2))
        if test.group(1) == "pp":
            assert r.id.endswith(f"-prefill-{n}") and r.metric == "ttft_s", r.id
            assert (synth["prompt_tokens"], synth["output_tokens"]) == (n, 2), r.id
            assert sim.get("prefill_chunk") == (2048 if n > 2048 else None), r.id
        else:
            assert r.id.endswith(f"-tg{n}") and r.metric == "decode_tokens_per_s", r.id
            assert (synth["prompt_tokens"], synth["output_tokens"]) == (1, n), r.id
        hw = load_profile(sim["hw"])
        assert hw.cpu == base.cpu, r.id  # the stand-in host the file names
        assert hw.gpu.name != base.gpu.name, r.id
        # the file size says what the non-expert weights are: 11.27 GiB Q8_0, 12.83 GiB 16-bit
        expect = "q8_0" if "11.27 GiB" in r.precision else ("fp16", "bf16")
        assert sim["nonexpert_dtype"] in expect, r.id
        assert (r.setting == "published") == ("CUDA" in r.system), r.id
