"""kv_fill against eecore.testing.reference, and against a Llama layer's own K/V projections."""
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, poison, tol
from test_op_rotary_embedding import cos_sin_cache


@dataclass
class Case:
    kv_cache: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    cos_sin_cache: Optional[torch.Tensor]
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    start_layer: torch.Tensor
    eps: float = 1e-5
    is_neox: bool = True

    def args(self, kv_cache=None):
        return (self.kv_cache if kv_cache is None else kv_cache, self.hidden, self.weight, self.bias,
                self.cos_sin_cache, self.positions, self.slot_mapping, self.start_layer, self.eps, self.is_neox)

    def written(self) -> torch.Tensor:
        """bool [L, 2, NB, BS]: the cache rows the op must write; all others keep their poison."""
        num_layers, _, num_blocks, block_size = self.kv_cache.shape[:4]
        mask = torch.zeros(num_layers, 2, num_blocks * block_size, dtype=torch.bool)
        for slot, start in zip(self.slot_mapping.tolist(), self.start_layer.tolist()):
            if slot >= 0:
                mask[start:, :, slot] = True
        return mask.view(num_layers, 2, num_blocks, block_size)


def make_case(device, dtype=torch.float32, *, num_tokens=7, num_layers=5, num_blocks=4, block_size=5,
              num_kv_heads=2, head_dim=32, hidden_size=72, rot_dim: Optional[int] = 32, is_neox=True,
              with_bias=True, cache_dtype=torch.float32, max_pos=50) -> Case:
    """Random inputs: distinct slots with one -1, start layers covering 0 and L, a poisoned cache."""
    assert num_tokens <= num_blocks * block_size
    kv_width = num_kv_heads * head_dim
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    start = torch.randint(0, num_layers + 1, (num_tokens,), dtype=torch.int32)
    if num_tokens >= 3:
        slots[1] = -1
        start[0], start[2] = 0, num_layers  # the full depth, and nothing to fill
    hidden = torch.randn(num_tokens, hidden_size) * 4 + 1  # an unnormalised residual stream
    weight = torch.randn(num_layers, 2 * kv_width, hidden_size) / hidden_size ** 0.5
    return Case(
        kv_cache=poison(torch.empty(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                                    device=device)),
        hidden=hidden.to(dtype=dtype, device=device),
        weight=weight.to(dtype=dtype, device=device),
        bias=torch.randn(num_layers, 2 * kv_width, dtype=dtype, device=device) if with_bias else None,
        cos_sin_cache=None if rot_dim is None else cos_sin_cache(max_pos, rot_dim, dtype=cache_dtype, device=device),
        positions=torch.randint(0, max_pos, (num_tokens,), device=device),
        slot_mapping=slots.to(device),
        start_layer=start.to(device),
        is_neox=is_neox,
    )


def check_against_reference(case: Case, dtype):
    expected = case.kv_cache.clone()
    reference.kv_fill(*case.args(expected))
    ops.kv_fill(*case.args())
    out = case.kv_cache
    written = case.written().to(out.device)
    # Every row the op must write is finite; every other row (layers below start_layer, skipped
    # tokens, other blocks) keeps its poison.
    assert not out[written].isnan().any(), "kv_fill left a row it must write unwritten"
    assert out[~written].isnan().all(), "kv_fill wrote a row it must not touch"
    # The GEMM runs in the activation dtype (as the model's own projections do), so 16-bit results
    # may be one rounding further from the fp32 oracle than a single cast.
    torch.testing.assert_close(out, expected, equal_nan=True, **tol(dtype, 1.0 if dtype == torch.float32 else 2.0))


