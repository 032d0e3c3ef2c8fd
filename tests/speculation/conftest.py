"""Spec tests run on tiny tensors: pin torch to one intra-op thread while they run.

Parallel kernels only add synchronisation on 5-token vocabularies, and on a
busy machine an OpenMP barrier can stall each call for milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
