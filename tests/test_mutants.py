"""Mutation checks: the golden store and the reference engine must each catch known mutants.

Each mutant is one exact edit of the source (old snippet, new snippet) that a plausible bug
would make. Two kinds:

* ``MUTANTS`` (the golden store): the test copies the package to a temporary folder (laid
  out as installed), applies one mutant, and runs ``daopsim regress`` from the copy
  (``PYTHONPATH`` pointing at it) against the real golden store, on the configurations that
  concern the mutant. Regress must exit 1 and report moved values; the unmutated copy must
  pass on the same configurations, so the check can fail.
* ``ENGINE_MUTANTS`` (the reference engine): one edit of one function of the engine core,
  compiled and monkeypatched in-process (on the interpreted core); the reference-equivalence
  check it names (``CHECKS``, built on tests/equivalence.py) must then fail, and pass
  unmutated.

A mutant whose old snippet is no longer in its source fails loudly: after a refactor, retarget
the snippet at the code that now holds the rule rather than letting the mutant pass silently.
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daopsim.simulator.regress import default_store

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    """One edit of the source and the store configurations that must catch it."""

    name: str
    file: str  #: relative to the repository root
    old: str
    new: str
    only: tuple[str, ...]  #: ``regress --only`` globs


MUTANTS = (
    Mutant(
        "lru-evicts-most-recent",
        "policies/lru.py",
        "        for e in self.order[layer]:\n            if e not in protected:",
        "        for e in reversed(self.order[layer]):\n            if e not in protected:",
        ("* | lru | *",),
    ),
    # the copy lanes are built by the Machine (one lane for both directions with one engine)
    Mutant(
        "copy-engines-ignored",
        "simulator/core/machine.py",
        "        if costs.hw.link.copy_engines >= 2:",
        "        if True:  # mutant: always two copy lanes",
        ("* | * | a6000-1ce-pcie4 | *",),
    ),
    Mutant(
        "daop-exact-fallback-ignored",
        "policies/daop.py",
        'self.exact_fallback = bool(o["exact_fallback"])',
        "self.exact_fallback = False",
        ("* | daop(exact_fallback=true) | *",),
    ),
    Mutant(
        "mixtral-offloading-prefetch-ignored",
        "policies/mixtral_offloading.py",
        'self.do_prefetch = bool(self.options["prefetch"])',
        "self.do_prefetch = False",
        ("* | mixtral-offloading(prefetch=true) | *",),
    ),
)


def _copy_file(src: str, dst: str) -> None:
    # traces are large read-only data: link them instead of copying megabytes per mutant
    if src.endswith(".parquet"):
        os.symlink(src, dst)
    else:
        shutil.copy2(src, dst)


#: the repository's folders that are subpackages of daopsim (pyproject.toml's package-dir)
SUBPACKAGES = ("simulator", "policies", "hardware_profiles", "traces")


def source_copy(dest: Path) -> Path:
    """The package copied to ``dest`` laid out as installed (``daopsim/``'s modules, and the
    folders simulator/, policies/, hardware_profiles/ and traces/ as ``daopsim/simulator`` ...),
    so that with ``PYTHONPATH=dest`` the copy's daopsim.simulator is imported: the copy the
    mutant is applied to. No compiled extension is copied: the copy runs its sources."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "native-build.json")
    shutil.copytree(REPO / "daopsim", dest / "daopsim", ignore=ignore)
    for folder in SUBPACKAGES:
        shutil.copytree(REPO / folder, dest / "daopsim" / folder, ignore=ignore,
                        copy_function=_copy_file)  # fmt: skip
    return dest


def _in_copy(root: Path, file: str) -> Path:
    """Where a repository file (``policies/lru.py``) lies in the copy."""
    return root / "daopsim" / file if file.split("/")[0] in SUBPACKAGES else root / file


def apply(root: Path, mutant: Mutant) -> None:
    """Edit the copy; fail loudly when the snippet is missing or ambiguous."""
    path = _in_copy(root, mutant.file)
    if not path.is_file():
        pytest.fail(f"mutant {mutant.name}: {mutant.file} does not exist; retarget the mutant")
    text = path.read_text(encoding="utf-8")
    n = text.count(mutant.old)
    if n != 1:
        pytest.fail(
            f"mutant {mutant.name}: the old snippet occurs {n} times in {mutant.file} (must be "
            f"exactly once); retarget it at the code that now holds the rule:\n{mutant.old}"
        )
    path.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")


