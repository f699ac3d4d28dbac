"""The speculation guard: stop drafting for a sequence while its drafts lose, at almost no cost.

A self-speculation round only pays when enough of its drafts are accepted: below a break-even
acceptance (which depends on E, d and the hardware; bench/roofline.py gives the bandwidth-bound
one) every draft costs more than it saves. `LayerDrafts(guard=AcceptanceGuard(min_acceptance=a))`
turns this guard on; `min_acceptance="break-even"` sets `a` to `break_even_acceptance` below, the
bandwidth-bound break-even of this model, E and d. The guard gates layer drafts only: a
prompt-lookup draft reads no weights, so its bandwidth-bound break-even is 0 (with
`draft="hybrid"`, a round in which a sequence drafts by lookup is not one of the guard's rounds).
Per sequence:

- a new sequence looks before it drafts: its first few rounds are plain steps with the shadow
  check (below), and its first probe follows;
- its running acceptance is an exponential average over the rounds it tried to draft in. While
  it is at least `a`, the sequence drafts every round; below `a`, drafting stops and its rounds
  cost what a full-depth step costs;
- while drafting is off, a probe round falls due every `probe_every` rounds, and the wait doubles
  each time (up to 128 rounds), so hopeless drafts cost next to nothing in the long run;
- a probe round drafts for real only if the shadow check (below) says it could pass. Over the
  last few rounds before it falls due, each round checks whether the sequence's layer-E state
  would have drafted the full model's token. If even this optimistic estimate is below `a`, the
  probe is skipped as if it had failed.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

import torch

from eecore.engine.sequence import Sequence
from eecore.speculative.state import SequenceStates


def weight_bytes(t) -> int:
    """Bytes of a tensor or an Int8Weight (its scales included); 0 for None."""
    return 0 if t is None else t.nbytes


def layer_weight_bytes(model, i: int) -> int:
    """Bytes of the weights layer `i` reads for a token."""
    w = model.layers[i]
    return sum(weight_bytes(t) for t in (w.input_norm, w.qkv, w.qkv_bias, w.o_proj, w.post_norm, w.gate_up, w.down))


def break_even_acceptance(model, exit_layer: int, num_speculations: int,
                          draft_head_bytes: Optional[int] = None, draft_bytes: Optional[int] = None) -> float:
    """The acceptance rate below which self-speculation loses to full depth when decoding is
    bound by reading weights (small batches, on CPUs and GPUs alike): the rate at which a round
    (d + 1 draft passes through layers 0..E-1, d draft LM heads, one verify pass through layers
    E..L-1 and its LM head) emits as many tokens per weight byte as full-depth steps do.
    Acceptances are taken as independent with rate a, so a round emits (1 - a^(d+1)) / (1 - a)
    tokens. `draft_head_bytes`: what a draft token reads past layer E when that is not the LM
    head (an exit adapter, a draft vocabulary: `DraftHead.weight_bytes`). `draft_bytes`: separate
    draft layers (`DraftStack.weight_bytes`, their head included) make each draft, and a round is
    then d drafts plus one pass through all L layers."""
    L, E, d = model.num_layers, exit_layer, num_speculations
    per_layer = statistics.mean(layer_weight_bytes(model, i) for i in range(L))
    head = weight_bytes(model.lm_head) + weight_bytes(model.final_norm)
    draft_head = head if draft_head_bytes is None else draft_head_bytes
    if draft_bytes is None:
        round_bytes = (d + 1) * E * per_layer + d * draft_head + (L - E) * per_layer + head
    else:
        round_bytes = d * draft_bytes + L * per_layer + head
    # tokens a round must emit to break even; below d + 1 whenever E < L, so the rate is below 1
    needed = round_bytes / (L * per_layer + head)
    lo, hi = 0.0, 1.0
    for _ in range(50):  # tokens per round grows with a: bisect
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** k for k in range(d + 1)) < needed else (lo, a)
    return hi


@dataclass
class _SequenceGuard:
    probe_interval: int
    running_acceptance: Optional[float] = None  # None until its first drafting round
    idle_rounds: int = 0
    shadow_hits: int = 0
    shadow_checks: int = 0
    wants_shadow: bool = False
    looked: bool = False  # the first look (FIRST_LOOK rounds) is over


class SpeculationGuard:
    # Half-life of about two drafting rounds: the guard reacts fast, and probes keep it from
    # locking a sequence out for good.
    ACCEPTANCE_DECAY = 0.7
    MAX_PROBE_INTERVAL = 128
    # Shadow checks per probe: enough for a rough estimate, few enough that their cost (a top-k
    # over the logits and a K-row matmul: 0.7% of a step on SmolLM2 at batch 1, 2.3% at batch 8)
    # vanishes once the probe interval has grown.
    SHADOW_WINDOW = 8
    # A new sequence looks before it drafts: its first probe falls due after this many rounds,
    # with the shadow checks of the rounds before it. Drafting blind in the first round would
    # cost a hopeless sequence one or two losing rounds (1-2% of 128 tokens on SmolLM2); a
    # sequence with good drafts loses only these few rounds of speed-up.
    FIRST_LOOK = 4

    def __init__(self, model, max_rows: int, min_acceptance: float, probe_every: int, draft_head=None,
                 states: Optional[SequenceStates] = None):
        self.floor = min_acceptance
        self.probe_every = probe_every
        self.shadow = ShadowCheck(model, max_rows, draft_head)
        self.states = SequenceStates() if states is None else states  # SequenceState.guard: a _SequenceGuard

    def allows(self, seq: Sequence) -> bool:
        """Whether `seq` drafts this round. Call once per round and sequence."""
        state = self.states.of(seq)
        if state.guard is None:
            state.guard = _SequenceGuard(min(self.FIRST_LOOK, self.probe_every))
        g = state.guard
        g.wants_shadow = False
        if g.running_acceptance is not None and g.running_acceptance >= self.floor:
            g.probe_interval = self.probe_every
            return True
        g.idle_rounds += 1
        if g.idle_rounds < g.probe_interval:
            g.wants_shadow = g.probe_interval - g.idle_rounds <= self.SHADOW_WINDOW
            return False
        promising = g.shadow_checks == 0 or g.shadow_hits >= self.floor * g.shadow_checks
        g.idle_rounds = g.shadow_hits = g.shadow_checks = 0
        g.probe_interval = self.probe_every if not g.looked else \
            min(2 * g.probe_interval, max(self.MAX_PROBE_INTERVAL, self.probe_every))
        g.looked = True
        return promising  # a probe round, unless the shadow check ruled it out

    def wants_shadow(self, seq: Sequence) -> bool:
        """Whether this round should run the shadow check for `seq` (which does not draft)."""
        g = self.states.slot(seq, "guard")
        return g is not None and g.wants_shadow

    def record_round(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A round in which `seq` was allowed to draft. A round whose first draft the draft
        threshold dropped counts as a rate of 0: it paid for a draft LM head and got nothing."""
        rate = min(accepted, drafted) / drafted if drafted else 0.0
        g = self.states.slot(seq, "guard")
        g.running_acceptance = rate if g.running_acceptance is None else \
            self.ACCEPTANCE_DECAY * g.running_acceptance + (1 - self.ACCEPTANCE_DECAY) * rate

    def record_shadow(self, seqs: list[Sequence], exit_states: torch.Tensor, logits: torch.Tensor) -> None:
        """exit_states `[n, d]` and logits `[n, V]`: the layer-E state and the full model's logits
        of the position each of `seqs` just decoded."""
        if not seqs:
            return
        for seq, agrees in zip(seqs, self.shadow.agreement(exit_states, logits)):
            g = self.states.slot(seq, "guard")
            g.shadow_checks += 1
            g.shadow_hits += int(agrees)

    def release(self, seq: Sequence) -> None:
        self.states.clear_slot(seq, "guard")

    def __len__(self) -> int:
        return self.states.count("guard")


