"""Token-tree verification (LayerDrafts(copy=DraftCopy(top_k=k)), separate draft layers): each
drafted position's top-k tokens are verified in one pass; an alternative the model agrees with is
accepted and its K/V moved to the position it takes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import eecore
from eecore.engine.block_table import BlockTable
from eecore.engine.inputs import MAX_TREE_TOKENS, InputBuilder, Row, tree_depths_and_masks
from eecore.speculative.token_tree import accept_greedy, most_likely_nodes, tree_row
from engine_utils import greedy, random_prompts
from model_factory import make_peaked_tiny_model, make_tiny_hf_model

L, VOCAB = 4, 320


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_peaked_tiny_model(tmp_path_factory.mktemp("tree"), num_layers=L, vocab_size=VOCAB)


def _tree(path, E, d, k, **kw):
    return eecore.LLM(path, dtype="float32", device="cpu", block_size=4,
                      speculative=eecore.SelfSpeculativeConfig(
                          num_speculations=d, layer=eecore.LayerDrafts(exit_layer=E, copy=eecore.DraftCopy(top_k=k))),
                      **kw)


# ---- the pieces ----------------------------------------------------------------------------------

class _Seq:
    def __init__(self, tokens, computed, block_table=(0, 1, 2, 3)):
        self.token_ids, self.num_computed_tokens, self.block_table = tokens, computed, BlockTable(block_table)
        self.encoder_token_ids = None

    @property
    def last_token_id(self):
        return self.token_ids[-1]


def test_tree_row_layout():
    seq = _Seq([7, 8, 9], computed=2)
    row = tree_row(seq, [11, 12, 13], [[21, 22], [], [31]])
    assert row.start == 2
    assert row.tokens == [9, 11, 12, 13, 21, 22, 31]
    assert row.parents == [-1, 0, 1, 2, 0, 0, 2]  # alternatives of chain[i] hang off chain token i
    plain = tree_row(seq, [11, 12], [[], []])
    assert plain.parents is None and plain.tokens == [9, 11, 12]


def test_depths_and_masks():
    depths, masks = tree_depths_and_masks([-1, 0, 1, 2, 0, 0, 2])
    assert depths.tolist() == [0, 1, 2, 3, 1, 1, 3]
    assert masks.tolist() == [0b1, 0b11, 0b111, 0b1111, 0b10001, 0b100001, 0b1000111]
    # 64 tokens: the last one's bit is the sign bit of its int64 mask
    _, masks = tree_depths_and_masks([-1] + list(range(63)))
    assert masks[-1] == -1
    for parents, match in [([0, 0], "token 0's parent must be the context"), ([-1, 1], "must be an earlier token"),
                           ([-1, 0, 5], "must be an earlier token"), ([], "1..64 tokens"),
                           ([-1] + list(range(64)), "1..64 tokens")]:
        with pytest.raises(ValueError, match=match):
            tree_depths_and_masks(parents)


def test_input_builder_tree_rows():
    """A tree row's tokens take consecutive slots at their depths' positions; a chain row beside it
    gets a causal mask; a step without trees has no mask."""
    builder = InputBuilder(max_tokens=16, max_seqs=2, max_blocks_per_seq=4, block_size=4, device=torch.device("cpu"))
    a, b = _Seq([1] * 6, computed=5, block_table=(3, 1, 2)), _Seq([2] * 3, computed=2, block_table=(0,))
    inputs = builder.build([Row(a, 5, [9, 10, 11, 12], [-1, 0, 0, 1]), Row(b, 2, [4, 5])])
    attn = inputs.attn
    assert attn.positions.tolist() == [5, 6, 6, 7, 2, 3]
    # a's tokens take slots for positions 5..8 (blocks 1 and 2 of its table), b's positions 2..3 of block 0
    assert attn.slot_mapping.tolist() == [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, 2, 3]
    assert attn.seq_lens.tolist() == [9, 4]
    assert attn.tree_mask.tolist() == [0b1, 0b11, 0b101, 0b1011, 0b1, 0b11]
    assert builder.build([Row(b, 2, [4, 5])]).attn.tree_mask is None
    with pytest.raises(ValueError, match="1 parents for 2 tokens"):
        builder.build([Row(b, 2, [4, 5], [-1])])


def test_accept_greedy():
    chain, alts = [11, 12, 13], [[21, 22], [31], []]
    # rows: 0 pending, 1-3 chain, 4-5 alternatives of chain[0], 6 of chain[1]
    target = [11, 12, 13, 14, 50, 51, 52]
    v = accept_greedy(chain, alts, target)
    assert (v.tokens, v.rows, v.leaf_row, v.chain_accepted) == ([11, 12, 13, 14], [0, 1, 2, 3], -1, 3)
    target = [22, 0, 0, 0, 60, 61, 62]  # chain[0] wrong, its second alternative right
    v = accept_greedy(chain, alts, target)
    assert (v.tokens, v.rows, v.leaf_row, v.chain_accepted) == ([22, 61], [0, 5], 5, 0)
    target = [11, 31, 0, 0, 60, 61, 62]  # chain[1] wrong, its alternative right
    v = accept_greedy(chain, alts, target)
    assert (v.tokens, v.rows, v.leaf_row, v.chain_accepted) == ([11, 31, 62], [0, 1, 6], 6, 1)
    target = [11, 12, 99, 0, 0, 0, 0]  # chain[2] wrong, no alternative for it
    v = accept_greedy(chain, alts, target)
    assert (v.tokens, v.rows, v.leaf_row, v.chain_accepted) == ([11, 12, 99], [0, 1, 2], -1, 2)


def test_most_likely_nodes_follow_the_draft_probabilities():
    chain, alts = [11, 12], [[21, 22], [31, 32]]
    # a doubtful first position: its runners-up beat the second position's
    assert most_likely_nodes(chain, alts, [[0.4, 0.3, 0.2], [0.9, 0.05, 0.01]], 4) == (2, [[21, 22], []])
    # a sure first position: the rows go to the second
    assert most_likely_nodes(chain, alts, [[0.95, 0.03, 0.01], [0.5, 0.3, 0.1]], 4) == (2, [[], [31, 32]])
    # the chain ends where its next token is less likely than a runner-up before it
    assert most_likely_nodes(chain, alts, [[0.3, 0.3, 0.2], [0.5, 0.1, 0.1]], 3) == (1, [[21, 22]])
    # a budget under positions x tokens a position (FeatureDrafts.tree_nodes): a sure chain goes deep
    sure = [[0.9, 0.05, 0.03]] * 3
    assert most_likely_nodes([11, 12, 13], [[21, 22], [31, 32], [41, 42]], sure, 4) == (3, [[21], [], []])
    # a budget as large as the candidates keeps them all
    assert most_likely_nodes(chain, alts, [[0.5, 0.2, 0.1], [0.5, 0.2, 0.1]], 6) == (2, alts)


def test_the_picker_keeps_a_greedy_trees_probabilities():
    """With keeps_tree_probs, a greedy row's draft carries its chain token's and its top_k runners-up'
    probabilities (one runner-up more than the tree verifies a position: most_likely_nodes ranks
    them); a sampled row's alternatives stay top_k - 1 draws, without probabilities."""
    from eecore.engine.sampler import Sampler
    from eecore.models.draft_columns import DraftColumns
    from eecore.speculative.draft import Draft, DraftPicker
    from eecore.speculative.options import FeatureDrafts

    vocab = torch.tensor([5, 7, 9, 11, 13, 15])
    columns = DraftColumns(vocab, 20, 4, torch.device("cpu"))
    picker = DraftPicker(FeatureDrafts(head="h"), 3, columns, Sampler(torch.device("cpu")))
    picker.keeps_tree_probs = True
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(3))

    class Seq:
        def __init__(self, greedy):
            self.params = eecore.SamplingParams(temperature=0.0 if greedy else 1.0)
            self.stats = __import__("collections").Counter()
            self.seq_id = id(self)

    seqs, drafts = [Seq(True), Seq(False)], [Draft(), Draft()]
    picker.take(logits, [0, 1], seqs, drafts, with_alternatives=True)
    p = torch.softmax(logits[0], dim=-1)
    order = p.argsort(descending=True)[:4]
    assert drafts[0].tokens == [int(vocab[order[0]])]
    assert drafts[0].alternatives == [[int(vocab[c]) for c in order[1:]]]
    assert drafts[0].tree_probs[0] == pytest.approx(p[order].tolist(), rel=1e-5)
    assert len(drafts[1].alternatives[0]) == 2 and drafts[1].tree_probs == []


