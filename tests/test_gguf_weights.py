"""A model whose projections and LM head are GGUFWeights (their GGUF block bytes, computed by
linear_gguf) decodes as the same model with those weights dequantized: the same greedy tokens and
logits up to summation order, on the engine at several batch sizes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

import eecore
from eecore.models.gguf_weights import GGUFWeight, StackedWeight, stack_weights
from eecore.models.int8_weights import dense, project
from engine_utils import greedy, random_prompts
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("gguf-weights"), num_layers=2, hidden_size=64,
                              intermediate_size=96)


def _to_gguf(weight: torch.Tensor, name: str) -> GGUFWeight:
    qtype = GGMLQuantizationType[name]
    return GGUFWeight(torch.from_numpy(quantize(weight.float().numpy(), qtype)), int(qtype), weight.shape[1])


def _pair(path, name: str):
    """(an LLM whose projections and LM head are GGUFWeights of type `name`, one with the same
    values dequantized to dense fp32)."""
    quantized = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=64, block_size=4)
    dense = eecore.LLM(path, dtype="float32", device="cpu", num_blocks=64, block_size=4)
    for lq, ld in zip(quantized.model.layers, dense.model.layers):
        for field in ("qkv", "o_proj", "gate_up", "down"):
            weight = _to_gguf(getattr(lq, field), name)
            object.__setattr__(lq, field, weight)
            object.__setattr__(ld, field, weight.dequantize(torch.float32))
    head = _to_gguf(quantized.model.lm_head, name)
    quantized.model.lm_head_proj = head
    dense.model.lm_head_proj = head.dequantize(torch.float32)
    return quantized, dense


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_model_decodes_as_its_dequantized_twin(tiny, name):
    path, hf = tiny
    quantized, dense = _pair(path, name)
    prompts = random_prompts(hf.config.vocab_size, [3, 9, 17, 5, 12, 2, 7], seed=4)
    params = [greedy(6 + i, logprobs=3) for i in range(len(prompts))]
    outs_q, outs_d = quantized.generate(prompts, params), dense.generate(prompts, params)
    assert [o.token_ids for o in outs_q] == [o.token_ids for o in outs_d]
    for a, b in zip(outs_q, outs_d):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert all(abs(step_a[t] - step_b[t]) < 1e-4 for t in step_a.keys() & step_b.keys())


def test_stack_weights_keeps_one_type_together_and_mixed_types_apart():
    rng = np.random.default_rng(0)
    w = torch.from_numpy(rng.standard_normal((6, 64)).astype(np.float32))
    q = _to_gguf(w, "Q8_0")
    assert q.shape == (6, 64)
    both = stack_weights([q, q.rows(torch.tensor([1, 3]))])
    assert isinstance(both, GGUFWeight)
    assert torch.equal(both.dequantize(torch.float32)[6:], q.dequantize(torch.float32)[[1, 3]])
    mixed = stack_weights([q, _to_gguf(w, "Q4_0"), w[:2]])
    assert isinstance(mixed, StackedWeight) and mixed.shape == (14, 64)
    x, bias = torch.randn(3, 64), torch.randn(14)
    out = torch.randn(3, 14)
    expected = out + x @ dense(mixed, torch.float32).T + bias
    torch.testing.assert_close(project(out, x, mixed, bias, accumulate=True), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one input size"):
        stack_weights([q, w[:, :32]])
