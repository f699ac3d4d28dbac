"""T5's relative position bias: distances binned into buckets, one learned scalar per bucket and head.

Buckets (Mesh TensorFlow's rule, as HF implements it): distances below half the buckets get a
bucket each; larger ones share logarithmically wider buckets up to `max_distance`, beyond which
all distances share the last bucket. Bidirectional attention (the encoder) spends half the
buckets on keys after the query.

The decoder's self-attention is causal, so its bias depends only on d = q_pos - k_pos >= 0 and is
handed to `paged_attention` as a table `[H, max_distance + 1]` indexed by d (the op reads the last
column for every larger distance, which is exactly the saturated bucket).
"""
from __future__ import annotations

import math

import torch


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket of each `relative_position` = key position - query position (int64 tensor)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)  # keys after the query never occur (causal)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # the same float32 arithmetic as the reference implementation, so bucket edges agree exactly
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


def causal_bias_table(bias_weight: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """fp32 `[H, max_distance + 1]`: the bias of a key d = 0..max_distance tokens before the query."""
    distance = torch.arange(max_distance + 1, device=bias_weight.device)
    buckets = relative_position_bucket(-distance, False, num_buckets, max_distance)
    return bias_weight.float()[buckets].t().contiguous()


def bidirectional_bias(bias_weight: torch.Tensor, length: int, num_buckets: int, max_distance: int) -> torch.Tensor:
    """fp32 `[H, length, length]`: the encoder's bias of key j for query i."""
    positions = torch.arange(length, device=bias_weight.device)
    relative = positions[None, :] - positions[:, None]
    buckets = relative_position_bucket(relative, True, num_buckets, max_distance)
    return bias_weight.float()[buckets].permute(2, 0, 1)
