"""rms_norm, fused_add_rms_norm, rotary_embedding and kv_fill against the torch code they replace.

Each op and its baselines share a pytest-benchmark group, so the table shows them side by side:

    PYTHONPATH=python python -m pytest bench/test_bench_norm_rope_kvfill.py --benchmark-enable -q

On a shared machine, also run it with OMP_NUM_THREADS=1: with other processes on the cores, every
parallel region can stall a whole scheduler slice waiting for a descheduled thread, which punishes
code made of many small parallel ops (the per-layer loop) far more than the fused ops.

Sizes are decode-like: B = T = 8 rows; SmolLM2-135M (d=576, Hkv=3, D=64, 30 layers) and a 1-2B
Llama-shaped model (d=2048, Hq=32, Hkv=8, D=64). The baselines are written the way a careful
PyTorch user would write them (HF's RMSNorm, vLLM's native RoPE, index_copy_ into the cache).
"""
import pytest
import torch
import torch.nn.functional as F

from eecore import ops

EPS = 1e-5
TOKENS = 8
BENCH_DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def _name(dtype):
    return DTYPE_IDS[BENCH_DTYPES.index(dtype)]


# ---------------------------------------------------------------------------------------------
# rms_norm, fused_add_rms_norm
# ---------------------------------------------------------------------------------------------

def torch_rms_norm(x, weight, eps):
    """HF LlamaRMSNorm: fp32 statistics, then the gain in the activation dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@pytest.mark.parametrize("dtype", BENCH_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden_size", [576, 2048])
@pytest.mark.parametrize("impl", ["eecore", "torch", "F.rms_norm"])
def test_rms_norm(benchmark, impl, hidden_size, dtype):
    benchmark.group = f"rms_norm B={TOKENS} d={hidden_size} {_name(dtype)}"
    x = torch.randn(TOKENS, hidden_size, dtype=dtype)
    w = torch.randn(hidden_size, dtype=dtype)
    out = torch.empty_like(x)
    fn = {
        "eecore": lambda: ops.rms_norm(out, x, w, EPS),
        "torch": lambda: torch_rms_norm(x, w, EPS),
        "F.rms_norm": lambda: F.rms_norm(x, (hidden_size,), w, EPS),
    }[impl]
    benchmark(fn)


@pytest.mark.parametrize("dtype", BENCH_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden_size", [576, 2048])
@pytest.mark.parametrize("impl", ["eecore", "torch"])
def test_fused_add_rms_norm(benchmark, impl, hidden_size, dtype):
    benchmark.group = f"fused_add_rms_norm B={TOKENS} d={hidden_size} {_name(dtype)}"
    x = torch.randn(TOKENS, hidden_size, dtype=dtype)
    residual = torch.randn(TOKENS, hidden_size, dtype=dtype)
    w = torch.randn(hidden_size, dtype=dtype) * 0.01  # keeps the growing residual tame

    def torch_fused_add_rms_norm():
        residual.add_(x)
        x.copy_(torch_rms_norm(residual, w, EPS))

    fn = {"eecore": lambda: ops.fused_add_rms_norm(x, residual, w, EPS), "torch": torch_fused_add_rms_norm}[impl]
    benchmark(fn)


# ---------------------------------------------------------------------------------------------
# rotary_embedding
# ---------------------------------------------------------------------------------------------

def make_cos_sin_cache(max_pos, rot_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def torch_rope_(x, cos, sin):
    """vLLM's native NeoX RoPE, in place: x [T, H, D]; cos, sin [T, 1, D / 2] fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def torch_rotary_embedding(positions, query, key, cos_sin_cache):
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    torch_rope_(query, cos, sin)
    torch_rope_(key, cos, sin)


