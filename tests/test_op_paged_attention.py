"""paged_attention against eecore.testing.reference: decode, prefill, chunked prefill, mixed varlen batches,
GQA, odd head dims, every block size, position bias, non-causal, token-tree masks, strided operands,
and bad input."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from eecore import ops
from eecore.testing import reference
from cuda_tests import needs_cuda
from op_utils import DTYPES, poison, random_block_tables, tol

# (query heads, KV heads): GQA ratios 1, 2, 4 and 8.
GQA = [(4, 4), (8, 4), (8, 2), (16, 2)]
BLOCK_SIZES = [1, 5, 16, 32]
# 64/128 are the common sizes; 80 and 72 are multiples of 8 but not of 16 (tail of the vector
# loops); 20 is not even a multiple of 8 (the kernel packs and pads such heads).
HEAD_DIMS = [64, 80, 128, 72, 20]


@dataclass
class PagedCase:
    """One batch: the paged caches and the index tensors that describe it."""
    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    scale: float
    causal: bool = True
    position_bias: Optional[torch.Tensor] = None
    kv_cache: Optional[torch.Tensor] = None  # the [L, 2, NB, BS, Hkv, D] tensor k/v_cache view
    tree_mask: Optional[torch.Tensor] = None

    def args(self, out):
        return (out, self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens, self.query_start_loc,
                self.max_query_len, self.scale, self.causal, self.position_bias, self.tree_mask)


def make_case(device, dtype, *, seq_lens, q_lens, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
              causal=True, max_distance=None, spare_blocks=3, num_layers=2, layer=1) -> PagedCase:
    """A random batch whose caches are the layer-`layer` views of one [L, 2, NB, BS, Hkv, D] tensor,
    as the runtime allocates them, with spare blocks that no sequence uses."""
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + spare_blocks
    kv_cache = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    bias = None
    if max_distance is not None:
        bias = torch.randn(num_q_heads, max_distance, device=device)
    return PagedCase(
        query=torch.randn(starts[-1], num_q_heads, head_dim, dtype=dtype, device=device),
        k_cache=kv_cache[layer, 0],
        v_cache=kv_cache[layer, 1],
        block_table=random_block_tables(seq_lens, block_size, num_blocks, device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(q_lens, default=0),
        scale=head_dim ** -0.5,
        causal=causal,
        position_bias=bias,
        kv_cache=kv_cache,
    )


def check_against_reference(case: PagedCase, scale_tol: float = 1.0):
    out = poison(torch.empty_like(case.query))
    expected = poison(torch.empty_like(case.query))
    ops.paged_attention(*case.args(out))
    reference.paged_attention(*case.args(expected))
    assert not out.isnan().any(), "some output rows were not written"
    torch.testing.assert_close(out, expected, **tol(case.query.dtype, scale_tol))
    return out


# --------------------------------------------------------------------------------------------
# Decode: one query row per sequence (the max_query_len == 1 kernel).
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_matches_reference(device, dtype, heads, block_size):
    num_q_heads, num_kv_heads = heads
    # lengths on, just past and just before block boundaries, plus one longer than a key tile
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 77, 201]
    case = make_case(device, dtype, seq_lens=seq_lens, q_lens=[1] * len(seq_lens), num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=64, block_size=block_size)
    check_against_reference(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_head_dims(device, dtype, head_dim):
    case = make_case(device, dtype, seq_lens=[5, 70, 130], q_lens=[1, 1, 1], num_q_heads=8, num_kv_heads=2,
                     head_dim=head_dim, block_size=16)
    check_against_reference(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(32, 8), (12, 3), (4, 1), (5, 5)])
def test_decode_single_sequence(device, dtype, heads):
    # Too few sequences for the threads: the kernel splits a sequence's KV heads across items.
    num_q_heads, num_kv_heads = heads
    case = make_case(device, dtype, seq_lens=[333], q_lens=[1], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                     head_dim=64, block_size=16)
    check_against_reference(case)


def test_decode_long_context(device):
    # Many key tiles: the running max must rescale the accumulators correctly. Scores are made
    # large so that a late key dominates and a missing rescale would show.
    case = make_case(device, torch.float32, seq_lens=[2048, 1000], q_lens=[1, 1], num_q_heads=8, num_kv_heads=2,
                     block_size=16)
    case.query.mul_(4.0)
    check_against_reference(case)


# --------------------------------------------------------------------------------------------
# Prefill, chunked prefill and mixed varlen batches.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prefill_matches_reference(device, dtype, heads, block_size):
    num_q_heads, num_kv_heads = heads
    seq_lens = [1, 2 * block_size + 1, 45]  # odd total rows: 1 + 2 * BS + 1 + 45
    case = make_case(device, dtype, seq_lens=seq_lens, q_lens=seq_lens, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=64, block_size=block_size)
    check_against_reference(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_prefill_head_dims(device, dtype, head_dim):
    case = make_case(device, dtype, seq_lens=[33, 70], q_lens=[33, 70], num_q_heads=8, num_kv_heads=2,
                     head_dim=head_dim, block_size=16)
    check_against_reference(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [5, 16])
def test_mixed_varlen_batch(device, dtype, block_size):
    # An empty step, a decode, a fresh prefill, chunked prefills (q_len < seq_len), a verification
    # of d + 1 = 4 draft tokens, and a sequence with cached tokens but nothing to compute.
    seq_lens = [9, 40, 37, 100, 130, 64, 23]
    q_lens = [0, 1, 37, 5, 67, 4, 0]
    case = make_case(device, dtype, seq_lens=seq_lens, q_lens=q_lens, num_q_heads=12, num_kv_heads=3,
                     head_dim=80, block_size=block_size)
    check_against_reference(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("max_distance", [None, 6])
def test_speculative_verification(device, dtype, heads, max_distance):
    # d + 1 = 4 new tokens per sequence over a long cache (few query vectors per KV head: the
    # kernel streams these like decode), next to a decode and a 2-token step.
    num_q_heads, num_kv_heads = heads
    case = make_case(device, dtype, seq_lens=[150, 37, 64, 9], q_lens=[4, 4, 1, 2], num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=64, block_size=16, max_distance=max_distance)
    check_against_reference(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_a_rows_bits_do_not_depend_on_the_rows_after_it(dtype, heads, head_dim):
    """CPU: the first query row of a chunk of q_len rows gets exactly the bits of a one-row call
    (whatever item layout, register blocks and key tail q_len makes), so a verify pass of d + 1
    tokens reproduces a decode step and greedy self-speculation is exactly full depth, bf16 too."""
    num_q_heads, num_kv_heads = heads
    for context in (1, 30, 95):
        case = make_case("cpu", dtype, seq_lens=[context + 12], q_lens=[12], num_q_heads=num_q_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim)
        outs = []
        for q_len in (1, 2, 3, 4, 5, 9, 12):  # the chunk's first row sits at position `context`
            out = torch.empty(q_len, num_q_heads, head_dim, dtype=dtype)
            ops.paged_attention(out, case.query[:q_len], case.k_cache, case.v_cache, case.block_table,
                                torch.tensor([context + q_len], dtype=torch.int32),
                                torch.tensor([0, q_len], dtype=torch.int32), q_len, case.scale, True)
            outs.append(out[0])
        for q_len, row in zip((2, 3, 4, 5, 9, 12), outs[1:]):
            assert torch.equal(row, outs[0]), (context, q_len)


def test_max_query_len_is_an_upper_bound(device):
    # A caller may pass a looser bound (e.g. the batch's token budget); the result is the same.
    case = make_case(device, torch.float32, seq_lens=[10, 20], q_lens=[1, 1])
    exact = check_against_reference(case)
    case.max_query_len = 8
    loose = check_against_reference(case)
    torch.testing.assert_close(loose, exact)


def test_long_prefill(device):
    case = make_case(device, torch.bfloat16, seq_lens=[512], q_lens=[512], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, block_size=16)
    check_against_reference(case)


def test_prefill_then_decode_agree(device):
    # The last row of a prefill over n tokens is the decode of token n over the same cache.
    case = make_case(device, torch.float32, seq_lens=[50], q_lens=[50], block_size=5)
    prefill = check_against_reference(case)
    decode = torch.empty_like(case.query[:1])
    ops.paged_attention(decode, case.query[-1:], case.k_cache, case.v_cache, case.block_table, case.seq_lens,
                        torch.tensor([0, 1], dtype=torch.int32, device=device), 1, case.scale, True, None)
    torch.testing.assert_close(decode[0], prefill[-1])


@pytest.mark.parametrize("trial", range(6))
def test_random_batches(device, trial):
    # Random shapes and layouts, a different mix on every trial.
    g = torch.Generator().manual_seed(1000 + trial)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    dtype = pick(DTYPES)
    num_q_heads, num_kv_heads = pick(GQA)
    block_size = pick(BLOCK_SIZES)
    seq_lens, q_lens = [], []
    for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
        seq_len = int(torch.randint(0, 150, (1,), generator=g))
        seq_lens.append(seq_len)
        q_lens.append(pick([0, 1, seq_len, seq_len // 3]) if seq_len else 0)
    case = make_case(device, dtype, seq_lens=seq_lens, q_lens=q_lens, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=pick(HEAD_DIMS), block_size=block_size,
                     max_distance=pick([None, 16]))
    check_against_reference(case)


# --------------------------------------------------------------------------------------------
# Position bias and non-causal attention.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_distance", [1, 7, 300])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [20, 3, 70]], ids=["decode", "varlen"])
def test_position_bias(device, dtype, max_distance, q_lens):
    # max_distance 7 clamps most distances to the last column; 300 covers every distance exactly.
    case = make_case(device, dtype, seq_lens=[20, 45, 70], q_lens=q_lens, num_q_heads=8, num_kv_heads=4,
                     block_size=16, max_distance=max_distance)
    case.position_bias.mul_(3.0)  # large enough to change which keys win
    check_against_reference(case)


def test_position_bias_changes_the_result(device):
    # Guards the test above: a bias that the kernel ignored would go unnoticed if it were tiny.
    case = make_case(device, torch.float32, seq_lens=[30], q_lens=[30], max_distance=40)
    with_bias = check_against_reference(case)
    case.position_bias = None
    without = check_against_reference(case)
    assert (with_bias - without).abs().max() > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens", [[1, 1], [12, 5], [30, 50]], ids=["decode", "shorter", "longer"])
@pytest.mark.parametrize("max_distance", [None, 8])
def test_non_causal(device, dtype, q_lens, max_distance):
    # Cross-attention: every query row sees all seq_len keys; a sequence may have more query rows
    # than keys (decoder rows over a short encoder output).
    case = make_case(device, dtype, seq_lens=[17, 40], q_lens=q_lens, block_size=5, causal=False,
                     max_distance=max_distance)
    check_against_reference(case)


def test_non_causal_differs_from_causal(device):
    case = make_case(device, torch.float32, seq_lens=[30], q_lens=[30], causal=False)
    full = check_against_reference(case)
    case.causal = True
    causal = check_against_reference(case)
    torch.testing.assert_close(full[-1], causal[-1])  # the last row sees every key either way
    assert (full[0] - causal[0]).abs().max() > 0.1

# --------------------------------------------------------------------------------------------
# Token-tree masks: a self-speculative step verifies a draft tree (the top-1 chain plus top-k
# alternatives) in one pass. Sibling rows sit in consecutive cache slots but must not see each
# other: row i of a chunk sees chunk key j only when bit j of tree_mask[row] is set. CPU only.
# --------------------------------------------------------------------------------------------

def _as_int64(bits: int) -> int:
    """The int64 value that holds a 64-bit set (bit 63 makes it negative)."""
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def tree_mask_of(parents: list[int]) -> list[int]:
    """The ancestor-or-self bit set of every row of a forest given by parent indices (-1: a root;
    parents come before their children, as the rows of a draft tree do)."""
    masks: list[int] = []
    for i, parent in enumerate(parents):
        assert parent < i
        masks.append((masks[parent] if parent >= 0 else 0) | 1 << i)
    return [_as_int64(m) for m in masks]


def random_parents(q_len: int) -> list[int]:
    # Every row hangs under a random earlier row, or (now and then) starts a tree of its own.
    return [int(torch.randint(-1, i, (1,))) if i else -1 for i in range(q_len)]


def chain_parents(q_len: int) -> list[int]:
    return list(range(-1, q_len - 1))


def tree_masks(q_lens: list[int], make_parents) -> torch.Tensor:
    """int64 [Tq]: the masks of one tree per sequence, back to back."""
    return torch.tensor([m for q_len in q_lens for m in tree_mask_of(make_parents(q_len))], dtype=torch.int64)


# With 2 query heads per KV head (GQA) and head dim 64, chunks of <= 8 rows run token-major and
# longer ones head-major (fp32: cache rows read in place; bf16/fp16: packed to fp32); head dim 20
# is always packed; 1 query head per KV head moves the token-major limit to 16 rows. Head-major
# items hold 32 / G rows, so the 40- and 64-row chunks span several items. The chunks of the 67-,
# 75-, 130- and 100-token sequences begin after one to three full key tiles (32 keys) and
# straddle a tile boundary; 64 rows use bit 63 (a negative int64).
TREE_SEQ_LENS = [1, 67, 75, 20, 9, 130, 100]
TREE_Q_LENS = [1, 6, 13, 0, 9, 40, 64]


def make_tree_case(dtype, make_parents=random_parents, num_q_heads=4, num_kv_heads=2, device="cpu",
                   **kwargs) -> PagedCase:
    case = make_case(device, dtype, seq_lens=TREE_SEQ_LENS, q_lens=TREE_Q_LENS, num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, **kwargs)
    case.tree_mask = tree_masks(TREE_Q_LENS, make_parents).to(device)
    return case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("block_size", [1, 16])
def test_tree_mask_matches_reference(dtype, heads, head_dim, block_size):
    num_q_heads, num_kv_heads = heads
    case = make_tree_case(dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          block_size=block_size)
    case.query.mul_(2.0)  # sharper attention: a key wrongly seen or missed moves the output more
    check_against_reference(case)


@pytest.mark.parametrize("max_distance", [8, 200])
def test_tree_mask_with_position_bias(max_distance):
    case = make_tree_case(torch.float32, max_distance=max_distance)
    check_against_reference(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 20])
def test_chain_mask_is_causal(dtype, head_dim):
    # A chain (row i sees rows 0..i) is the causal mask: the same result, bit for bit.
    case = make_tree_case(dtype, make_parents=chain_parents, head_dim=head_dim)
    chained = check_against_reference(case)
    case.tree_mask = None
    plain = check_against_reference(case)
    torch.testing.assert_close(chained, plain, atol=0, rtol=0)


# (head dim, q_len, dtype): token-major, head-major in place, head-major packed (GQA 8 / 2).
ORDERS = [(64, 4, torch.float32), (64, 20, torch.float32), (20, 4, torch.float32), (64, 20, torch.bfloat16)]


@pytest.mark.parametrize("head_dim, q_len, dtype", ORDERS)
def test_tree_mask_siblings_do_not_see_each_other(head_dim, q_len, dtype):
    # Rows 1 and 2 are both children of row 0 (two candidates for the same next token) with the
    # same query vector; rows 3.. continue under row 2. Row 1 sees key 1 and not key 2, row 2 the
    # other way round, so their outputs differ; under a plain causal mask row 2 would see both.
    # A short context (5 keys before the chunk) keeps the weight of one key large.
    parents = [-1, 0, 0] + list(range(2, q_len - 1))
    seq_len, block_size = q_len + 5, 4
    case = make_case("cpu", dtype, seq_lens=[seq_len], q_lens=[q_len], head_dim=head_dim, block_size=block_size)
    case.tree_mask = torch.tensor(tree_mask_of(parents), dtype=torch.int64)
    case.query[2] = case.query[1]
    case.query.mul_(2.0)
    out = check_against_reference(case)
    assert (out[1].float() - out[2].float()).abs().max() > 0.1

    # Nothing outside a row's path reaches it: scribbling over the key and value of row 1 leaves
    # every row that does not descend from row 1 (all but row 1 itself) exactly as it was.
    pos = seq_len - q_len + 1
    block, offset = int(case.block_table[0, pos // block_size]), pos % block_size
    case.k_cache[block, offset] = 50.0
    case.v_cache[block, offset] = 1e3
    after = check_against_reference(case)
    others = [r for r in range(q_len) if r != 1]
    torch.testing.assert_close(after[others], out[others], atol=0, rtol=0)
    assert (after[1].float() - out[1].float()).abs().max() > 1.0


def test_tree_mask_may_be_strided():
    case = make_tree_case(torch.float32)
    dense = check_against_reference(case)
    case.tree_mask = torch.stack([case.tree_mask, torch.zeros_like(case.tree_mask)], dim=1)[:, 0]
    assert not case.tree_mask.is_contiguous()
    torch.testing.assert_close(check_against_reference(case), dense, atol=0, rtol=0)


@pytest.mark.parametrize("q_lens", [[1, 1], [3, 9]])
def test_opcheck_tree_mask(q_lens):
    case = make_case("cpu", torch.float32, seq_lens=[10, 21], q_lens=q_lens, block_size=5)
    case.tree_mask = tree_masks(q_lens, random_parents)
    torch.library.opcheck(torch.ops.eecore.paged_attention.default, case.args(torch.empty_like(case.query)))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (6, 6)])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize("kernel", ["auto", "decode", "decode_mma", "rows", "mma"])
def test_tree_mask_on_cuda(dtype, heads, head_dim, kernel, monkeypatch):
    """The CUDA kernels' tree mask, each kernel forced in turn (one that cannot take the shape
    leaves it to the planner), against the reference."""
    monkeypatch.setenv("EECORE_PAGED_ATTENTION_KERNEL", kernel)
    num_q_heads, num_kv_heads = heads
    case = make_tree_case(dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          device="cuda")
    case.query.mul_(2.0)
    check_against_reference(case)


# --------------------------------------------------------------------------------------------
# Layouts: strided query/out (slices of fused buffers), views of the multi-layer cache.
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [7, 1, 12]], ids=["decode", "varlen"])
def test_strided_query_and_out(device, dtype, q_lens):
    case = make_case(device, dtype, seq_lens=[7, 30, 12], q_lens=q_lens, num_q_heads=8, num_kv_heads=2)
    num_tokens, num_q_heads, head_dim = case.query.shape
    # query: the Q part of a fused [T, Hq + 2 Hkv, D] projection output
    qkv = torch.randn(num_tokens, num_q_heads + 4, head_dim, dtype=dtype, device=device)
    case.query = qkv[:, :num_q_heads]
    # out: every other head of a wider buffer; the heads in between must stay untouched
    wide = poison(torch.empty(num_tokens, 2 * num_q_heads, head_dim, dtype=dtype, device=device))
    out = wide[:, ::2]
    assert out.stride(-1) == 1 and not out.is_contiguous()
    ops.paged_attention(*case.args(out))
    expected = torch.empty(num_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
    reference.paged_attention(*case.args(expected))
    torch.testing.assert_close(out, expected, **tol(dtype))
    assert wide[:, 1::2].isnan().all()


def test_other_layers_do_not_matter(device):
    # The op reads only its layer's view: scribbling over the other layer changes nothing.
    case = make_case(device, torch.float32, seq_lens=[40], q_lens=[3], num_layers=2, layer=0)
    before = check_against_reference(case)
    case.kv_cache[1].fill_(1e4)
    after = check_against_reference(case)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_empty_batch(device):
    case = make_case(device, torch.float32, seq_lens=[5, 0], q_lens=[0, 0])
    out = torch.empty_like(case.query)
    ops.paged_attention(*case.args(out))
    assert out.shape[0] == 0


# --------------------------------------------------------------------------------------------
# torch.library
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_distance", [None, 8])
@pytest.mark.parametrize("q_lens", [[1, 1], [3, 9]])
def test_opcheck(device, q_lens, max_distance):
    case = make_case(device, torch.float32, seq_lens=[10, 21], q_lens=q_lens, block_size=5,
                     max_distance=max_distance)
    torch.library.opcheck(torch.ops.eecore.paged_attention.default, case.args(torch.empty_like(case.query)))


# --------------------------------------------------------------------------------------------
# Bad arguments: a RuntimeError naming the argument, and nothing written.
# --------------------------------------------------------------------------------------------

def _replace(**changes):
    def apply(case: PagedCase):
        for name, fn in changes.items():
            setattr(case, name, fn(case))
    return apply


BAD_ARGUMENTS = [
    # dtypes
    (_replace(query=lambda c: c.query.double()), "'query'.*dtype"),
    (_replace(k_cache=lambda c: c.k_cache.half()), "'k_cache'.*dtype"),
    (_replace(v_cache=lambda c: c.v_cache.bfloat16()), "'v_cache'.*dtype"),
    (_replace(block_table=lambda c: c.block_table.long()), "'block_table'.*dtype"),
    (_replace(seq_lens=lambda c: c.seq_lens.long()), "'seq_lens'.*dtype"),
    (_replace(query_start_loc=lambda c: c.query_start_loc.long()), "'query_start_loc'.*dtype"),
    (_replace(position_bias=lambda c: torch.zeros(8, 4, dtype=torch.float16)), "'position_bias'.*dtype"),
    # ranks and shapes
    (_replace(query=lambda c: c.query.flatten(1)), "'query'.*3-D"),
    (_replace(k_cache=lambda c: c.k_cache.flatten(2)), "'k_cache'.*4-D"),
    (_replace(v_cache=lambda c: c.v_cache[:, :, :1]), "'v_cache'.*shape"),
    (_replace(block_table=lambda c: c.block_table[0]), "'block_table'.*2-D"),
    (_replace(block_table=lambda c: c.block_table[:1]), "'block_table'.*one row per sequence"),
    (_replace(seq_lens=lambda c: c.seq_lens[None]), "'seq_lens'.*1-D"),
    (_replace(query_start_loc=lambda c: c.query_start_loc[:-1]), "'query_start_loc'.*sequences \\+ 1"),
    (_replace(query=lambda c: c.query[:, :7]), "'query'.*multiple of the 2 KV heads"),
    (_replace(query=lambda c: c.query[..., :32]), "'k_cache'.*head dim"),
    (_replace(position_bias=lambda c: torch.zeros(4, 4)), "'position_bias'.*query heads"),
    (_replace(position_bias=lambda c: torch.zeros(8, 0)), "'position_bias'.*distance"),
    (_replace(position_bias=lambda c: torch.zeros(8)), "'position_bias'.*2-D"),
    (_replace(query=lambda c: c.query.transpose(1, 2).contiguous().transpose(1, 2)), "'query'.*unit stride"),
    (_replace(k_cache=lambda c: c.k_cache.transpose(0, 1)), "'k_cache'.*contiguous"),
    # values of the index tensors
    (_replace(query_start_loc=lambda c: c.query_start_loc + 1), "'query_start_loc'.*start at 0"),
    (_replace(query_start_loc=lambda c: torch.tensor([0, 1, 0, 10], dtype=torch.int32)),
     "'query_start_loc'.*non-decreasing"),
    (_replace(query_start_loc=lambda c: torch.tensor([0, 1, 3, 9], dtype=torch.int32)), "'query_start_loc'.*end"),
    (_replace(max_query_len=lambda c: 2), "'max_query_len'"),
    (_replace(max_query_len=lambda c: -1), "'max_query_len'"),
    (_replace(seq_lens=lambda c: torch.tensor([3, 1, 20], dtype=torch.int32)), "'seq_lens'.*query rows"),
    (_replace(seq_lens=lambda c: torch.tensor([3, -1, 20], dtype=torch.int32)), "'seq_lens'.*>= 0"),
    (_replace(seq_lens=lambda c: torch.tensor([3, 9, 80], dtype=torch.int32)), "'seq_lens'.*block_table"),
    (_replace(block_table=lambda c: c.block_table.index_fill(1, torch.tensor([1]), c.k_cache.shape[0])),
     "'block_table'.*block id"),
    (_replace(block_table=lambda c: c.block_table.index_fill(1, torch.tensor([0]), -1)), "'block_table'.*block id"),
]

def _chain_mask(case: PagedCase) -> torch.Tensor:
    starts = case.query_start_loc.tolist()
    return tree_masks([end - begin for begin, end in zip(starts, starts[1:])], chain_parents)


def _set_mask_row(row: int, value: int):
    def corrupt(case: PagedCase) -> torch.Tensor:
        mask = _chain_mask(case)
        mask[row] = value
        return mask
    return corrupt


# tree_mask: q_lens [1, 2, 7] put rows 1-2 in sequence 1 and rows 3-9 in sequence 2.
BAD_ARGUMENTS += [
    (_replace(tree_mask=lambda c: _chain_mask(c).int()), "'tree_mask'.*dtype"),
    (_replace(tree_mask=lambda c: _chain_mask(c)[:-1]), "'tree_mask'.*one per query row"),
    (_replace(tree_mask=lambda c: _chain_mask(c)[None]), "'tree_mask'.*1-D"),
    (_replace(tree_mask=_set_mask_row(5, 0b011)), "'tree_mask'.*row 5 \\(row 2 of sequence 2\\).*bit 2 set"),
    (_replace(tree_mask=_set_mask_row(2, 0b01)), "'tree_mask'.*row 2 \\(row 1 of sequence 1\\).*bit 1 set"),
    (_replace(tree_mask=_set_mask_row(3, 0b11)), "'tree_mask'.*row 3 \\(row 0 of sequence 2\\).*no bit above 0"),
    (_replace(tree_mask=_set_mask_row(8, -1)), "'tree_mask'.*row 8 \\(row 5 of sequence 2\\).*no bit above 5"),
    (_replace(tree_mask=_chain_mask, causal=lambda c: False), "'causal'.*tree_mask"),
    (_replace(tree_mask=_chain_mask, max_query_len=lambda c: 65), "'max_query_len'.*64.*tree_mask"),
]


@pytest.mark.parametrize("corrupt, message", BAD_ARGUMENTS)
def test_bad_arguments(corrupt, message):
    # seq_lens [3, 9, 20], q_lens [1, 2, 7] (Tq = 10), block size 5: table rows of 4 + 1 spare columns
    case = make_case("cpu", torch.float32, seq_lens=[3, 9, 20], q_lens=[1, 2, 7], num_q_heads=8, num_kv_heads=2,
                     head_dim=64, block_size=5)
    corrupt(case)
    out = poison(torch.empty(case.query.shape, dtype=case.query.dtype))
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention(*case.args(out))
    assert out.isnan().all(), "a rejected call wrote its output"


def test_unused_block_table_entries_are_not_checked(device):
    # Columns past a sequence's last block are padding (-1), and stale ids there are harmless.
    case = make_case(device, torch.float32, seq_lens=[7, 3], q_lens=[1, 1], block_size=5)
    case.block_table[1, 1:] = 10 ** 6
    check_against_reference(case)


def test_non_causal_needs_keys():
    # A check on the data: the CPU kernel raises; CUDA guards on the device instead (no host sync).
    case = make_case("cpu", torch.float32, seq_lens=[0, 4], q_lens=[2, 1], causal=False)
    with pytest.raises(RuntimeError, match="'seq_lens'.*no keys"):
        ops.paged_attention(*case.args(torch.empty_like(case.query)))


def test_bad_out(device):
    case = make_case(device, torch.float32, seq_lens=[4], q_lens=[1])
    with pytest.raises(RuntimeError, match="'out'.*shape"):
        ops.paged_attention(*case.args(torch.empty(2, 8, 64, device=device)))
    with pytest.raises(RuntimeError, match="'out'.*dtype"):
        ops.paged_attention(*case.args(torch.empty(1, 8, 64, dtype=torch.float16, device=device)))
