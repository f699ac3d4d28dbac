"""paged_attention and reshape_and_cache against their reference compositions.

    PYTHONPATH=python python -m pytest bench/test_bench_attention.py --benchmark-enable -q

Each group puts the eecore op next to the ATen composition an engine would otherwise run:
  decode    B=8 sequences x context 2048, Hq=32, Hkv=8, D=64, block 16: paged_attention vs
            "gather the KV through the block table (index_select into buffers allocated once) +
            F.scaled_dot_product_attention", once with SDPA's enable_gqa and once with the query
            heads folded into the query length (the fastest exact SDPA form for decode: one
            [G, D] x [S, D] product per KV head).
  prefill   1 sequence x 512 new tokens (a fresh prompt), same heads: paged_attention vs gather+SDPA(causal).
  cache     writing one decode step (B=8 tokens) and a 512-token prefill into a paged cache: reshape_and_cache
            vs index_copy_ into the flattened [NB * BS, Hkv, D] cache.
The ratios are only meaningful side by side within one run: these machines are shared and noisy.
"""
import pytest
import torch
import torch.nn.functional as F

from eecore import ops

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class PagedBatch:
    """B sequences of `context` cached tokens each, scattered over random cache blocks."""

    def __init__(self, dtype, num_seqs, context, q_len):
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = num_seqs * blocks_per_seq + 8
        g = torch.Generator().manual_seed(0)
        self.k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        self.v_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        perm = torch.randperm(num_blocks, generator=g)[: num_seqs * blocks_per_seq]
        self.block_table = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
        self.seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
        self.query_start_loc = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
        self.query = torch.randn(num_seqs * q_len, NUM_Q_HEADS, HEAD_DIM, generator=g).to(dtype)
        self.out = torch.empty_like(self.query)
        self.num_seqs, self.context, self.q_len = num_seqs, context, q_len
        self.scale = HEAD_DIM ** -0.5

    def paged_attention(self):
        ops.paged_attention(self.out, self.query, self.k_cache, self.v_cache, self.block_table, self.seq_lens,
                            self.query_start_loc, self.q_len, self.scale, True, None)
        return self.out

    def gathered_kv(self):
        """[B, Hkv, S, D] keys and values: one index_select over every block of the batch, into
        buffers allocated once (an engine would reuse them; a fresh 16 MiB allocation per call
        would cost page faults that have nothing to do with attention)."""
        if not hasattr(self, "_gather_buffers"):
            blocks = self.block_table.flatten().long()
            self._gather_buffers = (blocks, torch.empty_like(self.k_cache[blocks]),
                                    torch.empty_like(self.v_cache[blocks]))
        blocks, k_buf, v_buf = self._gather_buffers
        torch.index_select(self.k_cache, 0, blocks, out=k_buf)
        torch.index_select(self.v_cache, 0, blocks, out=v_buf)
        shape = (self.num_seqs, self.context, NUM_KV_HEADS, HEAD_DIM)
        return k_buf.view(shape).transpose(1, 2), v_buf.view(shape).transpose(1, 2)

    def gather_sdpa_gqa(self):
        k, v = self.gathered_kv()
        q = self.query.view(self.num_seqs, self.q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.q_len > 1, scale=self.scale, enable_gqa=True)

    def gather_sdpa_grouped(self):
        # Decode only: the G query heads of a KV head become G query rows of that head (no mask).
        assert self.q_len == 1
        k, v = self.gathered_kv()
        q = self.query.view(self.num_seqs, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM)
        return F.scaled_dot_product_attention(q, k, v, scale=self.scale)


def _check_same(batch, baseline):
    expected = baseline().transpose(1, 2).reshape(batch.out.shape) if batch.q_len > 1 else \
        baseline().reshape(batch.out.shape)
    torch.testing.assert_close(batch.paged_attention().float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["eecore", "gather+sdpa(enable_gqa)", "gather+sdpa(grouped)"])
def test_decode(benchmark, dtype, impl):
    batch = PagedBatch(DTYPES[dtype], num_seqs=8, context=2048, q_len=1)
    benchmark.group = f"paged_attention decode B=8 ctx=2048 {dtype}"
    fn = {"eecore": batch.paged_attention, "gather+sdpa(enable_gqa)": batch.gather_sdpa_gqa,
          "gather+sdpa(grouped)": batch.gather_sdpa_grouped}[impl]
    if impl != "eecore":
        _check_same(batch, fn)
    benchmark(fn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["eecore", "gather+sdpa(causal)"])
def test_prefill(benchmark, dtype, impl):
    batch = PagedBatch(DTYPES[dtype], num_seqs=1, context=512, q_len=512)
    benchmark.group = f"paged_attention prefill 1x512 {dtype}"
    fn = batch.paged_attention if impl == "eecore" else batch.gather_sdpa_gqa
    if impl != "eecore":
        _check_same(batch, fn)
    benchmark(fn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [8, 512])
@pytest.mark.parametrize("impl", ["eecore", "index_copy_"])
def test_reshape_and_cache(benchmark, dtype, num_tokens, impl):
    num_blocks = 1024
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPES[dtype])
    v_cache = torch.zeros_like(k_cache)
    # key/value as slices of a fused QKV projection output, as a model produces them
    qkv = torch.randn(num_tokens, NUM_Q_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, generator=g).to(DTYPES[dtype])
    key = qkv[:, NUM_Q_HEADS:NUM_Q_HEADS + NUM_KV_HEADS]
    value = qkv[:, NUM_Q_HEADS + NUM_KV_HEADS:]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:num_tokens]
    benchmark.group = f"reshape_and_cache T={num_tokens} {dtype}"
    if impl == "eecore":
        benchmark(ops.reshape_and_cache, key, value, k_cache, v_cache, slots)
    else:
        k_flat = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
        v_flat = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)

        def index_copy():
            k_flat.index_copy_(0, slots, key)
            v_flat.index_copy_(0, slots, value)

        benchmark(index_copy)
