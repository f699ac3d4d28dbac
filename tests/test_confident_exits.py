"""Dynamic early exit with deferred K/V (LayerDrafts(exit_threshold=x)): a layer draft whose top-1
probability reaches the exit threshold is emitted at layer E, and the next full-depth pass
computes the exact K/V of the exited positions beside the token after them.

The reference is HF transformers run over the whole context for every token: because every exited
position gets the full model's exact K/V, each full-depth token is the original model's next token
given the emitted ones, and each exit is the exit model's (the first E layers, through the copy's
LoRA pairs where there are any)."""
from __future__ import annotations

import pytest
import torch

import eecore
from eecore.models.exit_adapter import ExitAdapters, model_fingerprint
from engine_utils import first_two_token_counts, greedy, law_p_value, random_prompts, truncated_merged
from model_factory import make_peaked_tiny_model, random_lora

L, VOCAB = 4, 320


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, hf_model, file, lora): a 4-layer random Llama with peaked distributions, and an
    exit-ready file of random LoRA pairs for the separate copy."""
    path, hf = make_peaked_tiny_model(tmp_path_factory.mktemp("confident"), num_layers=L, vocab_size=VOCAB)
    base = eecore.LLM(path, dtype="float32", device="cpu")
    lora = random_lora(hf, seed=3)
    file = str(tmp_path_factory.mktemp("confident-file") / "draft.safetensors")
    ExitAdapters({}, None, model_fingerprint(base.model), {}, lora).save(file)
    return path, hf, file, lora


def _llm(path, E, d, threshold, draft_layers="shared", file=None, exit_threshold=None, **kw):
    """Drafts stop below `threshold`; those at least `exit_threshold` sure (default: threshold) exit."""
    layer = eecore.LayerDrafts(exit_layer=E, stop_below=threshold,
                               exit_threshold=threshold if exit_threshold is None else exit_threshold,
                               copy=eecore.DraftCopy() if draft_layers == "separate" else None)
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file,
                      speculative=eecore.SelfSpeculativeConfig(num_speculations=d, layer=layer), **kw)


def _reference(hf, exit_model, prompt, max_tokens, d, threshold, E, exit_threshold=None):
    """The tokens and exit layers early exit with deferred K/V emits, token by token on HF: a round
    drafts with the exit model while it is at least `threshold` sure (at most d times, and never a
    request's last token); its leading drafts at least `exit_threshold` sure (default: threshold)
    exit, the drafts after them are checked against the full model (accepted while it agrees, then
    its own token), and a round whose drafts all exited ends with the full model's token. Also the
    smallest distance of a confidence from either threshold (the test needs a margin against
    rounding), and how many rounds a doubtful draft ended."""
    exit_threshold = threshold if exit_threshold is None else exit_threshold
    tokens, layers, margin, stopped = [], [], float("inf"), 0

    def next_logits(model, context):
        with torch.no_grad():
            return model(torch.tensor([prompt + context])).logits[0, -1]

    tokens.append(int(next_logits(hf, tokens).argmax()))  # the prefill's token
    layers.append(L)
    while len(tokens) < max_tokens:
        budget = min(d, max_tokens - len(tokens) - 1)
        drafts, exits = [], 0
        for _ in range(budget):
            probs = next_logits(exit_model, tokens + drafts).softmax(-1)
            top = float(probs.max())
            margin = min(margin, abs(top - threshold), abs(top - exit_threshold))
            if top < threshold:
                stopped += 1
                break
            exits += exits == len(drafts) and top >= exit_threshold
            drafts.append(int(probs.argmax()))
        tokens += drafts[:exits]
        layers += [E] * exits
        for draft in drafts[exits:]:  # verified: the full model's token, until it disagrees
            tokens.append(int(next_logits(hf, tokens).argmax()))
            layers.append(L)
            if tokens[-1] != draft:
                break
        else:
            tokens.append(int(next_logits(hf, tokens).argmax()))
            layers.append(L)
    return tokens, layers, margin, stopped


@pytest.mark.parametrize("draft_layers, E, d, threshold, exit_threshold", [
    ("shared", 1, 3, 0.0, None), ("shared", 2, 2, 0.5, None), ("separate", 2, 4, 0.0, None),
    ("separate", 2, 3, 0.5, None), ("separate", 3, 8, 0.8, None),
    # exits and verified drafts in one round
    ("shared", 2, 4, 0.2, 0.6), ("separate", 3, 4, 0.3, 0.8), ("separate", 2, 6, 0.0, 0.5)])
def test_greedy_output_is_the_token_by_token_reference(tiny, draft_layers, E, d, threshold, exit_threshold):
    path, hf, file, lora = tiny
    separate = draft_layers == "separate"
    exit_model = truncated_merged(hf, lora if separate else None, E)
    prompts = random_prompts(VOCAB, [2 + (7 * i) % 13 for i in range(5)], seed=E + d)
    params = [greedy(6 + 3 * i) for i in range(5)]
    outs = _llm(path, E, d, threshold, draft_layers, file if separate else None,
                exit_threshold).generate(prompts, params)
    exits = stopped = verified = 0
    for prompt, p, out in zip(prompts, params, outs):
        tokens, layers, margin, doubts = _reference(hf, exit_model, prompt, p.max_tokens, d, threshold, E,
                                                    exit_threshold)
        assert margin > 1e-4, "a confidence sits on a threshold: pick another seed"
        assert out.token_ids == tokens
        assert out.exit_layers == layers
        exits, stopped = exits + layers.count(E), stopped + doubts
        verified += out.metrics["num_drafted_tokens"] - layers.count(E)
    assert exits > 0
    assert (stopped > 0) == (threshold > 0)  # the threshold did end some runs of drafts
    assert (verified > 0) == (exit_threshold is not None)  # drafts after the exits were checked


def test_nothing_exits_at_exit_threshold_one(tiny):
    """exit_threshold=1.0: no draft is that sure, so every draft is verified and the output is full
    depth's, token for token."""
    path = tiny[0]
    prompts = random_prompts(VOCAB, [5, 9, 3], seed=1)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(16))
    outs = _llm(path, 3, 4, 0.0, exit_threshold=1.0).generate(prompts, greedy(16))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert all(set(o.exit_layers) == {L} for o in outs)
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_exits_are_what_the_full_depth_would_not_always_say(tiny):
    """The mode is lossy: with threshold 0 on random weights some emitted tokens differ from full
    depth's greedy output, while verifying the same drafts (no exit_threshold) keeps it exactly."""
    path, hf, file, _ = tiny
    prompts = random_prompts(VOCAB, [5, 9, 3], seed=1)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(16))
    trusted = _llm(path, 2, 4, 0.0, "separate", file).generate(prompts, greedy(16))
    verified_config = eecore.SelfSpeculativeConfig(
        num_speculations=4, layer=eecore.LayerDrafts(exit_layer=2, stop_below=0.0, copy=eecore.DraftCopy()))
    verified = eecore.LLM(path, dtype="float32", device="cpu", exit_adapter=file,
                          speculative=verified_config).generate(prompts, greedy(16))
    assert [o.token_ids for o in verified] == [o.token_ids for o in full]
    assert [o.token_ids for o in trusted] != [o.token_ids for o in full]


