"""Where drafts come from: one `Proposer` per source, each adding tokens to the sequences' `Draft`s
within the budgets the round's policy gives it (eecore.speculative.policy). A round runs its
proposers in order, prompt lookup first; a later one drafts where the earlier ones left a sequence
without tokens (the policy sees to it). A new draft source is a new Proposer.

- `LookupProposer` (`LookupDrafts`): prompt lookup, the continuation of the sequence's last n-gram
  where it occurred before (eecore.text.ngram_index); no layer runs.
- `SharedLayerProposer` (LayerSkip): the model's own layers 0..E-1, writing the shared KV cache;
  each pass's layer-E states go to the exit-query cache, from which verification continues.
- `CopyProposer` (`LayerDrafts.copy`): a copy of layers 0..E-1 with a KV cache of its own;
  verification runs the whole model.
- `TokenSwitchProposer` (draft="hybrid", hybrid_switch="token"): each drafted position from a
  lookup continuation where the draft so far ends in a match, from the copy where it does not.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from eecore import envs
from eecore.engine.inputs import Row
from eecore.engine.sequence import Sequence
from eecore.engine.transfer import read_back
from eecore.speculative.draft import Budgets, Draft, DraftPicker
from eecore.speculative.state import SequenceStates
from eecore.text.ngram_index import NgramIndex


# Draft ahead (CopyProposer) and, with it, verify ahead (the round's verify pass launched from the
# chain's tokens before the chain is read back: verification.VerifyAhead): off by default. On an
# H200 they gained 1.27x / 1.56x at batch 1 / 8 with perfect drafts, but the layer preset's plain
# rounds ran slower beside them at batch 8-64 (docs/cuda.md).


class Proposer:
    """A draft source (see the module doc). `propose` adds to drafts[b] at most budgets.tokens[b]
    tokens for seqs[b]; `verify_ahead` (a verification.VerifyAhead), where `verifies_ahead`, is the
    round's verify pass, which the proposer launches behind its passes."""

    kind = "layer"                     # the policy's name for its budget: "lookup", "layer" or "hybrid"
    verifies_from_exit_states = False  # verification continues from layer E's states (shared layers)
    verifies_ahead = False             # it launches the verify pass behind its own passes
    # a round in which it ran passes and drafted nothing still verifies its rows (shared layers: the
    # pending token's layer-E state is in the exit-query cache; a copy: as any round of its)
    verifies_empty_drafts = True
    passes = 0                         # draft passes run so far (the draft planner's clock)

    def propose(self, seqs: list[Sequence], drafts: list[Draft], budgets: Budgets, verify_ahead=None) -> None:
        raise NotImplementedError

    def release(self, seq: Sequence) -> None:
        """`seq` has finished or was aborted."""


class LookupProposer(Proposer):
    """Prompt lookup: each sequence's n-gram index lives in its SequenceState (`index`) and follows
    its tokens round by round; `continuation` is also what the token switch and the exit decision
    (exit_decision.AgreementMeasure) ask of it."""

    kind = "lookup"

    def __init__(self, min_ngram: int, max_ngram: int, states: Optional[SequenceStates] = None):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.states = SequenceStates() if states is None else states

    def continuation(self, seq: Sequence, max_tokens: int, after: list[int] = ()) -> list[int]:
        """Up to `max_tokens` tokens that followed `seq`'s last n-gram (with `after`, the tokens
        already drafted past it) where it occurred before; none without a match."""
        state = self.states.of(seq)
        if state.index is None:
            state.index = NgramIndex(self.min_ngram, self.max_ngram)
        state.index.follow(seq.prompt_token_ids, seq.output_token_ids)
        return state.index.propose(max_tokens, after)

    def propose(self, seqs: list[Sequence], drafts: list[Draft], budgets: Budgets, verify_ahead=None) -> None:
        for seq, draft, n in zip(seqs, drafts, budgets.tokens):
            if n:
                draft.add_lookup(self.continuation(seq, n))

    def release(self, seq: Sequence) -> None:
        self.states.clear_slot(seq, "index")

    def __len__(self) -> int:
        return self.states.count("index")


