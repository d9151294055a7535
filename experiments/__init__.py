"""Bundled experiment files (*.toml).

Installed as the package data ``daopsim.data.experiments`` (see simulator/data.py).
"""
