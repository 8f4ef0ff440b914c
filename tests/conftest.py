import pytest
import torch

import distnorm


@pytest.fixture(autouse=True)
def _isolate():
    """Each test starts with debug mode off and a fixed seed."""
    previous = distnorm.debug(False)
    torch.manual_seed(0)
    yield
    distnorm.debug(previous)
