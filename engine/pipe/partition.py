"""Splitting a PipelineModule's layer list into contiguous stages: `partition(...)`.

Called by `engine/pipe/module.py` when a `PipelineModule` is built. Methods, DeepSpeed's names:
"uniform" (the same number of layers per part), "parameters" (balance trainable parameter counts),
"type:<regex>" (balance the number of layers whose class name matches the regex, case-insensitive), and
deepfleet's "profile" (balance measured per-layer time, given as weights by `measure_layer_times`).

Balancing is the linear partition problem: contiguous parts minimising the heaviest part. It is solved
exactly by a binary search over the bound with a greedy feasibility check (weights are integers
or floats; floats are searched over the candidate sums), which is O(n log n) instead of DeepSpeed's
O(n^2 m) dynamic programme. Ties are broken towards earlier parts holding fewer layers, so the last
stage (which also runs the loss) is never emptier than needed. Every part gets at least one layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence


def bounds_uniform(num_items: int, num_parts: int) -> list[int]:
    """Part boundaries [0, b1, ..., num_items] with sizes differing by at most one (the larger first)."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if part < extra else 0))
    return bounds


def _fits(weights: Sequence[float], num_parts: int, bound: float) -> bool:
    """Whether `weights` splits into at most `num_parts` contiguous parts of sum <= bound (each part
    holding at least one item, which any bound >= max(weights) allows)."""
    parts, running = 1, 0.0
    for w in weights:
        if running > 0 and running + w > bound:
            parts += 1
            running = 0.0
        running += w
    return parts <= num_parts


def bounds_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of `num_parts` non-empty contiguous parts minimising the heaviest part's weight."""
    n = len(weights)
    if n < num_parts:
        raise ValueError(f"{n} layers cannot fill {num_parts} parts")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # Candidate bounds are sums of contiguous runs; search the sorted set of candidates.
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(weights, num_parts, candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    bound = candidates[lo]
    # Fill parts from the back (the last parts take as much as the bound allows), keeping enough items
    # for the parts still to fill in front.
    cuts = [n]
    end = n
    for remaining in range(num_parts - 1, 0, -1):
        start = end - 1
        while start > remaining and prefix[end] - prefix[start - 1] <= bound:
            start -= 1
        cuts.append(start)
        end = start
    cuts.append(0)
    return sorted(cuts)


def layer_weights(
    method: str, *, names: Sequence[str], param_counts: Callable[[], list[int]],
    times: Callable[[], list[float]],
) -> list[float] | None:
    """The per-layer weights a method balances (None for "uniform"). `names` are the layers' class
    names; the two callables compute parameter counts and measured times only when asked. Raises
    ValueError naming `partition_method` for an unknown method."""
    lowered = method.lower()
    if lowered == "uniform":
        return None
    if lowered == "parameters":
        return [float(c) for c in param_counts()]
    if lowered == "profile":
        return list(times())
    if lowered.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        weights = [1.0 if pattern.search(name) else 0.0 for name in names]
        if not any(weights):
            raise ValueError(
                f"partition_method: {method!r} matches none of the layer types "
                f"({', '.join(sorted(set(names)))}); use a regex that matches the repeated layer"
            )
        return weights
    raise ValueError(
        f"partition_method: unknown method {method!r}; use 'parameters', 'uniform', 'type:<regex>' or 'profile'"
    )


def partition(num_layers: int, num_parts: int, weights: Sequence[float] | None) -> list[int]:
    """Boundaries of `num_parts` contiguous parts of `num_layers` layers, balancing `weights` (None:
    uniform). Zero-weight layers (a regex that leaves some layers out) go with their neighbours.
    Raises ValueError when there are fewer layers than parts."""
    if num_layers < num_parts:
        raise ValueError(
            f"num_stages: {num_parts} pipeline parts but only {num_layers} layers; "
            f"use at most {num_layers} stages (times virtual stages) or add layers"
        )
    if weights is None:
        return bounds_uniform(num_layers, num_parts)
    # A tiny epsilon per layer keeps zero-weight layers from piling up in one part and every part non-empty.
    total = sum(weights) or 1.0
    eps = total * 1e-6
    return bounds_balanced([w + eps for w in weights], num_parts)
