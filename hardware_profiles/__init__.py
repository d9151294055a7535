"""Bundled hardware profiles (*.toml; docs/hardware-profiles.md). Found by simulator/data.py."""