def regress(root: Path, only: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """``daopsim regress`` run from the copy against the real golden store."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    args = [sys.executable, "-m", "daopsim", "regress", "--no-progress"]
    args += ["--baseline", str(default_store()), *(f"--only={g}" for g in only)]
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_snippet_is_in_the_source(mutant: Mutant) -> None:
    """Fast and loud: a refactor that moves a rule must retarget its mutant."""
    text = (REPO / mutant.file).read_text(encoding="utf-8")
    assert text.count(mutant.old) == 1, f"mutant {mutant.name}: retarget {mutant.file}"


@pytest.mark.slow
def test_unmutated_copy_passes(tmp_path: Path) -> None:
    """The copy is what runs, and without a mutant regress passes on every mutant's cells."""
    root = source_copy(tmp_path / "src")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import daopsim.simulator, daopsim.policies; print(daopsim.simulator.__file__)",
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(probe.stdout.strip()).is_relative_to(root)
    res = regress(root, tuple(g for m in MUTANTS for g in m.only))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "nothing moved" in res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_regress_kills_the_mutant(mutant: Mutant, tmp_path: Path) -> None:
    root = source_copy(tmp_path / "src")
    apply(root, mutant)
    res = regress(root, mutant.only)
    assert res.returncode == 1, f"mutant {mutant.name} survived:\n{res.stdout}{res.stderr}"
    assert "regress FAILED" in res.stdout and "metrics." in res.stdout, res.stdout


# -- mutants of the engine core's rules, caught by the reference-equivalence check ----------
# The reference engine (simulator/reference/) re-implements the timing rules, so a bug in one
# of the core's rules must make the equivalence check (tests/equivalence.py) fail. Each mutant
# below is one exact edit of one function of the core, compiled and monkeypatched in-process
# (fast: no copy of the tree, no subprocess) on the interpreted core (marker ``pure``); the
# check it names must then fail with an AssertionError, and pass unmutated
# (test_equivalence_checks_pass).


@dataclass(frozen=True)
class EngineMutant:
    """One edit of a fast-engine function (``module:Qualified.name``) and its check."""

    name: str
    target: str
    old: str
    new: str
    check: str  #: a key of CHECKS


def _a6000() -> Any:
    from daopsim.simulator.hardware import load_profile

    return load_profile("a6000-pcie4")


def _check_chaos(**spec: Any) -> None:
    from equivalence import SLOW_HOST, chaos_both, slow_cpu

    for seed in range(4):
        chaos_both(seed, slow_cpu(_a6000()), 6 + seed, runtime=SLOW_HOST, **spec)


def _check_policy(policy: str, hw: str = "a6000-pcie4", **opts: Any) -> None:
    from equivalence import both

    from daopsim.simulator.hardware import load_profile

    both(policy, "ci-small", 0.25, load_profile(hw), **opts)


def _check_fast_cpu_jetson() -> None:
    """DAOP on the Jetson with a CPU streaming 80 GB/s of its 204.8: CPU experts and copies then
    oversubscribe the shared DRAM, so the DRAM share of copies matters."""
    import dataclasses

    from equivalence import both

    from daopsim.simulator.hardware import load_profile

    hw = load_profile("jetson-orin-64g")
    hw = dataclasses.replace(
        hw, cpu=dataclasses.replace(hw.cpu, stream_gbs=(("torch_bf16", 80.0),))
    )
    both("daop", "ci-small", 0.25, hw)


def _check_two_engines() -> None:
    from equivalence import chaos_both, engines_per_direction, slow_cpu, slow_link

    for seed in range(3):
        hw = engines_per_direction(slow_cpu(slow_link(_a6000(), 8.0)))
        chaos_both(seed, hw, 4 + seed, writeback=True, staging_buffers=1)


def _check_ssd() -> None:
    from equivalence import chaos_both, host_tier, slow_cpu

    from daopsim.simulator.hardware import load_profile
    from daopsim.simulator.testing import tiny_model

    hw = slow_cpu(load_profile("rtx4090-990pro-pcie4"))
    for seed in range(3):
        tier = host_tier(tiny_model(experts=6, top_k=2, moe_layers=3), hw, 2, "page-cache")
        chaos_both(seed, hw, 6, host_tier=tier, writeback=True)


def _check_in_flight() -> None:
    from equivalence import in_flight_both

    for seed in (0, 2, 7):
        in_flight_both(seed)


def _check_two_gpus() -> None:
    from daopsim.simulator.runner import simulate

    for mode in ("expert", "pipeline"):
        kw = {"policy": "lru", "hw": "2x-rtx3090-nvlink", "trace": "ci-small", "sequences": 1,
              "gpu_experts": 40, "gpus": 2, "multi_gpu": mode, "record": False}  # fmt: skip
        fast, ref = simulate(**kw), simulate(engine="reference", **kw)  # type: ignore[arg-type]
        assert fast.metrics["e2e_s"] == pytest.approx(ref.metrics["e2e_s"], abs=1e-9, rel=0)


#: the equivalence checks the mutants use (each must pass on the unmutated engine)
CHECKS: dict[str, Callable[[], None]] = {
    "chaos": lambda: _check_chaos(writeback=True, staging_buffers=1),
    "chaos-one-stream": lambda: _check_chaos(writeback=True, one_stream=True),
    "daop-unified": lambda: _check_fast_cpu_jetson(),
    "fiddler": lambda: _check_policy("fiddler"),
    "fused-runtime": lambda: _check_policy("llama-cpp-cpu-moe"),
    "gather": lambda: _check_policy("stream-all", "rtx6000ada-pcie4", gather="leaf"),
    "in-flight-victims": _check_in_flight,
    "in-use-victims": lambda: _check_policy("mixtral-offloading", experts_per_layer=1),
    "ssd": _check_ssd,
    "two-gpus": _check_two_gpus,
    "two-engines": _check_two_engines,
}

ENGINE_MUTANTS = (
    EngineMutant(
        "transfer-stall-halved",
        "daopsim.simulator.core.executor:Executor.copy_wait",
        "            self.c.transfer_stall += landed - free",
        "            self.c.transfer_stall += 0.5 * (landed - free)",
        "chaos",
    ),
    EngineMutant(
        "gpu-stream-by-expert-only",
        "daopsim.simulator.core.executor:Executor.add_job",
        "        job.time = job.ready if job.ready > base else base\n"
        "        job.time2, job.rank = job.ready, job.expert",
        "        job.time = job.time2 = 0.0\n        job.rank = job.expert",
        "chaos",
    ),
    EngineMutant(
        "slot-released-when-write-back-starts",
        "daopsim.simulator.core.executor:Executor._write_back",
        "        op.end, op.stage = e, 1\n        self.push(e, op)",
        "        op.end, op.stage = e, 1\n        self.push(e - dur, op)",
        "chaos",
    ),
    EngineMutant(
        "one-slot-too-many",
        "daopsim.simulator.core.resources:Residency.take",
        "        if self.held[k] >= self.cap[k]:",
        "        if self.held[k] > self.cap[k]:",
        "chaos",
    ),
    EngineMutant(
        "cpu-calls-do-not-share-the-socket",
        "daopsim.simulator.core.resources:SharedCpu._rerate",
        "        rate = 1.0 / share if share > 1.0 else 1.0",
        "        rate = 2.0 / share if share > 2.0 else 1.0",
        "chaos",
    ),
    EngineMutant(
        "cpu-worker-lowest-index",
        "daopsim.simulator.core.resources:SharedCpu._idle_worker",
        "            if free and (i < 0 or self.lanes[k].free_at < best):",
        "            if free and i < 0:",
        "chaos",
    ),
    EngineMutant(
        "expert-sync-does-not-wait-for-the-stream",
        "daopsim.simulator.core.resources:HostThread.expert",
        "            h = drained if drained > self.t else self.t",
        "            h = self.t",
        "fiddler",
    ),
    EngineMutant(
        "fused-call-charged-per-expert",
        "daopsim.simulator.core.executor:Executor._run_gpu",
        "            if st.fused:  # the layer's fused call, charged with the GPU's first expert\n"
        "                st.fused = False",
        "            if True:\n                st.fused = False",
        "fused-runtime",
    ),
    EngineMutant(
        "cpu-first-ignored",
        "daopsim.simulator.core.executor:Executor._wait_cpu_first",
        "        if not (w.cpu_first and w.sync):",
        "        if True:",
        "fiddler",
    ),
    EngineMutant(
        "gather-barrier-ignored",
        "daopsim.simulator.core.executor:Executor._barrier",
        "        return self.last_end([op for op in w.ops if op.kind == FETCH and op.layer"
        " == w.layer], -1.0)",
        "        return -1.0",
        "gather",
    ),
    EngineMutant(
        "in-use-victim-written-back-at-once",
        "daopsim.simulator.core.apply:Applier._evict",
        "        if layer == w.layer and expert in needed:",
        "        if False:",
        "in-use-victims",
    ),
    EngineMutant(
        "unified-copies-take-no-dram",
        "daopsim.simulator.core.resources:Lanes._traffic",
        "            share = self.copy_share(nbytes, end - start)",
        "            share = 0.0",
        "daop-unified",
    ),
    EngineMutant(
        "one-stream-kernel-beside-copies",
        "daopsim.simulator.core.executor:Executor._one_stream_ready",
        "        return max(at, up_h.engines.all_free_at(), up_d.engines.all_free_at())",
        "        return max(at, up_d.engines.all_free_at())",
        "chaos-one-stream",
    ),
    EngineMutant(
        "ssd-stall-not-counted",
        "daopsim.simulator.core.apply:Applier._ssd_stage",
        "        tier.ssd_stall += wait - now",
        "        tier.ssd_stall += 0.0",
        "ssd",
    ),
    EngineMutant(
        "in-flight-victim-frees-its-slot-at-once",
        "daopsim.simulator.core.apply:Applier._evict",
        "        elif landing == 0.0:  # the slot is free at once",
        "        elif True:",
        "in-flight-victims",
    ),
    EngineMutant(
        "in-flight-victim-freed-when-its-copy-starts",
        "daopsim.simulator.core.executor:Executor._copy_in",
        "            self.push(e, op.after)",
        "            self.push(t, op.after)",
        "in-flight-victims",
    ),
    EngineMutant(
        "barrier-ignored-by-late-copies",
        "daopsim.simulator.core.executor:Executor._landed",
        "            job.ready = end if end > self.bar else self.bar",
        "            job.ready = end",
        "in-flight-victims",
    ),
    EngineMutant(
        "pipeline-hand-over-of-every-selection",
        "daopsim.simulator.core.executor:Executor._cross",
        "int(counts.sum()) // self.m.costs.model.top_k)",
        "int(counts.sum()))",
        "two-gpus",
    ),
    EngineMutant(
        "copies-of-a-direction-on-its-first-engine-only",
        "daopsim.simulator.core.resources:Engines.pick",
        "            if lanes[i].free_at < best.free_at:",
        "            if False:",
        "two-engines",
    ),
    EngineMutant(
        "write-back-holds-only-its-own-direction",
        "daopsim.simulator.core.executor:Executor._write_back",
        "[up_d.engines, up_h.engines]",
        "[up_d.engines]",
        "chaos",
    ),
    EngineMutant(
        "unified-kernels-take-no-dram",
        "daopsim.simulator.core.resources:Lanes._traffic",
        "            share = self.kernel_share(tokens, context if context >= 0 else None)",
        "            share = 0.0",
        "daop-unified",
    ),
)


def _owner_and_source(target: str) -> tuple[Any, str, Any, str]:
    """(the module, the attribute name, the object holding it, the function's source as it
    stands in the file, indentation included)."""
    mod_name, qual = target.split(":")
    mod = importlib.import_module(mod_name)
    *path, attr = qual.split(".")
    owner: Any = mod
    for part in path:
        owner = getattr(owner, part)
    return mod, attr, owner, inspect.getsource(owner.__dict__[attr])


def apply_engine_mutant(mutant: EngineMutant, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compile the edited function in its module's namespace and patch it in."""
    mod, attr, owner, src = _owner_and_source(mutant.target)
    n = src.count(mutant.old)
    if n != 1:
        pytest.fail(
            f"mutant {mutant.name}: the old snippet occurs {n} times in {mutant.target}; "
            "retarget it at the code that now holds the rule"
        )
    edited = textwrap.dedent(src.replace(mutant.old, mutant.new))
    ns: dict[str, Any] = {}
    flags = __future__.annotations.compiler_flag
    exec(compile(edited, f"<mutant {mutant.name}>", "exec", flags=flags), mod.__dict__, ns)
    monkeypatch.setattr(owner, attr, ns[attr])


@pytest.mark.pure  # reads the interpreted core's functions
@pytest.mark.parametrize("mutant", ENGINE_MUTANTS, ids=lambda m: m.name)
def test_every_engine_mutant_snippet_is_in_the_source(mutant: EngineMutant) -> None:
    """Fast and loud: a refactor that moves a rule must retarget its mutant."""
    _, _, _, src = _owner_and_source(mutant.target)
    assert src.count(mutant.old) == 1, f"retarget {mutant.name}"
    assert mutant.check in CHECKS


@pytest.mark.reference
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_equivalence_checks_pass(check: str) -> None:
    """Unmutated, every check passes: a failure under a mutant is the mutant's doing."""
    CHECKS[check]()


@pytest.mark.pure  # patches the engine core's functions: needs the interpreted core
@pytest.mark.parametrize("mutant", ENGINE_MUTANTS, ids=lambda m: m.name)
def test_the_equivalence_check_kills_the_mutant(
    mutant: EngineMutant, monkeypatch: pytest.MonkeyPatch
) -> None:
    apply_engine_mutant(mutant, monkeypatch)
    with pytest.raises(AssertionError):
        CHECKS[mutant.check]()
