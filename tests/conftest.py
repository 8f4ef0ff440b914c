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


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """The demo digits written as shards once per test session."""
    from tests.helpers import write_digits_shards

    return write_digits_shards(tmp_path_factory.mktemp("digits"))