def _subtrees(d, k):
    """Every node set of a chain of d and k runners-up a position that is a tree (each node's
    parents in it): (chain tokens kept, the runners-up kept a position as ranks)."""
    import itertools

    for keep in range(1, d + 1):
        for picks in itertools.product(*[list(itertools.chain.from_iterable(
                itertools.combinations(range(k), n) for n in range(k + 1)))] * keep):
            yield keep, picks


@pytest.mark.parametrize("seed", range(8))
def test_most_likely_nodes_are_the_best_tree_of_their_size(seed):
    """Against every tree of the same size: the most total path probability (what a greedy tree
    expects to cover of the model's path, drafts taken as right at their probabilities)."""
    rng = np.random.default_rng(seed)
    d, k = 3, 2
    probs = []
    for _ in range(d):
        p = np.sort(rng.dirichlet(np.ones(6) * 0.5))[::-1][: k + 1]
        probs.append([float(x) for x in p])
    chain, alts = [10, 20, 30], [[11, 12], [21, 22], [31, 32]]

    def mass(keep, ranks):
        total, reach = 0.0, 1.0
        for j in range(keep):
            total += reach * (probs[j][0] + sum(probs[j][1 + r] for r in ranks[j]))
            reach *= probs[j][0]
        return total

    for budget in range(1, d * (k + 1) + 1):
        keep, kept = most_likely_nodes(chain, alts, probs, budget)
        assert keep + sum(map(len, kept)) == budget and len(kept) == keep
        ranks = [[alts[j].index(t) for t in kept[j]] for j in range(keep)]
        best = max(mass(c, r) for c, r in _subtrees(d, k) if c + sum(map(len, r)) == budget)
        assert mass(keep, ranks) == pytest.approx(best, rel=1e-12)


