"""Would a round's first draft be right more often if the draft copy also read what full depth computed
last? An upper-bound study for chat drafts, the exit-ready preset's weak spot.

In a round the copy runs the pending token (the one the last verify pass emitted) and reads the first
draft off its layer-8 state. The verify pass that emitted that token also computed full depth's last
state at the position before it, which predicted it; nothing of it reaches the copy today. EAGLE's
drafter feeds on such states; LayerSkip's exit-query cache reuses layer-E states, not the last one.
This measures, teacher-forced along full depth's greedy continuations, how often the first draft
equals full depth's next token:

- `copy`: the shipped copy as it drafts now (its draft head on its layer-8 state);
- `fused`: the same head on the copy's state plus a learned map of full depth's previous last state
  (x = s + A rms(h); A, 576 x 576, starts at zero and alone is trained), so the copy's own answer is
  where it starts from;
- `last state only`: a head on full depth's previous last state alone (Medusa's second head: x = h +
  B silu(C rms(h)), B and C trained, the copy's adapter block, norm and draft head after it, frozen);
  it would need no copy pass at all.

Each is fit on the training packages' code prompts and the training topics' everyday requests (the
exit decision's recipe), and scored on the held-out code prompts and held-out everyday requests
(positions whose token lies outside the 8,192-token draft vocabulary count as misses for all).

`--decision` asks the exit decision's question of the same state instead: does full depth's last
state at the position before tell when the copy's draft is wrong? A logistic regression on the copy's
top-1 probability, top-2 gap and entropy, and the same plus full depth's own three at the position
before (read through the final norm and the draft vocabulary's LM-head rows), scored as
bench/analysis/exit_decision_ceiling.py scores decisions (coverage at a precision, precision at a
coverage).

    python bench/analysis/fused_first_draft.py [--train-prompts 320] [--train-chat 160] [--eval-prompts 24]
        [--eval-chat 24] [--max-tokens 96] [--steps 2000] [--rank 0] [--weight-decay 1e-4] [--cache FILE]
        [--variants fused "last state only"] [--decision] [--out-name fused-first-draft]

writes bench/results/<machine>/<out-name>-<date>.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

import eecore
from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.models.exit_adapter import AdapterBlock, adapter_reference
from eecore.exits.decision import distribution_inputs, fit_scorer
from eecore.models.int8_weights import dense

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import bench_prompt_ids, chat_prompt_ids, cpu_model, save_results  # noqa: E402
from exit_decision_ceiling import table, training_prompts  # noqa: E402


class Models:
    """Full depth (the default model) and the exit-ready copy, with a differentiable twin of the draft
    head (adapter block, final norm, draft-vocabulary rows of the LM head, in fp32)."""

    def __init__(self):
        self.full = eecore.LLM(device="cpu", max_num_seqs=8)
        self.spec = eecore.LLM(device="cpu", max_num_seqs=8, exit_adapter=True,
                               speculative=eecore.SelfSpeculativeConfig.exit_ready("layer"))
        stack = self.spec.engine.strategy.draft_stack
        self.stack = stack
        head = stack.head
        self.block = AdapterBlock(head.block.norm.float(), dense(head.block.gate_up, torch.float32),
                                  dense(head.block.down, torch.float32))
        self.final_norm = stack.model.final_norm.float()
        self.eps = stack.model.eps
        self.columns = dense(head.head, torch.float32)  # [K, d]
        vocab = head.vocab.tolist()
        self.column_of = {token: c for c, token in enumerate(vocab)}

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The draft head's column logits `[n, K]` of layer-8 states `x`, differentiable."""
        adapted = adapter_reference(self.block, x, self.eps)
        return F.rms_norm(adapted, (adapted.shape[-1],), self.final_norm, self.eps) @ self.columns.t()

    @torch.no_grad()
    def record(self, prompts: list[list[int]], max_tokens: int, stop_at_end: bool) -> dict[str, torch.Tensor]:
        """Per continuation position q (token ids[q] in, ids[q + 1] out): the copy's layer-8 state at q,
        full depth's last residual state at q - 1, and the target column (-1 outside the vocabulary)."""
        outs = self.full.generate(prompts, eecore.SamplingParams(max_tokens=max_tokens, ignore_eos=not stop_at_end))
        copy_states, last_states, targets = [], [], []
        for prompt, out in zip(prompts, outs):
            ids = prompt + list(out.token_ids)
            n = len(out.token_ids)
            if n < 1 or len(prompt) < 2:
                continue
            copy_states.append(self._states(self.spec, self.stack.runner, ids, len(prompt) - 1, n, self.stack.exit_layer))
            runner = self.full.engine.runner
            last_states.append(self._states(self.full, runner, ids, len(prompt) - 2, n, runner.num_layers))
            targets.append(torch.tensor([self.column_of.get(t, -1) for t in out.token_ids]))
        return dict(copy=torch.cat(copy_states), last=torch.cat(last_states), target=torch.cat(targets))

    @staticmethod
    def _states(llm, runner, ids: list[int], first: int, count: int, layers: int) -> torch.Tensor:
        """Residual states after `layers` layers of positions first..first+count-1, teacher-forced."""
        seq = Sequence(ids, eecore.SamplingParams(max_tokens=1))
        llm.engine.blocks.grow(seq, len(ids))  # never scheduled: it only holds blocks for this pass
        try:
            inputs = runner.prepare([Row(seq, 0, ids)])
            hidden = runner.run_layers(runner.embed(inputs), inputs.attn, 0, layers)
            return hidden[first: first + count].float().clone()
        finally:
            llm.engine.blocks.free(seq)


