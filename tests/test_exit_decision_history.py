"""bench/analysis/exit_decision_ceiling.py's `history` inputs (a sequence's past agreement, seen
with the lag of a round) and `saturation` inputs (what the copy's earlier layers say) against their
definitions written as loops, on random records."""
from __future__ import annotations

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "bench", "analysis"), os.path.join(REPO, "bench")]

from exit_decision_ceiling import history, saturation  # noqa: E402


def history_by_loop(records, lag, window):
    rows = []
    for rec in records:
        right = [float(c == f) for c, f in zip(rec["copy"], rec["full"])]
        for t in range(len(right)):
            lo, hi = max(0, t - lag - window), max(0, t - lag)
            recent = sum(right[lo:hi]) / (hi - lo) if hi > lo else 0.5
            previous = rec["copy_p"][t - 1] if t else 0.5
            rows.append([recent, (hi - lo) / window, previous, t / 96])
    return torch.tensor(rows)


def test_history_matches_its_definition():
    g = torch.Generator().manual_seed(0)
    records = []
    for n in [1, 2, 5, 12, 13, 40]:
        records.append(dict(copy=torch.randint(0, 3, (n,), generator=g).tolist(),
                            full=torch.randint(0, 3, (n,), generator=g).tolist(),
                            copy_p=torch.rand(n, generator=g).tolist()))
    for lag, window in [(4, 8), (0, 3), (2, 1)]:
        torch.testing.assert_close(history(records, lag, window), history_by_loop(records, lag, window))


def test_saturation_is_each_positions_tapped_layers_in_order():
    g = torch.Generator().manual_seed(1)
    layers = (5, 7)
    records = []
    for n in [1, 3, 8]:
        rec = dict(full=[0] * n)
        for layer in layers:
            rec[f"agree{layer}"] = torch.randint(0, 2, (n,), generator=g).float().tolist()
            rec[f"p{layer}"] = torch.rand(n, generator=g).tolist()
        records.append(rec)
    expected = torch.tensor([[rec["agree5"][t], rec["agree7"][t], rec["p5"][t], rec["p7"][t]]
                             for rec in records for t in range(len(rec["full"]))])
    torch.testing.assert_close(saturation(records, layers), expected)
    assert saturation(records, ()).shape == (12, 0)
