"""Bundled routing traces (*.parquet); README.md says how each was made. See simulator/data.py.

Installed as ``daopsim.traces`` (pyproject.toml's package-dir maps this folder).
"""

if __name__ != "daopsim.traces":  # one name per module: never two copies
    raise ImportError(
        f"{__name__!r} is the package daopsim.traces: import it by that name "
        "(the folder traces/ installs only inside daopsim)"
    )
