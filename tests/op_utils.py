"""Helpers for op tests: dtypes, tolerances, poisoned outputs, random paged-KV layouts."""
from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Absolute/relative tolerances for results stored in each dtype, against an fp32 reference that
# was cast to the same dtype: one or two units in the last place of the storage type.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def tol(dtype: torch.dtype, scale: float = 1.0) -> dict:
    t = TOLERANCES[dtype]
    return dict(atol=t["atol"] * scale, rtol=t["rtol"] * scale)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (floats) or a wild value, so unwritten elements show up."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(-12345)


def random_block_tables(seq_lens: list[int], block_size: int, num_blocks: int, device="cpu",
                        extra_cols: int = 1) -> torch.Tensor:
    """int32 [B, max_blocks] with distinct random physical blocks per sequence, -1 padded."""
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    assert sum(need) <= num_blocks, "not enough blocks for this layout"
    perm = torch.randperm(num_blocks).tolist()
    width = max(need + [0]) + extra_cols
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[cursor:cursor + n], dtype=torch.int32)
        cursor += n
    return table.to(device)


def assert_within_torch_error(actual: torch.Tensor, reference: torch.Tensor, baseline: torch.Tensor,
                              factor: float = 3.0, atol: float = 1e-6) -> None:
    """flash-attn's accuracy bound for low-precision kernels (CUDA tests use it):

        max |actual - reference| <= factor * max |baseline - reference| + atol

    `reference` is the computation in fp32 (e.g. an eecore.testing.reference oracle writing into an fp32
    buffer), and `baseline` is the same computation run by plain PyTorch in the kernel's dtype
    (bf16/fp16 matmuls, softmax and so on). A kernel may be a few times worse than PyTorch at its
    own dtype, never more. `atol` keeps an exact baseline from demanding bit-exactness.
    """
    reference = reference.detach().float().cpu()
    err = (actual.detach().float().cpu() - reference).abs().nan_to_num(float("inf")).max().item()
    base = (baseline.detach().float().cpu() - reference).abs().nan_to_num(float("inf")).max().item()
    assert err <= factor * base + atol, (
        f"max error {err:.3e} against fp32 exceeds {factor} x PyTorch's own {baseline.dtype} error {base:.3e} "
        f"(+ {atol:.1e})")
