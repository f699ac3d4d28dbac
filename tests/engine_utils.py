"""Helpers for engine tests: tiny models made on the spot, HF greedy references."""
from __future__ import annotations

import torch

import eecore


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy continuation of one prompt (no EOS stop)."""
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def greedy(max_tokens: int, **kw) -> eecore.SamplingParams:
    return eecore.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]
