"""prefetch_l2: a hint that changes nothing, on any device; its bad arguments; in a CUDA graph."""
import pytest
import torch

from eecore import ops
from cuda_tests import needs_cuda


@pytest.mark.parametrize("numel, offset, max_bytes", [(1, 0, None), (4099, 1, None), (1 << 20, 3, 1000),
                                                      (3 << 20, 0, 0), (777, 5, 1 << 30)])
def test_prefetch_l2_changes_nothing(device, numel, offset, max_bytes):
    """Sizes and offsets that leave the range's ends unaligned (the kernel fetches the aligned
    interior), a budget below, at zero and past the tensor's size."""
    base = torch.randn(numel + offset, device=device).to(torch.bfloat16)
    weight = base[offset:]
    before = weight.clone()
    ops.prefetch_l2(weight, max_bytes)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(weight, before)


def test_prefetch_l2_any_dtype(device):
    for dtype in (torch.float32, torch.float16, torch.int8, torch.uint8, torch.int64):
        ops.prefetch_l2(torch.zeros(1000, dtype=dtype, device=device))


@pytest.mark.parametrize("make, message", [
    (lambda d: (torch.randn(8, 8, device=d).t(), 16), "contiguous"),
    (lambda d: (torch.randn(8, device=d), -1), "max_bytes"),
])
def test_prefetch_l2_bad_arguments(device, make, message):
    weight, max_bytes = make(device)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.eecore.prefetch_l2(weight, max_bytes)


@pytest.mark.cuda
@needs_cuda
def test_prefetch_l2_on_a_cuda_side_stream_in_a_graph():
    """The fork and join the model makes around attention: captured, replayed, values unchanged."""
    weight = torch.randn(4 << 20, device="cuda").to(torch.bfloat16)
    x = torch.randn(64, device="cuda")
    side = torch.cuda.Stream()

    def step():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ops.prefetch_l2(weight, 6 << 20)
        y = x * 2
        torch.cuda.current_stream().wait_stream(side)
        return y

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)


def test_weight_prefetch_is_for_gpus_that_ask_for_it(monkeypatch):
    from eecore.models.weight_prefetch import WeightPrefetch

    monkeypatch.setenv("EECORE_PREFETCH_WEIGHTS", "1")
    assert WeightPrefetch.for_device(torch.device("cpu")) is None
    if torch.cuda.is_available():
        assert WeightPrefetch.for_device(torch.device("cuda")) is not None
        monkeypatch.setenv("EECORE_PREFETCH_WEIGHTS", "0")
        assert WeightPrefetch.for_device(torch.device("cuda")) is None
