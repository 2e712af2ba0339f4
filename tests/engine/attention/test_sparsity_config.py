"""Layouts against DeepSpeed's construction rules, restated per block (h, r, c) over a table of shapes,
seeded random blocks included, plus hand-checked small layouts and the parameter checks."""

from __future__ import annotations

import random

import pytest
import torch

from deepfleet.engine.attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

NUM_BLOCKS = [1, 3, 4, 7, 9, 16]
ATTENTION = ["unidirectional", "bidirectional"]


def _fixed_rule(cfg: FixedSparsityConfig, nb: int, h: int) -> torch.Tensor:
    """Block (r, c) is set when r and c share a local window (c <= r if unidirectional), or c belongs to a
    global group of its window (the group that ends the window, shifted left by h % patterns groups; a
    short last window's group at the same offset, clamped to the end) and r is any row (unidirectional: a
    row at or after the group's first block), or, with horizontal attention, r belongs to such a group."""
    L, G = cfg.num_local_blocks, cfg.num_global_blocks
    uni = cfg.attention == "unidirectional"
    offset = L - (1 + h % cfg.num_different_global_patterns) * G
    groups = [w + offset for w in range(0, nb - nb % L, L)]
    if nb % L:
        groups.append(min(nb - nb % L + offset, nb - G))
    out = torch.zeros(nb, nb, dtype=torch.int64)
    for r in range(nb):
        for c in range(nb):
            local = r // L == c // L and (c <= r or not uni)
            vertical = any(g <= c < g + G and (not uni or r >= g) for g in groups)
            horizontal = cfg.horizontal_global_attention and any(g <= r < g + G for g in groups)
            out[r, c] = int(local or vertical or horizontal)
    return out


