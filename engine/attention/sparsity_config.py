"""Block-sparse attention layouts: DeepSpeed's `SparsityConfig` family, our own construction.

Callers: `SparseSelfAttention` (engine/attention/sparse_self_attention.py), models building a layout from
the `sparse_attention` config section (`from_config` below), user scripts through
`deepfleet.engine.ops.sparse_attention`, and the benchmarks.

A layout is an int64 tensor (num_heads, num_blocks, num_blocks): entry [h, r, c] = 1 when query block r
of head h attends to key block c; `make_layout(seq_len)` builds it for seq_len = num_blocks * block
(ValueError otherwise). Class names, parameters, defaults, error types and the construction rules per
mode are DeepSpeed's (0.18, `deepspeed/ops/sparse_attention/sparsity_config.py`, removed in 0.19):

- Dense: every block.
- Fixed (Sparse Transformers' "fixed"): local windows of `num_local_blocks` blocks (lower triangle of
  each window when unidirectional); in every full window the `num_global_blocks` blocks that end the
  window (head h of `num_different_global_patterns` patterns shifts them left by h % patterns groups) are
  global columns, attended by every row (unidirectional: from the global block's first row on); a
  trailing partial window gets one global group at the same offset, clamped to the end;
  `horizontal_global_attention` (bidirectional only) also makes those blocks attend to every block.
- Variable: `num_random_blocks` random columns per row, local windows of the listed sizes (the last
  size repeats to the end), global columns at `global_block_indices` (or the ranges
  [start, end) with `global_block_end_indices`), horizontal rows as for Fixed.
- BigBird: random columns per row (unidirectional: among the blocks up to the row), a sliding window
  of `num_sliding_window_blocks` centred on the diagonal, the first `num_global_blocks` blocks global
  as rows and columns; unidirectional keeps the lower block triangle.
- BSLongformer: sliding window, global rows and columns at the indices (or ranges); unidirectional keeps
  the lower block triangle.
- LocalSlidingWindow: the sliding window only (unidirectional: the window's past half and the diagonal).

Random blocks come from Python's `random` module, one `random.sample` per block row and layout head in
DeepSpeed's order, so `random.seed(s)` before `make_layout` gives DeepSpeed's layout for that seed.
One deliberate difference: a unidirectional BigBird row with fewer past blocks than `num_random_blocks`
takes all of them (DeepSpeed raised Python's "sample larger than population" there).
Without `different_layout_per_head`, head 0's layout is copied to every head.
"""

from __future__ import annotations

import random

import torch

_ATTENTION = ("unidirectional", "bidirectional")


def _check_attention(attention: str) -> str:
    if attention not in _ATTENTION:
        raise NotImplementedError(f'attention={attention!r}: only "unidirectional" or "bidirectional" are supported')
    return attention


