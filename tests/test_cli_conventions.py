"""CLI conventions (issue 29): ``python -m daopsim``, ``-o`` for outputs, one ``trace`` group,
a quiet exit on a closed pipe, GiB where binary units are meant, simulated time named as such,
per-GPU sums labelled, plurals, "did you mean", ``run --config`` and one-file policies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: the arguments of a quick run
QUICK = ("--policy", "lru", "--trace", "ci-small", "--sequences", "1", "--no-progress")

#: a complete one-file policy (no package, no registration line)
MY_POLICY = '''
from daopsim import CachingPolicy, Param


class MyPolicy(CachingPolicy):
    """Evict the most recently used expert of the layer (a one-file policy)."""

    name = "my-mru"
    summary = "per-layer MRU cache"
    params = {"spare": Param(int, 0, "slots kept free (unused here)", minimum=0)}

    def init_state(self, ctx):
        self.last = {}

    def touch(self, layer, expert, step, weight):
        self.last[layer, expert] = step

    def choose_victim(self, layer, protected, step):
        cands = [e for e in self.cache[layer] if e not in protected]
        return max(cands, key=lambda e: self.last.get((layer, e), -1))
'''


def _commands(help_text: str) -> set[str]:
    """The command names ``daopsim --help`` lists."""
    body = help_text.split("Commands:")[1]
    return {ln.split()[0] for ln in body.splitlines() if ln.startswith("  ") and ln.split()}


def _daopsim(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daopsim", *args], capture_output=True, text=True, timeout=300, **kw
    )


def test_python_dash_m_daopsim() -> None:
    proc = _daopsim("--help")
    assert proc.returncode == 0 and "Usage: daopsim" in proc.stdout
    assert _commands(proc.stdout) >= {"run", "trace"} and "traces" not in _commands(proc.stdout)


def test_closed_pipe_is_a_quiet_exit_0(tmp_path: Path) -> None:
    """``daopsim trace stats ci-small | head -1``: exit 0, nothing on stderr."""
    read, write = os.pipe()
    os.close(read)  # nobody will read: the first write fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "daopsim", "trace", "stats", "ci-small"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)
    assert proc.returncode == 0 and proc.stderr == ""
    # (the shell form, `| head -1`, runs from the installed wheel in tests/test_packaging.py)


def test_run_dash_o_and_the_table_words(cli: Callable[..., Any], tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = cli("run", *QUICK, "--no-bounds", "-o", out)
    assert res.exit_code == 0, res.output
    assert json.loads((out / "metrics.json").read_text())["policy"] == "lru"
    text = res.stdout
    assert "(1 sequence)" in text and "1 sequences" not in text
    assert "simulated" in text and "end-to-end time (simulated)" in text


def test_per_gpu_stall_sums_say_so() -> None:
    """With several GPUs the stall rows add up each GPU's stream, so they can exceed the run's
    time: the table says so beside them (one GPU: no note)."""
    from daopsim.simulator.commands.run_cmd import render_table

    doc = {
        "policy": "lru",
        "hw": "2x-rtx3090-nvlink",
        "model": "mixtral-8x7b",
        "dtype": "bf16",
        "trace": "ci-small",
        "sequences": 1,
        "gpu_experts": 110,
        "total_experts": 256,
        "cache_ratio": 0.43,
        "max_gpu_experts": 55,
        "metrics": {"e2e_s": 28.78, "stall_s": 32.04, "dispatch_stall_s": 0.0},
        "multi_gpu": {
            "gpus": 2,
            "mode": "expert",
            "peer_kind": "nvlink",
            "peer_bytes_total": 4e7,
            "per_gpu": [{"gpu": 0, "slots": 55, "busy_s": 1.4}],
        },
    }
    text = render_table(doc)
    stall = next(ln for ln in text.splitlines() if "GPU stall" in ln)
    assert "32.04 s" in stall and "summed over the 2 GPUs' streams" in stall
    one = render_table({**doc, "multi_gpu": None})
    assert "summed" not in one and "(1 sequence)" in one


def test_one_trace_group_and_its_old_spelling(cli: Callable[..., Any]) -> None:
    new, old = cli("trace", "list", "--json"), cli("traces", "list", "--json")
    assert new.exit_code == old.exit_code == 0
    assert json.loads(new.stdout) == json.loads(old.stdout)
    assert cli("traces", "stats", "ci-small", "--json").exit_code == 0
    assert "traces" not in _commands(cli("--help").stdout)


def test_profiles_list_in_gib(cli: Callable[..., Any]) -> None:
    res = cli("profiles", "list")
    head, *rows = res.stdout.splitlines()
    assert "MEM GiB" in head and "MEM GB " not in head
    row = next(r for r in rows if r.startswith("rtx4090-pcie4 "))
    assert " 24.0 " in row  # a "24 GB" card has 24 GiB (25.8 decimal GB)


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (("run", "--policy", "lur"), "did you mean 'lru'"),
        (("run", "--hw", "rtx4090"), "did you mean 'rtx4090-pcie4'"),
        (("run", "--runtime", "cuda_graph"), "did you mean 'cuda-graph'"),
        (("run", "--trace", "ci_small"), "did you mean 'ci-small'"),
        (("run", "--model", "mixtral"), "did you mean 'mixtral-8x7b'"),
        (("advise", "--model", "qwen3", "--hw", "a6000-pcie4"), "did you mean"),
    ],
)
def test_unknown_names_suggest_the_closest(
    cli: Callable[..., Any], args: tuple[str, ...], hint: str
) -> None:
    res = cli(*args, "--no-progress") if args[0] == "run" else cli(*args)
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and hint in lines[0], res.stderr


def test_run_config_is_a_one_point_grid(cli: Callable[..., Any], tmp_path: Path) -> None:
    cfg = tmp_path / "point.toml"
    cfg.write_text(
        'policies = ["daop"]\nhw = ["a6000-pcie4"]\ntraces = ["ci-small"]\n'
        "cache_ratios = [0.25]\nsequences = 1\n[options.daop]\nswap_num = 2\n"
    )
    by_file = cli("run", "--config", cfg, "--no-bounds", "--json")
    by_flags = cli(
        "run",
        "--policy",
        "daop",
        "--hw",
        "a6000-pcie4",
        "--trace",
        "ci-small",
        "--cache-ratio",
        "0.25",
        "--sequences",
        "1",
        "--policy-opt",
        "swap_num=2",
        "--no-bounds",
        "--json",
    )
    assert by_file.exit_code == by_flags.exit_code == 0, by_file.output
    a, b = json.loads(by_file.stdout), json.loads(by_flags.stdout)
    assert a["metrics"] == b["metrics"] and a["policy_options"]["swap_num"] == 2
    # the command line wins over the file
    over = cli("run", "--config", cfg, "--no-bounds", "--json", "--policy-opt", "swap_num=1")
    assert json.loads(over.stdout)["policy_options"]["swap_num"] == 1
    cfg.write_text('policies = ["lru", "daop"]\ntraces = ["ci-small"]\n')
    bad = cli("run", "--config", cfg)
    assert bad.exit_code == 2 and "key 'policies' has 2 values" in bad.stderr


def test_policy_from_one_file(cli: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "my_policy.py"
    path.write_text(MY_POLICY)
    res = cli("run", *QUICK[2:], "--policy", f"{path}:MyPolicy", "--cache-ratio", "0.25", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["policy"] == "my-mru" and doc["metrics"]["tokens_per_s"] > 0
    assert doc["metrics"]["tokens_per_s"] <= doc["bounds"]["all-gpu"]["tokens_per_s"]
    bad = cli("run", *QUICK[2:], "--policy", f"{path}:MyPolicie")
    assert bad.exit_code == 2 and "did you mean 'MyPolicy'" in bad.stderr
    missing = cli("run", *QUICK[2:], "--policy", f"{tmp_path / 'nope.py'}:X")
    assert missing.exit_code == 2 and "no such file" in missing.stderr