def test_hybrid_rounds_still_verify_lookup_drafts(tiny):
    """Hybrid drafts (layer and lookup): lookup drafts are checked as before; only layer drafts may
    exit. With a threshold no draft reaches, nothing exits and the output is full depth's, lookup
    rounds and all."""
    path, hf, file, _ = tiny
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 11, 12, 11], [40, 41, 42]]  # repeats: lookup matches
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(14))
    llm = eecore.LLM(path, dtype="float32", device="cpu", block_size=4, exit_adapter=file,
                     speculative=eecore.SelfSpeculativeConfig(
                         num_speculations=3, lookup=eecore.LookupDrafts(),
                         layer=eecore.LayerDrafts(exit_layer=2, stop_below=1.0, exit_threshold=1.0,
                                                  copy=eecore.DraftCopy())))
    outs = llm.generate(prompts, greedy(14))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert all(set(o.exit_layers) == {L} for o in outs)
    assert sum(o.metrics["num_lookup_drafted_tokens"] for o in outs) > 0


def test_exits_report_the_exit_distributions_logprobs(tiny):
    path, hf, _, _ = tiny
    E, prompt = 2, random_prompts(VOCAB, [6], seed=4)[0]
    out = _llm(path, E, 2, 0.0).generate([prompt], greedy(7, logprobs=2))[0]
    exit_model = truncated_merged(hf, None, E)
    for i, (token, layer, logprobs) in enumerate(zip(out.token_ids, out.exit_layers, out.logprobs)):
        model = exit_model if layer == E else hf
        with torch.no_grad():
            want = model(torch.tensor([prompt + out.token_ids[:i]])).logits[0, -1].log_softmax(-1)
        assert set(logprobs) >= set(want.topk(2).indices.tolist()) | {token}
        for t, lp in logprobs.items():
            assert lp == pytest.approx(float(want[t]), abs=1e-4)
    assert E in out.exit_layers


