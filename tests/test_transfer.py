"""eecore.engine.transfer: host lists to the device, and results read back in one copy."""
from __future__ import annotations

import pytest
import torch

from eecore.engine.transfer import device_tensor, read_back


def test_device_tensor_on_the_cpu_is_torch_tensor():
    assert torch.equal(device_tensor([3, 1, 2], torch.device("cpu")), torch.tensor([3, 1, 2]))
    t = device_tensor([0.5, 0.25], torch.device("cpu"), torch.float64)
    assert t.dtype == torch.float64 and t.tolist() == [0.5, 0.25]


def test_one_packed_read_back_gives_each_tensors_list():
    """The packing a GPU uses, run on CPU tensors: fp32 values, int64 ids near 2**31, 1-D and 2-D,
    an empty one; every list equals the tensor's own `.tolist()`, ints as ints."""
    g = torch.Generator().manual_seed(0)
    tensors = (torch.randn(3, 4, generator=g), torch.randint(0, 2**31, (3, 4), generator=g),
               torch.randn(5, generator=g), torch.randint(0, 128_256, (7,), generator=g), torch.empty(3, 0))
    got = read_back(*tensors, packed=True)
    assert got == [t.tolist() for t in tensors]
    assert all(type(v) is int for v in got[3]) and all(type(v) is int for row in got[1] for v in row)
    assert read_back(*tensors) == got  # (on the CPU: each tensor's own list)


def test_read_back_refuses_other_shapes():
    with pytest.raises(ValueError, match="1 or 2 dimensions"):
        read_back(torch.zeros(2, 2, 2), packed=True)
