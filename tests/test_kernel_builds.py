"""The count of Triton kernel variants the process builds (moelora_triton_kernel_builds on /metrics): the hook is
installed once, keeps the hook installed before it, and counts each variant Triton reports built."""

from __future__ import annotations

import pytest
import torch

from moelora.kernels import _triton

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not hasattr(triton, "knobs"), reason="Triton without knobs (before 3.5)")


@pytest.fixture
def hook_restored():
    runtime = triton.knobs.runtime
    saved = runtime.jit_post_compile_hook
    yield runtime
    runtime.jit_post_compile_hook = saved


def test_counts_each_reported_build_and_keeps_the_earlier_hook(hook_restored, caplog):
    runtime = hook_restored
    caplog.set_level("INFO", logger="moelora.kernels._triton")
    seen = []
    runtime.jit_post_compile_hook = lambda *a, **k: seen.append(k.get("key"))
    _triton.track_kernel_builds()
    _triton.track_kernel_builds()  # a second call installs nothing more: one count a build
    before = _triton.kernel_builds()
    runtime.jit_post_compile_hook(key="a", repr="k1")
    runtime.jit_post_compile_hook(key="b", repr="k2")
    assert _triton.kernel_builds() == before + 2
    assert seen == ["a", "b"]  # the hook installed before still runs, once a build
    assert [r.getMessage() for r in caplog.records if r.name == "moelora.kernels._triton"][-2:] == [
        "Triton kernel variant built: k1", "Triton kernel variant built: k2"]


def test_a_build_is_described_by_its_specialization():
    """The log line of a build: types, D for 16-divisible arguments, constexpr values (the shape of the hook's
    `compile` in Triton 3.6-3.9); the hook's repr, folded to one line, where `compile` lacks them."""
    class Fn:
        name = "test.<locals>._k"

    comp = {"signature": {"x_ptr": "*bf16", "n": "i32", "one": "constexpr", "BLOCK": "constexpr"},
            "constants": {(2,): 1, (3,): 64}, "configs": [{(0,): [["tt.divisibility", 16]], (1,): []}],
            "num_warps": 4, "num_stages": 3}
    assert _triton.describe_build({"compile": comp, "fn": Fn()}) == \
        "_k[warps=4, stages=3](x_ptr: *bf16D, n: i32, one=1, BLOCK=64)"
    assert _triton.describe_build({"repr": "_k[...](x_ptr: (\n)"}) == "_k[...](x_ptr: ( )"


def test_no_earlier_hook(hook_restored):
    runtime = hook_restored
    runtime.jit_post_compile_hook = None
    _triton.track_kernel_builds()
    before = _triton.kernel_builds()
    assert runtime.jit_post_compile_hook(key="c") is None
    assert _triton.kernel_builds() == before + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_new_specialization_is_one_build_and_a_repeat_is_none(hook_restored, caplog):
    """Triton itself calls the hook: a kernel first launched with n % 16 != 0 is one build, again with another such
    n none, with n % 16 == 0 (a new specialization) one more; each build logged with its specialization."""
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    caplog.set_level("INFO", logger="moelora.kernels._triton")
    _triton.track_kernel_builds()
    x = torch.zeros(64, device="cuda")
    counts = []
    for n in (13, 21, 32):
        before = _triton.kernel_builds()
        _add_one[(1,)](x, n, BLOCK=64)
        counts.append(_triton.kernel_builds() - before)
    torch.cuda.synchronize()
    assert counts == [1, 0, 1]
    assert x[:13].eq(3).all() and x[13:21].eq(2).all() and x[21:32].eq(1).all() and x[32:].eq(0).all()
    logged = [r.getMessage() for r in caplog.records if r.name == "moelora.kernels._triton"][-2:]
    assert logged == ["Triton kernel variant built: _add_one[warps=4, stages=3](x_ptr: *fp32D, n: i32, BLOCK=64)",
                      "Triton kernel variant built: _add_one[warps=4, stages=3](x_ptr: *fp32D, n: i32D, BLOCK=64)"]
