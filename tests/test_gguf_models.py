"""Quantized GGUF files computed in their own blocks (LLM's default on the CPU): tiny Llama models
written in each block format, against HF transformers on the same (dequantized) weights, and the
loader's and LLM's precision choices and errors."""
from __future__ import annotations

import pytest
import torch

import eecore
from eecore.models.gguf_weights import GGUFWeight, StackedWeight
from eecore.models.int8_weights import dense
from eecore.models.loader import load_model
from engine_utils import greedy, hf_greedy, random_prompts
from model_factory import hf_model_from_gguf, make_tiny_hf_model, write_gguf

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # rows of 256 weights: whole blocks of every format, the K formats' included
    path = tmp_path_factory.mktemp("gguf-models")
    return path, make_tiny_hf_model(path, "llama", hidden_size=256, intermediate_size=512, num_heads=4,
                                    num_kv_heads=2, vocab_size=320)[0]


def _gguf_file(tiny, qtype: str) -> str:
    path, hf_dir = tiny
    target = path / f"tiny-{qtype}.gguf"
    if not target.exists():
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        write_gguf(hf, target, tokenizer_dir=hf_dir, qtype=qtype)
    return str(target)


@pytest.mark.parametrize("qtype", FORMATS)
def test_quantized_file_matches_transformers(tiny, qtype):
    path = _gguf_file(tiny, qtype)
    llm = eecore.LLM(path, device="cpu", num_blocks=64, block_size=8)
    assert llm.weight_format == qtype and llm.dtype == torch.float32
    layer = llm.model.layers[0]
    assert all(isinstance(w, GGUFWeight) for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert isinstance(llm.model.embed, GGUFWeight)

    hf = hf_model_from_gguf(path)
    prompts = random_prompts(320, [5, 11, 3], seed=7)
    outs = llm.generate(prompts, greedy(8, logprobs=1))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 8)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
        expected = torch.log_softmax(logits, dim=-1)
        for step, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(logprobs[token] - float(expected[step, token])) < 2e-4


def test_blocks_are_the_dequantized_weights(tiny):
    """keep_quantized gives the same values as dequantizing (q and k rows unpermuted alike)."""
    path = _gguf_file(tiny, "Q4_K")
    kept = load_model(path, "auto", keep_quantized=True)
    plain = load_model(path, torch.float32)
    assert kept.precision == plain.precision == "Q4_K" and kept.quantized
    for name, tensor in plain.state_dict.items():
        got = kept.state_dict[name]
        assert torch.equal(dense(got, torch.float32) if isinstance(got, GGUFWeight) else got, tensor), name
    assert isinstance(kept.state_dict["model.layers.0.self_attn.q_proj.weight"], GGUFWeight)


def test_mixed_types_in_one_projection(tiny, tmp_path):
    """A Q4_K_M-like file (q, k in Q4_K, v in Q6_K) keeps qkv as a StackedWeight and still decodes
    as its dequantized twin."""
    path = _gguf_file(tiny, "Q4_K")
    loaded = load_model(path, "auto", keep_quantized=True)
    v_name = "model.layers.0.self_attn.v_proj.weight"
    loaded.state_dict[v_name] = GGUFWeight.quantize(dense(loaded.state_dict[v_name], torch.float32), "Q6_K")
    from eecore.models.llama import LlamaModel

    model = LlamaModel(loaded.config, loaded.state_dict, torch.float32, torch.device("cpu"))
    assert isinstance(model.layers[0].qkv, StackedWeight)
    x = torch.randn(3, 256)
    out = torch.empty(3, model.layers[0].qkv.shape[0])
    from eecore.models.int8_weights import project

    project(out, x, model.layers[0].qkv)
    torch.testing.assert_close(out, x @ dense(model.layers[0].qkv, torch.float32).T, rtol=1e-4, atol=1e-4)


def test_dequantized_and_quantized_forms_agree(tiny):
    path = _gguf_file(tiny, "Q4_1")
    quantized = eecore.LLM(path, device="cpu", num_blocks=64, block_size=8)
    plain = eecore.LLM(path, device="cpu", quantization="none", num_blocks=64, block_size=8)
    assert plain.weight_format == "float32" and isinstance(plain.model.layers[0].qkv, torch.Tensor)
    prompts = random_prompts(320, [4, 9, 2, 6], seed=3)
    assert [o.token_ids for o in quantized.generate(prompts, greedy(10))] == \
        [o.token_ids for o in plain.generate(prompts, greedy(10))]


