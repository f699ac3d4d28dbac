"""accept_update against eecore.testing.reference: sticky acceptance and the count of rows still running."""
import pytest
import torch

from eecore import ops
from eecore.testing import reference


def random_state(batch, device):
    status = torch.rand(batch, device=device) < 0.3
    confidence = torch.rand(batch, device=device)
    active = torch.rand(batch, device=device) < 0.8
    return status, confidence, active


def assert_matches_reference(status, confidence, threshold, active):
    expected_status = status.clone()
    expected = reference.accept_update(expected_status, confidence, threshold, active)
    remaining = ops.accept_update(status, confidence, threshold, active)
    assert remaining.dtype == torch.int32 and remaining.shape == ()
    assert remaining.item() == expected.item()
    assert torch.equal(status, expected_status)
    return remaining


@pytest.mark.parametrize("batch", [1, 3, 8, 17, 256])
@pytest.mark.parametrize("per_row", [False, True], ids=["scalar_threshold", "per_row_threshold"])
def test_accept_update_matches_reference(device, batch, per_row):
    status, confidence, active = random_state(batch, device)
    threshold = torch.rand(batch if per_row else (), device=device)
    assert_matches_reference(status, confidence, threshold, active)


def test_accept_update_is_sticky_and_counts(device):
    status = torch.tensor([True, True, False, False, False, False], device=device)
    confidence = torch.tensor([0.0, 0.0, 0.9, 0.1, 0.9, float("nan")], device=device)
    active = torch.tensor([True, False, True, True, False, True], device=device)
    remaining = ops.accept_update(status, confidence, torch.tensor(0.5, device=device), active)
    # Row 0/1: already accepted, stay accepted whatever the confidence or activity.
    # Row 2: newly confident. Row 3: not confident, still running. Row 4: confident but inactive.
    # Row 5: a NaN confidence is never above the threshold.
    assert status.tolist() == [True, True, True, False, False, False]
    assert remaining.item() == 2  # rows 3 and 5


def test_accept_update_over_layers_never_reverts(device):
    # One early-exit iteration: a decaying per-row threshold over 12 layers, fresh confidences at
    # each. Accepted rows stay accepted and the remaining count never grows.
    batch = 33
    status = torch.zeros(batch, dtype=torch.bool, device=device)
    active = torch.rand(batch, device=device) < 0.9
    expected_status = status.clone()
    previous = batch
    for layer in range(12):
        threshold = torch.full((batch,), 0.95 - 0.05 * layer, device=device)
        confidence = torch.rand(batch, device=device)
        before = status.clone()
        remaining = ops.accept_update(status, confidence, threshold, active)
        expected = reference.accept_update(expected_status, confidence, threshold, active)
        assert torch.equal(status, expected_status) and remaining.item() == expected.item()
        assert (status | ~before).all()  # nothing reverted
        assert remaining.item() <= previous
        previous = remaining.item()
    assert previous == int((active & ~status).sum())


def test_accept_update_strided_views(device):
    # Per-layer columns of a [B, L] bookkeeping table are strided 1-D views.
    table = torch.rand(9, 4, device=device) < 0.3
    confidence = torch.rand(9, 2, device=device)[:, 1]
    threshold = torch.rand(9, 3, device=device)[:, 2]
    active = (torch.rand(9, 5, device=device) < 0.8)[:, 0]
    column = table[:, 2]
    expected_table = table.clone()
    expected = reference.accept_update(expected_table[:, 2], confidence, threshold, active)
    remaining = ops.accept_update(column, confidence, threshold, active)
    assert remaining.item() == expected.item()
    assert torch.equal(table, expected_table)  # only column 2 changed


def test_accept_update_empty_batch(device):
    status = torch.zeros(0, dtype=torch.bool, device=device)
    empty = torch.zeros(0, device=device)
    remaining = ops.accept_update(status, empty, torch.tensor(0.5, device=device), status.clone())
    assert remaining.item() == 0


def test_accept_update_opcheck(device):
    for per_row in (False, True):
        status, confidence, active = random_state(11, device)
        threshold = torch.rand(11 if per_row else (), device=device)
        torch.library.opcheck(torch.ops.eecore.accept_update.default, (status, confidence, threshold, active))


def _args(device, **override):
    args = dict(status=torch.zeros(4, dtype=torch.bool, device=device), confidence=torch.rand(4, device=device),
                threshold=torch.tensor(0.5, device=device), active=torch.ones(4, dtype=torch.bool, device=device))
    args.update({k: v(device) for k, v in override.items()})
    return args


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(status=lambda d: torch.zeros(4, dtype=torch.int32, device=d)), "'status'.*dtype"),
        (dict(status=lambda d: torch.zeros(2, 2, dtype=torch.bool, device=d)), "'status'.*1-D"),
        (dict(confidence=lambda d: torch.rand(4, device=d).half()), "'confidence'.*dtype"),
        (dict(confidence=lambda d: torch.rand(5, device=d)), "'confidence'.*batch size"),
        (dict(confidence=lambda d: torch.rand(4, 1, device=d)), "'confidence'.*1-D"),
        (dict(threshold=lambda d: torch.rand(3, device=d)), "'threshold'.*shape"),
        (dict(threshold=lambda d: torch.rand(1, 4, device=d)), "'threshold'.*shape"),
        (dict(threshold=lambda d: torch.tensor(0.5, dtype=torch.float64, device=d)), "'threshold'.*dtype"),
        (dict(active=lambda d: torch.ones(4, device=d)), "'active'.*dtype"),
        (dict(active=lambda d: torch.ones(3, dtype=torch.bool, device=d)), "'active'.*batch size"),
    ],
)
def test_accept_update_bad_arguments(device, override, message):
    with pytest.raises(RuntimeError, match=message):
        ops.accept_update(**_args(device, **override))


def test_accept_update_python_number_threshold(device):
    status, confidence, active = random_state(12, device)
    expected_status = status.clone()
    expected = reference.accept_update(expected_status, confidence, 0.4, active)
    assert ops.accept_update(status, confidence, 0.4, active).item() == expected.item()
    assert torch.equal(status, expected_status)
