"""Bundled routing traces (*.parquet); README.md says how each was made. See simulator/data.py."""
