"""The embedding and the LM head split by vocabulary rows over tensor-parallel ranks.

- An embedding lookup: each rank writes the rows it holds, zeros elsewhere; one all-reduce.
- Logits: each rank's `[n, V/N]` columns, one all-gather to `[n, V]` (the padded columns dropped).
- The softmax top-2 gap an exit check reads: p1 - p2 needs the global max and the global sum of
  exponentials. Each rank sends five numbers a row (its max, its sum of exp(l - max), its two
  largest logits and the first's id), one all-gather, and every rank combines them the same way:
  the check's decision is made from one shared tensor.
- Rows of given ids (a draft vocabulary's, the guard's top-k): each rank copies those it holds,
  zeros elsewhere; one all-reduce.

`group` is an eecore.distributed.TensorParallelGroup (its all_reduce_ and all_gather_into). Buffers
grow to the largest row count seen and are reused after that (no allocation per step).
"""
from __future__ import annotations

import torch

from eecore.models.tensor_parallel import vocab_shard
from eecore.models.int8_weights import project, weight_rows


class VocabParallel:
    def __init__(self, group, vocab_size: int, dtype: torch.dtype, device: torch.device):
        self.group = group
        self.vocab_size = vocab_size
        self.start, self.end, self.rows = vocab_shard(vocab_size, group.rank, group.world_size)
        self.dtype, self.device = dtype, torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def _buf(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer of at least shape[0] rows, viewed at `shape`."""
        have = self._buffers.get(name)
        if have is None or have.shape[0] < shape[0] or have.shape[1:] != shape[1:] or have.dtype != dtype:
            have = self._buffers[name] = torch.empty((max(shape[0], 1),) + shape[1:], dtype=dtype,
                                                     device=self.device)
        return have[: shape[0]]

    def _local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids as rows of this rank's slice, clamped into it; whether each id is held here)."""
        n = ids.shape[0]
        held = self._buf("held", (n,), torch.bool)
        torch.logical_and(ids >= self.start, ids < self.end, out=held)
        local = self._buf("local", (n,), torch.int64)
        torch.sub(ids, self.start, out=local)
        local.clamp_(0, self.rows - 1)
        return local, held

    def rows_of(self, out: torch.Tensor, weight, ids: torch.Tensor) -> torch.Tensor:
        """`out [n, d]` = the full matrix's rows `ids` (an embedding lookup, the LM head's rows)."""
        local, held = self._local_ids(ids)
        weight_rows(out, weight, local)
        out.mul_(held.unsqueeze(1).to(out.dtype))
        return self.group.all_reduce_(out)

    def logits(self, out: torch.Tensor, normed: torch.Tensor, head) -> torch.Tensor:
        """`out [n, V]` = normed @ head^T over the whole vocabulary."""
        n, world = normed.shape[0], self.group.world_size
        local = project(self._buf("logits", (n, self.rows), out.dtype), normed, head)
        gathered = self._buf("gathered", (world * n, self.rows), out.dtype)
        self.group.all_gather_into(gathered, local)
        # [world, n, rows] -> [n, world * rows], then the real columns
        full = gathered.view(world, n, self.rows).transpose(0, 1)
        out.copy_(full.reshape(n, world * self.rows)[:, : self.vocab_size])
        return out

    def top2_gap(self, normed: torch.Tensor, head) -> tuple[torch.Tensor, torch.Tensor]:
        """(p1 - p2 of the softmax over the whole vocabulary `[n]` fp32, the top-1 ids `[n]` int64)."""
        n, world = normed.shape[0], self.group.world_size
        logits = project(self._buf("logits", (n, self.rows), self.dtype), normed, head).float()
        if self.end - self.start < self.rows:  # the last rank's padding rows
            logits[:, self.end - self.start:] = float("-inf")
        top, arg = logits.topk(2, dim=1)
        peak = top[:, :1]
        stats = self._buf("stats", (n, 5), torch.float32)
        stats[:, 0] = peak[:, 0]
        torch.sum(torch.exp(logits - peak), dim=1, out=stats[:, 1])
        stats[:, 2:4] = top
        stats[:, 4] = (arg[:, 0] + self.start).float()  # (token ids below 2^24 are exact in fp32)
        everyone = self._buf("every", (world * n, 5), torch.float32)
        self.group.all_gather_into(everyone, stats)
        every = everyone.view(world, n, 5)
        peak_all = every[:, :, 0].max(dim=0).values                      # [n]
        total = (every[:, :, 1] * torch.exp(every[:, :, 0] - peak_all)).sum(dim=0)
        firsts, seconds = every[:, :, 2], every[:, :, 3]                 # [world, n]
        best = firsts.argmax(dim=0)                                      # the rank with the top-1
        top1 = firsts.gather(0, best.unsqueeze(0))[0]
        # the runner-up: the best rank's second, or another rank's first
        others = firsts.scatter(0, best.unsqueeze(0), float("-inf")).max(dim=0).values
        top2 = torch.maximum(seconds.gather(0, best.unsqueeze(0))[0], others)
        gap = (torch.exp(top1 - peak_all) - torch.exp(top2 - peak_all)) / total
        ids = every[:, :, 4].gather(0, best.unsqueeze(0))[0].long()
        return gap, ids
