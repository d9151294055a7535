"""Synthetic traces generated on demand and cached outside the repository (the validation
table's ``synth`` settings, ``--model M`` without ``--trace``, ``advise``).

A cached trace is keyed on everything that shapes it (the preset's parameters, the sizes and
seed, the generator's version and source, numpy's version), so an edit regenerates it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from daopsim.simulator.errors import UserError


def cache_dir() -> Path:
    """Where generated synthetic traces are cached (outside the repository)."""
    env = os.environ.get("DAOPSIM_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "daopsim"
    return base.expanduser() / "validation"


def cache_summary() -> str:
    """One line on the cache folder: where it is, what it holds and how big it is."""
    folder = cache_dir()
    files = [p for p in folder.glob("*") if p.is_file()] if folder.is_dir() else []
    size = sum(p.stat().st_size for p in files)
    return (
        f"synthetic traces are cached in {folder} ({len(files)} files, {size / 1e9:.2f} GB; "
        "reused by later runs, safe to delete; $DAOPSIM_CACHE moves it)"
    )


# --- running --------------------------------------------------------------------------------------
def _generator_digest() -> str:
    """SHA-256 of the generator's and the presets' sources, simulator/synth.py and
    simulator/synth_params.py (part of the synthetic-trace cache key)."""
    from daopsim.simulator import synth, synth_params

    digest = hashlib.sha256()
    for module in (synth, synth_params):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:16]


def synth_trace(spec: dict[str, Any]) -> Path:
    """A cached synthetic trace for ``{preset, sequences, prompt_tokens, output_tokens, seed}``.

    Instead of ``preset``, ``model`` names a catalogue model: its own preset if it has one, else
    the generator's default parameters (for a row whose result does not depend on which experts
    are routed, e.g. every routed expert on the CPU).
    """
    from daopsim.simulator import synth
    from daopsim.simulator.models import get_model
    from daopsim.simulator.synth_params import SynthParams, SynthPreset, default_preset, get_preset

    if "preset" in spec or "model" not in spec:
        preset = str(spec.get("preset", ""))
        p = get_preset(preset)
        label: str | None = preset
    else:
        model = get_model(str(spec["model"])).name
        p = default_preset(model) or SynthPreset(
            name="", model=model, params=SynthParams(), matches="", assumes=""
        )
        preset = p.name or f"{model}-defaults"
        label = p.name or None
    n = int(spec.get("sequences", 8))
    prompt = int(spec.get("prompt_tokens", 256))
    out = int(spec.get("output_tokens", 512))
    seed = int(spec.get("seed", 0))
    # The key covers everything that shapes the trace: the preset's parameters, the generator
    # version and the generator's own source (so an edit that forgets to bump SYNTH_VERSION
    # still regenerates), and the numpy that draws the random numbers.
    key = json.dumps(
        [
            preset,
            p.model,
            p.params.to_dict(),
            n,
            prompt,
            out,
            seed,
            synth.GENERATOR,
            _generator_digest(),
            synth.np.__version__,
        ],
        sort_keys=True,
    ).encode()
    path = cache_dir() / f"{preset}-{hashlib.sha256(key).hexdigest()[:16]}.parquet"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        synth.write_synthetic(path, p.model, p.params, n, prompt, out, seed, preset=label)
    return path


#: the synthetic trace ``--model M`` generates when no ``--trace`` is given (small and fast;
#: the same size ``daopsim advise`` generates)
MODEL_TRACE = {"sequences": 3, "prompt_tokens": 32, "output_tokens": 48, "seed": 1}


def model_trace(model: str, trace: str | Any | None) -> str:
    """``--model M`` without ``--trace``: the path of M's synthetic trace (its synth preset,
    or the generator's defaults), generated on first use into the user cache folder
    (``$DAOPSIM_CACHE``, never the repository) and reused."""
    from daopsim.simulator.models import get_model

    if trace is not None:
        raise UserError("give --model or --trace, not both (a trace records its model)")
    name = get_model(model).name
    return str(synth_trace({"model": name, **MODEL_TRACE}))
