"""Per-batch LoRA metadata: grouping by slot, the single-slot flag, and the CUDA-graph static buffers
(refreshed in place; padding rows and stale slots never survive a refresh)."""

import pytest
import torch

from moelora.layers.lora_batch import LoRABatch


def test_groups_and_flags():
    b = LoRABatch.build([2, -1, 0, 2, 2, -1], max_loras=4)
    g = b.groups
    assert b.slot_ids == [0, 2] and b.has_lora and not b.all_lora and b.single_slot is None
    assert g.active_slots.tolist() == [0, 2, -1, -1] and g.slot_counts.tolist() == [1, 3, 0, 0]
    assert g.slot_starts.tolist()[:2] == [0, 1]
    assert g.sorted_token_ids.tolist()[:4] == [2, 0, 3, 4]  # slot 0's token, then slot 2's, base rows last
    one = LoRABatch.build([3, 3, -1], max_loras=4)
    assert one.single_slot == 3  # the fast path must index slot 3, not slot 0
    assert not LoRABatch.build([-1, -1], max_loras=4).has_lora


def test_static_buffers_refresh_in_place_and_pad_with_base_rows():
    b = LoRABatch.static(8, max_loras=4, device="cpu")
    assert b.graph and b.has_lora and b.single_slot is None
    ptrs = [t.data_ptr() for t in (b.groups.token_slots, b.groups.sorted_token_ids, b.groups.active_slots)]
    b.update_static([1, 1, 3, -1, 0] + [-1] * 3, max_loras=4)
    assert b.groups.token_slots.tolist() == [1, 1, 3, -1, 0, -1, -1, -1]
    assert b.groups.active_slots.tolist() == [0, 1, 3, -1] and b.groups.slot_counts.tolist() == [1, 2, 1, 0]
    b.update_static([2] + [-1] * 7, max_loras=4)  # a later, smaller batch: nothing of the last one remains
    assert b.groups.token_slots.tolist() == [2] + [-1] * 7
    assert b.groups.active_slots.tolist() == [2, -1, -1, -1] and b.groups.slot_counts.tolist() == [1, 0, 0, 0]
    assert ptrs == [t.data_ptr() for t in (b.groups.token_slots, b.groups.sorted_token_ids, b.groups.active_slots)]
    assert b.slot_ids == [2]


def test_slot_ids_are_checked_on_the_graph_path_too():
    """Eager batches (build) and CUDA-graph batches (update_static) refuse a slot outside [-1, max_loras): a graph
    reads whatever its buffers hold, so an out-of-range id would index past the adapter buffers (vLLM #28318's
    lesson: bound every metadata buffer). update_static also refuses a batch that does not fill every row."""
    with pytest.raises(ValueError, match=r"token slot out of range \[-1, 4\): found 0\.\.7"):
        LoRABatch.build([0, 7], max_loras=4)
    b = LoRABatch.static(4, max_loras=4, device="cpu")
    before = b.groups.token_slots.tolist()
    for bad in ([0, 7, -1, -1], [-2, 0, -1, -1]):
        with pytest.raises(ValueError, match=r"token slot out of range \[-1, 4\)"):
            b.update_static(bad, max_loras=4)
    with pytest.raises(ValueError, match="this graph batch has 4 rows"):
        b.update_static([1, 2], max_loras=4)
    assert b.groups.token_slots.tolist() == before  # nothing written by a refused batch


def test_kv_cache_reserves_a_dummy_block_for_graph_padding():
    from moelora.config import ModelConfig
    from moelora.engine.kv_cache import KVCache
    from helpers import hf_tiny

    cfg = ModelConfig.from_hf(hf_tiny("qwen3_moe")[0])
    kv = KVCache(cfg, num_blocks=5, block_size=4, dtype=torch.float32, device="cpu")
    assert kv.dummy_block == 5 and kv.caches[0][0].shape[0] == 6
    handed = kv.allocate(5)
    assert kv.dummy_block not in handed and kv.num_free_blocks == 0
