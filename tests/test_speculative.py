"""Self-speculative decoding (LayerSkip) on the batched paged engine."""
import copy

import pytest
import torch

import eecore
from engine_utils import first_two_token_counts, greedy, law_p_value, random_prompts
from model_factory import make_tiny_hf_model

NUM_LAYERS = 4


@pytest.fixture(scope="module", params=["llama", "mistral"])
def tiny(request, tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), arch=request.param, num_layers=NUM_LAYERS)


def _spec(path, E, d, threshold=None, guard=None, copy=None, **kw):
    layer = eecore.LayerDrafts(exit_layer=E, stop_below=threshold, guard=guard, copy=copy)
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4,
                      speculative=eecore.SelfSpeculativeConfig(num_speculations=d, layer=layer), **kw)


@pytest.mark.parametrize("E, d", [(1, 1), (1, 3), (2, 2), (3, 4), (2, 16)])
def test_greedy_self_speculation_is_full_depth_greedy(tiny, E, d):
    path, hf = tiny
    for batch in (1, 3, 8):
        prompts = random_prompts(hf.config.vocab_size, [2 + (7 * i) % 13 for i in range(batch)], seed=batch)
        params = [greedy(5 + 3 * i) for i in range(batch)]  # d=16 is more than the tokens left
        full = eecore.LLM(path, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
        outs = _spec(path, E, d).generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in full]
        for o in outs:
            assert 0.0 <= o.metrics["acceptance_rate"] <= 1.0
            assert 1.0 <= o.metrics["mean_accepted_tokens_per_step"] <= d + 1


def test_adaptive_draft_length_keeps_greedy_exact(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [4, 9, 1, 6], seed=7)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(14))
    outs = _spec(path, 2, 4, threshold=0.05).generate(prompts, greedy(14))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]


def _trusting_shadow(llm):
    """Make the guard's shadow check always say a probe could pass, to test the probe schedule
    on its own."""
    llm.engine.strategy.guard.shadow.agreement = lambda states, logits: [True] * logits.shape[0]
    return llm


def test_acceptance_guard_stops_losing_drafts_and_keeps_greedy_exact(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [4, 9, 1, 6], seed=11)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(30))
    free = _spec(path, 1, 4).generate(prompts, greedy(30))
    # min_acceptance=1.0: the first round with a rejected draft switches drafting off; from then
    # on a sequence drafts only in its probe rounds
    guarded = _trusting_shadow(_spec(path, 1, 4, guard=eecore.AcceptanceGuard(min_acceptance=1.0, probe_every=8)))
    guarded = guarded.generate(prompts, greedy(30))
    assert [o.token_ids for o in guarded] == [o.token_ids for o in full]
    assert all(o.metrics["acceptance_rate"] < 1.0 for o in free)  # else the guard has nothing to do
    drafted_free = sum(o.metrics["num_drafted_tokens"] for o in free)
    drafted_guarded = sum(o.metrics["num_drafted_tokens"] for o in guarded)
    assert 0 < drafted_guarded < drafted_free / 2, (drafted_guarded, drafted_free)
    # the first look after 4 rounds, then probes 8 and 16 rounds later: at most 3 drafting rounds
    for o in guarded:
        assert o.metrics["num_drafted_tokens"] <= 3 * 4


def test_guard_skips_probes_the_shadow_check_says_would_fail(tiny):
    # layer 1 of 4 random layers: drafts are hopeless, and the shadow check sees it. With a floor
    # of 1.0, one miss rules a probe out, so no sequence ever drafts, though 60 tokens leave room
    # for the first look and 3 probes
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [4, 9, 1, 6], seed=11)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(60))
    llm = _spec(path, 1, 4, guard=eecore.AcceptanceGuard(min_acceptance=1.0, probe_every=8))
    shadow, checked = llm.engine.strategy.guard.shadow, []
    check = shadow.agreement
    shadow.agreement = lambda states, logits: (checked.append(logits.shape[0]), check(states, logits))[1]
    outs = llm.generate(prompts, greedy(60))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert [o.metrics["num_drafted_tokens"] for o in outs] == [0] * len(prompts)
    assert len(llm.engine.strategy.guard) == 0  # finished sequences leave no guard state behind
    # the checks run only in the rounds before a look falls due, and looks grow apart: rounds 4,
    # 12, 28 and 60 with 3, 7, 8 and 8 checks before them, not one in each of the 59 rounds
    assert 0 < sum(checked) <= len(prompts) * (3 + 7 + 8 + 8), sum(checked)
    assert all(o.metrics["acceptance_rate"] < 1.0 for o in outs)


