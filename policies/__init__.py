"""The built-in policies, one module each, and the registry (docs/policy-api.md)."""

from simulator import native as _native

# the compiled policies run only with a current compiled build (simulator/native.py)
_native.install()
