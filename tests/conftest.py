"""Tiny-model tests run on one thread: their matmuls are too small for a second thread to pay, and on a shared
CPU an extra thread only spins (measured 10x slower). Real-model tests keep torch's default."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread(request):
    if request.node.get_closest_marker("real_model"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
