"""The read-only bandwidth kernel of `bench decode`'s second floor (moelora_bench/_read_kernel.py), under the
interpreter on the CPU (on a GPU compiled): every word read once, each program's sum right."""

import pytest
import torch
from kernel_cases import DEVICE  # sets TRITON_INTERPRET=1 without a GPU

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("n, block, iters", [(4096, 256, 4), (5000, 256, 4), (300, 128, 1)])
def test_read_words_sums_every_word_once(n, block, iters):
    from moelora_bench._read_kernel import read_words

    buf = torch.randint(-50, 50, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n)).to(DEVICE)
    got = read_words(buf, block, iters, 4).cpu()
    chunk = block * iters
    pad = torch.zeros(-(-n // chunk) * chunk, dtype=torch.int32)
    pad[:n] = buf.cpu()
    assert torch.equal(got, pad.view(-1, chunk).sum(1).to(torch.int32))
