"""The fixed colour of each policy in every daopsim figure (timelines, sweeps, notebooks)."""

from __future__ import annotations

import hashlib

#: One colour per built-in policy, the same in every plot (bounds are black: belady dashed,
#: all-gpu dotted). Other policies get a colour from ``_EXTRA`` by a hash of their name, so a
#: plugin policy also keeps its colour from plot to plot.
POLICY_COLORS = {
    "daop": "#d62728",
    "fiddler": "#1f77b4",
    "lru": "#2ca02c",
    "lfu": "#ff7f0e",
    "mixtral-offloading": "#9467bd",
    "static": "#8c564b",
    "round-robin": "#e377c2",
    "stream-all": "#7f7f7f",
    "belady": "#000000",
    "all-gpu": "#000000",
}


_EXTRA = ["#17becf", "#bcbd22", "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2"]


def policy_color(policy: str) -> str:
    """The fixed colour of a policy in every daopsim plot."""
    if policy in POLICY_COLORS:
        return POLICY_COLORS[policy]
    digest = hashlib.sha256(policy.encode()).digest()
    return _EXTRA[digest[0] % len(_EXTRA)]
