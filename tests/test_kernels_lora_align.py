"""The (slot, expert) alignment on the device (align_triton.moe_lora_align_triton: one program a slot sorts and
counts that slot's pairs by expert, in two launches): equal to moe_lora_align bit for bit, with expert-parallel
pairs left out (expert -1), and its limits. The grouped routed-expert LoRA kernel
(kernels/moe_lora/grouped_triton.py, at decode from moe_lora.grouped_min_pairs) reads it, one per layer.

CPU: the Triton kernel under TRITON_INTERPRET=1; GPU: compiled."""

import pytest
import torch

from kernel_cases import DEVICE
from moelora.kernels.moe.align_triton import moe_lora_align_triton
from moelora.kernels.moe_lora.chain import moe_lora_align

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("ep_dropped", [False, True])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("T,Kk,Ee,Ss", [(1, 2, 8, 1), (1, 2, 8, 2), (7, 4, 16, 3), (64, 8, 16, 4), (30, 8, 128, 8),
                                       (3, 8, 128, 32)])
def test_lora_alignment_is_moe_lora_align(T, Kk, Ee, Ss, block_m, ep_dropped):
    _check(T, Kk, Ee, Ss, block_m, ep_dropped)


def test_lora_alignment_at_decode_batch_256():
    """Qwen3-30B-A3B's decode at batch 256 with 8 adapter slots: 2,048 pairs, the largest the alignment takes."""
    _check(256, 8, 128, 8, 16, True)


def _check(T, Kk, Ee, Ss, block_m, ep_dropped):
    gen = torch.Generator().manual_seed(T + Ee)
    ids = torch.stack([torch.randperm(Ee, generator=gen)[:Kk] for _ in range(T)])
    if ep_dropped:  # expert parallelism leaving out another rank's pairs: expert -1
        ids[torch.rand(T, Kk, generator=gen) < 0.4] = -1
    slots = torch.randint(-1, Ss, (T,), generator=gen).to(torch.int32)
    got = moe_lora_align_triton(ids.to(DEVICE), slots.to(DEVICE), Ee, Ss, block_m)
    want = moe_lora_align(ids, slots, Ee, Ss, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_lora_alignment_refuses_what_it_cannot_hold():
    ids = torch.zeros(300, 8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="2400 pairs over 128 experts"):
        moe_lora_align_triton(ids, torch.zeros(300, dtype=torch.int32, device=DEVICE), 128, 4, 16)
    with pytest.raises(ValueError, match="8 pairs over 1024 experts"):
        moe_lora_align_triton(ids[:1], torch.zeros(1, dtype=torch.int32, device=DEVICE), 1024, 4, 16)
