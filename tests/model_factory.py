"""Tiny random-weight models for tests: HF checkpoints made with `transformers`, and GGUF files made
from them the way llama.cpp's converter would. Nothing is downloaded.

    path, hf_model = make_tiny_hf_model(tmp_path, arch="qwen2", tie=True)
    gguf_path = write_gguf(hf_model, tmp_path / "tiny.gguf", tokenizer_dir=path)

The HF model comes back in fp32 eval mode. Its weights are deterministic for a seed, and the norm
gains and biases are randomized too (HF initializes them to 1 and 0, which would hide a swapped or
missing norm/bias in a comparison).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from eecore.models.lora import LLAMA_TARGETS, LoraDeltas

# A small corpus for the tiny byte-level BPE tokenizer: words, code, digits, unicode.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * 2)\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 1234 3.14159",
    "Unicode: café naïve 日本語 Привет 🤖 ✓",
    "Early exit lets easy tokens leave the network after a few layers.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
] * 4

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_hf_model(tmp_path, arch: str = "llama", *, tie: bool = False, num_kv_heads: int = 2,
                       num_heads: int = 4, hidden_size: int = 64, intermediate_size: int = 96,
                       num_layers: int = 2, vocab_size: int = 320, head_dim: int | None = None,
                       rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                       max_position_embeddings: int = 512, rms_norm_eps: float = 1e-5, seed: int = 0,
                       max_shard_size: str | int | None = None, with_tokenizer: bool = True,
                       subdir: str | None = None):
    """Save a random `arch` ("llama" | "mistral" | "qwen2") causal LM under tmp_path and return
    (path, hf_model). `max_shard_size` (e.g. "20KB") makes a sharded checkpoint with an index.
    With `with_tokenizer` the folder also gets a byte-level BPE tokenizer trained on a small corpus
    (vocabulary <= vocab_size, ids 0..2 the ChatML special tokens, eos <|im_end|>) and a chat template."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2, pad_token_id=None,
    )
    if head_dim is not None:
        kwargs["head_dim"] = head_dim
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))

    path = Path(tmp_path) / (subdir or f"tiny-{arch}")
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    if with_tokenizer:
        write_tiny_tokenizer(path, vocab_size)
    return str(path), model


def make_peaked_tiny_model(tmp_path, **kwargs):
    """make_tiny_hf_model with its LM head scaled up 25x and saved again, so its distributions are
    peaked (HF's 0.02-std init gives near-uniform ones, which leave exits little to learn)."""
    path, model = make_tiny_hf_model(tmp_path, **kwargs)
    with torch.no_grad():
        model.lm_head.weight.mul_(25.0)
    model.save_pretrained(path)
    return path, model


def load_for_windows(path, batch: int, seq_len: int, **kwargs):
    """An fp32 CPU eecore.LLM of `path` sized for training windows: `batch` sequences of `seq_len`
    tokens in one step (the trainers' teacher passes), and one generated token more."""
    import eecore

    return eecore.LLM(path, dtype="float32", device="cpu", max_num_seqs=batch, max_num_batched_tokens=batch * seq_len,
                      max_model_len=seq_len + 1, **kwargs)


def write_tiny_tokenizer(path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (SmolLM2-style pre-tokenizer: single digits, then GPT-2's split)
    trained on `_CORPUS`, saved as tokenizer.json + tokenizer_config.json with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    assert tokenizer.get_vocab_size() <= vocab_size
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                   "eos_token": "<|im_end|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
                   "chat_template": CHATML_TEMPLATE}, f)


# ---- GGUF -------------------------------------------------------------------------------------


def hf_model_from_gguf(path):
    """transformers' own loading of a GGUF file in fp32 (eval mode): the oracle for GGUF models."""
    from unittest import mock

    import transformers
    import transformers.modeling_utils as modeling_utils

    dirname, basename = os.path.split(str(path))
    # transformers refuses GGUF files unless `accelerate` is installed, although its dequantizing
    # path does not use it; lift the gate so the comparison also runs where accelerate is absent.
    with mock.patch.object(modeling_utils, "is_accelerate_available", return_value=True):
        model = transformers.AutoModelForCausalLM.from_pretrained(dirname, gguf_file=basename, dtype=torch.float32)
    return model.eval()


def llamacpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter: within each head, row j*D/2 + i (rotate-half layout) goes to row 2*i + j."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def write_gguf(hf_model, path, *, tokenizer_dir=None, qtype: str = "F32", arch: str | None = None,
               tokenizer_pre: str = "smollm", rope_freqs: torch.Tensor | None = None,
               extra_metadata: dict | None = None, skip_tensors: tuple[str, ...] = ()) -> str:
    """Write `hf_model` as llama.cpp would: arch "llama" (Q/K rows permuted) or "qwen2" (not
    permuted), its tensors as `qtype` ("F32", "F16" or any type eecore.models.gguf_quantize writes, e.g. "Q8_0";
    norms and biases always F32), and, given `tokenizer_dir`, the tiny tokenizer as "gpt2" metadata."""
    import gguf

    config = hf_model.config
    arch = arch or ("qwen2" if config.model_type == "qwen2" else "llama")
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer_dir is not None:
        _add_tokenizer(writer, tokenizer_dir, tokenizer_pre, config.vocab_size)
    for key, value in (extra_metadata or {}).items():
        _add_metadata(writer, key, value)

    qk_heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for hf_name, tensor in hf_model.state_dict().items():
        name = _gguf_name(hf_name)
        if name is None or name in skip_tensors or (config.tie_word_embeddings and hf_name == "lm_head.weight"):
            continue
        tensor = tensor.detach().to(torch.float32)
        proj = hf_name.split(".")[-2]
        if arch == "llama" and proj in qk_heads:
            tensor = llamacpp_permute(tensor, qk_heads[proj])
        _add_tensor(writer, name, tensor.numpy(), qtype if tensor.dim() == 2 else "F32")
    if rope_freqs is not None:
        _add_tensor(writer, "rope_freqs.weight", rope_freqs.to(torch.float32).numpy(), "F32")

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


_GGUF_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str | None:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{_GGUF_LAYER_PARTS[module]}.{parts[-1]}"


def _add_tensor(writer, name: str, array: np.ndarray, qtype: str) -> None:
    import gguf

    if qtype == "F32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:  # the gguf package's quantizers, and eecore's for the K formats it lacks
        from eecore.models.gguf_quantize import quantize

        kind = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor(name, quantize(array, qtype), raw_dtype=kind)


def _add_metadata(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def _add_tokenizer(writer, tokenizer_dir, pre: str, vocab_size: int) -> None:
    """The tiny tokenizer as llama.cpp's "gpt2" metadata, padded with unused tokens to vocab_size."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    tokens = [None] * vocab_size
    for text, index in vocab.items():
        tokens[index] = text
    types = [1] * vocab_size
    for index, text in enumerate(tokens):
        if text in SPECIAL_TOKENS:
            types[index] = 3
        elif text is None:
            tokens[index], types[index] = f"[PAD{index}]", 5
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def random_lora(hf, seed: int) -> LoraDeltas:
    """Random LoRA pairs for every projection of every layer of `hf`."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(hf.named_modules())
    pairs = {}
    for i in range(hf.config.num_hidden_layers):
        for target in LLAMA_TARGETS:
            path = f"model.layers.{i}.{target}"
            out, inp = modules[path].weight.shape
            pairs[path] = (0.3 * torch.randn(2, inp, generator=g), 0.3 * torch.randn(out, 2, generator=g))
    return LoraDeltas(pairs, scale=0.5)


_SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello world! Hello there, how are you today?",
    "def add(a, b):\n    return a + b", "Numbers like 12 and 345 and 6789 appear here.",
    "café naïve résumé über straße", "Early exit lets easy tokens leave after a few layers.",
] * 20


def write_sentencepiece_gguf(folder):
    """A SentencePiece BPE tokenizer with byte fallback (a Llama 2 kind of vocabulary) trained on a
    small corpus, in the GGUF file of a one-layer model: (the sentencepiece processor, the path)."""
    import io

    import sentencepiece as spm
    from transformers import LlamaConfig, LlamaForCausalLM

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_SPM_CORPUS), model_writer=proto, model_type="bpe", vocab_size=400,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else
             5 if sp.is_unused(i) else 1 for i in range(n)]
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)], "tokenizer.ggml.token_type": types,
                "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.unknown_token_id": 0}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=n, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    path = write_gguf(model, Path(folder) / "spm.gguf", extra_metadata=metadata)
    return sp, path