def test_guard_counts_a_draft_the_threshold_dropped_as_a_loss(tiny):
    # stop_below=1.0 drops every draft: no token is ever drafted, but each attempt still
    # paid for a draft LM head, so the guard must switch drafting off all the same
    path, hf = tiny
    guard = eecore.AcceptanceGuard(min_acceptance=0.5, probe_every=8)
    llm = _trusting_shadow(_spec(path, 2, 4, threshold=1.0, guard=guard))
    draft_head, rows = llm.engine.strategy.draft_head, []
    head = draft_head.columns
    draft_head.columns = lambda hidden: (rows.append(hidden.shape[0]), head(hidden))[1]
    out = llm.generate(random_prompts(hf.config.vocab_size, [7], seed=13), greedy(40))[0]
    assert out.metrics["num_drafted_tokens"] == 0
    draft_heads = len(rows)
    # 39 rounds: the first look at round 4 and probes at rounds 12 and 28; each is a rate of 0
    # (were a dropped draft not counted, every look would be a first look, 8 rounds apart: 5)
    assert draft_heads == 3, draft_heads


def test_break_even_floor(tiny):
    from eecore.speculative.guard import break_even_acceptance

    path, hf = tiny
    llm = _spec(path, 2, 3, guard=eecore.AcceptanceGuard(min_acceptance="break-even"))
    floor = llm.engine.strategy.guard.floor
    assert floor == break_even_acceptance(llm.model, 2, 3)
    # deeper drafts and longer ones both cost more per round, so they need more acceptance
    by_depth = [break_even_acceptance(llm.model, E, 2) for E in range(1, NUM_LAYERS)]
    by_length = [break_even_acceptance(llm.model, 1, d) for d in (1, 2, 4, 8)]
    assert all(0.0 < a < b for a, b in zip(by_depth, by_depth[1:])), by_depth
    assert all(0.0 < a < b for a, b in zip(by_length, by_length[1:])), by_length
    prompts = random_prompts(hf.config.vocab_size, [5, 8], seed=14)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(12))
    assert [o.token_ids for o in llm.generate(prompts, greedy(12))] == [o.token_ids for o in full]


def test_cli_min_acceptance_flag(tiny, capsys):
    from eecore.cli import main

    path, _ = tiny
    assert main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "6", "--speculate",
                 "--exit-layer", "2", "--min-acceptance", "break-even"]) == 0
    with pytest.raises(SystemExit) as exc:
        main(["generate", "Hello", "--model", path, "--speculate", "--exit-layer", "2", "--min-acceptance", "often"])
    assert exc.value.code == 2
    assert "--min-acceptance" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--early-exit", "softmax", "--speculate", "--exit-layer", "2"], "eecore: choose --early-exit or --speculate"),
    (["--early-exit", "softmax", "--threshold", "2.5"], "eecore: EarlyExitConfig: 'threshold' must be"),
    (["--threshold", "0.5", "file.json"], "eecore: --threshold takes numbers, or a single thresholds file"),
])
def test_cli_generate_bad_decoding_flags_exit_with_a_message(tiny, flags, message):
    """A contradiction or a bad setting of the decoding flags ends `eecore generate` with a message
    (SystemExit), not a traceback."""
    from eecore.cli import main

    path, _ = tiny
    with pytest.raises(SystemExit, match=message):
        main(["generate", "Hello", "--model", path, "--dtype", "float32", "--max-tokens", "2", *flags])