class SharedLayerProposer(Proposer):
    """Pass k (k = 0..d) runs the newest token (the pending one, then each draft) through layers
    0..E-1 only and stores its layer-E state in the exit-query cache; passes k < d also read a draft
    token off the draft head. Lookup drafts join pass 0 as one more varlen row each (all their
    positions at once), so the exit-query cache holds every position the verify pass needs."""

    verifies_from_exit_states = True

    def __init__(self, runner, picker: DraftPicker, exit_layer: int, num_drafts: int, exit_states: torch.Tensor,
                 static=None):
        self.runner = runner
        self.picker = picker
        self.exit_layer = exit_layer
        self.num_drafts = num_drafts
        self.exit_states = exit_states  # [rows, verify width, d]: layer-E state of each drafted position
        self.static = static  # speculative.static_passes.StaticLayers over layers 0..E-1: one-token passes as graphs

    def propose(self, seqs: list[Sequence], drafts: list[Draft], budgets: Budgets, verify_ahead=None) -> None:
        budgets = list(budgets.tokens)  # (a sequence whose chain ends keeps its length as its budget)
        states = self.exit_states
        width = states.shape[1]
        lookup = [list(d.tokens) for d in drafts]  # what lookup drafted: run in pass 0, with the pending token
        newest = [s.last_token_id for s in seqs]
        live = list(range(len(seqs)))  # rows whose newest token still needs its layer-E state
        for k in range(self.num_drafts + 1):
            if not live:
                break
            if k == 0:
                rows = [Row(s, s.num_computed_tokens, [s.last_token_id] + d) for s, d in zip(seqs, lookup)]
            else:
                rows = [Row(seqs[b], seqs[b].num_computed_tokens + k, [newest[b]]) for b in live]
            hidden = self._layers_to_exit(rows, continues=k > 0)
            if k == 0 and hidden.shape[0] > len(seqs):  # lookup rows hold several positions
                index = [b * width + j for b, d in enumerate(lookup) for j in range(len(d) + 1)]
                states[: len(seqs)].view(len(seqs) * width, -1).index_copy_(
                    0, torch.tensor(index, device=hidden.device), hidden)
                starts = [0]
                for d in lookup:
                    starts.append(starts[-1] + len(d) + 1)
            elif len(live) == len(seqs):
                states[: len(seqs), k].copy_(hidden)
                starts = range(len(seqs))
            else:
                states[:, k].index_copy_(0, torch.tensor(live, device=hidden.device), hidden)
                starts = range(len(live))
            drafting = [j for j, b in enumerate(live) if len(drafts[b]) < budgets[b]]
            if not drafting:
                break
            picked = hidden if len(drafting) == len(live) == hidden.shape[0] else \
                hidden.index_select(0, torch.tensor([starts[j] for j in drafting], device=hidden.device))
            rows = [live[j] for j in drafting]
            kept, ended = self.picker.take(self.picker.head.columns(picked), rows, seqs, drafts,
                                           opening=rows if k == 0 else ())
            for b in kept:
                newest[b] = drafts[b].tokens[-1]
                if b in ended:
                    budgets[b] = len(drafts[b])  # its last pass writes the draft's layer-E state only
            live = kept

    def _layers_to_exit(self, rows: list[Row], continues: bool) -> torch.Tensor:
        """Layers 0..E-1 over `rows`, writing the shared KV cache: their layer-E states `[T, d]`
        (`continues`: a later pass of the round, see StaticPass._build)."""
        if self.static is not None and self.static.takes(rows):
            return self.static.run(rows, continues)  # a CUDA graph replay on a GPU
        inputs = self.runner.prepare(rows)
        hidden = self.runner.embed(inputs)
        return self.runner.run_layers(hidden, inputs.attn, 0, self.exit_layer)


