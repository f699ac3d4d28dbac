"""EECORE_FUSED_PROJECTIONS=1 through the whole engine: each layer runs qkv_projection,
linear_residual and gate_up_projection instead of the nine ops they fuse, and the engine gives the
same tokens and log-probabilities as without them, for full depth with requests arriving (steps
with prompt chunks, which take the separate ops on a GPU, between fused decode steps), and for
self-speculation (draft and verify passes). On the CPU the fused ops run the separate ones, so this
checks the model's wiring (which buffer, norm and weight goes where); on a GPU in bf16, with
linear's gemv_mma kernel on both sides, it checks the fused kernels' bits as well."""
import pytest
import torch

import eecore
from eecore.models.llama import LlamaModel
from eecore.models.loader import load_model
from cuda_tests import DEVICES
from engine_utils import generate_arriving, greedy, random_prompts
from model_factory import make_tiny_hf_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: biases on the QKV projection
def tiny(request, tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=4)


def _runs(path, device, monkeypatch, make_requests, **kw):
    """The engine's outputs without and with the fused projections."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    monkeypatch.setenv("EECORE_LINEAR_KERNEL", "gemv_mma")  # the bits the fused kernels keep (GPU)
    outs = []
    for fused in ("0", "1"):
        monkeypatch.setenv("EECORE_FUSED_PROJECTIONS", fused)
        llm = eecore.LLM(path, dtype=dtype, device=device, num_blocks=64, block_size=4, **kw)
        assert llm.engine.runner.model.fused_projections == (fused == "1")
        outs.append(make_requests(llm))
    return outs


def _assert_same(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b):
        assert x.logprobs == y.logprobs


@pytest.mark.parametrize("device", DEVICES)
def test_full_depth_gives_the_same_outputs(tiny, device, monkeypatch):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [9, 3, 21, 14, 7, 30, 2, 11], seed=31)
    params = [greedy(4 + 2 * i, logprobs=2) for i in range(len(prompts))]
    plain, fused = _runs(path, device, monkeypatch, lambda llm: generate_arriving(llm, prompts, params),
                         max_num_batched_tokens=32)
    _assert_same(plain, fused)


@pytest.mark.parametrize("device", DEVICES)
def test_self_speculation_gives_the_same_outputs(tiny, device, monkeypatch):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [6, 13, 4], seed=32)
    params = [greedy(10, logprobs=1) for _ in prompts]
    spec = eecore.SelfSpeculativeConfig(exit_layer=2, num_speculations=3)
    plain, fused = _runs(path, device, monkeypatch, lambda llm: llm.generate(prompts, params), speculative=spec)
    _assert_same(plain, fused)


def test_quantized_weights_keep_the_separate_ops(tiny, monkeypatch):
    """The fused ops take dense weights in the model's dtype: an 8-bit model keeps the separate ops."""
    path, _ = tiny
    monkeypatch.setenv("EECORE_FUSED_PROJECTIONS", "1")
    loaded = load_model(path)
    assert LlamaModel(loaded.config, dict(loaded.state_dict), torch.float32, "cpu").fused_projections
    assert not LlamaModel(loaded.config, dict(loaded.state_dict), torch.float32, "cpu",
                          weight_dtype=torch.int8).fused_projections
