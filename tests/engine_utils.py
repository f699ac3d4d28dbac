"""Helpers for engine tests: tiny models made on the spot, HF greedy references."""
from __future__ import annotations

import copy

import torch

import eecore
from eecore.models.lora import LoraDeltas


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' `generate` greedy continuation of one prompt, with EOS not stopping it
    (eecore's side runs with ignore_eos=True)."""
    config = copy.deepcopy(hf_model.generation_config)
    # None would mean "the model's default" to transformers: name a token that cannot occur
    config.eos_token_id, config.pad_token_id = hf_model.config.vocab_size + 1000, 0
    config.do_sample, config.max_new_tokens = False, max_new_tokens
    config.temperature = config.top_p = config.top_k = None
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids):].tolist()


def greedy(max_tokens: int, **kw) -> eecore.SamplingParams:
    return eecore.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def generate_arriving(llm, prompts, params, every: int = 2):
    """Requests added one every `every` steps while the others decode, so that steps mix decodes
    with prompt chunks. Returns the outputs in request order."""
    engine, seqs, pending, steps = llm.engine, [], list(zip(prompts, params)), 0
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            prompt, p = pending.pop(0)
            seqs.append(engine.add_request(prompt, p, len(seqs)))
        engine.step()
        steps += 1
    return [engine.output(s) for s in seqs]


def assert_same_outputs(outs_a, outs_b, tolerance: float = 1e-4) -> None:
    """The same tokens, and at every step the same logprob keys with values within `tolerance`."""
    assert [o.token_ids for o in outs_a] == [o.token_ids for o in outs_b]
    for a, b in zip(outs_a, outs_b):
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            assert all(abs(step_a[t] - step_b[t]) < tolerance for t in step_a)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def truncated_merged(hf, lora: LoraDeltas | None, E: int):
    """HF's model cut to layers 0..E-1 with `lora`'s pairs merged by hand: what the copy computes."""
    model = copy.deepcopy(hf)
    model.model.layers = model.model.layers[:E]
    model.config.num_hidden_layers = E
    if lora is not None:
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name, (a, b) in lora.pairs.items():
                if int(name.split(".")[2]) < E:
                    modules[name].weight += lora.scale * (b @ a)
    return model.eval()


def assert_copy_logits_match(hf, lora: LoraDeltas | None, E: int, seen) -> None:
    """Each (context, logits) of `seen`, draft logits a copy of layers 0..E-1 computed after
    `context`, equals HF's truncated model with `lora` merged (truncated_merged) there."""
    reference = truncated_merged(hf, lora, E)
    with torch.no_grad():
        for context, logits in seen:
            torch.testing.assert_close(logits, reference(torch.tensor([context])).logits[0, -1], atol=1e-4, rtol=1e-4)


def int8_rounded(hf):
    """HF's model with every projection and the LM head in weight-only int8 as eecore computes it
    (eecore.models.int8_weights): the weights replaced by their dequantized int8 values, and each
    projection's input rows rounded to int16 first (eecore.testing.reference.round_rows_to_int16). What an
    int8 draft copy computes; the embeddings stay as they are (the copy keeps them dense)."""
    from eecore.models.int8_weights import Int8Weight
    from eecore.testing.reference import round_rows_to_int16

    def round_rows(x):
        q, scale = round_rows_to_int16(x)
        return q * scale[:, None]

    return _rounded(hf, lambda w: Int8Weight.quantize(w).dequantize(w.dtype), round_rows)


def q8_0_rounded(hf):
    """HF's model as an int8 draft copy computes it where GGUF blocks run with 8-bit activations
    (EECORE_GGUF_ACTIVATIONS=q8): every projection and the LM head in Q8_0 blocks, and each
    projection's input rows rounded to int8 per block of 32 (eecore.testing.reference.quantize_rows_q8)."""
    from eecore.models.gguf_weights import GGUFWeight
    from eecore.testing.reference import quantize_rows_q8

    def round_rows(x):
        q, scale = quantize_rows_q8(x)
        return (q * scale).reshape(x.shape)

    return _rounded(hf, lambda w: GGUFWeight.quantize(w, "Q8_0").dequantize(w.dtype), round_rows)


def _rounded(hf, round_weight, round_rows):
    """A copy of HF's model with its layers' projections and LM head replaced by `round_weight(W)`
    and their input rows `[n, K]` by `round_rows(x)`."""
    def round_input(module, args):
        x = args[0]
        return (round_rows(x.reshape(-1, x.shape[-1])).view(x.shape).to(x.dtype),) + tuple(args[1:])

    model = copy.deepcopy(hf)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (".layers." in name or name == "lm_head"):
                module.weight.copy_(round_weight(module.weight))
                module.register_forward_pre_hook(round_input)
    return model.eval()


# ---- sampling laws: chi-square tests of the first two sampled tokens ------------------------------
def first_two_token_counts(outs, vocab_size: int) -> torch.Tensor:
    """`[V, V]` counts of the (first, second) token pairs of the request outputs `outs`."""
    counts = torch.zeros(vocab_size, vocab_size)
    for o in outs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    return counts


def law_p_value(counts: torch.Tensor, law: torch.Tensor) -> float:
    """The chi-square p-value of pair counts `[V, V]` against a joint law `[V, V]`; the cells expected
    fewer than 5 times are pooled into one, so that the chi-square approximation holds."""
    from scipy.stats import chisquare

    n = counts.sum()
    expected = (law.double() * n).flatten()
    observed = counts.double().flatten()
    keep = expected >= 5
    obs, exp = observed[keep], expected[keep]
    if (~keep).any():
        obs = torch.cat([obs, observed[~keep].sum()[None]])
        exp = torch.cat([exp, expected[~keep].sum()[None]])
    exp = exp * (obs.sum() / exp.sum())
    return chisquare(obs.numpy(), exp.numpy()).pvalue


class EmulatedGraph:
    """A CUDA graph's semantics on the CPU: recording runs nothing that lasts (here the pass runs
    once, to learn its output tensors, and its in-place state is put back), and each replay runs
    the pass again, writing into those same output tensors."""

    def __init__(self, static_pass, key, step, inputs):
        saved = [t.clone() for t in static_pass._state(key)]
        self.output = step(inputs)
        for tensor, before in zip(static_pass._state(key), saved):
            tensor.copy_(before)
        self.step, self.inputs = step, inputs

    def replay(self):
        new = self.step(self.inputs)
        pairs = zip(self.output, new) if isinstance(new, tuple) else [(self.output, new)]
        for recorded, fresh in pairs:
            if recorded is not None:
                recorded.copy_(fresh)


def emulate_graphs(static_pass):
    """Turn capture on with emulated graphs: a pass whose warm-up run before the recording left its
    state changed would replay from the wrong state here, as it would on a GPU."""
    static_pass.capture = True

    def record(key, step, inputs):
        graph = EmulatedGraph(static_pass, key, step, inputs)
        return graph, graph.output

    static_pass._record = record
    return static_pass
