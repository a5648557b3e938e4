import json

import pytest
import torch

from dynemb.cli import main


@pytest.fixture(autouse=True)
def _restore_threads():
    """In-process runs set torch's thread count (``--threads``); give the rest of the session its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def dynemb(capsys):
    """Run ``dynemb ARGS`` in-process; returns the last stdout line parsed as JSON (asserting exit status 0)."""

    def run(*args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        assert code == 0, err
        return json.loads(out.strip().splitlines()[-1])

    return run
