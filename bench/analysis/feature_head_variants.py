"""Would another shape of feature head draft better? Variants of a trained head, each trained the
same steps on the same batches, against the head as it is trained the same way.

    PYTHONPATH=python python bench/analysis/feature_head_variants.py --corpus MIX --variants head context two-layers \
        [--init HEAD.safetensors] [--steps 200] [--lr 0.0002] [--seed 12] [--eval-windows 32]

Variants, all starting from `--init` (default: the shipped head) and trained with its recipe
(eecore.train.feature_head: the unroll of 4 drafts from every position, the target sharpened at
temperature 0.5, a cosine schedule):
- "head": the head as it is: each draft attends to the round's window only (the drafts so far);
- "context": attention over the whole context as well, as EAGLE's heads do (their own K/V of every
  position before, from the target's states there), so a draft can look back at the prompt;
- "two-layers": a second decoder layer after the first, starting silent (its output projections
  zero, so it drafts what the head does until trained).

Prints held-out agreement (the first k drafts all right) before and after, each variant's unroll
being what it would run. "head" before training is the trainer's own evaluation, which the script
checks. Writes nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
import torch.nn.functional as F

import eecore
from eecore.models.feature_head import SHIPPED_FILE, FeatureHead, rotate_half
from eecore.models.rope import cos_sin_cache
from eecore.train.exit_ready import corpus_tokens
from eecore.train.feature_head import FeatureHeadConfig, FeatureHeadTrainer
from eecore.train.loop import batch_windows, heldout_windows

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: common.py
from common import cpu_model  # noqa: E402

VARIANTS = ("head", "context", "two-layers")
LAYER = ("norm_attn", "qkv", "o", "norm_mlp", "gate_up", "down")


class VariantTrainer(FeatureHeadTrainer):
    """FeatureHeadTrainer whose unroll attends over the context too (`context`) or runs `layers`
    decoder layers (layer n > 0's weights named NAME + str(n))."""

    def __init__(self, llm, config, vocab, head, context: bool, layers: int):
        super().__init__(llm, config, vocab, head=head)
        self.context, self.layers = context, layers
        for n in range(1, layers):
            for name in LAYER:
                weight = self.params[name].detach().clone()
                self.params[f"{name}{n}"] = torch.nn.Parameter(weight.zero_() if name in ("o", "down") else weight)
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=config.lr, weight_decay=config.weight_decay)

    def unroll(self, windows: torch.Tensor):
        features, probs = self._target(windows)
        B, T = windows.shape
        drafts = self.config.drafts
        S = T - drafts - 1  # starts: every position with `drafts` tokens after it
        head, w = self.head, self.params
        H, Hkv, hd = head.num_heads, head.num_kv_heads, head.head_dim
        groups, half = H // Hkv, hd // 2
        cos_sin = cos_sin_cache(S + drafts, hd, head.rope_theta)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        state = head.start_state(features[:, :S].reshape(B * S, -1)).view(B, S, -1)
        firsts = [None] * self.layers             # per layer: step 0's keys and values [B, S, Hkv, hd]
        chains = [[] for _ in range(self.layers)]  # per layer: later steps' keys and values
        loss, all_right, agreed = 0.0, None, []
        for j in range(drafts):
            token, target = windows[:, 1 + j: 1 + j + S], probs[:, 1 + j: 1 + j + S]
            h = F.linear(torch.cat([self.embed[token], state], -1), w["merge"])
            rows = cos_sin[torch.arange(S) + j][:, None]  # each start's position j steps on
            cos, sin = rows[..., :half], rows[..., half:]
            for n in range(self.layers):
                s = "" if n == 0 else str(n)
                qkv = F.linear(F.rms_norm(h, (h.shape[-1],), w["norm_attn" + s], head.eps), w["qkv" + s])
                q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], -1)
                q = rotate_half(q.view(B, S, H, hd), cos, sin).view(B, S, Hkv, groups, hd) / hd ** 0.5
                k, v = rotate_half(k.view(B, S, Hkv, hd), cos, sin), v.view(B, S, Hkv, hd)
                if j == 0:
                    firsts[n] = (k, v)
                else:
                    chains[n].append((k, v))
                k0, v0 = firsts[n]
                if self.context:  # every start's step-0 keys up to its own
                    before = torch.einsum("bikgd,bjkd->bkgij", q, k0).masked_fill(~causal, float("-inf"))
                else:             # its own step-0 key alone
                    before = torch.einsum("bikgd,bikd->bkgi", q, k0)[..., None]
                own = [torch.einsum("bikgd,bikd->bkgi", q, ck)[..., None] for ck, _ in chains[n]]
                weights = torch.cat([before] + own, -1).softmax(-1)
                m = before.shape[-1]
                if self.context:
                    attended = torch.einsum("bkgij,bjkd->bikgd", weights[..., :m], v0)
                else:
                    attended = torch.einsum("bkgi,bikd->bikgd", weights[..., 0], v0)
                for i, (_, cv) in enumerate(chains[n]):
                    attended = attended + torch.einsum("bkgi,bikd->bikgd", weights[..., m + i], cv)
                h = h + F.linear(attended.reshape(B, S, H * hd), w["o" + s])
                gate, up = F.linear(F.rms_norm(h, (h.shape[-1],), w["norm_mlp" + s], head.eps),
                                    w["gate_up" + s]).chunk(2, -1)
                h = h + F.linear(F.silu(gate) * up, w["down" + s])
            logits = F.linear(F.rms_norm(h, (h.shape[-1],), w["norm_out"], head.eps), self.head_rows)
            state = h
            loss = loss - (target * F.log_softmax(logits, -1)).sum(-1).mean()
            right = (logits.argmax(-1) == target.argmax(-1)).reshape(-1)
            all_right = right if all_right is None else all_right & right
            agreed.append(all_right)
        return loss / drafts, agreed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True, help="a generated corpus (python -m eecore.train.generated_corpus)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--init", default=SHIPPED_FILE)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--cache", default=None, help="a folder for the corpus's token cache")
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = eecore.LLM(dtype="float32", device="cpu", quantization="none")
    tokens = corpus_tokens(llm.tokenizer, args.corpus, "train", args.cache)
    heldout = corpus_tokens(llm.tokenizer, args.corpus, "heldout", args.cache)
    config = FeatureHeadConfig(steps=args.steps, lr=args.lr, seed=args.seed, target_temperature=0.5,
                               lr_schedule="cosine")
    evaluation = heldout_windows(heldout, dataclasses.replace(config, batch_size=args.eval_windows))
    print(f"CPU: {cpu_model()}; {args.steps} steps from {os.path.basename(args.init)}")
    for variant in args.variants:
        init = FeatureHead.load(args.init, llm.model)
        trainer = VariantTrainer(llm, config, init.vocab, init, context=variant == "context",
                                 layers=2 if variant == "two-layers" else 1)
        before = trainer.evaluate(evaluation)
        if variant == "head":  # the unroll here is the trainer's own
            own = FeatureHeadTrainer.unroll(trainer, evaluation)[1]
            assert [round(float(a.float().mean()), 3) for a in own] == [before[f"agree_{k + 1}"] for k in range(4)]
        start = time.time()
        for step in range(args.steps):
            trainer.train_step(batch_windows(tokens, step, config.batch_size, config.seq_len, config.seed))
        print(f"{variant:11s} before {before}\n{'':11s} after  {trainer.evaluate(evaluation)} "
              f"({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
