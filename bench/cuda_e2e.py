"""Full-depth decode throughput on CUDA: eecore against HF transformers' `generate`, on random
weights of real model shapes (nothing is downloaded; decode speed does not depend on the values).

    PYTHONPATH=python python bench/cuda_e2e.py [--models smollm2-135m llama-3.2-1b]
        [--batch-sizes 1 8 64] [--max-tokens 128] [--dtype bfloat16] [--repeats 3]
        [--exit-models llama-3.2-1b] [--num-speculations 3] [--exit-configs TEXT ...] [--exit-ready-model GGUF]
        [--exit-ready-prompts code everyday] [--piecewise]
        [--no-hf] [--temperature T] [--ab-env EECORE_LINEAR_KERNEL=gemv,... [--ab-env ...]]

Both engines get the same random prompts, decode greedily (with --temperature, the decode rows
sample, each request seeded, and HF is left out) and ignore EOS; they alternate, and the medians
are kept. eecore runs twice: as configured (CUDA graphs of the decode step) and with
enforce_eager=True, so each row also says what the graphs gain. With --ab-env NAME=VALUE,... (once
or more), another engine runs with those variables set around each of its calls (the kernel selectors, such
as EECORE_LINEAR_KERNEL=gemv, are read at every launch and so at every capture): each row then
also says what they gain over the default kernels, side by side, and whether the outputs match.

For each of --exit-models, early exit and self-speculation at E = L/4 and L/2 against full depth,
at every batch size, each alternating with full depth (both graphed where eecore captures them):
static exits at E (`EarlyExitConfig(measure="static")`, the seed's batched iteration with KV fill
of the skipped layers), the same iteration with a softmax check at E whose threshold lets every
row exit there or none (on random weights the confidence means nothing: the two bound what the
check costs and what exiting gains with it), LayerSkip's self-speculation with the first E layers as the drafter
(`LayerDrafts(E)`, shared KV cache and exit-query cache) and with a draft copy of them
(`LayerDrafts(E, copy=DraftCopy())`). Random weights measure speed only: their drafts' acceptance
is printed beside it, since a round's speed depends on it; the draft copy also runs with perfect
drafts (eecore.testing.accept_every_draft: every pass runs, and every draft is accepted), the most
any training of the drafter could give at that E, d and batch. Their output is the drafts' text, so
those rows report no comparison with full depth's. (Drafts taken from full depth's own output held
only while a verify pass rounds as a one-row step: in bf16 at batch 64 a near-tie flipped within a
few tokens and every later draft missed, acceptance 0.04.)

With --exit-ready-model (the SmolLM2-135M-Instruct GGUF, which a lent GPU gets in parts: see
tools/gpu_train_exit_ready.sh), the exit-ready presets for a GPU (`SelfSpeculativeConfig.exit_ready(
preset, device="cuda")` with the shipped draft layers) run against that model's full depth on
held-out prompts (--exit-ready-prompts: code, and "everyday" chat requests), at every batch size:
real weights, real acceptance; on a GPU also the shipped feature head, alone and beside the layer
preset's copy, op by op and as graphs ("..., graphs": EECORE_FEATURE_GRAPHS=1 and
EECORE_TREE_GRAPHS=1). --exit-configs
filters these rows too. Writes
bench/results/<gpu>/<device>-e2e-<date>.json (cuda_ops.py names both).
"""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import statistics
import tempfile
import time

import torch

import eecore
from common import (PROMPT_KINDS, bench_prompt_ids, device_folder, device_slug, hf_generate_greedy, save_results,
                    timed)

MODELS = {  # HF LlamaConfig fields of the real checkpoints
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True),
}
# a shape of the same kind small enough to run these scripts end to end on a CPU (tests/test_gpu_scripts.py)
SMOKE_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=True)
SHAPES = dict(MODELS, tiny=SMOKE_MODEL)  # what --models accepts; MODELS, the real ones, are the default


