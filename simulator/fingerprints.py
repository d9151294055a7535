"""Fingerprints of a run's inputs: the installed version and content hashes of files and
machine profiles (sweep keys, provenance, in-sample calibration checks)."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from daopsim.simulator.hardware import load_profile
from daopsim.simulator.hardware_spec import HardwareProfile


def daopsim_version() -> str:
    """The installed daopsim version (part of every configuration key)."""
    try:
        return importlib.metadata.version("daopsim")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "0+unknown"


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    # keyed on size and mtime so a rewritten file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes (cached per process while the file is unchanged)."""
    st = os.stat(path)
    return _file_sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def profile_sha256(hw: str | HardwareProfile) -> str:
    """SHA-256 of a machine profile's resolved content (not its file name or location)."""
    data = (hw if isinstance(hw, HardwareProfile) else load_profile(hw)).to_dict()
    data.pop("path", None)
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