class ShadowCheck:
    """Would layer E's draft have been the full model's token? An upper bound, for a sliver of a
    draft's cost.

    The exact answer needs layer E's argmax over the whole vocabulary: one more LM head pass,
    which at batch 1 costs about a fifth of a step on a small model. Instead, the check scores
    layer E's state against only the full model's top-K tokens: if the full model's top-1 does
    not win among them at layer E, the draft would certainly have been rejected; if it wins, it
    most likely would have been accepted (unless layer E's argmax lies outside the K). So the
    agreement it reports is never below the true first-draft acceptance, and on SmolLM2-135M at
    K=64 it is within 0.03-0.05 of it at every exit layer tried (E = 4..27). That is tight
    enough to tell hopeless drafts from promising ones, which is all the guard asks of it.
    """

    NUM_CANDIDATES = 64

    def __init__(self, model, max_rows: int, draft_head=None):
        self.model = model
        # with an exit adapter the draft reads the adapted state; with a draft vocabulary, a
        # top-1 outside it can never be drafted
        self.draft_head = draft_head
        vocab = getattr(draft_head, "vocab", None)
        self._in_vocab = None
        if vocab is not None:
            self._in_vocab = torch.zeros(model.config.vocab_size, dtype=torch.bool, device=model.device)
            self._in_vocab[vocab] = True
        self.k = min(self.NUM_CANDIDATES, model.config.vocab_size)
        d, dev = model.config.hidden_size, model.device
        self._top_values = torch.empty(max_rows, self.k, dtype=torch.float32, device=dev)
        self._top_ids = torch.empty(max_rows, self.k, dtype=torch.long, device=dev)
        self._states = torch.empty(max_rows, d, dtype=model.dtype, device=dev)
        self._normed = torch.empty(max_rows, d, dtype=model.dtype, device=dev)
        head = model.lm_head
        self._rows = torch.empty(max_rows * self.k, d, dtype=head.dtype if isinstance(head, torch.Tensor) else
                                 model.dtype, device=dev)
        self._scores = torch.empty(max_rows, self.k, 1, dtype=model.dtype, device=dev)

    def agreement(self, exit_states: torch.Tensor, logits: torch.Tensor) -> list[bool]:
        """exit_states `[n, d]` (layer-E residual stream), logits `[n, V]` (the full model's, fp32):
        per row, whether the full model's top-1 is also layer E's top-1 among the full model's
        top-K tokens."""
        n, k = logits.shape[0], self.k
        _, ids = torch.topk(logits, k, dim=-1, out=(self._top_values[:n], self._top_ids[:n]))
        if self.draft_head is not None:
            states = self.draft_head.adapted(exit_states)
        else:
            states = self._states[:n].copy_(exit_states)  # the exit-query cache rows are strided
        normed = self.model.final_norm_(states, self._normed[:n])
        rows = self.model.head_rows(self._rows[: n * k], ids.view(-1)).view(n, k, -1)
        scores = torch.bmm(rows.to(normed.dtype), normed.unsqueeze(-1), out=self._scores[:n])
        wins = scores.squeeze(-1).argmax(dim=-1) == 0
        if self._in_vocab is not None:
            wins &= self._in_vocab[ids[:, 0]]
        return wins.tolist()
