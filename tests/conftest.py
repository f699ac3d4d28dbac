"""Shared fixtures: the devices every op test runs on, and a seeded generator per test."""
import zlib

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    # Every test that takes a `device` argument runs on each available device; CUDA tests are
    # simply absent (not failing) where no GPU is visible.
    if "device" in metafunc.fixturenames and not any(m.name == "parametrize" and "device" in m.args[0]
                                                     for m in metafunc.definition.iter_markers()):
        metafunc.parametrize("device", DEVICES)


@pytest.fixture(autouse=True)
def _seed(request):
    # A fresh, reproducible stream per test: inputs differ between tests but not between runs.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