class CopyProposer(Proposer):
    """The separate draft stack: pass 0 runs what the copy has not seen through the pending token,
    pass k draft k; the last draft needs no pass (verification runs it through the model).

    With draft ahead (`EECORE_DRAFT_AHEAD=1`, where the copy's passes are static and the round's
    rows are greedy with no exits or token trees) each pass takes its tokens from the pass before on
    the device, and the host reads the chain back once, after its last pass, instead of after every
    pass: on a GPU each read-back stalls the host until the pass is done and then the GPU until the
    host has built and launched the next one. Each sequence still drafts what it would have drafted
    (where `long_draft_acceptance` lets a sequence's first draft decide how far it goes, that draft
    is read back first; a draft under `stop_below` ends its chain at the same place), but a chain
    that ends early has run its remaining passes all the same."""

    def __init__(self, stack, picker: DraftPicker, max_drafts: int):
        self.stack = stack
        self.picker = picker
        self.passes = 0  # copy passes run, for the draft planner's clock
        self.ahead = envs.flag("EECORE_DRAFT_AHEAD")
        self.verifies_ahead = self.ahead and envs.flag("EECORE_VERIFY_AHEAD")
        if self.ahead:
            rows, dev = stack.runner.max_seqs, stack.model.device
            self.chain_tokens = torch.empty(rows, max_drafts, dtype=torch.int64, device=dev)
            self._chain_probs = torch.zeros(rows, max_drafts, dtype=torch.float32, device=dev)
            # the chain's indices (chain): each row's first token, each pass's rows and the rows it
            # keeps, the verify pass's slots and their sources; staged in pinned memory on a GPU
            cuda = dev.type == "cuda"
            most = rows * (1 + 4 * max_drafts)
            self._index_host = torch.empty(most, dtype=torch.int64, pin_memory=cuda)
            self._index = torch.empty(most, dtype=torch.int64, device=dev) if cuda else None
        if self.verifies_ahead and stack.model.device.type == "cuda":
            # the chain's read-back goes out before the verify pass, into pinned memory, so that
            # the host reads the chain while the GPU verifies it (a plain read would wait for both)
            self._chain_host = (torch.empty(rows, max_drafts, dtype=torch.int64, pin_memory=True),
                                torch.empty(rows, max_drafts, dtype=torch.float32, pin_memory=True))
            self._chain_read = torch.cuda.Event()

    def propose(self, seqs: list[Sequence], drafts: list[Draft], budgets: Budgets, verify_ahead=None) -> None:
        """`verify_ahead` (a verification.VerifyAhead, with `verifies_ahead`): a chain launches the
        round's verify pass behind its passes, before reading them back."""
        budgets = budgets.tokens
        live = [b for b, n in enumerate(budgets) if n]
        if not live:
            return
        for b in live:
            drafts[b].copy_ran = True
        logits = self.stack.first_pass([seqs[b] for b in live])
        self.passes += 1
        length = self.picker.draft_length
        if self._chains(seqs, live) and (length is None or all(length.trusts(seqs[b]) for b in live)):
            # no sequence's first draft decides how far it drafts: the chain starts at the first pass
            self.chain(seqs, drafts, budgets, live, opening=logits, verify_ahead=verify_ahead)
            return
        for k in range(1, max(budgets[b] for b in live) + 1):
            kept, ended = self.picker.take(logits, live, seqs, drafts, with_alternatives=True,
                                           opening=live if k == 1 else ())
            live = [b for b in kept if len(drafts[b]) < budgets[b] and b not in ended]
            if not live:
                break
            if self._chains(seqs, live):
                self.chain(seqs, drafts, budgets, live, verify_ahead=verify_ahead)
                return
            logits = self.stack.next_pass([seqs[b] for b in live], [drafts[b].tokens for b in live])
            self.passes += 1

    def _chains(self, seqs: list[Sequence], live: list[int]) -> bool:
        picker = self.picker
        return (self.ahead and picker.top_k == 1 and picker.exit_threshold is None and picker.measure is None
                and self.stack.chains(len(live)) and all(seqs[b].params.greedy for b in live))

    def chain(self, seqs: list[Sequence], drafts: list[Draft], budgets: list[int], live: list[int],
               opening: Optional[torch.Tensor] = None, verify_ahead=None) -> None:
        """The rest of `live`'s drafts, pass after pass on the device, read back once: after each
        has drafted its first (read back to decide how far it goes), or from the round's first pass
        (`opening`, its draft head logits) when nothing needs deciding. `verify_ahead`: the round's
        verify pass goes out behind the chain, before the read-back."""
        stop_below = self.picker.stop_below
        more = [budgets[b] - len(drafts[b]) for b in live]  # drafts each may still take
        dev = self.chain_tokens.device
        # Which rows (indices into `live`) each pass runs is known now, so every index the chain
        # needs goes to the device in one copy, while the GPU is idle: a copy from a host list inside
        # the loop would wait for the pass just launched, and the chain would run pass by pass again.
        passes = [[i for i in range(len(live)) if more[i] > j] for j in range(max(more))]
        # the first chained pass's tokens: each row's newest draft (none yet after `opening`)
        flat = [drafts[b].tokens[-1] if drafts[b].tokens else 0 for b in live]
        spans = []
        for j, rows in enumerate(passes):
            kept = [] if j == 0 or rows == passes[j - 1] else [passes[j - 1].index(i) for i in rows]
            spans.append((len(flat), len(rows), len(kept)))
            flat += rows + kept
        at, n = len(flat), sum(more)
        flat = np.array(flat, dtype=np.int64)
        if verify_ahead is not None:  # then the verify pass's slots of the chain's drafts, and their sources
            counts = np.array(more)
            row = np.repeat(np.arange(len(live)), counts)  # each draft's row of the chain, and its step
            step = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
            slots = verify_ahead.chain_slots(np.array(live)[row], step)
            flat = np.concatenate([flat, slots, row * self.chain_tokens.shape[1] + step])
        index = self._to_device(flat)
        self.launch_chain(seqs, drafts, live, passes, spans, index, opening)
        tokens, probs = self.chain_tokens[: len(live)], self._chain_probs[: len(live)]
        if verify_ahead is not None:
            if dev.type == "cuda":  # (whole rows: one contiguous copy each)
                tokens, probs = (host[: len(live)].copy_(t, non_blocking=True) for host, t in
                                 zip(self._chain_host, (tokens, probs)))
                self._chain_read.record()
            verify_ahead.launch(live, more, self.chain_tokens.view(-1).index_select(0, index[at + n: at + 2 * n]),
                                index[at: at + n])
            if dev.type == "cuda":
                self._chain_read.synchronize()
        # the round's one read-back of the chain (its probabilities only where a stop rule reads them)
        tokens, probs = tokens[:, : max(more)], probs[:, : max(more)]
        chain, confidence = (tokens.tolist(), None) if stop_below is None else read_back(tokens, probs)
        for i, b in enumerate(live):
            seq, draft = seqs[b], drafts[b]
            seq.stats["layer_proposals"] += more[i]  # each ran, kept or not
            for j in range(more[i]):
                if stop_below is not None and confidence[i][j] < stop_below:
                    break  # a doubtful draft is dropped and ends the chain, as DraftPicker.take does
                draft.tokens.append(chain[i][j])
                draft.probs.append(None)
                draft.from_lookup.append(False)

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        """The chain's indices `values` (int64) on its device, without waiting for the GPU: through
        pinned memory, since a copy from pageable memory would first wait for every pass already
        queued (the round's first pass, where the chain starts from it). The buffers are reused:
        each round ends by reading its results back, after which the last copy has been read."""
        host = self._index_host[: values.size]
        host.numpy()[:] = values
        return host if self._index is None else self._index[: values.size].copy_(host, non_blocking=True)

    def launch_chain(self, seqs, drafts, live, passes, spans, index: torch.Tensor,
                      opening: Optional[torch.Tensor]) -> None:
        """The chain's passes and draft head reads, launched one after another with nothing read back
        (on a GPU: no host synchronization; tests/test_engine_cuda.py holds it to that)."""
        head = self.picker.head
        tokens = index[: len(live)]
        for j, rows in enumerate(passes):
            start, n, kept = spans[j]
            if kept:  # the rows that go on, out of the last pass's tokens
                tokens = tokens.index_select(0, index[start + n: start + n + kept])
            if j == 0 and opening is not None:
                logits = opening
            else:
                logits = self.stack.chained_pass([seqs[live[i]] for i in rows],
                                                 [len(drafts[live[i]]) + j for i in rows], tokens)
                self.passes += 1
            _, p, columns = self.picker.top1(logits)
            tokens = head.token_ids(columns)
            where = index[start: start + n]
            self.chain_tokens[:, j].index_copy_(0, where, tokens)
            if p is not None:
                self._chain_probs[:, j].index_copy_(0, where, p)


