"""A binary min-heap of items that carry their own keys (the engine's queues).

The executor's request queue and a layer's GPU jobs are heaps of :class:`Keyed` items:
heapq's algorithm on four keys stored in the item, so no tuple is built per entry. A generic
data structure, kept outside the core as ``heapq`` is; compiled with it
(``daopsim.simulator.native``).
"""

from __future__ import annotations


class Keyed:
    """An item of a :class:`Heap`, ordered by its key ``(time, time2, rank, serial)``,
    smallest first. The executor's request queue keys a request (submission time, 0, issue
    number, submission number); a GPU stream keys a computation (start time, ready time,
    expert, 0)."""

    __slots__ = ("rank", "serial", "time", "time2")

    def __init__(self) -> None:
        #: the first key: a time
        self.time = 0.0
        #: ties on ``time`` broken by a second time
        self.time2 = 0.0
        #: then by a rank (an issue number, an expert)
        self.rank = 0
        #: then by the order of insertion
        self.serial = 0


def _before(a: Keyed, b: Keyed) -> bool:
    if a.time != b.time:
        return a.time < b.time
    if a.time2 != b.time2:
        return a.time2 < b.time2
    if a.rank != b.rank:
        return a.rank < b.rank
    return a.serial < b.serial


class Heap:
    """A binary min-heap of :class:`Keyed` items on their own keys (heapq's algorithm
    without building a tuple per entry). Keys are unique, so the order is total."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[Keyed] = []

    def push(self, x: Keyed) -> None:
        """Add ``x``."""
        items = self.items
        items.append(x)
        i = len(items) - 1
        while i > 0:
            parent = (i - 1) >> 1
            p = items[parent]
            if not _before(x, p):
                break
            items[i] = p
            i = parent
        items[i] = x

    def pop(self) -> Keyed:
        """Remove and return the smallest item."""
        items = self.items
        last = items.pop()
        if not items:
            return last
        top = items[0]
        n = len(items)
        i = 0
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and _before(items[child + 1], items[child]):
                child += 1
            if not _before(items[child], last):
                break
            items[i] = items[child]
            i = child
        items[i] = last
        return top

    def rebuild(self) -> None:
        """Restore the order after keys changed in place (the same list object)."""
        old = list(self.items)
        self.items.clear()
        for x in old:
            self.push(x)
