"""Fixtures shared by the engine's in-process tests."""

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def one_rank_group():
    """`initialize()` creates a one-rank gloo group when none exists; drop it after the test. Modules
    whose every test builds an engine in this process use it with
    `pytestmark = pytest.mark.usefixtures("one_rank_group")`."""
    torch.set_num_threads(1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
