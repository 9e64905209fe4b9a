"""The native dispatch's slot maps on the GPU (runtime/backends/native.py SlotMaps): each stream takes its slot maps
from a batch allocated on that stream (torch's allocator hands a freed block back to its own stream only).

Run on the GPU machine: python -m pytest -m gpu tests/gpu/test_slot_maps.py
"""

import pytest
import torch

from runtime.backends.native import SlotMaps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _batch(m) -> int:
    return m.slots.untyped_storage().data_ptr()


def test_each_stream_takes_from_a_batch_of_its_own():
    maps = SlotMaps(torch.device("cuda", torch.cuda.current_device()))
    here = maps.take(2, 8)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        there = maps.take(2, 8)
        there_again = maps.take(2, 8)
    again = maps.take(2, 8)
    assert _batch(here) == _batch(again) and _batch(there) == _batch(there_again)
    assert _batch(here) != _batch(there)
    assert len({m.slots_ptr for m in (here, there, there_again, again)}) == 4


def test_a_captured_dispatch_allocates_its_own_from_the_graph_pool():
    """Inside capture (the dispatch says so: capturing=True) nothing comes from a batch: the captured kernels write
    their slot map at every replay, so it lives in the graph's pool (a batch could be freed with its last handle
    while the graph still writes it)."""
    maps = SlotMaps(torch.device("cuda", torch.cuda.current_device()))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        eager = maps.take(2, 8)  # a batch on the capture stream, with pairs left
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        captured = maps.take(2, 8, torch.cuda.is_current_stream_capturing())
        captured.slots.fill_(3)
    assert _batch(captured) != _batch(eager)
    assert captured.slots.untyped_storage().nbytes() == 4 * (2 * 8 + 1)  # its own allocation, not a batch
