"""A step's rows and the buffers they become: `Row` (which sequence, from which position, which
tokens, or a token tree), `StepInputs` (the tensors the model reads), `StepBuffers` (one step
shape's arrays, packed one after another in the builder's host buffer so that a GPU step takes one
copy) and `PaddedStep` (the last padded build, which a draft chain's next pass may continue).

engine.inputs.InputBuilder fills them (and re-exports Row and StepInputs, where most code imports
them from); engine.step_prediction builds a step from a predicted one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from eecore.engine.sequence import Sequence
from eecore.models.llama import AttentionInputs


# paged_attention's tree_mask is one int64 per query row: a tree row holds at most this many tokens
MAX_TREE_TOKENS = 64


@dataclass
class Row:
    """`tokens` of `seq` at positions start, start+1, ... (their K/V get written this step), or,
    with `parents`, a token tree: token j's parent is token parents[j] of this row (an earlier
    one), or the context for -1 (token 0's parent must be). Token j still takes slot start + j;
    its position is start + its depth, and it sees the context and its ancestors only."""
    seq: Sequence
    start: int
    tokens: list[int]
    parents: Optional[list[int]] = None


def tree_depths_and_masks(parents: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each token's depth in the tree (0 for a child of the context) and its ancestor-or-self
    bitmask over the row's tokens (paged_attention's tree_mask)."""
    n = len(parents)
    if not 0 < n <= MAX_TREE_TOKENS:
        raise ValueError(f"Row.parents: a token tree holds 1..{MAX_TREE_TOKENS} tokens, got {n}")
    if parents[0] != -1:
        raise ValueError(f"Row.parents: token 0's parent must be the context (-1), got {parents[0]}")
    depths = np.zeros(n, dtype=np.int64)
    masks = np.zeros(n, dtype=np.uint64)
    masks[0] = 1
    for j in range(1, n):
        parent = parents[j]
        if not 0 <= parent < j:
            raise ValueError(f"Row.parents: token {j}'s parent must be an earlier token of the row, got {parent}")
        depths[j] = depths[parent] + 1
        masks[j] = masks[parent] | np.uint64(1 << j)
    return depths, masks.view(np.int64)


@dataclass
class StepInputs:
    token_ids: torch.Tensor       # int64 [T]
    attn: AttentionInputs
    last_rows: torch.Tensor       # int64 [B]: the row of each sequence's last token
    row_lens: list[int]           # host copy of the per-sequence token counts

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]


@dataclass
class PaddedStep:
    """The last `build` when it was a padded step without token trees (InputBuilder.advance)."""
    key: tuple                # its buffers: (tokens, rows, table width, trees)
    seqs: list[Sequence]
    ends: np.ndarray          # each row's position after its last token
    table_lens: np.ndarray    # the blocks each row's table held (what the buffers' tables hold)
    buffers: "StepBuffers"

    @property
    def one_token_each(self) -> bool:
        return self.key[0] == self.key[1]


class StepBuffers:
    """One step shape's arrays, packed one after another at the start of the builder's buffer
    (int64 arrays first, so that each starts aligned): `arrays` (numpy, filled by the host),
    `host` (the same memory as torch tensors), and on a GPU `device` (the same layout in the device
    buffer), which one copy of `host_bytes` into `device_bytes` fills. A shape's tensors keep their
    addresses from one step to the next, as a captured CUDA graph needs."""

    # The token arrays come first: their addresses then depend on the token count alone, which
    # piecewise graphs (keyed by tokens, not sequences) rely on.
    LAYOUT = (("tokens", np.int64), ("positions", np.int64), ("slots", np.int64), ("last", np.int64),
              ("tree", np.int64), ("seq_lens", np.int32), ("qsl", np.int32), ("tables", np.int32))

    def __init__(self, host: torch.Tensor, device: Optional[torch.Tensor], T: int, B: int, table_width: int,
                 has_tree: bool):
        shapes = self.shapes(T, B, table_width, has_tree)
        self.arrays: dict[str, np.ndarray] = {}
        self.host: dict[str, torch.Tensor] = {}
        self.device: Optional[dict[str, torch.Tensor]] = None if device is None else {}
        host_np, offset = host.numpy(), 0
        for name, dtype in self.LAYOUT:
            shape = shapes[name]
            if shape is None:
                continue
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.arrays[name] = host_np[offset: offset + nbytes].view(dtype).reshape(shape)
            self.host[name] = torch.from_numpy(self.arrays[name])
            if device is not None:
                self.device[name] = device[offset: offset + nbytes].view(_TORCH_DTYPES[dtype]).view(shape)
            offset += nbytes
        self.host_bytes = host[:offset]
        self.device_bytes = None if device is None else device[:offset]

    @staticmethod
    def shapes(T: int, B: int, table_width: int, has_tree: bool) -> dict[str, Optional[tuple]]:
        return dict(tokens=(T,), positions=(T,), slots=(T,), last=(B,), tree=(T,) if has_tree else None,
                    seq_lens=(B,), qsl=(B + 1,), tables=(B, table_width))

    @classmethod
    def nbytes_of(cls, max_tokens: int, max_seqs: int, max_blocks: int, has_tree: bool) -> int:
        shapes = cls.shapes(max_tokens, max_seqs, max_blocks, has_tree)
        return sum(int(np.prod(shapes[name])) * np.dtype(dtype).itemsize
                   for name, dtype in cls.LAYOUT if shapes[name] is not None)


_TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32}


def tap_points(tap) -> tuple[int, ...]:
    """A tap's layers (ModelRunner.forward's `tap` is (layers, out), the layers one int or several)
    as a tuple."""
    return (tap[0],) if isinstance(tap[0], int) else tuple(tap[0])
