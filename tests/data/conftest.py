import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Run data tests on one intra-op thread: on this shared, oversubscribed 2-core machine, OpenMP barriers
    make two threads 10-30x slower than one for the ~100k-element ops of the generator."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
