"""Bundled validation table (published.toml).

Installed as the package data ``daopsim.data.validation`` (see simulator/data.py).
"""