def _check_ranges(starts: list[int], ends: list[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries but global_block_indices has {len(starts)}; "
            "give one end per start"
        )
    for start, end in zip(starts, ends, strict=True):
        if start >= end:
            raise ValueError(f"global block start index {start} must be smaller than its end index {end}")


class SparsityConfig:
    """The shared part of every layout: heads, block size, one layout per head or one for all."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        if num_heads < 1 or block < 1:
            raise ValueError(f"num_heads={num_heads} and block={block} must be positive")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout (num_heads, seq_len // block, seq_len // block); ValueError if seq_len is not
        a multiple of the block size."""
        if seq_len % self.block:
            raise ValueError(f"Sequence Length, {seq_len}, needs to be dividable by Block size {self.block}!")
        num_blocks = seq_len // self.block
        return torch.zeros((self.num_heads, num_blocks, num_blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0's layout to every head unless each head has its own."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The layout (num_heads, num_blocks, num_blocks) for `seq_len` tokens."""
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self._fill_head(h, layout)
            if getattr(self, "attention", "bidirectional") == "unidirectional" and self._tril_after:
                layout[h] = torch.tril(layout[h])
        return self.check_and_propagate_first_head_layout(layout)

    _tril_after = False
    """Whether unidirectional attention drops every block above the diagonal at the end (BigBird, Longformer)."""

    def _fill_head(self, h: int, layout: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no layout; use one of its subclasses")

    # -- pieces shared by several modes -----------------------------------------------------------

    @staticmethod
    def _random_columns(h: int, layout: torch.Tensor, count: int, *, causal: bool) -> None:
        num_blocks = layout.shape[1]
        if num_blocks < count:
            raise ValueError(
                f"Number of random blocks, {count}, must be smaller than overall number of blocks in a row, "
                f"{num_blocks}!"
            )
        for row in range(num_blocks):
            population = range(row + 1) if causal else range(num_blocks)
            cols = random.sample(population, min(count, len(population)))
            layout[h, row, cols] = 1

    @staticmethod
    def _sliding_window(h: int, layout: torch.Tensor, width: int, *, causal: bool) -> None:
        num_blocks = layout.shape[1]
        if num_blocks < width:
            raise ValueError(
                f"Number of sliding window blocks, {width}, must be smaller than overall number of blocks in a "
                f"row, {num_blocks}!"
            )
        rows = torch.arange(num_blocks)[:, None]
        cols = torch.arange(num_blocks)[None, :]
        half = width // 2
        upper = rows if causal else rows + half
        layout[h] |= ((cols >= rows - half) & (cols <= upper)).long()

    @staticmethod
    def _local_window(h: int, layout: torch.Tensor, start: int, end: int, *, causal: bool) -> None:
        """Block rows and columns [start, end) attend to each other (lower triangle when causal)."""
        window = torch.ones(end - start, end - start, dtype=torch.int64)
        layout[h, start:end, start:end] |= torch.tril(window) if causal else window

    def _global_ranges(self, h: int, layout: torch.Tensor, ranges: list[tuple[int, int]], *,
                       rows_too: bool, causal: bool) -> None:
        for start, end in ranges:
            if start >= layout.shape[1]:
                continue
            end = min(end, layout.shape[1])
            if rows_too:
                layout[h, start:end, :] = 1
            layout[h, (start if causal else 0):, start:end] = 1


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block (for comparison: dense attention as a layout)."""

    def _fill_head(self, h: int, layout: torch.Tensor) -> None:
        layout[h] = 1


class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformers' "fixed" pattern: local windows plus the last blocks of each window as global."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_local_blocks: int = 4, num_global_blocks: int = 1, attention: str = "bidirectional",
                 horizontal_global_attention: bool = False, num_different_global_patterns: int = 1) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks % num_global_blocks:
            raise ValueError(
                f"Number of blocks in a local window, {num_local_blocks}, must be dividable by number of global "
                f"blocks, {num_global_blocks}!"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError('only "bi-directional" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                "num_different_global_patterns > 1 needs a layout per head; set different_layout_per_head=True"
            )
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} cannot exceed num_local_blocks / "
                f"num_global_blocks = {num_local_blocks // num_global_blocks}"
            )
        self.num_different_global_patterns = num_different_global_patterns

    def _fill_head(self, h: int, layout: torch.Tensor) -> None:
        num_blocks, local, group = layout.shape[1], self.num_local_blocks, self.num_global_blocks
        causal = self.attention == "unidirectional"
        for start in range(0, num_blocks, local):
            self._local_window(h, layout, start, min(start + local, num_blocks), causal=causal)
        offset = local - (1 + h % self.num_different_global_patterns) * group  # first global block of a window
        full_end = num_blocks - num_blocks % local
        starts = list(range(offset, full_end, local))
        if full_end < num_blocks:  # a short last window still gets one global group, clamped to the end
            starts.append(min(full_end + offset, num_blocks - group))
        ranges = [(s, s + group) for s in starts]
        self._global_ranges(h, layout, ranges, rows_too=self.horizontal_global_attention, causal=causal)


class VariableSparsityConfig(SparsityConfig):
    """Fixed, generalized: random blocks, a list of local window sizes, chosen global blocks or ranges."""

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 0, local_window_blocks: list[int] | None = None,
                 global_block_indices: list[int] | None = None, global_block_end_indices: list[int] | None = None,
                 attention: str = "bidirectional", horizontal_global_attention: bool = False) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = [4] if local_window_blocks is None else list(local_window_blocks)
        if not self.local_window_blocks or min(self.local_window_blocks) < 1:
            raise ValueError(f"local_window_blocks={self.local_window_blocks} must list positive window sizes")
        self.global_block_indices = [0] if global_block_indices is None else list(global_block_indices)
        _check_ranges(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError('only "bi-directional" attentions can support horizontal global attention!')
        self.horizontal_global_attention = horizontal_global_attention

    def _fill_head(self, h: int, layout: torch.Tensor) -> None:
        num_blocks = layout.shape[1]
        causal = self.attention == "unidirectional"
        self._random_columns(h, layout, self.num_random_blocks, causal=False)
        start = 0
        for size in self.local_window_blocks:
            if start < num_blocks:
                self._local_window(h, layout, start, min(start + size, num_blocks), causal=causal)
            start += size
        for begin in range(start, num_blocks, self.local_window_blocks[-1]):  # the last size repeats
            self._local_window(h, layout, begin, min(begin + self.local_window_blocks[-1], num_blocks), causal=causal)
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        self._global_ranges(h, layout, list(zip(self.global_block_indices, ends, strict=True)),
                            rows_too=self.horizontal_global_attention, causal=causal)


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: random blocks, a sliding window and global blocks at the start."""

    _tril_after = True

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_random_blocks: int = 1, num_sliding_window_blocks: int = 3, num_global_blocks: int = 1,
                 attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = _check_attention(attention)

    def _fill_head(self, h: int, layout: torch.Tensor) -> None:
        num_blocks = layout.shape[1]
        self._random_columns(h, layout, self.num_random_blocks, causal=self.attention == "unidirectional")
        self._sliding_window(h, layout, self.num_sliding_window_blocks, causal=False)
        if num_blocks < self.num_global_blocks:
            raise ValueError(
                f"Number of global blocks, {self.num_global_blocks}, must be smaller than overall number of blocks "
                f"in a row, {num_blocks}!"
            )
        self._global_ranges(h, layout, [(0, self.num_global_blocks)], rows_too=True, causal=False)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window plus global blocks (rows and columns)."""

    _tril_after = True

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False,
                 num_sliding_window_blocks: int = 3, global_block_indices: list[int] | None = None,
                 global_block_end_indices: list[int] | None = None, attention: str = "bidirectional") -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = [0] if global_block_indices is None else list(global_block_indices)
        _check_ranges(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = None if global_block_end_indices is None else list(global_block_end_indices)
        self.attention = _check_attention(attention)

    def _fill_head(self, h: int, layout: torch.Tensor) -> None:
        self._sliding_window(h, layout, self.num_sliding_window_blocks, causal=False)
        ends = self.global_block_end_indices or [i + 1 for i in self.global_block_indices]
        self._global_ranges(h, layout, list(zip(self.global_block_indices, ends, strict=True)), rows_too=True, causal=False)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window (one layout for all heads)."""

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3,
                 attention: str = "unidirectional") -> None:
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = _check_attention(attention)

    def _fill_head(self, h: int, layout: torch.Tensor) -> None:
        self._sliding_window(h, layout, self.num_sliding_window_blocks, causal=self.attention == "unidirectional")


def from_config(section, *, num_heads: int) -> SparsityConfig:
    """The layout object of a `sparse_attention` config section (`SparseAttentionConfig` or its dict) for a
    layer with `num_heads` heads; each mode takes only its own keys, as DeepSpeed's parser did."""
    if isinstance(section, dict):
        from deepfleet.engine.config_sparse_attention import SparseAttentionConfig

        section = SparseAttentionConfig.model_validate(section)
    common = dict(num_heads=num_heads, block=section.block)
    per_head = dict(different_layout_per_head=section.different_layout_per_head)
    if section.mode == "dense":
        return DenseSparsityConfig(**common)
    if section.mode == "fixed":
        return FixedSparsityConfig(**common, **per_head, num_local_blocks=section.num_local_blocks,
                                   num_global_blocks=section.num_global_blocks, attention=section.attention,
                                   horizontal_global_attention=section.horizontal_global_attention,
                                   num_different_global_patterns=section.num_different_global_patterns)
    if section.mode == "variable":
        return VariableSparsityConfig(**common, **per_head, num_random_blocks=section.num_random_blocks,
                                      local_window_blocks=section.local_window_blocks,
                                      global_block_indices=section.global_block_indices,
                                      global_block_end_indices=section.global_block_end_indices,
                                      attention=section.attention,
                                      horizontal_global_attention=section.horizontal_global_attention)
    if section.mode == "bigbird":
        return BigBirdSparsityConfig(**common, **per_head, num_random_blocks=section.num_random_blocks,
                                     num_sliding_window_blocks=section.num_sliding_window_blocks,
                                     num_global_blocks=section.num_global_blocks, attention=section.attention)
    if section.mode == "bslongformer":
        return BSLongformerSparsityConfig(**common, **per_head,
                                          num_sliding_window_blocks=section.num_sliding_window_blocks,
                                          global_block_indices=section.global_block_indices,
                                          global_block_end_indices=section.global_block_end_indices,
                                          attention=section.attention)
    raise NotImplementedError(f"Given sparsity mode, {section.mode}, has not been implemented yet!")