class Results:
    """The run's rows by kind, written out after every row: a GPU call's step that runs out of
    time keeps what it measured."""

    def __init__(self, args):
        self.device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        self.payload = dict(device=self.device, dtype=args.dtype, max_tokens=args.max_tokens,
                            prompt_len=args.prompt_len, repeats=args.repeats, weights="random", rows=[], exits=[],
                            piecewise=[])
        self.path = None

    def add(self, kind: str, row: dict) -> None:
        self.payload[kind].append(row)
        self.path = save_results(f"{device_slug(self.device)}-e2e", self.payload,
                                 folder=device_folder(self.device) if self.device != "cpu" else None)


def with_env(env: dict, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the variables of `env` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args, **kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def random_checkpoint(name: str, folder: str, dtype: torch.dtype, device: str):
    """Save a random-weight model of `name`'s shape to `folder`; return it as an HF model on `device`."""
    import transformers

    config = transformers.LlamaConfig(max_position_embeddings=4096, **SHAPES[name])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, safe_serialization=True)
    return model.to(device).eval()


# a draft copy's round: pass by pass, its chain on the device, and its verify pass behind the chain
AHEAD_MODES = {"": {}, ", ahead": {"EECORE_DRAFT_AHEAD": "1"},
               ", ahead, verify ahead": {"EECORE_DRAFT_AHEAD": "1", "EECORE_VERIFY_AHEAD": "1"},
               ", fused": {"EECORE_FUSED_ROUNDS": "1"}}


