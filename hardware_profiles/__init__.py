"""Bundled hardware profiles (*.toml; docs/hardware-profiles.md). Found by simulator/data.py.

Installed as ``daopsim.hardware_profiles`` (pyproject.toml's package-dir maps this folder).
"""

if __name__ != "daopsim.hardware_profiles":  # one name per module: never two copies
    raise ImportError(
        f"{__name__!r} is the package daopsim.hardware_profiles: import it by that name "
        "(the folder hardware_profiles/ installs only inside daopsim)"
    )
