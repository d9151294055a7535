"""``daopsim doctor``: what this installation is: version, build, caches, extras, machine."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

import click

from daopsim.simulator.commands.common import echo_json, json_option

#: the optional extras (pyproject.toml) and the modules each brings, and what it enables
EXTRAS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("capture", ("torch", "transformers"), "daopsim capture (record routing from a model)"),
    ("dask", ("distributed",), "--executor dask (sweeps, advise)"),
    ("gym", ("gymnasium", "greenlet"), "daopsim.gym and daopsim learn"),
    ("notebook", ("jupyterlab", "ipykernel"), "make notebook (JupyterLab on notebooks/)"),
    ("dev", ("pytest", "ruff", "mypy"), "tests, lint, rebuilding the compiled core"),
)
#: packages that describe the host better when present (docs/hardware-profiles.md)
HOST_TOOLS = ("cpuinfo", "psutil", "pynvml")
#: module -> the distributions that provide it (filled by :func:`report`, read once)
_DISTRIBUTIONS: dict[str, list[str]] = {}


def _version(module: str) -> str | None:
    """The installed distribution version of a module's package, or None when absent."""
    if importlib.util.find_spec(module) is None:
        return None
    for name in _DISTRIBUTIONS.get(module, [module]):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed"


def _size(path: Path) -> tuple[int, int]:
    """(files, bytes) under ``path`` (0, 0 when it does not exist)."""
    if not path.exists():
        return 0, 0
    files = total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += (Path(root) / n).stat().st_size
                files += 1
            except OSError:
                continue
    return files, total


def report() -> dict[str, Any]:
    """Everything ``doctor`` prints, as plain data."""
    from daopsim.simulator.fingerprints import daopsim_version
    from daopsim.simulator.native import ENV, status
    from daopsim.simulator.trace_cache import cache_dir

    build = status()
    if not _DISTRIBUTIONS:
        _DISTRIBUTIONS.update(importlib.metadata.packages_distributions())
    cache = cache_dir()
    files, size = _size(cache)
    import daopsim

    extras = []
    for name, modules, what in EXTRAS:
        found = {m: _version(m) for m in modules}
        extras.append(
            {
                "extra": name,
                "installed": all(v is not None for v in found.values()),
                "modules": found,
                "enables": what,
            }
        )
    return {
        "version": daopsim_version(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "package": str(Path(daopsim.__file__).resolve().parent),
        "build": {
            "state": build.state,
            "describe": build.describe(),
            "interpreted": dict(build.interpreted),
            "pure_python_env": f"{ENV}={os.environ.get(ENV, '')}" if os.environ.get(ENV) else None,
        },
        "cache": {
            "path": str(cache),
            "env": "DAOPSIM_CACHE" if os.environ.get("DAOPSIM_CACHE") else None,
            "files": files,
            "bytes": size,
            "holds": "synthetic traces of `run --model`, advise and validate (safe to delete)",
        },
        "extras": extras,
        "host_tools": {m: _version(m) for m in HOST_TOOLS},
        "cpus": os.cpu_count(),
    }


@click.command("doctor", context_settings={"help_option_names": ["-h", "--help"]})
@json_option
def doctor(as_json: bool) -> None:
    """Show this installation: version, compiled or pure-Python build and why, cache folder
    and size, installed extras."""
    doc = report()
    if as_json:
        echo_json(doc)
        return
    b, c = doc["build"], doc["cache"]
    lines = [
        f"daopsim {doc['version']} (Python {doc['python']}, {doc['platform']})",
        f"package: {doc['package']}",
        f"build: {b['describe']}",
        f"cache: {c['path']}"
        + (" (from $DAOPSIM_CACHE)" if c["env"] else " (set $DAOPSIM_CACHE to move it)"),
        f"       {c['files']} files, {c['bytes'] / 1e6:.1f} MB: {c['holds']}",
        "extras:",
    ]
    for e in doc["extras"]:
        mods = ", ".join(f"{m} {v}" if v else f"{m} missing" for m, v in e["modules"].items())
        mark = "yes" if e["installed"] else "no "
        lines.append(f"  {mark} {e['extra']:<9} {e['enables']} ({mods})")
        if not e["installed"]:
            lines.append(f"      pip install 'daopsim[{e['extra']}]'")
    tools = ", ".join(f"{m} {v}" if v else f"{m} missing" for m, v in doc["host_tools"].items())
    lines.append(f"host description tools: {tools}")
    lines.append(f"CPUs: {doc['cpus']}")
    click.echo("\n".join(lines))
