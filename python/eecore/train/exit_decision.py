"""Fit the learned exit decision of Algorithm 1's checks (`EarlyExitConfig(measure="agreement")`).

For every prompt, full depth's greedy continuation is generated, then teacher-forced through the
model once: at each exit layer E (the exit adapters' layers, or `--layers`) every continuation
position gives the decision's five inputs (eecore.exits.decision: the early head's distribution and
prompt lookup's agreement with it) and whether the early head's token is full depth's. A logistic
regression per layer is fit on them and written as a decision file (eecore.exits.agreement), bound
to the model and its exit adapters.

    python -m eecore.train.exit_decision --out decision.json --exit-adapter \\
        [--prompts FILE] [--code-prompts 320] [--chat-prompts 160] [--max-tokens 96]

Prompts come from a file (text, one per line, or JSONL; wrapped in the chat template with
`--chat on`) and/or the training split of eecore's own sources: code-completion prompts of the
training packages (`--code-prompts`) and everyday requests of the training topics in the chat
template (`--chat-prompts`). The shipped file (eecore.exits.agreement.SHIPPED) is
`--exit-adapter --code-prompts 320 --chat-prompts 160`.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch

from eecore.exits.agreement import early_inputs, position_proposals, save
from eecore.exits.calibration_data import teacher_forced
from eecore.exits.decision import fit_logistic
from eecore.sampling_params import SamplingParams


@torch.no_grad()
def collect(llm, prompts: list[list[int]], max_tokens: int, layers: list[int], ignore_eos: bool = False
            ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per exit layer E: (inputs `[n, 5]`, right `[n]`: 1.0 where the head's token is full depth's)
    over every continuation position of full depth's greedy outputs of `prompts` (token ids) on
    `llm` (built with the exit adapters to fit for, if any, and no early exit)."""
    from eecore.models.exit_adapter import DraftHead

    if not layers or sorted(set(layers)) != list(layers):
        raise ValueError(f"collect: 'layers' must be exit layers in ascending order, got {layers!r}")
    model, engine = llm.model, llm.engine
    if not all(1 <= E < model.num_layers for E in layers):
        raise ValueError(f"collect: exit layers lie in 1..{model.num_layers - 1}, got {layers!r}")
    chunk = engine.config.max_num_batched_tokens
    heads = {E: DraftHead(model, E, llm.exit_adapters, chunk) for E in layers}
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))
    xs: dict[int, list] = {E: [] for E in layers}
    ys: dict[int, list] = {E: [] for E in layers}
    for prompt, out in zip(prompts, outs):
        output = list(out.token_ids)
        if not output:
            continue
        ids = list(prompt) + output[:-1]  # position len(prompt) - 1 + j predicts output token j
        target = torch.tensor(output, device=model.device)
        proposals = None
        # from output token 1 on: the first comes from the prompt's pass, at full depth
        for E, h, _, first, end in teacher_forced(engine, model, ids, len(prompt), layers, chunk):
            if E == layers[0]:
                proposals = torch.tensor(position_proposals(ids, first, end), device=model.device)
            inputs, tokens = early_inputs(heads[E], h, proposals)
            cols = slice(first - len(prompt) + 1, end - len(prompt) + 1)
            xs[E].append(inputs.float().cpu())
            ys[E].append((tokens == target[cols]).float().cpu())
    return {E: (torch.cat(xs[E]), torch.cat(ys[E])) for E in layers if xs[E]}


def fit(data: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    """(the regression per layer, what to record beside it: positions and the head's agreement)."""
    decisions, stats = {}, {}
    for E, (x, y) in data.items():
        decisions[E] = fit_logistic(x, y)
        stats[E] = dict(positions=len(y), agreement=round(y.mean().item(), 4))
    return decisions, stats


def training_prompts(llm, code: int, chat: int) -> list[list[int]]:
    """`code` code-completion prompts of the training packages (raw text) and `chat` everyday
    requests of the training topics in the chat template, as token ids."""
    prompts = []
    if code:
        from eecore.evaluation.prompts import heldout_code_prompt_records
        from eecore.sources.corpus import build_corpus

        files = build_corpus().train
        records = heldout_code_prompt_records(code, packages=sorted({f.package for f in files}), files=files)
        prompts += [llm.tokenizer.encode(r.text) for r in records]
    if chat:
        from eecore.sources.general_chat_prompts import general_instruction_records

        prompts += [llm.chat_prompt([{"role": "user", "content": r.text}])[1]
                    for r in general_instruction_records(chat, "train")]
    return prompts


def main(argv: Optional[list[str]] = None) -> int:
    import eecore
    from eecore.cli.args import add_precision_flags, prompt_input
    from eecore.evaluation.prompt_sets import read_prompt_file

    ap = argparse.ArgumentParser(prog="python -m eecore.train.exit_decision", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the decision file to write (JSON)")
    ap.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    add_precision_flags(ap)
    ap.add_argument("--exit-adapter", nargs="?", const=True, default=None, metavar="FILE",
                    help="fit for exit adapters: the shipped ones (no FILE), or a file")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="exit layers to fit (default: the exit adapters' layers)")
    ap.add_argument("--prompts", default=None, help="prompts: text (one per line) or JSONL")
    ap.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                    help="wrap --prompts in the model's chat template (auto: when it has one)")
    ap.add_argument("--code-prompts", type=int, default=0, help="code prompts of eecore's training packages")
    ap.add_argument("--chat-prompts", type=int, default=0, help="everyday requests of eecore's training topics")
    ap.add_argument("--max-tokens", type=int, default=96, help="continuation length per prompt")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    args = ap.parse_args(argv)
    try:
        llm = eecore.LLM(args.model, dtype=args.dtype, quantization=args.quantization, device="cpu",
                         exit_adapter=args.exit_adapter, max_num_seqs=args.max_num_seqs)
        layers = args.layers or (llm.exit_adapters.exit_layers() if llm.exit_adapters is not None else None)
        if not layers:
            raise ValueError("--layers is required without --exit-adapter")
        prompts = training_prompts(llm, args.code_prompts, args.chat_prompts)
        if args.prompts:
            prompts += [llm.tokenizer.encode(p) if isinstance(p, str) else p for p in
                        (prompt_input(llm, q.prompt, args.chat) for q in read_prompt_file(args.prompts))]
        if not prompts:
            raise ValueError("no prompts: give --prompts, --code-prompts or --chat-prompts")
        data = collect(llm, prompts, args.max_tokens, sorted(layers))
    except ValueError as exc:
        print(f"exit_decision: {exc}", file=sys.stderr)
        return 2
    decisions, stats = fit(data)
    how = (f"python -m eecore.train.exit_decision {' '.join(argv if argv is not None else sys.argv[1:])}: "
           f"{len(prompts)} prompts, {args.max_tokens}-token greedy continuations")
    save(args.out, llm.model, llm.exit_adapters, decisions, how, stats)
    for E in sorted(stats):
        print(f"layer {E}: {stats[E]['positions']} positions, the head agrees with full depth on "
              f"{stats[E]['agreement']:.1%}")
    print(f"decision file: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