@pytest.mark.parametrize("exit_threshold", [None, 1.0], ids=["exits", "verified"])
def test_sampled_exits_follow_the_exit_law(tmp_path, exit_threshold):
    """Threshold 0 and max_tokens 3: the first token comes from the prefill (full depth), the second
    exits at layer 1 (drawn from the exit's law, not the full model's), the third is full depth's.
    With exit_threshold 1.0 the second is a draft no exit is sure enough of: verified by rejection
    sampling, so it follows the full model's law. Temperature 0.5 sharpens the two laws apart: at 1.0
    and 3,000 requests the second check had only a 2 in 3 chance to tell them apart."""
    from model_factory import make_tiny_hf_model

    path, hf = make_tiny_hf_model(tmp_path, arch="llama", num_layers=L, vocab_size=12, with_tokenizer=False)
    prompt, n, V = [3, 7, 1], 3000, 12
    T = 0.5
    params = [eecore.SamplingParams(max_tokens=3, temperature=T, seed=s, ignore_eos=True) for s in range(n)]
    outs = _llm(path, 1, 3, 0.0, exit_threshold=exit_threshold, max_num_seqs=64).generate([prompt] * n, params)
    assert all(o.exit_layers == ([L, 1, L] if exit_threshold is None else [L, L, L]) for o in outs)
    exit_model = truncated_merged(hf, None, 1)
    with torch.no_grad():
        p1 = (hf(torch.tensor([prompt])).logits[0, -1] / T).softmax(-1)
        ids = torch.tensor([prompt + [t] for t in range(V)])
        exit_law = (exit_model(ids).logits[:, -1] / T).softmax(-1)
        full_law = (hf(ids).logits[:, -1] / T).softmax(-1)
    counts = first_two_token_counts(outs, V)
    law, other = (exit_law, full_law) if exit_threshold is None else (full_law, exit_law)
    assert law_p_value(counts, p1[:, None] * law) > 1e-3
    assert law_p_value(counts, p1[:, None] * other) < 1e-3  # the test tells the two laws apart


@pytest.mark.parametrize("make, match", [
    (lambda: eecore.LayerDrafts(exit_layer=2, stop_below=0.5, exit_threshold=0.5,
                                guard=eecore.AcceptanceGuard(min_acceptance=0.3)),
     "LayerDrafts: 'guard' does not apply with 'exit_threshold'"),
    (lambda: eecore.LayerDrafts(exit_layer=2, stop_below=0.5, exit_threshold=0.5, copy=eecore.DraftCopy(top_k=2)),
     "LayerDrafts: DraftCopy 'top_k' > 1 does not apply with 'exit_threshold'"),
    (lambda: eecore.LayerDrafts(exit_layer=2, stop_below=0.5, exit_threshold=0.4),
     r"LayerDrafts: 'exit_threshold' \(--exit-threshold\) must be at least stop_below \(0.5\).*got 0.4"),
    (lambda: eecore.LayerDrafts(exit_layer=2, stop_below=0.5, exit_threshold=1.5),
     r"LayerDrafts: 'exit_threshold' \(--exit-threshold\) must be a number in \[0, 1\] or None, got 1.5"),
    (lambda: eecore.LayerDrafts(exit_layer=2, stop_below=0.5, exit_threshold="high"),
     r"LayerDrafts: 'exit_threshold' \(--exit-threshold\) must be a number in \[0, 1\] or None, got 'high'"),
], ids=["guard", "top-k", "below-stop", "above-one", "not-a-number"])
def test_bad_config(make, match):
    """(An exit threshold without a stop threshold is no longer an error, and a lookup-only config has
    no layer to exit from; the deprecated accept= spellings: test_speculative_config.py.)"""
    with pytest.raises(ValueError, match=match):
        make()


def test_cli_flag(tiny, capsys):
    from eecore.cli import main

    path = tiny[0]
    # --exit-threshold turns exits on (formerly --accept confident, at the draft threshold)
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--exit-layer", "2", "--num-speculations", "3", "--draft-threshold", "0.2",
                 "--exit-threshold", "0.2"]) == 0
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--exit-layer", "2", "--num-speculations", "3", "--draft-threshold", "0.2",
                 "--exit-threshold", "0.6"]) == 0
    with pytest.raises(SystemExit, match=r"'exit_threshold' \(--exit-threshold\) must be at least stop_below \(0.6\)"):
        main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--draft-threshold", "0.6",
              "--exit-threshold", "0.2"])
    with pytest.raises(SystemExit, match="'guard' does not apply with 'exit_threshold'"):
        main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--exit-threshold", "0.6",
              "--min-acceptance", "0.3"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # the flag is gone
        main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--accept", "confident"])
    assert exc.value.code == 2 and "--accept" in capsys.readouterr().err
