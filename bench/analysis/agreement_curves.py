"""Per-layer agreement curves: how often each exit layer E = 1..L-1 picks the full model's token.

The top-1 token read off layer E's residual state is compared with the full model's top-1 at the
same position, on text that training never saw:
- `text`: teacher-forced windows of the held-out corpus (eecore.sources.corpus: the Python source of
  jinja2, tqdm and gguf), `--windows` windows of `--seq-len` tokens, evenly spaced over the stream;
- `generated`: the model's own greedy continuations (`--max-tokens`) of `--prompts` held-out code
  prompts (eecore.evaluation.prompts.heldout_code_prompts), teacher-forced on the generated text. These are the
  positions self-speculation drafts at, and a greedy draft is accepted when it agrees.

Settings (one curve each):
- `logit_lens`: the original model; every exit reads layer E through the model's own final norm
  and full LM head;
- `draft_vocab` (with `--exit-adapter`, if its file has a draft vocabulary): the same head
  restricted to the draft vocabulary, no adapter, at every exit;
- `adapter`: at the exits the file covers, the DraftHead (adapter block + draft vocabulary) that
  self-speculation drafts with; it agrees when its token equals the full model's full-vocabulary
  argmax;
- `draft_copy` (with `--draft-layers FILE`, an exit-ready draft-layers file): at the file's exit,
  the separate draft copy that `SelfSpeculativeConfig.exit_ready()` drafts with (layers 0..E-1
  with the file's LoRA pairs merged, weight-only int8 as the preset runs it, on its own KV cache)
  read through the file's DraftHead. The model it is compared with stays the original.
`coverage` is the fraction of the full model's tokens inside the draft vocabulary (the ceiling of
any draft-vocabulary head). For each exit and d in {1, 2, 3, 4, 6} the JSON also holds the
bandwidth-bound break-even acceptance (eecore.speculative.break_even_acceptance) of each head,
with the bytes it reads past layer E (DraftHead.weight_bytes): a greedy draft pays where its
agreement on `generated` is above it.

Every group of sequences (up to `--batch-tokens` tokens) runs as one batched prefill on eecore's
engine, layer by layer; each layer's states are read by every head in row chunks. fp32, CPU.

    python bench/analysis/agreement_curves.py [--exit-adapter FILE] [--draft-layers FILE] [--windows 16]
        [--seq-len 256] [--prompts 16] [--max-tokens 64] [--out-name NAME]
writes bench/results/<machine>/<out-name>-<date>.{json,png} (out-name: agreement, or agreement-exit-adapter
with --exit-adapter) and prints a table.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import eecore
from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import DraftHead, ExitAdapters
from eecore.evaluation.prompts import heldout_code_prompt_records
from eecore.speculative import break_even_acceptance

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import cpu_model, file_sha256, save_results, text_windows  # noqa: E402

DS = (1, 2, 3, 4, 6)
KINDS = ("text", "generated")
SETTINGS = ("logit_lens", "draft_vocab", "adapter", "draft_copy")


class Heads:
    """The heads of every setting by exit layer, and the full model's head (on the last layer)."""

    def __init__(self, model, adapters: ExitAdapters | None, chunk: int):
        L = model.num_layers
        self.lens = DraftHead(model, L, None, chunk)  # final norm + full LM head, at any layer
        self.by_setting: dict[str, dict[int, DraftHead]] = {"logit_lens": {E: self.lens for E in range(1, L)}}
        self.vocab = None
        if adapters is not None:
            if adapters.vocab is not None:
                self.vocab = adapters.vocab
                vocab_head = DraftHead(model, L, ExitAdapters(vocab=adapters.vocab), chunk)
                self.by_setting["draft_vocab"] = {E: vocab_head for E in range(1, L)}
            self.by_setting["adapter"] = {E: DraftHead(model, E, adapters, chunk) for E in adapters.exit_layers()}

    def at(self, E: int) -> dict[str, DraftHead]:
        return {s: heads[E] for s, heads in self.by_setting.items() if E in heads}


def top1(head: DraftHead, states: torch.Tensor, chunk: int) -> torch.Tensor:
    """Token ids of the head's argmax over each row of `states` [N, d], chunk by chunk."""
    return torch.cat([head.logits(states[i:i + chunk]).argmax(-1) for i in range(0, states.shape[0], chunk)])