@pytest.mark.parametrize("dtype", BENCH_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("impl", ["eecore", "torch"])
def test_rotary_embedding(benchmark, impl, dtype):
    num_q_heads, num_kv_heads, head_dim = 32, 8, 64
    benchmark.group = f"rotary_embedding T={TOKENS} Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} {_name(dtype)}"
    cache = make_cos_sin_cache(4096, head_dim)
    positions = torch.randint(0, 4096, (TOKENS,))
    query = torch.randn(TOKENS, num_q_heads, head_dim, dtype=dtype)
    key = torch.randn(TOKENS, num_kv_heads, head_dim, dtype=dtype)
    fn = {
        "eecore": lambda: ops.rotary_embedding(positions, query, key, cache, True),
        "torch": lambda: torch_rotary_embedding(positions, query, key, cache),
    }[impl]
    benchmark(fn)


# ---------------------------------------------------------------------------------------------
# kv_fill
# ---------------------------------------------------------------------------------------------

KV_FILL_MODELS = {
    "smollm2-135m": dict(hidden_size=576, num_kv_heads=3, head_dim=64),
    "d2048-hkv8": dict(hidden_size=2048, num_kv_heads=8, head_dim=64),
}
NUM_LAYERS = 30


class KvFillProblem:
    """One decode step's fill: T tokens, each from its own exit layer to the top, in a paged cache.

    The per-layer baseline gets what a model has (each layer's gain and K/V projections); kv_fill
    gets the stacked, gain-folded weight a runtime builds once at load time.
    """

    def __init__(self, hidden_size, num_kv_heads, head_dim, dtype, start_layer):
        kv_width = num_kv_heads * head_dim
        block_size, num_blocks = 16, 64
        self.shape = (num_kv_heads, head_dim)
        self.gammas = [torch.rand(hidden_size, dtype=dtype) + 0.5 for _ in range(NUM_LAYERS)]
        self.k_proj = [torch.randn(kv_width, hidden_size, dtype=dtype) / hidden_size ** 0.5
                       for _ in range(NUM_LAYERS)]
        self.v_proj = [torch.randn(kv_width, hidden_size, dtype=dtype) / hidden_size ** 0.5
                       for _ in range(NUM_LAYERS)]
        self.weight = torch.stack([torch.cat([k * g, v * g]) for k, v, g in zip(self.k_proj, self.v_proj, self.gammas)])
        self.kv_cache = torch.zeros(NUM_LAYERS, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        self.hidden = torch.randn(TOKENS, hidden_size, dtype=dtype)
        self.cos_sin_cache = make_cos_sin_cache(4096, head_dim)
        self.positions = torch.randint(0, 4096, (TOKENS,))
        self.slot_mapping = torch.randperm(num_blocks * block_size)[:TOKENS]
        self.start_layer = start_layer.to(torch.int32)
        # The baseline's per-layer token selection, prepared outside the timed loop (in its favour).
        self.layer_rows = {l: torch.nonzero(self.start_layer <= l).flatten() for l in range(NUM_LAYERS)}
        self.layer_slots = {l: self.slot_mapping[rows] for l, rows in self.layer_rows.items()}

    def eecore(self):
        ops.kv_fill(self.kv_cache, self.hidden, self.weight, None, self.cos_sin_cache, self.positions,
                    self.slot_mapping, self.start_layer, EPS, True)

    def per_layer_loop(self):
        """What a runtime without kv_fill does: every skipped layer's norm, K/V projections, RoPE
        and cache write, one layer after the other."""
        cos, sin = self.cos_sin_cache.index_select(0, self.positions).unsqueeze(1).chunk(2, dim=-1)
        first = int(self.start_layer.min())
        for layer in range(first, NUM_LAYERS):
            rows, slots = self.layer_rows[layer], self.layer_slots[layer]
            if rows.numel() == 0:
                continue
            x = F.rms_norm(self.hidden, self.hidden.shape[-1:], self.gammas[layer], EPS)
            k = F.linear(x, self.k_proj[layer]).view(-1, *self.shape)
            v = F.linear(x, self.v_proj[layer]).view(-1, *self.shape)
            torch_rope_(k, cos, sin)
            if rows.numel() != TOKENS:
                k, v = k[rows], v[rows]
            self.kv_cache[layer, 0].view(-1, *self.shape).index_copy_(0, slots, k)
            self.kv_cache[layer, 1].view(-1, *self.shape).index_copy_(0, slots, v)


@pytest.mark.parametrize("dtype", BENCH_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("model", list(KV_FILL_MODELS))
@pytest.mark.parametrize("exits", ["all-layers", "mixed-exits"])
@pytest.mark.parametrize("impl", ["eecore", "per_layer_loop"])
def test_kv_fill(benchmark, impl, exits, model, dtype):
    benchmark.group = f"kv_fill L={NUM_LAYERS} T={TOKENS} {model} {exits} {_name(dtype)}"
    gen = torch.Generator().manual_seed(0)
    # all-layers: fill every layer (the whole prompt's worth); mixed-exits: each token exited
    # somewhere in layers 8..29, as in an early-exit decode step.
    start = torch.zeros(TOKENS) if exits == "all-layers" else torch.randint(8, NUM_LAYERS, (TOKENS,), generator=gen)
    problem = KvFillProblem(**KV_FILL_MODELS[model], dtype=dtype, start_layer=start)
    benchmark(getattr(problem, impl))


def test_kv_fill_baseline_is_equivalent():
    """The two benchmarked paths fill the same cache (a benchmark of different work is useless)."""
    start = torch.tensor([0, 3, 8, 29, 15, 1, 0, 22])
    problem = KvFillProblem(hidden_size=64, num_kv_heads=2, head_dim=16, dtype=torch.float32, start_layer=start)
    problem.kv_cache.fill_(float("nan"))
    problem.per_layer_loop()
    expected = problem.kv_cache.clone()
    problem.kv_cache.fill_(float("nan"))
    problem.eecore()
    torch.testing.assert_close(problem.kv_cache, expected, atol=1e-4, rtol=1e-4, equal_nan=True)
