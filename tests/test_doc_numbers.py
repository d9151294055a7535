"""Numbers the docs state are the numbers the code gives: each claim below is a phrase of a page
(whitespace folded, so it may wrap) and the check that makes it true. A page that changes its
claim, or code that changes the number, fails here until both agree again."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from daopsim.simulator.cli import main

REPO = Path(__file__).resolve().parents[1]


def _page(name: str) -> str:
    return " ".join((REPO / name).read_text(encoding="utf-8").split())


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def _header(*args: str) -> str:
    """The GPU-experts line of a run's header."""
    res = _cli("run", "--trace", "ci-small", "--sequences", "1", "--no-bounds", "--no-progress",
               *args)  # fmt: skip
    assert res.exit_code == 0, res.output
    return res.stdout.splitlines()[1]


def _does_not_fit(policy: str, hw: str, budget: int, trace: str = "ci-small") -> int:
    import daopsim
    from daopsim.simulator.errors import DoesNotFit

    with pytest.raises(DoesNotFit) as info:
        daopsim.simulate(policy=policy, hw=hw, trace=trace, sequences=1, gpu_experts=budget,
                         record=False)  # fmt: skip
    return info.value.max_experts


def _runtime_list() -> None:
    res = _cli("run", "--policy", "lru", "--trace", "ci-small", "--runtime", "no-such-runtime")
    got = re.search(r"\(known: ([^)]*)\)", res.stderr)
    assert got is not None, res.stderr
    page = _page("docs/cli.md")
    shown = re.search(r"unknown runtime 'no-such-runtime' \(known: ([^)]*)\)", page)
    assert shown is not None and shown.group(1) == got.group(1)


def _readme_ratio() -> None:
    import daopsim
    from daopsim.simulator.errors import DoesNotFit

    with pytest.raises(DoesNotFit, match=r"--cache-ratio <= 0\.212"):
        daopsim.simulate(policy="lru", hw="rtx4090-pcie4", cache_ratio=0.5, sequences=1,
                         record=False)  # fmt: skip


def _advise_constants() -> None:
    from daopsim.simulator import advise
    from daopsim.simulator.trace_cache import MODEL_TRACE

    assert (advise.COARSE_POINTS, advise.REFINE_ALL, advise.REFINE_PASSES) == (9, 12, 3)
    assert advise.SMALL_RATIOS == (0.25,) and advise.SEQUENCES == 2
    assert advise.DEFAULT_TOP == 10 and advise.DEFAULT_DTYPES == ("q4_k_m",)
    assert MODEL_TRACE == {"sequences": 3, "prompt_tokens": 32, "output_tokens": 48, "seed": 1}


def _fixed_header() -> None:
    line = _header("--policy", "llama-cpp-cpu-moe")
    assert line == (
        "GPU experts: 0 resident at most, budget 123 of 256 (cache ratio 0.480; 123 fit in "
        "memory); the policy's options fix 0 resident experts, so 123 of the budget go unused"
    )


def _multi_gpu_header() -> None:
    line = _header("--policy", "lru", "--gpus", "2", "--hw", "2x-rtx3090-nvlink")
    assert "budget 110 of 256 over 2 GPUs" in line and "55 fit in each GPU" in line


def _compare_from() -> None:
    doc = json.loads(
        _cli(
            "run",
            "--policy",
            "lru",
            "--trace",
            "ci-small",
            "--sequences",
            "1",
            "--gpu-experts",
            "64",
            "--no-bounds",
            "--json",
        ).stdout
    )
    assert any("compare them from 96 experts (3 per layer)" in n for n in doc["notes"])


def _advise_json_fields() -> None:
    """docs/advise.md's JSON paragraph names every field of the Advice and AdviceRow objects."""
    from daopsim.simulator.advise_answer import Advice, AdviceRow, MachineAnswer

    page = _page("docs/advise.md")
    para = page[page.index("## JSON and CSV") :]
    for cls in (Advice, AdviceRow, MachineAnswer):
        for name in cls.__dataclass_fields__:
            if name in ("hw",) and cls is MachineAnswer:
                continue
            assert f"`{name}`" in para, (cls.__name__, name)


#: (page, phrase, check)
CLAIMS: list[tuple[str, str, Callable[[], None]]] = [
    (
        "docs/cli.md",
        "hf-eager-attn, hf-eager, ideal, ik_llama.cpp-rtr, ik_llama.cpp, ktransformers, "
        "llama.cpp-eager, llama.cpp, moe-infinity-2024, moe-infinity)",
        _runtime_list,
    ),
    (
        "docs/sweeps.md",
        "asks the 24 GB RTX 4090 for 96 and 120 of Mixtral's 256 experts; at most 55 fit)",
        lambda: [
            _does_not_fit(p, "rtx4090-pcie4", n) == 55 or pytest.fail(p)
            for p in ("lru", "fiddler", "daop")
            for n in (round(0.375 * 256), round(0.46875 * 256))
        ],
    ),
    ("README.md", "--cache-ratio 0.2 --json # 24 GB: at most 0.212", _readme_ratio),
    (
        "docs/metrics.md",
        "`GPU experts: 96 resident at most, budget 96 of 256 (cache ratio 0.375; 123 fit in "
        "memory)`",
        lambda: (
            _header("--policy", "lru", "--cache-ratio", "0.375").startswith(
                "GPU experts: 96 resident at most, budget 96 of 256 (cache ratio 0.375; 123 fit in "
                "memory)"
            )
            or pytest.fail("header")
        ),
    ),
    (
        "docs/metrics.md",
        "`0 resident at most, budget 123 of 256 ...; the policy's options fix 0 resident "
        "experts, so 123 of the budget go unused`",
        _fixed_header,
    ),
    (
        "docs/metrics.md",
        "(`budget 110 of 256 over 2 GPUs ...; 55 fit in each GPU`)",
        _multi_gpu_header,
    ),
    (
        "docs/metrics.md",
        "compare caching policies from `(k + 1) x layers` experts (96 for Mixtral)",
        _compare_from,
    ),
    (
        "docs/advise.md",
        "runs on a coarse grid of at most 9 values over its whole range, then every value "
        "between the best one's tried neighbours (when more than 12 lie between, 12 evenly "
        "spaced, and again, up to 3 rounds)",
        _advise_constants,
    ),
    ("docs/advise.md", "3 sequences of 32 prompt + 48 generated tokens, seed 1", _advise_constants),
    ("docs/advise.md", "evaluation sequences per run (default 2)", _advise_constants),
    ("docs/advise.md", "`--json` prints the `Advice` object", _advise_json_fields),
]


@pytest.mark.parametrize(("page", "phrase", "check"), CLAIMS, ids=[c[0] for c in CLAIMS])
def test_a_stated_number_is_the_code_s(page: str, phrase: str, check: Callable[[], None]) -> None:
    assert " ".join(phrase.split()) in _page(page), f"{page} no longer says: {phrase!r}"
    check()
