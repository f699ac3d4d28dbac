"""HF transformers running on eecore's kernels (eecore.integrations.transformers): a Llama model
from transformers gives the same logits and greedy tokens with attn_implementation="eecore" and
eecore's RMSNorm as with its own attention, alone and as a left-padded batch."""
import copy

import pytest
import torch

from eecore import ops
from eecore.integrations import transformers as eet
from model_factory import make_tiny_hf_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    eet.register()
    path, _ = make_tiny_hf_model(tmp_path_factory.mktemp("integration"), num_layers=3, num_heads=4,
                                 num_kv_heads=2)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eecore").eval()
    assert eet.use_eecore_rms_norm(ours) == 2 * 3 + 1
    return ref, ours


def test_logits_equal_transformers_attention(models, monkeypatch):
    ref, ours = models
    calls = []
    attention = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda *a: calls.append(1) or attention(*a))
    ids = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)
    assert len(calls) == 3  # one paged_attention call a layer: the kernels did run


def test_left_padded_batch_and_generate(models):
    ref, ours = models
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, as generate's batches have
    mask[2, :1] = 0
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-4, rtol=1e-4)
    config = copy.deepcopy(ref.generation_config)
    config.do_sample, config.max_new_tokens, config.eos_token_id, config.pad_token_id = False, 12, 10 ** 6, 0
    out_ours = ours.generate(ids, attention_mask=mask, generation_config=config)
    out_ref = ref.generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(out_ours, out_ref)


def test_refuses_what_it_does_not_implement(models):
    _, ours = models
    q = torch.randn(1, 4, 3, 8)
    kv = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="dropout"):
        eet.eecore_attention(ours.model.layers[0].self_attn, q, kv, kv, None, dropout=0.1)
