"""The feature head shipped inside the package for the embedded SmolLM2-135M-Instruct: small, it
fits the model it was trained for, and `--draft feature` uses it without a file."""
import os

import pytest

import eecore
from eecore.models.feature_head import SHIPPED_FILE, FeatureHead
from engine_utils import greedy

pytestmark = pytest.mark.slow


def test_the_file_is_in_the_package_and_small_with_its_card():
    assert os.path.getsize(SHIPPED_FILE) <= 10 * 2 ** 20  # the budget
    assert os.path.exists(SHIPPED_FILE.replace(".safetensors", ".md"))
    head = FeatureHead.load(SHIPPED_FILE)
    assert head.vocab is not None and head.info["steps"] > 0 and head.info["heldout"]["agree_1"] > 0.3


def test_the_default_head_drafts_for_the_embedded_model():
    full = eecore.LLM(quantization="none", max_num_seqs=1)
    spec = eecore.LLM(quantization="none", max_num_seqs=1, speculative=eecore.SelfSpeculativeConfig(
        num_speculations=2, feature=eecore.FeatureDrafts()))
    prompt = "def add(a, b):\n    return"
    out = spec.generate(prompt, greedy(16))[0]
    assert out.token_ids == full.generate(prompt, greedy(16))[0].token_ids
    assert out.metrics["num_drafted_tokens"] > 0


def test_another_model_refuses_it(tmp_path):
    from model_factory import make_tiny_hf_model

    path, _ = make_tiny_hf_model(tmp_path, num_layers=2)
    with pytest.raises(ValueError, match="made for a model with"):
        eecore.LLM(path, dtype="float32", device="cpu", speculative=eecore.SelfSpeculativeConfig(
            num_speculations=2, feature=eecore.FeatureDrafts()))
