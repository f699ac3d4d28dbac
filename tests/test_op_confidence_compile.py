"""The confidence ops inside one torch.compile(fullgraph=True) graph: an early-exit decision step."""
import torch

from eecore import ops
from eecore.testing import reference


def exit_decision(ops_module, hidden, prev_hidden, lm_weight, classifier, status, threshold, active):
    """One exit layer: three confidence measures, their max, then the sticky batch update."""
    logits = hidden @ lm_weight.T
    gap, top1 = ops_module.softmax_top2_gap(logits)
    fused_gap, fused_top1 = ops_module.lm_head_top2_gap(hidden, lm_weight)
    similarity = ops_module.hidden_cosine(prev_hidden, hidden)
    learned = ops_module.mlp_confidence(hidden, *classifier)
    confidence = torch.maximum(torch.maximum(gap, similarity), learned)
    remaining = ops_module.accept_update(status, confidence, threshold, active)
    return top1, fused_top1, fused_gap, confidence, remaining


def test_confidence_ops_compile_fullgraph(device):
    torch._dynamo.reset()
    batch, d, vocab, m = 6, 48, 3001, 20
    hidden = torch.randn(batch, d, device=device)
    prev_hidden = hidden + 0.3 * torch.randn(batch, d, device=device)
    lm_weight = torch.randn(vocab, d, device=device) * 0.5
    classifier = (torch.randn(m, d, device=device) * 0.2, torch.randn(m, device=device) * 0.1,
                  torch.randn(m, device=device) * 0.3, torch.zeros(1, device=device))
    active = torch.tensor([True, True, True, True, False, True], device=device)
    threshold = torch.full((batch,), 0.9, device=device)
    status = torch.tensor([True, False, False, False, False, False], device=device)
    expected_status = status.clone()

    compiled = torch.compile(exit_decision, fullgraph=True)
    got = compiled(ops, hidden, prev_hidden, lm_weight, classifier, status, threshold, active)
    want = exit_decision(reference, hidden, prev_hidden, lm_weight, classifier, expected_status, threshold, active)

    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # top1 of the same logits
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)  # precision: test_op_lm_head_top2_gap
    torch.testing.assert_close(got[3], want[3], rtol=1e-4, atol=1e-6)
    assert torch.equal(status, expected_status)  # the mutation survived functionalization
    assert got[4].item() == want[4].item()