@pytest.mark.parametrize("quantization,expected", [("int8", "Q8_0"), ("q4_0", "Q4_0"), ("q4_k", "Q4_K")])
def test_quantization_of_a_float_checkpoint(tiny, quantization, expected):
    _, hf_dir = tiny
    llm = eecore.LLM(str(hf_dir), device="cpu", quantization=quantization, num_blocks=64, block_size=8)
    assert llm.weight_format == expected
    assert llm.model.layers[0].down.quant_type == eecore.ops.GGUF_QUANT_TYPES[expected]
    full = eecore.LLM(str(hf_dir), device="cpu", num_blocks=64, block_size=8)
    # each weight within its format's rounding error of the float one (4 bits: a fifteenth of a
    # block's range; 8 bits: a 255th), and it decodes
    tolerance = 0.02 if expected == "Q8_0" else 0.15
    for name in ("qkv", "o_proj", "gate_up", "down"):
        got, ref = dense(getattr(llm.model.layers[1], name), torch.float32), getattr(full.model.layers[1], name)
        assert (got - ref).abs().max() <= tolerance * ref.abs().max(), name
    assert len(llm.generate(random_prompts(320, [6], seed=5), greedy(6))[0].token_ids) == 6


def test_auto_dtype_follows_the_checkpoint(tiny, tmp_path):
    _, hf_dir = tiny
    assert eecore.LLM(str(hf_dir), device="cpu", num_blocks=16).dtype == torch.float32  # torch_dtype float32
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    f16 = write_gguf(hf, tmp_path / "f16.gguf", tokenizer_dir=hf_dir, qtype="F16")
    llm = eecore.LLM(f16, device="cpu", num_blocks=16)
    assert llm.dtype == torch.float16 and llm.weight_format == "float16"
    assert eecore.LLM(f16, dtype="bfloat16", device="cpu", num_blocks=16).dtype == torch.bfloat16


def test_bad_quantization_arguments(tiny):
    path = _gguf_file(tiny, "Q8_0")
    with pytest.raises(ValueError, match="'quantization' must be None, 'none' or one of"):
        eecore.LLM(path, device="cpu", quantization="q2_k")
    with pytest.raises(ValueError, match="already quantized \\(Q8_0\\)"):
        eecore.LLM(path, device="cpu", quantization="q4_0")
    with pytest.raises(ValueError, match="'dtype' must be auto, float32"):
        eecore.LLM(path, device="cpu", dtype="int4")


def test_cli_generate_sizes_the_kv_cache_to_its_request(tiny, capsys):
    from eecore.cli import main
    from eecore.cli.generate import request_blocks

    # tokens <= UTF-8 bytes + the template's, plus max_tokens and the verify width; doubled
    assert request_blocks(["héllo"], 10, 16, lookahead=5) == 2 * (-(-(6 + 64 + 10 + 5) // 16) + 1)
    path = _gguf_file(tiny, "Q8_0")
    long_prompt = "ab cd ef " * 40
    assert main(["generate", long_prompt, "--model", path, "--max-tokens", "12", "--temperature", "0",
                 "--device", "cpu", "--chat", "off"]) == 0
    assert "12 tokens in" in capsys.readouterr().err
    # self-speculation writes ahead of the last token: its verify width is reserved too
    assert main(["generate", long_prompt, "--model", path, "--max-tokens", "40", "--temperature", "0",
                 "--device", "cpu", "--chat", "off", "--speculate", "--exit-layer", "1",
                 "--num-speculations", "8"]) == 0
    assert "40 tokens in" in capsys.readouterr().err


def test_blocks_are_copied_once_from_the_file(tiny):
    """The loader writes every kept matrix into one buffer, each layer's q, k, v (and gate, up) back
    to back, so stacking them is a view and huge-page placement leaves them where they are."""
    llm = eecore.LLM(_gguf_file(tiny, "Q8_0"), device="cpu", num_blocks=16)
    storage = llm.model.embed.data.untyped_storage().data_ptr()
    for layer in llm.model.layers:
        for weight in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert weight.data.untyped_storage().data_ptr() == storage
    plain = load_model(_gguf_file(tiny, "Q8_0"), torch.float32)
    qkv = torch.cat([plain.state_dict[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(dense(llm.model.layers[1].qkv, torch.float32), qkv)


def test_quantize_state_dict_falls_back_as_llama_cpp_does():
    from eecore.models.gguf_weights import quantize_state_dict

    g = torch.Generator().manual_seed(0)
    state = {"wide": torch.randn(4, 512, generator=g), "narrow": torch.randn(4, 96, generator=g),
             "odd": torch.randn(4, 40, generator=g), "norm": torch.randn(96, generator=g)}
    odd, norm = state["odd"], state["norm"]
    quantize_state_dict(state, "Q4_K")
    types = {v: k for k, v in eecore.ops.GGUF_QUANT_TYPES.items()}
    assert types[state["wide"].quant_type] == "Q4_K" and types[state["narrow"].quant_type] == "Q5_0"
    assert state["odd"] is odd and state["norm"] is norm  # no whole blocks / not a matrix: as they were


@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_truncated_quantized_file_is_refused(tiny, tmp_path, keep):
    from eecore.models.errors import CorruptCheckpointError

    source = _gguf_file(tiny, "Q4_K")
    target = tmp_path / "cut.gguf"
    data = open(source, "rb").read()
    target.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CorruptCheckpointError, match="cut.gguf: .*truncated"):
        eecore.LLM(str(target), device="cpu")