@torch.no_grad()
def layer_top1(llm, sequences: list[list[int]], first: list[int], last: list[int], heads: Heads,
               chunk: int, batch_tokens: int) -> tuple[torch.Tensor, dict[str, dict[int, torch.Tensor]]]:
    """Teacher-forced over `sequences`, positions first[i]..last[i] (inclusive) of each: the full
    model's top-1 token `[N]`, and every setting's top-1 at every exit it covers `{setting: {E: [N]}}`.
    Sequences go in groups of at most `batch_tokens` tokens, each group one prefill."""
    L = llm.model.num_layers
    full, per = [], {s: {} for s in heads.by_setting}
    for runner, inputs, hidden, rows in prefill_groups(llm.engine, llm.engine.runner, sequences, first, last,
                                                       batch_tokens):
        for layer in range(L):
            runner.run_layers(hidden, inputs.attn, layer, layer + 1)
            states = hidden.index_select(0, rows)
            E = layer + 1
            if E == L:
                full.append(top1(heads.lens, states, chunk))
                continue
            for setting, head in heads.at(E).items():
                per[setting].setdefault(E, []).append(top1(head, states, chunk))
    return torch.cat(full), {s: {E: torch.cat(v) for E, v in d.items()} for s, d in per.items()}


@torch.no_grad()
def copy_top1(llm, sequences: list[list[int]], first: list[int], last: list[int], chunk: int,
              batch_tokens: int) -> torch.Tensor:
    """As layer_top1, for the separate draft copy of `llm` (an exit-ready LLM): its DraftHead's top-1
    at its exit `[N]`, teacher-forced on its own KV cache."""
    stack = llm.engine.strategy.draft_stack
    head = DraftHead(stack.model, stack.exit_layer, llm.exit_adapters, chunk)  # the copy's head, `chunk` rows
    out = []
    for runner, inputs, hidden, rows in prefill_groups(llm.engine, stack.runner, sequences, first, last,
                                                       batch_tokens):
        runner.run_layers(hidden, inputs.attn, 0, stack.exit_layer)
        out.append(top1(head, hidden.index_select(0, rows), chunk))
    return torch.cat(out)


def prefill_groups(engine, runner, sequences: list[list[int]], first: list[int], last: list[int], batch_tokens: int):
    """Yields, per group of whole sequences of at most `batch_tokens` tokens, what one batched
    prefill of the group on `runner` needs: its inputs, its embedded residual stream (no layer run
    yet) and the rows of positions first[i]..last[i] (inclusive) of each sequence. The sequences hold
    blocks of `engine` while the caller runs layers, and give them back after."""
    groups, group, size = [], [], 0
    for i, ids in enumerate(sequences):
        if group and size + len(ids) > batch_tokens:
            groups.append(group)
            group, size = [], 0
        group.append(i)
        size += len(ids)
    if group:
        groups.append(group)
    for group in groups:
        seqs = [Sequence(sequences[i], eecore.SamplingParams(max_tokens=1)) for i in group]
        for s, i in zip(seqs, group):  # never scheduled: they only hold blocks for this pass
            engine.blocks.grow(s, len(sequences[i]))
        try:
            inputs = runner.prepare([Row(s, 0, sequences[i]) for s, i in zip(seqs, group)])
            hidden = runner.embed(inputs)
            rows, offset = [], 0
            for i in group:
                rows.append(torch.arange(offset + first[i], offset + last[i] + 1))
                offset += len(sequences[i])
            yield runner, inputs, hidden, torch.cat(rows).to(hidden.device)
        finally:
            for s in seqs:
                engine.blocks.free(s)