class TokenSwitchProposer(Proposer):
    """hybrid_switch="token": each sequence's draft grows by lookup continuations while it ends in
    an n-gram match, and by one copy token where it does not (one copy pass for all such sequences
    at once, which first runs what the copy has not seen: its catch-up, the pending token and the
    draft's lookup tokens), until its budget, its copy passes, or a doubtful copy token."""

    kind = "hybrid"
    verifies_empty_drafts = False  # nothing drafted: a plain step, the copy's pending K/V settled

    def __init__(self, stack, picker: DraftPicker, lookup: LookupProposer):
        self.stack = stack
        self.picker = picker
        self.lookup = lookup
        self.passes = 0

    def propose(self, seqs: list[Sequence], drafts: list[Draft], budgets: Budgets, verify_ahead=None) -> None:
        """`budgets.copy_passes[b]`: the most copy passes seqs[b] may draft with this round (0: the
        guard, the batch limit of layer drafts or the planner keep the copy off; a draft is then a
        lookup run alone)."""
        budgets, copy_passes = budgets.tokens, budgets.copy_passes
        passes_left = [p if n else 0 for p, n in zip(copy_passes, budgets)]

        def extend_by_lookup(b: int) -> None:
            while len(drafts[b]) < budgets[b]:
                more = self.lookup.continuation(seqs[b], budgets[b] - len(drafts[b]), after=drafts[b].tokens)
                if not more:
                    return
                drafts[b].add_lookup(more)

        for b in range(len(seqs)):
            extend_by_lookup(b)
        live = [b for b in range(len(seqs)) if len(drafts[b]) < budgets[b] and passes_left[b]]
        first = True
        while live:
            live_seqs, live_drafts = [seqs[b] for b in live], [drafts[b].tokens for b in live]
            logits = self.stack.first_pass(live_seqs, live_drafts) if first else \
                self.stack.next_pass(live_seqs, live_drafts)
            self.passes += 1
            first = False
            opening = [b for b in live if not drafts[b].copy_ran]
            for b in live:
                drafts[b].copy_ran = drafts[b].layer_turn = True
                passes_left[b] -= 1
            kept, ended = self.picker.take(logits, live, seqs, drafts, opening=opening)
            for b in kept:
                if b in ended:
                    passes_left[b] = 0
                extend_by_lookup(b)
            live = [b for b in kept if len(drafts[b]) < budgets[b] and passes_left[b]]
