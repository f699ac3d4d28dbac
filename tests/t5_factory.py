"""Tiny random-weight T5 models for tests, made with transformers' own classes. Nothing is downloaded.

    path, hf = make_tiny_t5(tmp_path, variant="v1.1")      # gated-GELU, untied head, no output scaling
    path, hf = make_tiny_t5(tmp_path, variant="original")  # ReLU, head tied to the embedding, scaled

The folder holds config.json in the spelling of the released checkpoints (`tie_word_embeddings`
false for v1.1, true for the original; no `scale_decoder_outputs`), model.safetensors with every
tensor the HF model uses (v1.1 keeps its own lm_head.weight), and a tiny SentencePiece-style
Unigram tokenizer.json whose post-processor appends </s>, as T5's does. The HF model comes back in
fp32 eval mode; its norm gains are randomized (HF sets them to 1, which would hide a swapped norm).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

T5_CORPUS = [
    "translate English to German: the house is wonderful",
    "summarize: studies have shown that owning a dog is good for you",
    "the quick brown fox jumps over the lazy dog",
    "question: what is early exit? context: easy tokens leave the decoder after a few layers",
    "numbers 0 1 2 3 4 5 6 7 8 9 and words",
] * 6


def make_tiny_t5(tmp_path, variant: str = "v1.1", *, d_model: int = 32, d_kv: int = 8, num_heads: int = 4,
                 d_ff: int = 48, num_layers: int = 2, num_decoder_layers: int = 3, vocab_size: int = 96,
                 num_buckets: int = 8, max_distance: int = 20, seed: int = 0, with_tokenizer: bool = True,
                 subdir: str | None = None):
    """Save a random T5 ("v1.1" or "original") under tmp_path; return (path, hf_model).
    Small `num_buckets`/`max_distance` make the bias saturate within short test sequences."""
    import transformers

    if variant not in ("v1.1", "original"):
        raise ValueError(f"variant must be 'v1.1' or 'original', got {variant!r}")
    v11 = variant == "v1.1"
    config = transformers.T5Config(
        vocab_size=vocab_size, d_model=d_model, d_kv=d_kv, d_ff=d_ff, num_layers=num_layers,
        num_decoder_layers=num_decoder_layers, num_heads=num_heads, relative_attention_num_buckets=num_buckets,
        relative_attention_max_distance=max_distance, feed_forward_proj="gated-gelu" if v11 else "relu",
        tie_word_embeddings=not v11, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("relative_attention_bias.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
        if not v11:
            # With HF's unit-variance embedding, the tied head mostly reads the input token's own
            # embedding back from the residual stream and repeats it; a smaller one lets the
            # layers decide, so greedy outputs vary and a wrong layer shows.
            model.shared.weight.mul_(0.1)
        else:
            # transformers 5 ties T5's head to the embedding even for v1.1; the released v1.1
            # checkpoints have a head of their own, so give the oracle one.
            model.lm_head.weight = torch.nn.Parameter(0.2 * torch.randn(vocab_size, d_model, generator=generator))

    path = Path(tmp_path) / (subdir or f"tiny-t5-{variant}")
    save_tiny_t5(model, path)
    if with_tokenizer:
        write_t5_tokenizer(path, vocab_size)
    return str(path), model


def save_tiny_t5(model, path) -> None:
    """(Re)write `model`'s config.json and model.safetensors in the released checkpoints' spelling."""
    from safetensors.torch import save_file

    v11 = model.config.feed_forward_proj == "gated-gelu"
    path = Path(path)
    model.save_pretrained(path)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()
               if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}
    if not v11:
        tensors.pop("lm_head.weight", None)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(path / f)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with open(path / "config.json") as f:
        raw = json.load(f)
    raw.pop("scale_decoder_outputs", None)
    raw["tie_word_embeddings"] = not v11
    with open(path / "config.json", "w") as f:
        json.dump(raw, f, indent=2)


def write_t5_tokenizer(path, vocab_size: int) -> None:
    """A Unigram tokenizer with Metaspace pre-tokenization (SentencePiece's shape, as T5's
    tokenizer.json has), ids 0/1/2 = <pad>/</s>/<unk>, and a post-processor appending </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    tokenizer.train_from_iterator(T5_CORPUS, trainer=trainer)
    assert tokenizer.get_vocab_size() <= vocab_size and tokenizer.token_to_id("</s>") == 1
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                             special_tokens=[("</s>", 1)])
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "T5TokenizerFast", "eos_token": "</s>", "pad_token": "<pad>",
                   "unk_token": "<unk>"}, f)


def hf_t5_greedy(hf_model, encoder_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one encoder input by T5ForConditionalGeneration's forward, recomputed
    from scratch at every step (no cache; EOS does not stop it), without the decoder start token.
    HF's `generate` is not used: transformers 5.23 sizes its cache by the encoder's depth and fails
    on a T5 whose decoder is deeper."""
    start = hf_model.config.decoder_start_token_id
    encoder = torch.tensor([encoder_ids])
    decoded = [start]
    with torch.no_grad():
        encoder_out = hf_model.get_encoder()(input_ids=encoder)
        for _ in range(max_new_tokens):
            logits = hf_model(encoder_outputs=encoder_out, decoder_input_ids=torch.tensor([decoded])).logits
            decoded.append(int(logits[0, -1].argmax()))
    return decoded[1:]


def hf_t5_generate(hf_model, encoder_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`'s greedy continuation (EOS does not stop it), without the decoder start token."""
    import copy

    config = copy.deepcopy(hf_model.generation_config)
    config.eos_token_id = hf_model.config.vocab_size + 1000  # a token that cannot occur
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.temperature = config.top_p = config.top_k = None
    ids = torch.tensor([encoder_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, 1:].tolist()
