"""The (slot, expert) alignment on the device (align_triton.moe_lora_align_triton: moe_align's kernels with virtual
experts slot * E + e, one program up to ALIGN_ONE_PROGRAM_MAX_PAIRS pairs, three launches over chunks of pairs above):
equal to moe_lora_align bit for bit on both paths, with expert-parallel pairs left out (expert -1), and its limit.
The grouped routed-expert LoRA kernel (kernels/moe_lora/grouped_triton.py, at decode from
moe_lora.grouped_min_pairs) reads it, one per layer.

CPU: the Triton kernels under TRITON_INTERPRET=1; GPU: compiled."""

import pytest
import torch

from kernel_cases import DEVICE
from moelora.kernels.moe import align_triton
from moelora.kernels.moe.align_triton import moe_lora_align_triton
from moelora.kernels.moe_lora.chain import moe_lora_align

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("path", ["one program", "chunks"])
@pytest.mark.parametrize("ep_dropped", [False, True])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("T,Kk,Ee,Ss", [(1, 2, 8, 2), (7, 4, 16, 3), (64, 8, 16, 4), (30, 8, 128, 8), (256, 8, 128, 4)])
def test_lora_alignment_is_moe_lora_align(T, Kk, Ee, Ss, block_m, ep_dropped, path, monkeypatch):
    monkeypatch.setattr(align_triton, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 10**6 if path == "one program" else 0)
    gen = torch.Generator().manual_seed(T + Ee)
    ids = torch.stack([torch.randperm(Ee, generator=gen)[:Kk] for _ in range(T)])
    if ep_dropped:  # expert parallelism leaving out another rank's pairs: expert -1
        ids[torch.rand(T, Kk, generator=gen) < 0.4] = -1
    slots = torch.randint(-1, Ss, (T,), generator=gen).to(torch.int32)
    got = moe_lora_align_triton(ids.to(DEVICE), slots.to(DEVICE), Ee, Ss, block_m)
    want = moe_lora_align(ids, slots, Ee, Ss, block_m)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


def test_lora_alignment_refuses_what_it_cannot_hold():
    ids = torch.zeros(30, 8, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="8192 virtual experts"):
        moe_lora_align_triton(ids, torch.zeros(30, dtype=torch.int32, device=DEVICE), 1024, 8, 16)
