"""Bundled regress baseline (policy-metrics.json).

Installed as the package data ``daopsim.data.baselines`` (see simulator/data.py).
"""
