"""Figure sizes that stay bounded whatever the number of clients.

Why: a plot with one row, column or bar per client grew with the clients; FEDORA's
similarity heat map at 1,000 clients asked matplotlib for a 502 x 250 inch canvas (50,200 x
25,000 pixels) and the server ran out of memory (22 GB) after the round had finished.
"""

from __future__ import annotations

MAX_INCHES = 20.0   # the longest side of any per-client figure
MAX_TICKS = 40      # per-client tick labels shown along one axis


def inches(count: int, per_item: float, minimum: float) -> float:
    """``per_item`` inches per client, at least ``minimum``, at most :data:`MAX_INCHES`."""
    return min(MAX_INCHES, max(minimum, per_item * count))


def tick_step(count: int, most: int = MAX_TICKS) -> int:
    """Label every ``tick_step``-th client so that at most ``most`` labels are drawn."""
    return max(1, -(-count // most))