def _windows(sizes: list[int], nb: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    while start < nb:
        out.append((start, start + sizes[-1]))
        start += sizes[-1]
    return out


def _ranges(starts: list[int], ends: list[int] | None) -> list[tuple[int, int]]:
    return list(zip(starts, ends, strict=True)) if ends is not None else [(s, s + 1) for s in starts]


def _variable_rule(cfg: VariableSparsityConfig, nb: int, random_cells: set[tuple[int, int]]) -> torch.Tensor:
    uni = cfg.attention == "unidirectional"
    glob = _ranges(cfg.global_block_indices, cfg.global_block_end_indices)
    out = torch.zeros(nb, nb, dtype=torch.int64)
    for r in range(nb):
        for c in range(nb):
            local = any(a <= r < b and a <= c < b for a, b in _windows(cfg.local_window_blocks, nb)) and (c <= r or not uni)
            vertical = any(a <= c < b and (not uni or r >= a) for a, b in glob)
            horizontal = cfg.horizontal_global_attention and any(a <= r < b for a, b in glob)
            out[r, c] = int(local or vertical or horizontal or (r, c) in random_cells)
    return out


def _window_rule(nb: int, width: int, r: int, c: int, *, past_only: bool) -> bool:
    return r - width // 2 <= c <= (r if past_only else r + width // 2)


def _bigbird_rule(cfg: BigBirdSparsityConfig, nb: int, random_cells: set[tuple[int, int]]) -> torch.Tensor:
    uni = cfg.attention == "unidirectional"
    out = torch.zeros(nb, nb, dtype=torch.int64)
    for r in range(nb):
        for c in range(nb):
            hit = (_window_rule(nb, cfg.num_sliding_window_blocks, r, c, past_only=False)
                   or r < cfg.num_global_blocks or c < cfg.num_global_blocks or (r, c) in random_cells)
            out[r, c] = int(hit and (c <= r or not uni))
    return out


def _longformer_rule(cfg: BSLongformerSparsityConfig, nb: int) -> torch.Tensor:
    uni = cfg.attention == "unidirectional"
    glob = _ranges(cfg.global_block_indices, cfg.global_block_end_indices)
    out = torch.zeros(nb, nb, dtype=torch.int64)
    for r in range(nb):
        for c in range(nb):
            hit = _window_rule(nb, cfg.num_sliding_window_blocks, r, c, past_only=False) or any(
                a <= r < b or a <= c < b for a, b in glob)
            out[r, c] = int(hit and (c <= r or not uni))
    return out


def _random_cells(seed: int, nb: int, count: int, layout_heads: int, *, causal: bool) -> list[set]:
    """DeepSpeed's stream: per layout head, per row, one random.sample of the row's candidate blocks."""
    random.seed(seed)
    cells = []
    for _ in range(layout_heads):
        head = set()
        for r in range(nb):
            population = range(r + 1) if causal else range(nb)
            head |= {(r, c) for c in random.sample(population, min(count, len(population)))}
        cells.append(head)
    return cells


@pytest.mark.parametrize("nb", NUM_BLOCKS)
def test_dense_is_all_ones(nb: int) -> None:
    layout = DenseSparsityConfig(num_heads=3, block=2).make_layout(nb * 2)
    assert layout.shape == (3, nb, nb) and layout.dtype == torch.int64 and bool((layout == 1).all())


FIXED = [  # (num_local_blocks, num_global_blocks, horizontal, patterns)
    (4, 1, False, 1), (4, 2, False, 2), (3, 1, True, 3), (2, 2, True, 1), (4, 1, True, 4),
]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("params", FIXED, ids=str)
@pytest.mark.parametrize("nb", NUM_BLOCKS)
def test_fixed_follows_the_rules(nb: int, params: tuple, attention: str) -> None:
    local, glob, horizontal, patterns = params
    if horizontal and attention == "unidirectional":
        pytest.skip("horizontal global attention is bidirectional only (tested below)")
    if nb < glob:
        pytest.skip("fewer blocks than one global group")
    cfg = FixedSparsityConfig(num_heads=4, block=3, different_layout_per_head=patterns > 1, num_local_blocks=local,
                              num_global_blocks=glob, attention=attention, horizontal_global_attention=horizontal,
                              num_different_global_patterns=patterns)
    layout = cfg.make_layout(nb * 3)
    for h in range(4):
        torch.testing.assert_close(layout[h], _fixed_rule(cfg, nb, h if patterns > 1 else 0), msg=f"head {h}")


def test_fixed_default_small_layout_by_hand() -> None:
    # 4-block windows, the 4th block of each window global; 10 blocks = 2 full windows + a short one whose
    # global block is clamped to the last block (9).
    layout = FixedSparsityConfig(1, block=1, horizontal_global_attention=True).make_layout(10)[0]
    g = {3, 7, 9}
    for r in range(10):
        expected = {c for c in range(10) if r // 4 == c // 4} | g | (set(range(10)) if r in g else set())
        assert {c for c in range(10) if layout[r, c]} == expected, r


VARIABLE = [  # (random, local windows, global starts, global ends, horizontal)
    (0, [4], [0], None, False), (1, [1, 2, 3], [0, 5], None, True), (2, [2], [1], [3], False),
    (0, [3, 1], [0, 4], [2, 6], True), (1, [5], [20], None, False),
]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("params", VARIABLE, ids=str)
@pytest.mark.parametrize("nb", NUM_BLOCKS)
def test_variable_follows_the_rules(nb: int, params: tuple, attention: str) -> None:
    rnd, windows, starts, ends, horizontal = params
    if horizontal and attention == "unidirectional" or nb < rnd:
        pytest.skip("not a valid combination")
    cfg = VariableSparsityConfig(num_heads=2, block=2, different_layout_per_head=True, num_random_blocks=rnd,
                                 local_window_blocks=windows, global_block_indices=starts,
                                 global_block_end_indices=ends, attention=attention,
                                 horizontal_global_attention=horizontal)
    random.seed(7)
    layout = cfg.make_layout(nb * 2)
    cells = _random_cells(7, nb, rnd, 2, causal=False)  # Variable samples every column, whatever the direction
    for h in range(2):
        torch.testing.assert_close(layout[h], _variable_rule(cfg, nb, cells[h]), msg=f"head {h}")


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("params", [(1, 3, 1), (2, 1, 2), (0, 5, 1), (3, 3, 3)], ids=str)
@pytest.mark.parametrize("nb", [5, 7, 16])
@pytest.mark.parametrize("per_head", [False, True])
def test_bigbird_follows_the_rules(nb: int, params: tuple, attention: str, per_head: bool) -> None:
    rnd, window, glob = params
    cfg = BigBirdSparsityConfig(num_heads=3, block=4, different_layout_per_head=per_head, num_random_blocks=rnd,
                                num_sliding_window_blocks=window, num_global_blocks=glob, attention=attention)
    random.seed(11)
    layout = cfg.make_layout(nb * 4)
    cells = _random_cells(11, nb, rnd, 3 if per_head else 1, causal=attention == "unidirectional")
    for h in range(3):
        torch.testing.assert_close(layout[h], _bigbird_rule(cfg, nb, cells[h if per_head else 0]), msg=f"head {h}")


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("params", [(3, [0], None), (5, [1, 6], None), (1, [0, 4], [2, 9]), (3, [30], None)], ids=str)
@pytest.mark.parametrize("nb", [5, 8, 13])
def test_longformer_follows_the_rules(nb: int, params: tuple, attention: str) -> None:
    window, starts, ends = params
    cfg = BSLongformerSparsityConfig(num_heads=2, block=1, num_sliding_window_blocks=window,
                                     global_block_indices=starts, global_block_end_indices=ends, attention=attention)
    layout = cfg.make_layout(nb)
    for h in range(2):
        torch.testing.assert_close(layout[h], _longformer_rule(cfg, nb))


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("window", [1, 2, 3, 6])
@pytest.mark.parametrize("nb", [6, 9])
def test_local_sliding_window_follows_the_rules(nb: int, window: int, attention: str) -> None:
    layout = LocalSlidingWindowSparsityConfig(2, block=2, num_sliding_window_blocks=window,
                                              attention=attention).make_layout(nb * 2)
    past_only = attention == "unidirectional"
    expected = torch.tensor([[int(_window_rule(nb, window, r, c, past_only=past_only)) for c in range(nb)]
                             for r in range(nb)])
    torch.testing.assert_close(layout[0], expected)
    torch.testing.assert_close(layout[1], expected)


def test_seeded_random_layouts_repeat_and_differ_across_seeds() -> None:
    cfg = BigBirdSparsityConfig(num_heads=2, block=1, num_random_blocks=2)
    random.seed(3)
    a = cfg.make_layout(32)
    random.seed(3)
    b = cfg.make_layout(32)
    random.seed(4)
    c = cfg.make_layout(32)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3), ValueError, "dividable"),
    (lambda: FixedSparsityConfig(2, attention="sideways"), NotImplementedError, "unidirectional"),
    (lambda: FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True), ValueError,
     "bi-directional"),
    (lambda: FixedSparsityConfig(2, num_different_global_patterns=2), ValueError, "different_layout_per_head"),
    (lambda: FixedSparsityConfig(2, different_layout_per_head=True, num_different_global_patterns=5), ValueError,
     "cannot exceed"),
    (lambda: VariableSparsityConfig(2, global_block_indices=[0, 2], global_block_end_indices=[1]), ValueError,
     "one end per start"),
    (lambda: BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[3]), ValueError,
     "smaller than"),
])
def test_bad_parameters_raise_deepspeeds_errors(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def test_make_layout_checks_lengths_and_block_counts() -> None:
    with pytest.raises(ValueError, match="dividable by Block size 16"):
        FixedSparsityConfig(2).make_layout(40)
    with pytest.raises(ValueError, match="sliding window blocks"):
        BigBirdSparsityConfig(2, block=4, num_sliding_window_blocks=5).make_layout(16)
    with pytest.raises(ValueError, match="random blocks"):
        VariableSparsityConfig(2, block=4, num_random_blocks=5).make_layout(16)
    with pytest.raises(NotImplementedError):
        SparsityConfig(2).make_layout(32)