def _with_identity_tail(hf, exit_layer: int, path):
    """Save `hf` with its layers from `exit_layer` on zeroed into identities (their attention
    and MLP add nothing to the residual stream): layer E's draft is then always the full model's."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in model.model.layers[exit_layer:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return str(path)


def test_guard_keeps_drafting_while_drafts_are_accepted(tiny, tmp_path):
    path, hf = tiny
    exact = _with_identity_tail(hf, 2, tmp_path / "identity-tail")
    prompts = random_prompts(hf.config.vocab_size, [4, 9, 1], seed=12)
    full = eecore.LLM(exact, dtype="float32", device="cpu").generate(prompts, greedy(21))
    outs = _spec(exact, 2, 4, guard=eecore.AcceptanceGuard(min_acceptance=0.9)).generate(prompts, greedy(21))
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    for o in outs:  # 20 decoded tokens: the first look's 3 plain rounds, then rounds of 4
        # accepted drafts + the bonus token, the last one cut to the 2 tokens left
        assert o.metrics["acceptance_rate"] == 1.0
        assert o.metrics["num_verify_steps"] == 3 + 4 and o.metrics["num_drafted_tokens"] == 4 + 4 + 4 + 1


def test_shadow_check_bounds_the_draft_acceptance_from_above(tiny):
    from eecore.speculative.guard import ShadowCheck

    path, _ = tiny
    model = eecore.LLM(path, dtype="float32", device="cpu").model
    check = ShadowCheck(model, max_rows=16)
    g = torch.Generator().manual_seed(3)
    d, n = model.config.hidden_size, 13
    exit_states = torch.randn(n, d, generator=g)
    final_states = torch.randn(n, d, generator=g)
    final_states[::3] = exit_states[::3]  # rows where the draft is the full model's token

    def head(h):
        return torch.nn.functional.rms_norm(h, (d,), model.final_norm, model.config.rms_norm_eps) @ model.lm_head.T

    logits = head(final_states)
    got = check.agreement(exit_states, logits)
    # the reference: layer E's scores over the full model's top-K, by brute force
    top = logits.topk(check.k, dim=-1).indices
    expected = [int(head(exit_states)[i, top[i]].argmax()) == 0 for i in range(n)]
    assert got == expected
    truly_accepted = (head(exit_states).argmax(-1) == logits.argmax(-1)).tolist()
    assert all(g or not t for g, t in zip(got, truly_accepted))  # never below the true acceptance
    assert all(got[::3]) and not all(got)


def test_first_layers_are_never_recomputed(tiny):
    path, hf = tiny
    E = 2
    llm = _spec(path, E, 3)
    llm.generate(random_prompts(hf.config.vocab_size, [5, 8, 3], seed=8), greedy(12))
    counts = llm.engine.runner.layer_tokens
    # every position ran through every layer exactly once: drafting covered layers 0..E-1,
    # verification continued from the exit-query cache through E..L-1
    assert len(set(counts)) == 1, counts


def test_blocks_come_back_with_and_without_preemption(tiny):
    path, hf = tiny
    prompts = random_prompts(hf.config.vocab_size, [3 + (5 * i) % 11 for i in range(12)], seed=9)
    params = [greedy(4 + i % 7) for i in range(12)]
    expected = [o.token_ids for o in eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, params)]
    for num_blocks in (200, 14):
        llm = _spec(path, 2, 3, num_blocks=num_blocks, max_num_seqs=6)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == expected
        assert llm.engine.blocks.num_free_blocks == num_blocks
        if num_blocks == 14:
            assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_stop_token_in_the_middle_of_a_draft(tiny):
    path, hf = tiny
    prompt = random_prompts(hf.config.vocab_size, [6], seed=11)
    free = eecore.LLM(path, dtype="float32", device="cpu").generate(prompt, greedy(15))[0].token_ids
    stop = free[6]
    out = _spec(path, 2, 5).generate(prompt, greedy(15, stop_token_ids=[stop]))[0]
    assert out.token_ids == free[: free.index(stop) + 1]


def _joint_law(hf, prompt, num_layers=None):
    """p(t1, t2 | prompt) of the (possibly truncated) HF model at temperature 1, `[V, V]`."""
    model = hf
    if num_layers is not None:
        model = copy.deepcopy(hf)
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
    V = hf.config.vocab_size
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        ids = torch.tensor([prompt + [t] for t in range(V)])
        p2 = model(ids).logits[:, -1].softmax(-1)
    return p1[:, None] * p2


@pytest.mark.parametrize("copy", [None, eecore.DraftCopy(), eecore.DraftCopy(dtype="int8"), eecore.DraftCopy(top_k=3)],
                         ids=["shared", "separate", "separate-int8", "tree"])
def test_speculative_sampling_preserves_the_full_model_law(tmp_path, copy):
    path, hf = make_tiny_hf_model(tmp_path, arch="llama", num_layers=NUM_LAYERS, vocab_size=12,
                                  with_tokenizer=False)
    prompt = [3, 7, 1]
    n = 3000
    # max_tokens=3: t2 comes out of a round that drafted it (with 2 tokens, the only decode round
    # would have no room for a draft, and the test would check plain sampling)
    params = [eecore.SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    # mixed_steps=False: steps of one kind, so that every request's t2 comes from a round (with mixed
    # steps, requests this short, arriving all along, would take plain steps while prompts wait)
    outs = _spec(path, 1, 3, max_num_seqs=64, mixed_steps=False, copy=copy).generate([prompt] * n, params)
    assert all(o.metrics["num_drafted_tokens"] >= 1 for o in outs)
    assert 0 < sum(o.metrics["num_accepted_tokens"] for o in outs) < n
    if copy is not None and copy.top_k > 1:  # sampled rows' alternatives were verified, some accepted
        assert sum(o.metrics["num_tree_alternatives_accepted"] for o in outs) > 0
    counts = first_two_token_counts(outs, 12)
    full = _joint_law(hf, prompt)
    assert law_p_value(counts, full) > 1e-3
    # the test has power: t2 drawn from the draft's own law (what accepting every draft would
    # give; t1 always comes from the full model's prefill) is rejected
    draft = _joint_law(hf, prompt, num_layers=1)
    assert law_p_value(counts, full.sum(1, keepdim=True) * draft / draft.sum(1, keepdim=True)) < 1e-3


def test_bad_speculative_config():
    from re import escape

    with pytest.raises(ValueError, match=escape("LayerDrafts: 'exit_layer' (--exit-layer) must be an int >= 1, got 0")):
        eecore.SelfSpeculativeConfig(exit_layer=0)
    with pytest.raises(ValueError, match=escape("LayerDrafts: 'exit_layer' (--exit-layer) must be an int >= 1, got 0")):
        eecore.LayerDrafts(exit_layer=0)
    with pytest.raises(ValueError, match=escape("SelfSpeculativeConfig: 'num_speculations' (--num-speculations) "
                                                "must be an int >= 1, got 0")):
        eecore.SelfSpeculativeConfig(exit_layer=2, num_speculations=0)
    with pytest.raises(ValueError, match=escape("LayerDrafts: 'stop_below' (--draft-threshold) must be a number in "
                                                "[0, 1] or None, got 2.0")):
        eecore.LayerDrafts(exit_layer=2, stop_below=2.0)
    with pytest.raises(ValueError, match=escape("AcceptanceGuard: 'min_acceptance' (--min-acceptance) must be")):
        eecore.AcceptanceGuard(min_acceptance=-0.1)
    with pytest.raises(ValueError, match=escape("AcceptanceGuard: 'min_acceptance' (--min-acceptance) must be a "
                                                "number in [0, 1] or 'break-even', got 'auto'")):
        eecore.AcceptanceGuard(min_acceptance="auto")
    with pytest.raises(ValueError, match=escape("AcceptanceGuard: 'probe_every' (--probe-every) must be an int >= 1, "
                                                "got 0")):
        eecore.AcceptanceGuard(min_acceptance=0.5, probe_every=0)
    with pytest.raises(ValueError, match=escape("LayerDrafts: 'disable_by_batch_size' (--layer-disable-by-batch-size) "
                                                "must be at most the config's disable_by_batch_size (4), got 6")):
        eecore.SelfSpeculativeConfig(layer=eecore.LayerDrafts(exit_layer=2, disable_by_batch_size=6),
                                     lookup=eecore.LookupDrafts(), disable_by_batch_size=4)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=escape("LayerDrafts: 'disable_by_batch_size' "
                                                    "(--layer-disable-by-batch-size) must be an int >= 1 or None, got")):
            eecore.LayerDrafts(exit_layer=2, disable_by_batch_size=bad)


def test_exit_layer_must_be_below_the_depth(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="'exit_layer' must be below"):
        _spec(path, NUM_LAYERS, 2)


def test_rejection_sample_edges():
    """eecore.speculative.rejection on laws where the outcome is certain: drafts from the model's own
    law are all accepted (then the bonus token), a draft the model gives no mass is replaced by a
    token of the residual, and a lookup draft (q None) the model rules out is never emitted."""
    from eecore.speculative.rejection import rejection_sample

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 10, generator=g), dim=-1)
    for _ in range(20):
        verdict = rejection_sample([4, 7], [p[0], p[1]], p, g)
        assert verdict.tokens[:2] == [4, 7] and len(verdict.tokens) == 3 and verdict.rows == [0, 1, 2]
    p0 = p.clone()
    p0[0, 4] = 0.0
    p0[0] /= p0[0].sum()
    q = torch.zeros(10)
    q[4] = 1.0
    for draft_q in (q, None):
        for _ in range(20):
            verdict = rejection_sample([4, 7], [draft_q, p[1]], p0, g)
            assert len(verdict.tokens) == 1 and verdict.tokens[0] != 4 and verdict.leaf_row == -1


def test_rejection_sample_tree_emits_the_models_law():
    """Multi-step speculative sampling over a token tree: a chain draft and two alternatives drawn
    independently from q, tried in turn against the residuals; the first token emitted follows p,
    whatever q is, and an accepted alternative's own verify row (tree_row's layout) gives the next."""
    from eecore.speculative.rejection import rejection_sample
    from engine_utils import law_p_value

    g = torch.Generator().manual_seed(1)
    V, n = 8, 20000
    p = torch.softmax(torch.randn(5, V, generator=g) * 1.5, dim=-1)  # rows: x0, x1, leaves of depth 0
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=-1)
    first = torch.zeros(V)
    after_leaf = {2: torch.zeros(V), 3: torch.zeros(V)}  # the token drawn from an accepted leaf's row
    for _ in range(n):
        y, a, b = (int(t) for t in torch.multinomial(q, 3, replacement=True, generator=g))
        verdict = rejection_sample([y], [q], p, g, alternatives=[[a, b]])
        assert len(verdict.rows) == len(verdict.tokens) and verdict.chain_accepted in (0, 1)
        if verdict.leaf_row >= 0:
            assert verdict.tokens[0] == (a if verdict.leaf_row == 2 else b)
            assert verdict.rows == [0, verdict.leaf_row] and verdict.chain_accepted == 0
            after_leaf[verdict.leaf_row][verdict.tokens[1]] += 1
        first[verdict.tokens[0]] += 1
    assert law_p_value(first[:, None], p[0][:, None]) > 1e-3
    assert law_p_value(first[:, None], q[:, None]) < 1e-3  # power: q is not p
    for row, counts in after_leaf.items():
        assert counts.sum() > n // 50, row
        assert law_p_value(counts[:, None], p[row][:, None]) > 1e-3