# ---- end to end ----------------------------------------------------------------------------------

@pytest.mark.parametrize("E, d, k", [(1, 1, 3), (2, 2, 2), (1, 3, 4), (2, 4, 3)])
def test_greedy_is_full_depth(tiny, E, d, k):
    """Exactly the full model's tokens at batch 1, 3 and 8, with alternatives accepted along the way
    (whose K/V must have moved for the later tokens to stay right)."""
    path, _ = tiny
    llm, full = _tree(path, E, d, k), eecore.LLM(path, dtype="float32", device="cpu", block_size=4)
    accepted = 0
    for batch in (1, 3, 8):
        prompts = random_prompts(VOCAB, [2 + (7 * i) % 13 for i in range(batch)], seed=batch + 10 * d)
        params = [greedy(12 + 3 * i) for i in range(batch)]
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in full.generate(prompts, params)]
        for o in outs:
            assert 1.0 <= o.metrics["mean_accepted_tokens_per_step"] <= d + 1
            assert 0 < o.metrics["num_tree_alternatives"] <= (k - 1) * o.metrics["num_drafted_tokens"]
        accepted += sum(o.metrics["num_tree_alternatives_accepted"] for o in outs)
    assert accepted > 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


@pytest.fixture(scope="module")
def gqa3(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("gqa3"), num_layers=L, vocab_size=VOCAB, num_heads=6,
                                  num_kv_heads=2, head_dim=64, hidden_size=96)


@pytest.mark.parametrize("spec", [
    dict(num_speculations=2, layer=eecore.LayerDrafts(exit_layer=1, copy=eecore.DraftCopy(top_k=3))),
    dict(num_speculations=2, layer=eecore.LayerDrafts(exit_layer=1, copy=eecore.DraftCopy())),
    dict(exit_layer=2, num_speculations=3),
    dict(num_speculations=3, lookup=eecore.LookupDrafts())],
                         ids=["tree", "separate", "shared", "lookup"])
def test_bf16_greedy_is_full_depth(gqa3, spec):
    """In bf16 too: a verify pass gives each row the bits of a one-row step (no rounding of the
    attention or the projections depends on how many rows a pass holds). Heads of 64 dims in
    groups of 3, like SmolLM2's, where the attention's register blocks differ by row count."""
    path, _ = gqa3
    prompts = [p * 3 for p in random_prompts(VOCAB, [4, 7, 5, 9], seed=31)]  # repeats: lookup matches
    params = greedy(40)
    full = eecore.LLM(path, dtype="bfloat16", device="cpu", block_size=4).generate(prompts, params)
    outs = eecore.LLM(path, dtype="bfloat16", device="cpu", block_size=4,
                      speculative=eecore.SelfSpeculativeConfig(**spec)).generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert sum(o.metrics["num_accepted_tokens"] for o in outs) > 0