def exit_configs(num_layers: int, d: int) -> dict:
    """Early exit and self-speculation at E = L/4 and L/2, by row name ("ahead": the draft copy's
    chain on the device, EECORE_DRAFT_AHEAD=1; "verify ahead": its verify pass launched behind it,
    EECORE_VERIFY_AHEAD=1; "fused": the round fused, one read-back, EECORE_FUSED_ROUNDS=1;
    "adaptive": lengths from the draft planner)."""
    configs = {}
    for E in sorted({num_layers // 4, num_layers // 2}):
        configs[f"static exit E={E}"] = dict(early_exit=eecore.EarlyExitConfig(measure="static", exit_layer=E))
        # the seed's batched iteration with one softmax check at E (rule "all", KV fill of the skipped
        # layers): random weights give no meaningful confidence, so the threshold makes every row
        # exit there (0: a top-2 gap is > 0) or none (1: it never is), the gain with the check's cost
        # and the check's cost alone
        for label, threshold in (("all exit", 0.0), ("none exit", 1.0)):
            configs[f"softmax check at E={E}, {label}"] = dict(early_exit=eecore.EarlyExitConfig(
                measure="softmax", threshold=threshold, min_exit_layer=E, check_every=num_layers))
        configs[f"layer drafts E={E} d={d}"] = dict(
            speculative=eecore.SelfSpeculativeConfig(num_speculations=d, layer=eecore.LayerDrafts(E)))
        for perfect in (False, True):
            for ahead, env in AHEAD_MODES.items():
                label = f"draft copy E={E} d={d}" + (", perfect drafts" if perfect else "") + ahead
                configs[label] = dict(
                    speculative=eecore.SelfSpeculativeConfig(num_speculations=d,
                                                             layer=eecore.LayerDrafts(E, copy=eecore.DraftCopy())),
                    perfect=perfect, env=env)
        # the draft planner on drafts that fail (random weights): it turns drafting off, and its
        # plain rounds launch their successors ahead as full depth's steps do
        configs[f"draft copy E={E} d={d}, adaptive"] = dict(speculative=eecore.SelfSpeculativeConfig(
            num_speculations=d, adaptive=True, layer=eecore.LayerDrafts(E, copy=eecore.DraftCopy())))
    return configs


def pick_configs(configs: dict, patterns) -> dict:
    """The entries of `configs` whose label contains one of `patterns`, or matches it as a glob
    ("*E=4*perfect*": a pattern without spaces, which a shell variable of arguments can carry);
    None picks them all."""
    if patterns is None:
        return configs
    return {label: config for label, config in configs.items()
            if any(p in label or fnmatch.fnmatchcase(label, p) for p in patterns)}


def exit_ready_configs(device: str) -> dict:
    """The exit-ready presets for `device`, with the shipped draft layers (eecore.speculative.presets)."""
    from eecore.models.exit_adapter import SHIPPED_DRAFT_FILE

    # the shipped file by path: exit_adapter=True is refused for a model given by path
    configs = {f"exit-ready {preset}": dict(exit_adapter=SHIPPED_DRAFT_FILE,
                                            speculative=eecore.SelfSpeculativeConfig.exit_ready(preset, device=device))
               for preset in ("layer", "hybrid")}
    for ahead, env in AHEAD_MODES.items():
        if env:
            configs["exit-ready layer" + ahead] = dict(configs["exit-ready layer"], env=env)
    if device == "cuda":  # the shipped feature head, alone (chains) and beside the layer preset's copy
        # (trees of 3, as the CPU preset), op by op and as CUDA graphs (EECORE_FEATURE_GRAPHS, EECORE_TREE_GRAPHS)
        layer = configs["exit-ready layer"]
        for graphs in ("0", "1"):
            label, env = (", graphs" if graphs == "1" else ""), {"EECORE_FEATURE_GRAPHS": graphs,
                                                                 "EECORE_TREE_GRAPHS": graphs}
            configs["feature head d=2" + label] = dict(env=env, speculative=eecore.SelfSpeculativeConfig(
                num_speculations=2, adaptive=True, feature=eecore.FeatureDrafts(max_length=2)))
            configs["exit-ready layer + head" + label] = dict(layer, env=env, speculative=dataclasses.replace(
                layer["speculative"], feature=eecore.FeatureDrafts(top_k=3, max_length=2)))
    return configs


def against_full_depth(name: str, model: str, configs: dict, full, prompt_sets: dict, params, args,
                       results: Results) -> None:
    """Each of `configs` (label -> LLM keywords, "perfect": accept every draft) on `model` against
    the full-depth engine `full`, alternating run by run, on each of
    `prompt_sets` (kind -> prompts; a kind other than "" is named in the rows). One engine a config
    serves every kind: its graph captures, not the decoding, take most of a row's time."""
    from eecore.testing import accept_every_draft

    for label, config in configs.items():
        config = dict(config)
        perfect = config.pop("perfect", False)
        llm = with_env(config.pop("env", {}), eecore.LLM, model, dtype=args.dtype, device=args.device,
                       max_num_seqs=max(args.batch_sizes), **config)
        if perfect:  # every pass runs, every draft is accepted
            accept_every_draft(llm)
        first = next(iter(prompt_sets.values()))
        llm.generate(first[:1], eecore.SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        for (kind, prompts), batch in ((k, b) for k in prompt_sets.items() for b in args.batch_sizes):
            row_label = f"{label}, {kind} prompts" if kind else label
            t_full, t_exit = [], []
            for _ in range(args.repeats):
                full_outs, t = timed(full.generate, prompts[:batch], params)
                t_full.append(t)
                outs, t = timed(llm.generate, prompts[:batch], params)
                t_exit.append(t)
            speedup = statistics.median(t_full) / statistics.median(t_exit)
            drafted = sum(o.metrics.get("num_drafted_tokens", 0) for o in outs)
            accepted = sum(o.metrics.get("num_accepted_tokens", 0) for o in outs)
            # the rounds the sequences took, and the draft layers' proposals, kept or not (a chain's
            # drafts under its stop rule are proposals that are never drafted, and still cost passes)
            rounds = sum(o.metrics.get("num_verify_steps", 0) for o in outs)
            proposals = sum(o.metrics.get("num_layer_proposals", 0) for o in outs)
            same = sum(o.token_ids == f.token_ids for o, f in zip(outs, full_outs))
            tok_s = batch * args.max_tokens / statistics.median(t_exit)
            layers = statistics.mean(o.metrics.get("mean_layers_per_token", 0.0) for o in outs)
            results.add("exits", dict(model=name, config=row_label, batch=batch, tok_s=tok_s, vs_full_depth=speedup,
                                      drafted=drafted, accepted=accepted, rounds=rounds, layer_proposals=proposals,
                                      mean_layers_per_token=layers,
                                      identical_to_full_depth="-" if perfect else f"{same}/{batch}"))
            acceptance = f"   acceptance {accepted / drafted:.2f}" if drafted else ""
            acceptance += f"   {proposals} layer proposals in {rounds} rounds" if rounds else ""
            print(f"{name} {row_label} batch {batch}: {tok_s:8.1f} tok/s   {speedup:4.2f}x full depth{acceptance}   "
                  f"{layers:.1f} layers a token" + ("" if perfect else f"   identical to full depth {same}/{batch}"),
                  flush=True)
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()


def run_arrivals(llm, prompts, params, every: int) -> tuple[float, list]:
    """Requests added one every `every` steps while the others decode (a server's steady state:
    most steps carry a prompt chunk beside the decodes). Returns the wall time and the outputs."""
    engine, seqs, pending, steps = llm.engine, [], list(prompts), 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        if pending and steps % every == 0:
            seqs.append(engine.add_request(pending.pop(0), params, len(seqs)))
        engine.step()
        steps += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, [engine.output(s) for s in seqs]


def piecewise_rows(name: str, folder: str, prompts, params, args, results: Results) -> None:
    """Steps that carry prompt chunks with everything but attention as CUDA graphs (the default,
    eecore.engine.piecewise) against the same steps launched op by op (EECORE_PIECEWISE_GRAPHS=0;
    decode steps are graphs in both): a batch's prefill alone, and requests arriving every 2 steps."""
    PIECEWISE_GRAPHS_ENV = "EECORE_PIECEWISE_GRAPHS"

    engines = {}
    for on in (False, True):
        os.environ[PIECEWISE_GRAPHS_ENV] = "1" if on else "0"
        engines[on] = eecore.LLM(folder, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_sizes))
    os.environ.pop(PIECEWISE_GRAPHS_ENV)
    batch = max(args.batch_sizes)
    first = eecore.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    workloads = {f"prefill of {batch} prompts": lambda llm: timed(llm.generate, prompts[:batch], first)[::-1],
                 f"{batch} requests arriving every 2 steps": lambda llm: run_arrivals(llm, prompts[:batch], params, 2)}
    for label, run in workloads.items():
        for llm in engines.values():  # warm-up: the captures
            run(llm)
        times, outputs = {False: [], True: []}, {}
        for _ in range(args.repeats):
            for on, llm in engines.items():
                t, outputs[on] = run(llm)
                times[on].append(t)
        same = sum(a.token_ids == b.token_ids for a, b in zip(outputs[True], outputs[False]))
        count = len(outputs[True])
        t_eager, t_piecewise = statistics.median(times[False]), statistics.median(times[True])
        gaps = divergence_gaps(folder, prompts, outputs[True], outputs[False], args.device)
        results.add("piecewise", dict(model=name, workload=label, eager_s=t_eager, piecewise_s=t_piecewise,
                                      piecewise_vs_eager=t_eager / t_piecewise, identical=f"{same}/{count}",
                                      divergence_gaps=gaps))
        where = (f"   where they differ, fp32 logit gap between the two choices: max {max(gaps):.3f}, "
                 f"median {statistics.median(gaps):.3f}" if gaps else "")
        print(f"{name} {label}: piecewise graphs {t_piecewise * 1e3:8.1f} ms, op by op {t_eager * 1e3:8.1f} ms, "
              f"{t_eager / t_piecewise:4.2f}x   identical outputs {same}/{count}{where}", flush=True)


def divergence_gaps(folder: str, prompts, outputs_a, outputs_b, device: str) -> list[float]:
    """For each pair of outputs that differ, the fp32 model's logit gap between the two tokens
    chosen at the first position where they part. bf16 rounds differently for another GEMM shape
    (a padded graph's rows); a gap of the size of bf16's rounding noise is a near-tie that such
    rounding flips, a large one is a wrong token."""
    import transformers

    pairs = [(p, a.token_ids, b.token_ids) for p, a, b in zip(prompts, outputs_a, outputs_b)
             if a.token_ids != b.token_ids]
    if not pairs:
        return []
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).to(device).eval()
    gaps = []
    with torch.no_grad():
        for prompt, a, b in pairs:
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            ids = torch.tensor([list(prompt) + a[:k]], device=device)
            logits = model(ids).logits[0, -1].float()
            gaps.append(abs(logits[a[k]] - logits[b[k]]).item())
    del model
    return gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exit-models", nargs="*", default=["llama-3.2-1b"], choices=list(SHAPES))
    ap.add_argument("--num-speculations", type=int, default=3)
    ap.add_argument("--exit-configs", nargs="*", default=None, metavar="TEXT",
                    help="only the exit rows whose name contains one of these or matches it as a glob (default: all)")
    ap.add_argument("--exit-ready-model", default=None, metavar="GGUF",
                    help="also run the exit-ready presets (SelfSpeculativeConfig.exit_ready(device='cuda'), the "
                         "shipped draft layers) on this SmolLM2-135M-Instruct file against its full depth, on "
                         "held-out code prompts")
    ap.add_argument("--exit-ready-prompts", nargs="+", default=["code"], choices=list(PROMPT_KINDS),
                    help="the held-out prompts the exit-ready rows decode (bench/common.py's kinds; \"everyday\": "
                         "chat requests in the chat template)")
    ap.add_argument("--piecewise", action="store_true",
                    help="also time steps that carry prompt chunks with piecewise graphs against op by op")
    ap.add_argument("--no-hf", action="store_true", help="leave out HF generate (its figures change little)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the decode rows' sampling temperature (each request seeded, so that every engine draws "
                         "the same numbers; no HF row): sampled steps, which decode ahead overlaps as well")
    ap.add_argument("--ab-env", action="append", default=[], metavar="NAME=VALUE,...",
                    help="also run an engine with these environment variables set (comma-separated), against the "
                         "default; once per engine")
    ap.add_argument("--device", default="cuda", help="cpu only to check the script itself")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_e2e.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    variants = {text: dict(item.split("=", 1) for item in text.split(",") if item) for text in args.ab_env}

    results = Results(args)
    for name in args.models:
        with tempfile.TemporaryDirectory() as folder:
            hf = random_checkpoint(name, folder, dtype, args.device)
            if args.no_hf or args.temperature > 0:
                hf = None
            llm = eecore.LLM(folder, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_sizes))
            # the same engine launching op by op: what the CUDA graphs of the decode step gain
            eager = eecore.LLM(folder, dtype=args.dtype, device=args.device, max_num_seqs=max(args.batch_sizes),
                               enforce_eager=True)
            g = torch.Generator().manual_seed(1)
            prompts = [torch.randint(0, SHAPES[name]["vocab_size"], (args.prompt_len,), generator=g).tolist()
                       for _ in range(max(args.batch_sizes))]
            params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
            sampled = args.temperature > 0
            decode_params = [eecore.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                   seed=i if sampled else None, ignore_eos=True)
                             for i in range(max(args.batch_sizes))]
            # built under their switches too: some are read when the model is built
            ab = {text: with_env(variants[text], eecore.LLM, folder, dtype=args.dtype, device=args.device,
                                 max_num_seqs=max(args.batch_sizes))
                  for text in variants}
            warm_up = eecore.SamplingParams(max_tokens=8, ignore_eos=True)
            for engine in (llm, eager):  # warm-up (and, with graphs, the capture of batch 1)
                engine.generate(prompts[:1], warm_up)
            for text, engine in ab.items():
                with_env(variants[text], engine.generate, prompts[:1], warm_up)
            if hf is not None:
                hf_generate_greedy(hf, prompts[:1], 8)
            for batch in args.batch_sizes:
                # untimed, each engine at this batch: its graphs for every table width the run reaches,
                # and the process's first use of the kernels the batch's shapes pick, which would
                # otherwise fall on whichever engine ran first (the default's batch-64 run, 1.2-1.6x
                # slower than switches that change nothing at 64 rows, on an H200)
                llm.generate(prompts[:batch], decode_params[:batch])
                for text, engine in ab.items():
                    with_env(variants[text], engine.generate, prompts[:batch], decode_params[:batch])
                # the engines alternate run by run, so a burst of load hits them alike
                times: dict[str, list[float]] = {"graphs": [], "eager": [], "hf": [], **{t: [] for t in ab}}
                ab_outs = {}
                for _ in range(args.repeats):
                    outs, t = timed(llm.generate, prompts[:batch], decode_params[:batch])
                    times["graphs"].append(t)
                    for text, engine in ab.items():
                        ab_outs[text], t = with_env(variants[text], timed, engine.generate, prompts[:batch],
                                                    decode_params[:batch])
                        times[text].append(t)
                    eager_outs, t = timed(eager.generate, prompts[:batch], decode_params[:batch])
                    times["eager"].append(t)
                    if hf is not None:
                        hf_outs, t = timed(hf_generate_greedy, hf, prompts[:batch], args.max_tokens)
                        times["hf"].append(t)
                t_ee, t_eager = statistics.median(times["graphs"]), statistics.median(times["eager"])
                tokens = batch * args.max_tokens
                same_eager = sum(o.token_ids == e.token_ids for o, e in zip(outs, eager_outs))
                row = dict(model=name, batch=batch, eecore_tok_s=tokens / t_ee, eager_tok_s=tokens / t_eager,
                           graphs_vs_eager=t_eager / t_ee, identical_to_eager=f"{same_eager}/{batch}")
                line = (f"{name} batch {batch}: eecore {tokens / t_ee:8.1f} tok/s (eager {tokens / t_eager:8.1f}, "
                        f"graphs {t_eager / t_ee:4.2f}x, identical to eager {same_eager}/{batch})")
                row["variants"] = []
                for text in ab:
                    t_ab = statistics.median(times[text])
                    same_ab = sum(o.token_ids == a.token_ids for o, a in zip(outs, ab_outs[text]))
                    row["variants"].append(dict(env=text, tok_s=tokens / t_ab, vs_default=t_ee / t_ab,
                                                identical=f"{same_ab}/{batch}"))
                    line += f"   | with {text}: {t_ee / t_ab:4.2f}x, identical {same_ab}/{batch}"
                if hf is not None:
                    t_hf = statistics.median(times["hf"])
                    same = sum(o.token_ids == h for o, h in zip(outs, hf_outs))
                    row.update(hf_tok_s=tokens / t_hf, speedup=t_hf / t_ee, identical_greedy_outputs=f"{same}/{batch}")
                    line += (f"   HF {tokens / t_hf:8.1f} tok/s   speed-up {t_hf / t_ee:5.2f}x   identical greedy "
                             f"outputs {same}/{batch}")
                results.add("rows", row)
                print(line, flush=True)
            del eager, hf, ab
            if args.piecewise:
                piecewise_rows(name, folder, prompts, params, args, results)
            if name in args.exit_models:
                configs = pick_configs(exit_configs(SHAPES[name]["num_hidden_layers"], args.num_speculations),
                                       args.exit_configs)
                against_full_depth(name, folder, configs, llm, {"": prompts}, params, args, results)
            del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.exit_ready_model is not None:
        full = eecore.LLM(args.exit_ready_model, dtype=args.dtype, device=args.device,
                          max_num_seqs=max(args.batch_sizes))
        prompt_sets = {kind: bench_prompt_ids(full.tokenizer, kind, max(args.batch_sizes))
                       for kind in args.exit_ready_prompts}
        params = eecore.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        full.generate(prompt_sets[args.exit_ready_prompts[0]][:1], eecore.SamplingParams(max_tokens=8, ignore_eos=True))
        configs = pick_configs(exit_ready_configs(args.device), args.exit_configs)
        against_full_depth("smollm2-135m-instruct", args.exit_ready_model, configs, full, prompt_sets, params, args,
                           results)
        del full
    print(f"results: {results.path}")


if __name__ == "__main__":
    main()
