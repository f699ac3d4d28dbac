"""T5 (v1.1 and the original) on the paged engine against HF's T5ForConditionalGeneration (fp32):
encoder outputs, decoder logits, greedy tokens; batches, preemption, text, streaming, errors."""
import json
import os

import pytest
import torch

import eecore
from eecore.engine.inputs import Row
from eecore.models import CorruptCheckpointError, UnsupportedModelError
from engine_utils import greedy, random_prompts
from t5_factory import hf_t5_generate, hf_t5_greedy, make_tiny_t5

VARIANTS = ["v1.1", "original"]


@pytest.fixture(scope="module", params=VARIANTS)
def tiny(request, tmp_path_factory):
    return make_tiny_t5(tmp_path_factory.mktemp("t5"), request.param)


def _llm(path, **kw):
    kw = {"num_blocks": 96, "block_size": 4, **kw}
    return eecore.LLM(path, dtype="float32", device="cpu", **kw)


def _prompts(hf, lengths, seed=0):
    # avoid id 0 (pad) and 1 (</s>) inside the inputs, end each with </s> as the tokenizer does
    return [[2 + t % (hf.config.vocab_size - 2) for t in p] + [1] for p in random_prompts(hf.config.vocab_size, lengths, seed)]


def test_config_and_weights_are_read(tiny):
    path, hf = tiny
    model = _llm(path).model
    c = model.config
    assert (c.num_encoder_layers, c.num_layers, c.hidden_size, c.head_dim, c.num_heads) == (2, 3, 32, 8, 4)
    v11 = hf.config.feed_forward_proj == "gated-gelu"
    assert c.gated == v11 and c.activation == ("gelu_new" if v11 else "relu")
    assert c.scale_decoder_outputs == (not v11)
    assert (model.lm_head is model.embed) == (not v11)
    assert c.eos_token_ids == (1,) and model.decoder_prompt() == [0]


def test_encoder_outputs_match_hf_for_a_batch_of_lengths(tiny):
    path, hf = tiny
    model = _llm(path).model
    prompts = _prompts(hf, [5, 12, 1, 27], seed=1)  # 27 > max_distance: saturated buckets too
    ours = model.encode(prompts)
    offset = 0
    for prompt in prompts:
        with torch.no_grad():
            theirs = hf.encoder(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(ours[offset: offset + len(prompt)], theirs, atol=1e-5, rtol=1e-5)
        offset += len(prompt)
    assert offset == ours.shape[0]


def test_decoder_logits_match_hf_teacher_forced_batch(tiny):
    """A batch of requests, each with its own encoder input and a teacher-forced decoder sequence,
    in one prefill step: every decoder position's logits equal HF's."""
    path, hf = tiny
    llm = _llm(path)
    encoder_inputs = _prompts(hf, [7, 3, 19], seed=2)
    decoder_inputs = [[0] + p for p in random_prompts(hf.config.vocab_size, [25, 4, 11], seed=3)]
    rows = []
    for enc, dec in zip(encoder_inputs, decoder_inputs):
        seq = llm.engine.add_request(enc, greedy(1))
        seq.prompt_token_ids = dec  # teacher forcing: the decoder's tokens, as a prompt
        llm.engine.blocks.grow(seq, len(dec))
        rows.append(Row(seq, 0, dec))
    _, hidden = llm.engine.runner.forward(rows)
    logits = torch.cat([llm.engine.runner.logits(hidden[i:i + 8]).clone() for i in range(0, hidden.shape[0], 8)])
    offset = 0
    for enc, dec in zip(encoder_inputs, decoder_inputs):
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor([enc]), decoder_input_ids=torch.tensor([dec])).logits[0]
        torch.testing.assert_close(logits[offset: offset + len(dec)], theirs, atol=1e-4, rtol=1e-4)
        offset += len(dec)


def test_greedy_tokens_match_hf_for_a_batch_of_prompts(tiny):
    path, hf = tiny
    prompts = _prompts(hf, [4, 16, 1, 30], seed=4)
    outs = _llm(path).generate(prompts, greedy(12))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_t5_greedy(hf, prompt, 12)
        assert out.exit_layers == [3] * 12
        assert out.prompt_token_ids == prompt and out.metrics["num_prompt_tokens"] == len(prompt)
        assert out.finish_reason == "length"


def test_greedy_tokens_match_hf_generate(tmp_path):
    """HF's own generate (with its KV cache), on a T5 whose encoder and decoder are equally deep
    (transformers 5.23's generate cannot run a deeper decoder)."""
    path, hf = make_tiny_t5(tmp_path, "v1.1", num_layers=2, num_decoder_layers=2, seed=5)
    prompts = _prompts(hf, [6, 13], seed=5)
    outs = _llm(path).generate(prompts, greedy(10))
    assert [o.token_ids for o in outs] == [hf_t5_generate(hf, p, 10) for p in prompts]