def test_the_copy_keeps_only_agreed_drafts(tiny):
    """After a round that accepted an alternative, the copy's cache holds the chain drafts it ran,
    the wrong one at the alternative's position included: that K/V must not count as known. Every
    round's first draft is what HF's model cut to E layers says after the whole context."""
    import copy

    path, hf = tiny
    E = 1
    llm = _tree(path, E, 3, 4)
    strategy, stack = llm.engine.strategy, llm.engine.strategy.draft_stack
    seen, first = [], []
    first_pass, propose = stack.first_pass, strategy.picker.propose

    def recording_first_pass(seqs):
        first.append([s.token_slice(0, s.num_computed_tokens + 1) for s in seqs])
        return first_pass(seqs)

    def recording_propose(logits, seqs, drafted=None):
        if first:
            seen.extend(zip(first.pop(), logits.clone()))
        return propose(logits, seqs, drafted)

    stack.first_pass, strategy.picker.propose = recording_first_pass, recording_propose
    outs = llm.generate(random_prompts(VOCAB, [5, 9, 3], seed=6), greedy(30))
    assert sum(o.metrics["num_tree_alternatives_accepted"] for o in outs) > 0 and len(seen) > 20
    reference = copy.deepcopy(hf)
    reference.model.layers = reference.model.layers[:E]
    reference.config.num_hidden_layers = E
    with torch.no_grad():
        for context, logits in seen:
            torch.testing.assert_close(logits, reference(torch.tensor([context])).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_more_tokens_per_round_than_the_chain(tiny):
    path, _ = tiny
    prompts = random_prompts(VOCAB, [5, 9, 3, 12], seed=3)

    def per_round(k):
        outs = _tree(path, 1, 2, k).generate(prompts, greedy(24))
        return sum(o.metrics["num_accepted_tokens"] for o in outs) / sum(o.metrics["num_verify_steps"] for o in outs)

    assert per_round(4) > per_round(1)


def test_logprobs_are_the_models(tiny):
    """Each token's logprobs come from the verify row that predicted it (an alternative's row
    for the token after an accepted alternative)."""
    path, _ = tiny
    prompts = random_prompts(VOCAB, [4, 10, 7, 3], seed=8)
    outs = _tree(path, 1, 2, 4).generate(prompts, greedy(24, logprobs=3))
    full = eecore.LLM(path, dtype="float32", device="cpu").generate(prompts, greedy(24, logprobs=3))
    assert sum(o.metrics["num_tree_alternatives_accepted"] for o in outs) > 0
    for o, f in zip(outs, full):
        assert o.token_ids == f.token_ids
        for got, want in zip(o.logprobs, f.logprobs):
            assert got.keys() == want.keys()
            assert np.allclose(list(got.values()), list(want.values()), atol=1e-4)


def test_greedy_and_sampled_requests_share_a_tree_round(tiny):
    """In a batch mixing greedy and sampled requests both get alternatives (the runners-up, or more
    draws from q: their law is test_speculative.py's); the greedy ones still match full depth."""
    path, _ = tiny
    prompts = random_prompts(VOCAB, [6, 8, 5], seed=21)
    params = [greedy(14), eecore.SamplingParams(max_tokens=14, temperature=0.8, seed=1, ignore_eos=True), greedy(10)]
    outs = _tree(path, 1, 2, 3).generate(prompts, params)
    full = eecore.LLM(path, dtype="float32", device="cpu").generate([prompts[0], prompts[2]], [params[0], params[2]])
    assert [outs[0].token_ids, outs[2].token_ids] == [f.token_ids for f in full]
    assert outs[1].metrics["num_tree_alternatives"] > 0 and len(outs[1].token_ids) == 14
    assert outs[0].metrics["num_tree_alternatives"] > 0


@pytest.mark.parametrize("make, match", [
    (lambda: eecore.DraftCopy(top_k=0), r"DraftCopy: 'top_k' \(--draft-top-k\) must be an int >= 1, got 0"),
    (lambda: eecore.DraftCopy(top_k=2.0), r"DraftCopy: 'top_k' \(--draft-top-k\) must be an int >= 1, got 2.0"),
    (lambda: eecore.SelfSpeculativeConfig(num_speculations=8,
                                          layer=eecore.LayerDrafts(exit_layer=2, copy=eecore.DraftCopy(top_k=8))),
     f"at most {MAX_TREE_TOKENS} fit a token tree"),
], ids=["zero", "float", "too-wide"])
def test_bad_config(make, match):
    """(top_k lives on the copy, so k > 1 without separate draft layers cannot be written; the deprecated
    flat spelling: test_speculative_config.py.)"""
    with pytest.raises(ValueError, match=match):
        make()


def test_slots_reserved_for_the_tree():
    """The engine reserves a round's whole tree: 1 + d x k slots per sequence."""
    tree = eecore.DraftCopy(top_k=3)
    assert eecore.SelfSpeculativeConfig(num_speculations=3,
                                        layer=eecore.LayerDrafts(exit_layer=2, copy=tree)).verify_width == 10
    assert eecore.SelfSpeculativeConfig(num_speculations=5, layer=eecore.LayerDrafts(exit_layer=2, max_length=1, copy=tree),
                                        lookup=eecore.LookupDrafts()).verify_width == 6