# (rot_dim, is_neox, cos_sin_cache in the activation dtype): none, full NeoX, partial GPT-J,
# partial NeoX with a 16-bit cache.
ROPES = [(None, True, False), (32, True, False), (16, False, False), (8, True, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("rope", ROPES, ids=["no_rope", "neox", "gptj_partial", "neox_partial_cache16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_kv_fill_matches_reference(device, dtype, block_size, rope, with_bias):
    rot_dim, is_neox, cache_in_dtype = rope
    case = make_case(device, dtype, num_tokens=7, num_blocks=max(2, 16 // block_size), block_size=block_size,
                     rot_dim=rot_dim, is_neox=is_neox, with_bias=with_bias,
                     cache_dtype=dtype if cache_in_dtype else torch.float32)
    check_against_reference(case, dtype)


# (T, L, Hkv, D, d): decode batches, odd T, GQA-sized Hkv, 30 layers, a large batch.
SHAPES = [(1, 3, 1, 64, 48), (8, 30, 3, 64, 96), (13, 4, 8, 16, 40), (31, 6, 4, 80, 128), (70, 5, 2, 32, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-L{}-Hkv{}-D{}-d{}".format(*s))
@pytest.mark.parametrize("is_neox", [True, False])
def test_kv_fill_shapes(device, dtype, shape, is_neox):
    num_tokens, num_layers, num_kv_heads, head_dim, hidden_size = shape
    case = make_case(device, dtype, num_tokens=num_tokens, num_layers=num_layers, num_blocks=8, block_size=16,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, hidden_size=hidden_size, rot_dim=head_dim,
                     is_neox=is_neox)
    check_against_reference(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_writing", [9, 64, 65])
def test_kv_fill_both_cpu_strategies(device, dtype, num_writing):
    # The CPU kernel streams the weights itself for up to 64 writing tokens and calls one GEMM above
    # (in fp32; 16-bit only where the CPU has native bf16/fp16 matmul). Exactly `num_writing` tokens
    # write here: make_case skips token 1 (slot -1) and token 2 (start_layer = L).
    num_layers = 5
    case = make_case(device, dtype, num_tokens=num_writing + 2, num_layers=num_layers, num_blocks=5, block_size=16,
                     num_kv_heads=3, head_dim=48, hidden_size=100, rot_dim=24, is_neox=False, with_bias=True)
    start = torch.randint(0, num_layers, (num_writing + 2,), dtype=torch.int32)
    start[0], start[2] = 0, num_layers
    case.start_layer = start.to(device)
    check_against_reference(case, dtype)


def test_kv_fill_strided_hidden(device):
    # hidden may be a row-strided view (e.g. the exit rows of a larger buffer).
    case = make_case(device)
    case.hidden = torch.cat([case.hidden, torch.randn_like(case.hidden)], dim=1)[:, :case.hidden.shape[1]]
    assert not case.hidden.is_contiguous()
    check_against_reference(case, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_fill_nothing_to_write_keeps_the_cache(device, dtype):
    for slots, starts in [([-1, -1, -1], [0, 1, 2]), ([0, 1, 2], [5, 5, 9]), ([], [])]:
        case = make_case(device, dtype, num_tokens=3)
        case.hidden = case.hidden[:len(slots)]
        case.positions = case.positions[:len(slots)]
        case.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        case.start_layer = torch.tensor(starts, dtype=torch.int32, device=device)
        ops.kv_fill(*case.args())
        assert case.kv_cache.isnan().all()


def test_kv_fill_reproduces_a_llama_layer(device):
    """kv_fill with W_l = [k_proj * diag(gamma); v_proj * diag(gamma)] is what each layer itself
    computes: k = rope(k_proj(rms_norm(h) * gamma)), v = v_proj(rms_norm(h) * gamma). Plain torch
    modules and HF-style rotate_half RoPE, independent of eecore.testing.reference."""
    num_layers, hidden_size, num_kv_heads, head_dim, eps, base = 4, 96, 2, 32, 1e-6, 10000.0
    num_tokens, block_size, num_blocks = 5, 4, 3
    kv_width = num_kv_heads * head_dim
    layers = []
    for _ in range(num_layers):
        layers.append(dict(gamma=torch.rand(hidden_size, device=device) + 0.5,
                           k_proj=torch.nn.Linear(hidden_size, kv_width, bias=True, device=device),
                           v_proj=torch.nn.Linear(hidden_size, kv_width, bias=True, device=device)))
    hidden = torch.randn(num_tokens, hidden_size, device=device) * 3
    positions = torch.tensor([0, 17, 3, 99, 42], device=device)
    slots = torch.tensor([0, 5, -1, 11, 2], device=device)
    start = torch.tensor([0, 2, 0, 3, 4], dtype=torch.int32, device=device)

    with torch.no_grad():
        weight = torch.stack([torch.cat([l["k_proj"].weight * l["gamma"], l["v_proj"].weight * l["gamma"]])
                              for l in layers])
        bias = torch.stack([torch.cat([l["k_proj"].bias, l["v_proj"].bias]) for l in layers])
        kv_cache = poison(torch.empty(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, device=device))
        ops.kv_fill(kv_cache, hidden, weight, bias, cos_sin_cache(128, head_dim, base, device=device), positions,
                    slots, start, eps, True)

        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        emb = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos(), emb.sin()

        def rotate_half(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([-x2, x1], dim=-1)

        normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        for index, layer in enumerate(layers):
            x = normed * layer["gamma"]  # the layer's input_layernorm
            k = layer["k_proj"](x).view(num_tokens, num_kv_heads, head_dim)
            k = k * cos + rotate_half(k) * sin
            v = layer["v_proj"](x).view(num_tokens, num_kv_heads, head_dim)
            for t in range(num_tokens):
                block, offset = divmod(int(slots[t]), block_size)
                if slots[t] < 0 or index < start[t]:
                    continue
                torch.testing.assert_close(kv_cache[index, 0, block, offset], k[t], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(kv_cache[index, 1, block, offset], v[t], atol=1e-4, rtol=1e-4)
        written = sum(num_layers - int(s) for s, slot in zip(start, slots) if slot >= 0)
        assert (~kv_cache.isnan()).sum() == written * 2 * kv_width


def test_kv_fill_opcheck(device):
    for rot_dim, with_bias in [(32, True), (None, False)]:
        case = make_case(device, num_tokens=4, rot_dim=rot_dim, with_bias=with_bias)
        case.kv_cache.zero_()  # opcheck compares runs; NaN never equals itself
        torch.library.opcheck(torch.ops.eecore.kv_fill.default, case.args())


BAD_ARGUMENTS = [
    # (field, a function of the valid case returning its replacement, the message)
    ("kv_cache", lambda c: c.kv_cache[0], "'kv_cache'.*6-D"),
    ("kv_cache", lambda c: torch.cat([c.kv_cache, c.kv_cache[:, :1]], 1), "'kv_cache'.*K and V"),
    ("kv_cache", lambda c: c.kv_cache.transpose(4, 5), "'kv_cache'.*contiguous"),
    ("kv_cache", lambda c: c.kv_cache.int(), "'kv_cache'.*dtype"),
    ("hidden", lambda c: c.hidden.half(), "'hidden'.*dtype"),
    ("hidden", lambda c: c.hidden[None], "'hidden'.*2-D"),
    ("hidden", lambda c: c.hidden.t().contiguous().t(), "'hidden'.*unit stride"),
    ("hidden", lambda c: c.hidden[:, :0], "'hidden'.*non-empty"),
    ("weight", lambda c: c.weight[1:], "'weight'.*layers L"),
    ("weight", lambda c: c.weight[:, 1:], "'weight'.*2 \\* Hkv \\* D"),
    ("weight", lambda c: c.weight[..., 1:].contiguous(), "'weight'.*hidden size"),
    ("weight", lambda c: c.weight.half(), "'weight'.*dtype"),
    ("weight", lambda c: c.weight.transpose(1, 2).contiguous().transpose(1, 2), "'weight'.*contiguous"),
    ("bias", lambda c: c.bias[:, 1:], "'bias'.*2 \\* Hkv \\* D"),
    ("bias", lambda c: c.bias[1:], "'bias'.*layers L"),
    ("bias", lambda c: c.bias.half(), "'bias'.*dtype"),
    ("cos_sin_cache", lambda c: cos_sin_cache(50, 64), "'cos_sin_cache'.*head dim"),
    ("cos_sin_cache", lambda c: c.cos_sin_cache[:, :7], "'cos_sin_cache'.*even"),
    ("cos_sin_cache", lambda c: c.cos_sin_cache.half(), "'cos_sin_cache'.*dtype"),
    ("positions", lambda c: c.positions.int(), "'positions'.*dtype"),
    ("positions", lambda c: c.positions[1:], "'positions'.*number of tokens"),
    ("slot_mapping", lambda c: c.slot_mapping.int(), "'slot_mapping'.*dtype"),
    ("slot_mapping", lambda c: c.slot_mapping[:-1], "'slot_mapping'.*number of tokens"),
    ("start_layer", lambda c: c.start_layer.long(), "'start_layer'.*dtype"),
    ("start_layer", lambda c: c.start_layer[None], "'start_layer'.*1-D"),
    ("eps", lambda c: -1.0, "'eps'"),
]


@pytest.mark.parametrize("field, make, message", BAD_ARGUMENTS)
def test_kv_fill_bad_arguments(device, field, make, message):
    case = make_case(device)
    setattr(case, field, make(case))
    with pytest.raises(RuntimeError, match=message):
        ops.kv_fill(*case.args())


# Checks that read the index data, done by the CPU kernel before it writes anything.
BAD_DATA = [
    ("slot_mapping", 20, r"'slot_mapping'.*slots < 20"),  # num_blocks * block_size = 4 * 5
    ("slot_mapping", 1 << 40, r"'slot_mapping'.*slots < 20"),
    ("start_layer", -1, r"'start_layer'.*>= 0"),
    ("positions", 50, r"'positions'.*\[0, 50\)"),
    ("positions", -3, r"'positions'.*\[0, 50\)"),
]


@pytest.mark.parametrize("field, value, message", BAD_DATA)
def test_kv_fill_bad_index_data(field, value, message):
    case = make_case("cpu")
    getattr(case, field)[-1] = value
    with pytest.raises(RuntimeError, match=message):
        ops.kv_fill(*case.args())
    assert case.kv_cache.isnan().all(), "a rejected call wrote to the cache"


def test_kv_fill_positions_unused_without_rope():
    # Without a cos_sin_cache the positions are not read, so any value is accepted.
    case = make_case("cpu", rot_dim=None)
    case.positions.fill_(-7)
    check_against_reference(case, torch.float32)


def test_kv_fill_and_rotary_embedding_in_a_compiled_graph(device):
    # Both mutating ops trace through torch.compile(fullgraph=True) via their schemas and fakes.
    case = make_case(device, num_tokens=5)
    query = torch.randn(5, 4, 32, device=device)
    key = torch.randn(5, 2, 32, device=device)

    def step(kv_cache, query, key):
        ops.rotary_embedding(case.positions, query, key, case.cos_sin_cache, True)
        ops.kv_fill(*case.args(kv_cache))
        return query * 2

    expected_cache, expected_q, expected_k = case.kv_cache.clone(), query.clone(), key.clone()
    expected_out = step(expected_cache, expected_q, expected_k)
    compiled = torch.compile(step, fullgraph=True)
    out = compiled(case.kv_cache, query, key)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(key, expected_k)
    torch.testing.assert_close(case.kv_cache, expected_cache, equal_nan=True)
