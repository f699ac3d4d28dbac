"""Weights packed into huge pages (eecore.models.huge_pages): the same values, aligned, tied
weights still shared, the mapping advised where the OS has THP, and the same generations."""
import dataclasses
import mmap
import re

import pytest
import torch

from eecore.models.huge_pages import HUGE_PAGE_BYTES, huge_pages_enabled, place_in_huge_pages, weight_buffer
from eecore.models.gguf_weights import GGUFWeight
from eecore.models.int8_weights import Int8Weight

linux_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE (not Linux)")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return "never"


def _smaps_entry(address: int) -> tuple[int, int, dict[str, str]]:
    """The mapping holding `address`: its start, end and /proc/self/smaps fields."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= address < int(m.group(2), 16):
            fields = {}
            for entry in lines[i + 1:]:
                if re.match(r"[0-9a-f]+-[0-9a-f]+ ", entry):
                    break
                key, _, value = entry.partition(":")
                fields[key] = value.strip()
            return int(m.group(1), 16), int(m.group(2), 16), fields
    raise AssertionError(f"no mapping holds {address:#x}")


class _Holder:
    pass


def _holder(**attributes) -> _Holder:
    holder = _Holder()
    for name, value in attributes.items():
        setattr(holder, name, value)
    return holder


@linux_thp
def test_place_copies_each_tensor_once_aligned(monkeypatch):
    monkeypatch.delenv("EECORE_HUGE_PAGES", raising=False)
    a, b = torch.randn(300, 7), torch.randint(-127, 128, (5, 33), dtype=torch.int8)
    c = torch.randn(3, dtype=torch.bfloat16)
    h = _holder(a=a, pair=[b, a], c=(c,))
    assert place_in_huge_pages((h, ("a", "pair", "c")))
    assert h.pair[1] is h.a  # `a` held twice, copied once
    for got, t in ((h.a, a), (h.pair[0], b), (h.c[0], c)):
        assert got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous()
        assert torch.equal(got, t) and got.data_ptr() != t.data_ptr()
        assert got.data_ptr() % 64 == 0
    # one mapping, starting on a huge-page boundary, in the order met
    assert h.a.data_ptr() % HUGE_PAGE_BYTES == 0
    assert h.a.data_ptr() < h.pair[0].data_ptr() < h.c[0].data_ptr()
    h.a.zero_()  # the copies are writable and independent of the originals
    assert a.abs().sum() > 0


@linux_thp
def test_place_leaves_what_was_written_in_place(monkeypatch):
    monkeypatch.delenv("EECORE_HUGE_PAGES", raising=False)
    buffer = weight_buffer(4096)
    inside, outside = buffer[64:128], torch.randn(16)
    h = _holder(inside=inside, outside=outside)
    assert place_in_huge_pages((h, ("inside", "outside")))
    assert h.inside is inside and h.outside is not outside and torch.equal(h.outside, outside)


def test_place_refuses_strided_or_non_cpu_tensors():
    with pytest.raises(ValueError, match="expected contiguous CPU tensors, got cpu strided"):
        place_in_huge_pages((_holder(w=torch.randn(4, 4).t()), ("w",)))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="expected contiguous CPU tensors, got cuda"):
            place_in_huge_pages((_holder(w=torch.randn(4, device="cuda")), ("w",)))


def test_disabled_or_empty_places_nothing(monkeypatch):
    monkeypatch.setenv("EECORE_HUGE_PAGES", "0")
    assert not huge_pages_enabled()
    w = torch.randn(8)
    h = _holder(w=w)
    assert not place_in_huge_pages((h, ("w",))) and h.w is w
    monkeypatch.delenv("EECORE_HUGE_PAGES")
    assert not place_in_huge_pages((_holder(w=None), ("w",)))
    assert not place_in_huge_pages((_holder(w=torch.empty(0)), ("w",)))


@linux_thp
@pytest.mark.parametrize("weight_dtype", [None, torch.int8])
def test_llama_weights_live_in_one_advised_mapping(tmp_path, monkeypatch, weight_dtype):
    from eecore.models.llama import LlamaModel
    from eecore.models.loader import load_model
    from model_factory import make_tiny_hf_model

    path, _ = make_tiny_hf_model(tmp_path, num_layers=2, vocab_size=200, tie=True, with_tokenizer=False)
    loaded = load_model(path, dtype=torch.float32)
    cpu = torch.device("cpu")
    monkeypatch.setenv("EECORE_HUGE_PAGES", "0")
    plain = LlamaModel(loaded.config, loaded.state_dict, torch.float32, cpu, weight_dtype=weight_dtype)
    monkeypatch.delenv("EECORE_HUGE_PAGES")
    packed = LlamaModel(loaded.config, loaded.state_dict, torch.float32, cpu, weight_dtype=weight_dtype)

    def tensors(model):
        out = [model.embed, model.final_norm, model.lm_head]
        for layer in model.layers:
            out += [layer.input_norm, layer.qkv, layer.o_proj, layer.post_norm, layer.gate_up, layer.down]
        # an 8-bit weight's tensors (Int8Weight: integers and scales; GGUFWeight: blocks and their
        # repacked copy), as place_in_huge_pages walks a dataclass
        return [u for t in out for u in ((t,) if isinstance(t, torch.Tensor) else
                                         [getattr(t, f.name) for f in dataclasses.fields(t)
                                          if isinstance(getattr(t, f.name), torch.Tensor)])]

    for want, got in zip(tensors(plain), tensors(packed), strict=True):
        assert torch.equal(got, want) and got.data_ptr() != want.data_ptr()
    if weight_dtype is None:
        assert packed.lm_head is packed.embed  # tied: still one tensor
    else:
        eight_bit = (Int8Weight, GGUFWeight)  # int8_weights.eight_bit
        assert isinstance(packed.lm_head, eight_bit) and isinstance(packed.layers[0].qkv, eight_bit)
    start, end, fields = _smaps_entry(packed.embed.data_ptr())
    assert all(start <= t.data_ptr() < end for t in tensors(packed))
    assert not any(start <= t.data_ptr() < end for t in tensors(plain))
    if _thp_mode() != "never" and "THPeligible" in fields:  # the field exists since Linux 5.0
        assert fields["THPeligible"] == "1"


@linux_thp
def test_generation_is_the_same_with_and_without_huge_pages(tmp_path, monkeypatch):
    import eecore
    from model_factory import make_tiny_hf_model

    path, _ = make_tiny_hf_model(tmp_path, num_layers=2, vocab_size=200, with_tokenizer=False)
    prompts = [[5, 17, 42, 7], [9, 3]]
    params = eecore.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for setting in ("0", "1"):
        monkeypatch.setenv("EECORE_HUGE_PAGES", setting)
        llm = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=16, block_size=8)
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert outputs[0] == outputs[1]


@linux_thp
def test_zeros_in_huge_pages(monkeypatch):
    from eecore.models.huge_pages import zeros_in_huge_pages

    monkeypatch.delenv("EECORE_HUGE_PAGES", raising=False)
    t = zeros_in_huge_pages((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0 and not t.any()
    t[1, 2, 3] = 2.5
    assert t.sum() == 2.5
    assert zeros_in_huge_pages((0, 4), torch.float32) is None  # nothing to map
    monkeypatch.setenv("EECORE_HUGE_PAGES", "0")
    assert zeros_in_huge_pages((4,), torch.float32) is None


@linux_thp
def test_kv_cache_lives_in_huge_pages(monkeypatch):
    from eecore.engine.kv_cache import KVCache

    monkeypatch.delenv("EECORE_HUGE_PAGES", raising=False)
    kv = KVCache(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert kv.tensor.shape == (2, 2, 7, 4, 2, 8) and not kv.tensor.any()  # 6 blocks and the pad block
    start, end, fields = _smaps_entry(kv.tensor.data_ptr())
    assert start <= kv.tensor.data_ptr() + kv.tensor.nbytes - 1 < end
    if _thp_mode() != "never" and "THPeligible" in fields:
        assert fields["THPeligible"] == "1"
    kv.k(1)[3, 2] = 1.0  # the per-layer views write into the one tensor
    kv.copy_slots(torch.tensor([3 * 4 + 2]), torch.tensor([0]))
    assert torch.equal(kv.k(1)[0, 0], torch.ones(2, 8)) and kv.tensor.sum() == 2 * 16
    monkeypatch.setenv("EECORE_HUGE_PAGES", "0")
    plain = KVCache(2, 6, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert not plain.tensor.any() and plain.tensor.shape == kv.tensor.shape


@linux_thp
@pytest.mark.parametrize("variant", ["v1.1", "original"])
def test_t5_weights_live_in_one_mapping(tmp_path, monkeypatch, variant):
    """Decoder, encoder, cross K/V and bias tables all packed; the tied head of the original T5
    still is its embedding (its outputs against HF: tests/test_t5_model.py)."""
    import eecore
    from eecore.models.huge_pages import _tensors_in
    from t5_factory import make_tiny_t5

    monkeypatch.delenv("EECORE_HUGE_PAGES", raising=False)
    path, _ = make_tiny_t5(tmp_path, variant)
    model = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=16, block_size=4).model
    weights = _tensors_in([model.embed, model.lm_head, model.final_norm, model.layers, model.cross_kv_weight,
                           model.self_bias, model.encoder.bias_weight, model.encoder.final_norm, model.encoder.layers])
    start, end, _ = _smaps_entry(model.embed.data_ptr())
    assert all(start <= t.data_ptr() < end for t in weights)
    assert (model.lm_head is model.embed) == (variant == "original")