def test_text_prompt_goes_through_the_tokenizer(tiny):
    path, hf = tiny
    llm = _llm(path)
    text = "summarize: the quick brown fox"
    ids = llm.tokenizer.encode(text)
    assert ids[-1] == 1, "T5's tokenizer appends </s>"
    out = llm.generate(text, greedy(8))[0]
    assert out.prompt_token_ids == ids and out.prompt == text
    assert out.token_ids == hf_t5_greedy(hf, ids, 8)
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_eos_stops_and_streaming_gives_the_same_tokens(tiny):
    path, hf = tiny
    llm = _llm(path)
    prompts = _prompts(hf, [5, 9], seed=6)
    params = eecore.SamplingParams(max_tokens=10, temperature=0.0)
    full = llm.generate(prompts, params)
    streamed = {0: [], 1: []}
    for delta in llm.generate_stream(prompts, params):
        streamed[delta.index] += delta.token_ids
    assert [streamed[0], streamed[1]] == [o.token_ids for o in full]
    for o, p in zip(full, prompts):
        expected = hf_t5_greedy(hf, p, 10)
        if 1 in expected:  # EOS (id 1) ends generation, and is the last token
            expected = expected[: expected.index(1) + 1]
        assert o.token_ids == expected


def test_batch_invariance(tiny):
    path, hf = tiny
    llm = _llm(path, num_blocks=256)
    prompts = _prompts(hf, [9, 3, 21, 14, 7, 30, 2, 11], seed=7)
    alone = llm.generate([prompts[2]], greedy(16))[0].token_ids
    batched = llm.generate(prompts, greedy(16))[2].token_ids
    assert alone == batched


def test_sampling_is_seeded_and_batch_invariant(tiny):
    path, hf = tiny
    llm = _llm(path, num_blocks=128)
    prompts = _prompts(hf, [6, 10, 3], seed=8)
    params = eecore.SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=123, ignore_eos=True)
    alone = llm.generate([prompts[1]], params)[0].token_ids
    batched = llm.generate(prompts, params)[1].token_ids
    assert alone == batched and len(set(alone)) > 1


def test_preemption_returns_cross_blocks_and_keeps_outputs(tiny):
    path, hf = tiny
    prompts = _prompts(hf, [6, 10, 3, 8], seed=9)
    expected = [o.token_ids for o in _llm(path, num_blocks=128).generate(prompts, greedy(20))]
    tight = _llm(path, num_blocks=16)
    seqs = [tight.engine.add_request(p, greedy(20), i) for i, p in enumerate(prompts)]
    saw_cross = False
    while tight.engine.has_unfinished():
        tight.engine.step()
        for s in tight.engine.scheduler.running:
            assert len(s.cross_block_table) == -(-len(s.encoder_token_ids) // 4)
            saw_cross = True
        held = sum(len(s.block_table) + len(s.cross_block_table) for s in seqs)
        assert held + tight.engine.blocks.num_free_blocks == 16  # no block lost or shared
    outs = [tight.engine.output(s) for s in seqs]
    assert saw_cross
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the cache was meant to be too small"
    assert tight.engine.blocks.num_free_blocks == 16


def test_prompt_that_cannot_fit_with_its_cross_blocks_is_refused(tiny):
    path, hf = tiny
    llm = _llm(path, num_blocks=8)  # 32 slots
    with pytest.raises(ValueError, match=r"prompt 1: its 21 encoder tokens.*need \d+ KV blocks"):
        llm.generate(_prompts(hf, [3, 20]), greedy(12))
    assert not llm.engine.has_unfinished(), "a bad request must leave the engine as it was"


def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(file, "w") as f:
        json.dump(raw, f)


def test_transformers5_config_spelling_loads_the_same_model(tmp_path):
    """transformers 5 writes tie_word_embeddings=true plus scale_decoder_outputs for every T5."""
    path, hf = make_tiny_t5(tmp_path, "v1.1")
    before = _llm(path).generate(_prompts(hf, [5]), greedy(6))[0].token_ids
    _edit_config(path, tie_word_embeddings=True, scale_decoder_outputs=False)
    after = _llm(path)
    assert not after.model.config.scale_decoder_outputs and after.model.lm_head is not after.model.embed
    assert after.generate(_prompts(hf, [5]), greedy(6))[0].token_ids == before


def test_bad_checkpoints_are_clear_errors(tmp_path):
    path, _ = make_tiny_t5(tmp_path, "original")
    _edit_config(path, feed_forward_proj="gated-swish")
    with pytest.raises(UnsupportedModelError, match="feed_forward_proj"):
        _llm(path)
    _edit_config(path, feed_forward_proj="relu", num_decoder_layers=4)
    with pytest.raises(CorruptCheckpointError, match=r"missing.*decoder\.block\.3"):
        _llm(path)
    _edit_config(path, num_decoder_layers=3, d_ff=50)
    with pytest.raises(CorruptCheckpointError, match="DenseReluDense.*shape"):
        _llm(path)


def test_sentencepiece_only_directory_warns_and_takes_token_ids(tmp_path):
    """spiece.model without tokenizer.json: a clear warning at load, token-id prompts still work,
    a text prompt is refused."""
    path, hf = make_tiny_t5(tmp_path, "v1.1")
    os.remove(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "spiece.model"), "wb") as f:
        f.write(b"not read")
    with pytest.warns(UserWarning, match=r"spiece\.model but no tokenizer\.json.*save_pretrained"):
        llm = _llm(path)
    assert llm.generate(_prompts(hf, [5]), greedy(3))[0].token_ids
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("a text prompt", greedy(3))