def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


class Fused(torch.nn.Module):
    """x = s + A rms(h), A of rank `rank` (0: full) and zero at the start."""

    def __init__(self, d: int, rank: int = 0):
        super().__init__()
        self.down = torch.nn.Identity() if rank == 0 else torch.nn.Linear(d, rank, bias=False)
        self.a = torch.nn.Linear(rank or d, d)
        torch.nn.init.zeros_(self.a.weight)
        torch.nn.init.zeros_(self.a.bias)

    def forward(self, copy: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return copy + self.a(self.down(rms(last)))


class LastOnly(torch.nn.Module):
    def __init__(self, d: int, hidden: int = 1536):
        super().__init__()
        self.c = torch.nn.Linear(d, hidden)
        self.b = torch.nn.Linear(hidden, d)
        torch.nn.init.zeros_(self.b.weight)
        torch.nn.init.zeros_(self.b.bias)

    def forward(self, copy: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return last + self.b(F.silu(self.c(rms(last))))


def train(module: torch.nn.Module, models: Models, data: dict, steps: int, batch: int = 512, lr: float = 1e-3,
          weight_decay: float = 1e-4) -> float:
    """Cross-entropy on the draft columns at positions whose target has one; returns the seconds."""
    keep = data["target"] >= 0
    copy, last, target = data["copy"][keep], data["last"][keep], data["target"][keep]
    opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for step in range(steps):
        i = torch.randint(len(target), (batch,), generator=gen)
        loss = F.cross_entropy(models.head_logits(module(copy[i], last[i])), target[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.3f}", flush=True)
    return time.perf_counter() - start


@torch.no_grad()
def agreement(module, models: Models, data: dict) -> float:
    """Share of positions whose first draft (the head's argmax) is full depth's token."""
    hits = 0
    for lo in range(0, len(data["target"]), 1024):
        copy, last = data["copy"][lo: lo + 1024], data["last"][lo: lo + 1024]
        x = copy if module is None else module(copy, last)
        hits += (models.head_logits(x).argmax(-1) == data["target"][lo: lo + 1024]).sum().item()
    return hits / len(data["target"])


@torch.no_grad()
def decision_inputs(models: Models, data: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the copy's three distribution inputs `[n, 3]`, full depth's three at the position before
    `[n, 3]`, whether the copy's draft is full depth's token `[n]`)."""
    copy_in, last_in, right = [], [], []
    for lo in range(0, len(data["target"]), 1024):
        copy_probs = models.head_logits(data["copy"][lo: lo + 1024]).softmax(-1)
        last = data["last"][lo: lo + 1024]
        last_probs = (F.rms_norm(last, (last.shape[-1],), models.final_norm, models.eps) @ models.columns.t()).softmax(-1)
        x, column = distribution_inputs(copy_probs)
        copy_in.append(x)
        last_in.append(distribution_inputs(last_probs)[0])
        right.append((column == data["target"][lo: lo + 1024]).float())
    return torch.cat(copy_in), torch.cat(last_in), torch.cat(right)


def decision_tables(models: Models, data: dict, evals: dict) -> dict:
    """Each held-out set's table: the copy's top-1 probability, a logistic regression on its three
    inputs, and one on those and full depth's three at the position before."""
    x, xl, y = decision_inputs(models, data)
    copy_only = fit_scorer(x, y)
    with_last = fit_scorer(torch.cat([x, xl], 1), y)
    tables = {}
    for name, held_out in evals.items():
        xe, xle, ye = decision_inputs(models, held_out)
        rows = table(f"\n{name}: {len(ye)} positions, copy agreement {ye.mean():.3f}", {
            "top-1 probability": xe[:, 0], "logistic": copy_only(xe),
            "logistic + full depth's previous state": with_last(torch.cat([xe, xle], 1)), "perfect": ye}, ye)
        tables[name] = dict(positions=len(ye), agreement=ye.mean().item(), rows=rows)
    return tables


def main() -> None:
    from eecore.sources.general_chat_prompts import general_instruction_records

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-prompts", type=int, default=320)
    ap.add_argument("--train-chat", type=int, default=160)
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--eval-chat", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rank", type=int, default=0, help="the fused map's rank (0: full)")
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--cache", default=None, metavar="FILE",
                    help="keep the recorded states here (recorded once, read by later runs with the same prompts)")
    ap.add_argument("--variants", nargs="*", default=["fused", "last state only"], choices=["fused", "last state only"])
    ap.add_argument("--decision", action="store_true", help="also the exit decision table (see the module doc)")
    ap.add_argument("--out-name", default="fused-first-draft")
    args = ap.parse_args()
    torch.manual_seed(0)

    models = Models()
    tok = models.full.tokenizer
    start = time.perf_counter()
    if args.cache and os.path.exists(args.cache):
        data, evals, counts = torch.load(args.cache)
    else:
        code = models.record([tok.encode(t) for t in training_prompts(args.train_prompts)], args.max_tokens, False)
        chat = models.record([chat_prompt_ids(tok, r.text) for r in general_instruction_records(args.train_chat, "train")],
                             args.max_tokens, True)
        data, counts = {k: torch.cat([code[k], chat[k]]) for k in code}, (len(code["target"]), len(chat["target"]))
        evals = {"held-out code": models.record(bench_prompt_ids(tok, "code", args.eval_prompts), args.max_tokens, False),
                 "held-out everyday requests": models.record(bench_prompt_ids(tok, "everyday", args.eval_chat),
                                                             args.max_tokens, True)}
        if args.cache:
            torch.save((data, evals, counts), args.cache)
    recorded = time.perf_counter() - start
    print(f"CPU: {cpu_model()}; recorded in {recorded:.0f} s: {len(data['target'])} training positions "
          f"({counts[0]} code, {counts[1]} everyday)", flush=True)

    d = data["copy"].shape[1]
    variants = {"copy": None, "fused": Fused(d, args.rank), "last state only": LastOnly(d)}
    variants = {name: module for name, module in variants.items() if module is None or name in args.variants}
    seconds = {}
    for name, module in variants.items():
        if module is not None:
            print(f"training {name}", flush=True)
            seconds[name] = train(module, models, data, args.steps, weight_decay=args.weight_decay)
    rows = []
    for name, module in variants.items():
        row = dict(variant=name, train=agreement(module, models, data),
                   **{k: agreement(module, models, v) for k, v in evals.items()})
        rows.append(row)
        print(f"{name:18} " + "  ".join(f"{k}: {v:.3f}" for k, v in row.items() if k != "variant"), flush=True)
    decisions = decision_tables(models, data, evals) if args.decision else None
    results = dict(model="SmolLM2-135M-Instruct (Q4_1, exact kernel)", draft="the shipped exit-ready copy, exit 8",
                   max_tokens=args.max_tokens, train_prompts=args.train_prompts, train_chat=args.train_chat,
                   train_positions=len(data["target"]), steps=args.steps, rank=args.rank,
                   weight_decay=args.weight_decay, record_seconds=recorded,
                   train_seconds=seconds, eval_positions={k: len(v["target"]) for k, v in evals.items()},
                   rows=rows, decisions=decisions)
    print(f"results: {save_results(args.out_name, results)}")


if __name__ == "__main__":
    main()
