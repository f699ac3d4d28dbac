"""reshape_and_cache against eecore.testing.reference: every dtype and block size, skipped slots, strided
key/value, per-layer views of the KV tensor, untouched unused slots, and bad input."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference
from op_utils import DTYPES, poison

BLOCK_SIZES = [1, 5, 16, 32]


def make_inputs(device, dtype, *, num_tokens, num_blocks, block_size, num_kv_heads, head_dim, skip_every=3):
    """key/value and a slot_mapping of distinct random slots, every `skip_every`-th token skipped (-1)."""
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    if skip_every:
        slots[::skip_every] = -1
    return key, value, slots.to(device)


def run_both(key, value, k_cache, v_cache, slot_mapping):
    """The op and the reference on copies of the same caches; returns both results."""
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    reference.reshape_and_cache(key, value, k_ref, v_ref, slot_mapping)
    return (k_cache, v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads_dim", [(1, 64), (2, 80), (8, 128), (3, 72), (2, 20)])
def test_matches_reference(device, dtype, block_size, heads_dim):
    num_kv_heads, head_dim = heads_dim
    num_blocks = 97 // block_size + 2
    key, value, slots = make_inputs(device, dtype, num_tokens=37, num_blocks=num_blocks, block_size=block_size,
                                    num_kv_heads=num_kv_heads, head_dim=head_dim)
    # Poisoned caches: every slot the op should not write stays NaN in both results.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = poison(torch.empty(shape, dtype=dtype, device=device))
    v_cache = poison(torch.empty(shape, dtype=dtype, device=device))
    got, expected = run_both(key, value, k_cache, v_cache, slots)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)
    written = slots[slots >= 0]
    assert not got[0].view(-1, num_kv_heads, head_dim)[written].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_unused_slots_are_untouched(device, dtype):
    # Only the mapped slots change, bit for bit; the rest of every block keeps its old contents.
    num_blocks, block_size, num_kv_heads, head_dim = 12, 16, 2, 64
    key, value, slots = make_inputs(device, dtype, num_tokens=50, num_blocks=num_blocks, block_size=block_size,
                                    num_kv_heads=num_kv_heads, head_dim=head_dim)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots)

    mapped = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    mapped[slots[slots >= 0]] = True
    flat = lambda c: c.view(num_blocks * block_size, -1)  # noqa: E731
    assert torch.equal(flat(k_cache)[~mapped], flat(k_before)[~mapped])
    assert torch.equal(flat(v_cache)[~mapped], flat(v_before)[~mapped])
    written = slots >= 0
    assert torch.equal(flat(k_cache)[slots[written]], key[written].flatten(1))
    assert torch.equal(flat(v_cache)[slots[written]], value[written].flatten(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_key_value_from_fused_qkv(device, dtype):
    # key/value as slices of a fused [T, Hq + 2 Hkv, D] projection: strided tokens and heads.
    num_tokens, num_q_heads, num_kv_heads, head_dim, block_size = 21, 8, 2, 64, 5
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    key = qkv[:, num_q_heads:num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads:]
    # and a key whose heads are not adjacent either (every other head of a wider tensor)
    wide = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
    for k in (key, wide[:, ::2]):
        assert not k.is_contiguous()
        _, _, slots = make_inputs(device, dtype, num_tokens=num_tokens, num_blocks=6, block_size=block_size,
                                  num_kv_heads=num_kv_heads, head_dim=head_dim)
        k_cache = poison(torch.empty(6, block_size, num_kv_heads, head_dim, dtype=dtype, device=device))
        v_cache = poison(torch.empty_like(k_cache))
        got, expected = run_both(k, value, k_cache, v_cache, slots)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)


def test_writes_only_its_layer_of_the_kv_tensor(device):
    # k_cache / v_cache are kv_cache[l, 0] / kv_cache[l, 1]: the other layers stay untouched.
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = 3, 4, 16, 2, 64
    kv_cache = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, device=device)
    before = kv_cache.clone()
    key, value, slots = make_inputs(device, torch.float32, num_tokens=30, num_blocks=num_blocks,
                                    block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    k_ref, v_ref = kv_cache[1, 0].clone(), kv_cache[1, 1].clone()
    ops.reshape_and_cache(key, value, kv_cache[1, 0], kv_cache[1, 1], slots)
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(kv_cache[1, 0], k_ref) and torch.equal(kv_cache[1, 1], v_ref)
    assert torch.equal(kv_cache[0], before[0]) and torch.equal(kv_cache[2], before[2])
    assert not torch.equal(kv_cache[1], before[1])


def test_all_skipped_and_empty(device):
    k_cache = torch.randn(3, 16, 2, 64, device=device)
    v_cache = torch.randn_like(k_cache)
    before = k_cache.clone(), v_cache.clone()
    key = torch.randn(4, 2, 64, device=device)
    ops.reshape_and_cache(key, key, k_cache, v_cache, torch.full((4,), -1, dtype=torch.int64, device=device))
    empty = key[:0]
    ops.reshape_and_cache(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_many_tokens(device):
    # A prefill-sized step, spread over the threads.
    key, value, slots = make_inputs(device, torch.bfloat16, num_tokens=3000, num_blocks=200, block_size=16,
                                    num_kv_heads=4, head_dim=128, skip_every=7)
    k_cache = poison(torch.empty(200, 16, 4, 128, dtype=torch.bfloat16, device=device))
    v_cache = poison(torch.empty_like(k_cache))
    got, expected = run_both(key, value, k_cache, v_cache, slots)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0, equal_nan=True)


def test_opcheck(device):
    key, value, slots = make_inputs(device, torch.float32, num_tokens=9, num_blocks=4, block_size=5,
                                    num_kv_heads=2, head_dim=16)
    k_cache = torch.zeros(4, 5, 2, 16, device=device)
    torch.library.opcheck(torch.ops.eecore.reshape_and_cache.default,
                          (key, value, k_cache, torch.zeros_like(k_cache), slots))


# --------------------------------------------------------------------------------------------
# Bad arguments: a RuntimeError naming the argument, and the caches left as they were.
# --------------------------------------------------------------------------------------------

def _base():
    key = torch.randn(6, 2, 16)
    return dict(key=key, value=key.clone(), k_cache=torch.zeros(4, 5, 2, 16), v_cache=torch.zeros(4, 5, 2, 16),
                slot_mapping=torch.tensor([0, 7, -1, 19, 3, 12]))


BAD_ARGUMENTS = [
    (dict(slot_mapping=torch.tensor([0, 7, -1, 20, 3, 12])), "'slot_mapping'.*entry 3 is 20"),
    (dict(slot_mapping=torch.tensor([0, 7, -2, 19, 3, 12])), "'slot_mapping'.*entry 2 is -2"),
    (dict(slot_mapping=torch.tensor([0, 7, -1, 19, 3, 12], dtype=torch.int32)), "'slot_mapping'.*dtype"),
    (dict(slot_mapping=torch.tensor([0, 7, -1])), "'slot_mapping'.*tokens of 'key'"),
    (dict(slot_mapping=torch.zeros(6, 1, dtype=torch.int64)), "'slot_mapping'.*1-D"),
    (dict(key=torch.randn(6, 2, 16).half()), "'key'.*dtype"),
    (dict(value=torch.randn(6, 2, 16, dtype=torch.float64)), "'value'.*dtype"),
    (dict(k_cache=torch.zeros(4, 5, 2, 16, dtype=torch.int32), v_cache=torch.zeros(4, 5, 2, 16, dtype=torch.int32)),
     "'k_cache'.*dtype"),
    (dict(v_cache=torch.zeros(4, 5, 2, 16).half()), "'v_cache'.*dtype"),
    (dict(key=torch.randn(6, 32)), "'key'.*3-D"),
    (dict(k_cache=torch.zeros(20, 2, 16)), "'k_cache'.*4-D"),
    (dict(v_cache=torch.zeros(4, 5, 2, 8)), "'v_cache'.*shape"),
    (dict(key=torch.randn(6, 4, 16)), "'key'.*KV heads"),
    (dict(value=torch.randn(6, 2, 8)), "'value'.*head dim"),
    (dict(value=torch.randn(5, 2, 16)), "'value'.*tokens of 'key'"),
    (dict(key=torch.randn(6, 16, 2).transpose(1, 2)), "'key'.*unit stride"),
    (dict(k_cache=torch.zeros(5, 4, 2, 16).transpose(0, 1)), "'k_cache'.*contiguous"),
]


@pytest.mark.parametrize("changes, message", BAD_ARGUMENTS)
def test_bad_arguments(changes, message):
    args = {**_base(), **changes}
    caches = args["k_cache"].clone(), args["v_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        ops.reshape_and_cache(**args)
    assert torch.equal(args["k_cache"], caches[0]) and torch.equal(args["v_cache"], caches[1])