def agreement(full: torch.Tensor, per: dict) -> dict[str, dict[int, float]]:
    return {s: {E: (t == full).float().mean().item() for E, t in d.items()} for s, d in per.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exit-adapter", default=None, metavar="FILE", help="an ExitAdapters file")
    ap.add_argument("--draft-layers", default=None, metavar="FILE",
                    help="an exit-ready draft-layers file (its separate int8 draft copy, as --exit-ready runs it)")
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--windows", type=int, default=16, help="held-out text windows")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    ap.add_argument("--prompts", type=int, default=16, help="held-out code prompts to continue")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="tokens per batched prefill")
    ap.add_argument("--chunk", type=int, default=512, help="rows per LM-head matmul")
    ap.add_argument("--out-name", default=None, help="results name (default: agreement[-exit-adapter])")
    args = ap.parse_args(argv)
    for name in ("windows", "seq_len", "prompts", "max_tokens", "batch_tokens", "chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    started = time.perf_counter()

    records = heldout_code_prompt_records(args.prompts)
    # the LLM is sized for the larger of the two passes; the KV cache holds one group at a time
    probe = eecore.LLM(args.model, dtype="float32", device="cpu", max_num_seqs=1, num_blocks=64)
    tokenizer = probe.tokenizer
    prompt_ids = [tokenizer.encode(r.text, add_special_tokens=False) for r in records]
    del probe
    longest = max(args.seq_len, max(map(len, prompt_ids)) + args.max_tokens)
    batch_tokens = max(args.batch_tokens, longest)
    gen_tokens = sum(len(p) + args.max_tokens for p in prompt_ids)
    block = 16
    num_blocks = max(batch_tokens, gen_tokens) // block + max(args.windows, len(prompt_ids)) + 16
    engine_kw = dict(dtype="float32", device="cpu", max_num_seqs=max(args.windows, len(prompt_ids)),
                     max_num_batched_tokens=batch_tokens, max_model_len=longest + 1, num_blocks=num_blocks,
                     block_size=block)
    llm = eecore.LLM(args.model, **engine_kw, exit_adapter=args.exit_adapter)
    model = llm.model  # an exit-ready file's LoRA pairs are merged into it: its own curves
    L = model.num_layers
    adapters = None
    adapter_info = None
    if args.exit_adapter:
        adapters = llm.exit_adapters
        adapter_info = dict(path=os.path.abspath(args.exit_adapter), sha256=file_sha256(args.exit_adapter),
                            exits=adapters.exit_layers(),
                            draft_vocab=None if adapters.vocab is None else len(adapters.vocab), info=adapters.info)
    heads = Heads(model, adapters, args.chunk)

    # (a) teacher-forced held-out text
    windows, text_info = text_windows(tokenizer, args.windows, args.seq_len)
    t0 = time.perf_counter()
    full_text, per_text = layer_top1(llm, windows, [0] * len(windows), [len(w) - 1 for w in windows], heads,
                                     args.chunk, batch_tokens)
    text_s = time.perf_counter() - t0

    # (b) the model's own greedy continuations of held-out code prompts, teacher-forced
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids, eecore.SamplingParams(max_tokens=args.max_tokens))
    gen_s = time.perf_counter() - t0
    sequences = [list(p) + list(o.token_ids) for p, o in zip(prompt_ids, outs)]
    keep = [i for i, o in enumerate(outs) if o.token_ids]
    t0 = time.perf_counter()
    full_gen, per_gen = layer_top1(llm, [sequences[i] for i in keep], [len(prompt_ids[i]) - 1 for i in keep],
                                   [len(sequences[i]) - 2 for i in keep], heads, args.chunk, batch_tokens)
    forced_s = time.perf_counter() - t0
    generated = torch.tensor([t for i in keep for t in outs[i].token_ids])
    greedy_match = (full_gen == generated).float().mean().item()

    copy_info = None
    if args.draft_layers:
        del llm  # one engine at a time: the copy's LLM holds a KV cache of the same size
        t0 = time.perf_counter()
        spec = eecore.LLM(args.model, **engine_kw, exit_adapter=args.draft_layers,
                          speculative=eecore.SelfSpeculativeConfig.exit_ready("layer"))
        stack = spec.engine.strategy.draft_stack
        E = stack.exit_layer
        per_text["draft_copy"] = {E: copy_top1(spec, windows, [0] * len(windows), [len(w) - 1 for w in windows],
                                               args.chunk, batch_tokens)}
        per_gen["draft_copy"] = {E: copy_top1(spec, [sequences[i] for i in keep], [len(prompt_ids[i]) - 1 for i in keep],
                                              [len(sequences[i]) - 2 for i in keep], args.chunk, batch_tokens)}
        copy_info = dict(path=os.path.abspath(args.draft_layers), sha256=file_sha256(args.draft_layers), exit=E,
                         draft_dtype=spec.engine.strategy.config.layer.copy.dtype, copy_bytes=stack.weight_bytes(),
                         seconds=round(time.perf_counter() - t0, 1))
        heads.by_setting["draft_copy"] = {E: stack}

    full = {"text": full_text, "generated": full_gen}
    agree = {"text": agreement(full_text, per_text), "generated": agreement(full_gen, per_gen)}
    coverage = None
    if heads.vocab is not None:
        coverage = {k: torch.isin(full[k], heads.vocab).float().mean().item() for k in KINDS}

    # break-even acceptance of each head, per exit and d
    # (the draft copy's "head" is the whole copy: it reads its E layers and its DraftHead per token)
    head_bytes = {s: {E: h.weight_bytes() for E, h in hs.items()} for s, hs in heads.by_setting.items()}
    rows = []
    for E in range(1, L):
        row = {"exit": E}
        for s in heads.by_setting:
            if E not in heads.by_setting[s]:
                continue
            kw = {} if s == "logit_lens" else \
                {"draft_bytes": head_bytes[s][E]} if s == "draft_copy" else {"draft_head_bytes": head_bytes[s][E]}
            row[s] = {"agreement": {k: round(agree[k][s][E], 4) for k in KINDS}, "head_bytes": head_bytes[s][E],
                      "break_even": {str(d): round(break_even_acceptance(model, E, d, **kw), 4) for d in DS}}
        rows.append(row)

    payload = dict(
        model=args.model or "SmolLM2-135M-Instruct", dtype="float32", device="cpu", cpu=cpu_model(),
        num_layers=L, exit_adapter=adapter_info, draft_layers=copy_info, settings=list(heads.by_setting),
        d_values=list(DS),
        windows=args.windows, seq_len=args.seq_len, text=text_info,
        prompts=[dict(package=r.package, path=r.path, function=r.function, line=r.lineno,
                      prompt_tokens=len(p), generated_tokens=len(o.token_ids))
                 for r, p, o in zip(records, prompt_ids, outs)],
        max_tokens=args.max_tokens, positions={k: int(full[k].numel()) for k in KINDS},
        greedy_match=round(greedy_match, 4), draft_vocab_coverage=coverage, rows=rows,
        seconds=dict(text_pass=round(text_s, 1), generate=round(gen_s, 1), generated_pass=round(forced_s, 1),
                     total=round(time.perf_counter() - started, 1)))
    name = args.out_name or ("agreement-exit-ready" if copy_info is not None else
                             "agreement-exit-adapter" if adapters is not None else "agreement")
    path = save_results(name, payload)
    plot(payload, path[:-len(".json")] + ".png")
    print_table(payload)
    print(f"\nresults: {path}")


def print_table(p: dict) -> None:
    settings = p["settings"]
    label = {"logit_lens": "lens", "draft_vocab": "vocab", "adapter": "adapter", "draft_copy": "copy"}
    print(f"\n{p['model']}, {p['positions']['text']} text positions, {p['positions']['generated']} generated "
          f"positions (teacher-forced full top-1 = greedy tokens: {p['greedy_match']:.3f})")
    if p["draft_vocab_coverage"]:
        c = p["draft_vocab_coverage"]
        print(f"draft vocabulary ({p['exit_adapter']['draft_vocab']} tokens) covers {c['text']:.3f} of the full "
              f"model's tokens on text, {c['generated']:.3f} on generated")
    head = f"{'E':>3} |" + "".join(f"{label[s] + ' text':>13}{'gen':>6}" for s in settings)
    head += " |" + "".join(f"{'BE ' + label[s]:>12}" for s in settings)
    print(f"agreement with the full model's top-1; BE: break-even acceptance of that head at d=1/d=4\n{head}")
    for row in p["rows"]:
        line = f"{row['exit']:>3} |"
        for s in settings:
            a = row.get(s, {}).get("agreement")
            line += f"{a['text']:13.3f}{a['generated']:6.3f}" if a else f"{'-':>13}{'-':>6}"
        line += " |"
        for s in settings:
            b = row.get(s, {}).get("break_even")
            line += f" {b['1']:.3f}/{b['4']:.3f}" if b else f"{'-':>12}"
        print(line)


def plot(p: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"logit_lens": "original model (logit lens)", "draft_vocab": "draft vocabulary only",
             "adapter": "exit adapter + draft vocabulary",
             "draft_copy": "exit-ready draft copy (layers 0..E-1 + LoRA, int8) + its head"}
    colors = {"logit_lens": "C0", "draft_vocab": "C2", "adapter": "C3", "draft_copy": "C1"}
    kinds = {"text": ("-", "held-out code, teacher-forced"), "generated": ("--", "own greedy continuations")}
    fig, ax = plt.subplots(figsize=(12, 5))
    for s in p["settings"]:
        for k, (style, kind_label) in kinds.items():
            pts = [(r["exit"], r[s]["agreement"][k]) for r in p["rows"] if s in r]
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=colors[s],
                    marker="o" if len(pts) < 8 else None, label=f"{names[s]}: {kind_label}")
    for d, style in ((1, ":"), (4, "-.")):
        pts = [(r["exit"], r["logit_lens"]["break_even"][str(d)]) for r in p["rows"]]
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, color="gray", lw=0.9,
                label=f"break-even acceptance, full head, d={d}")
        for s in ("adapter", "draft_copy"):
            pts = [(r["exit"], r[s]["break_even"][str(d)]) for r in p["rows"] if s in r]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "x" if d == 1 else "+", color=colors[s], ms=8,
                        label=f"break-even acceptance, {names[s]}, d={d}")
    ax.set_xlabel("exit layer E")
    ax.set_ylabel("top-1 agreement with the full model")
    ax.set_ylim(0, 1)
    ax.set_xlim(1, p["num_layers"] - 1)
    ax.grid(alpha=0.3)
    ax.set_title(f"{p['model']}: exit agreement on held-out code ({p['cpu']})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
