"""Batched sampling: penalties, temperature, top-k / top-p / min-p, per-request seeded draws, logprobs.

Order of operations for one step (as vLLM):
    logits = apply_logit_bias(raw_logits, ...)       # OpenAI logit_bias, per request
    logits = apply_penalties(logits, ...)            # repetition, frequency, presence
    logprobs = log_softmax(logits)                    # what is reported (no temperature, no filters)
    greedy rows:  token = argmax(logits)              # ties: lowest id
    other rows:   logits /= temperature; top-k; top-p; min-p; token ~ softmax(logits)

Every seeded row draws from its own torch.Generator with a fixed number of
draws per step, so its tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora.engine.sampling_params import SamplingParams
from moelora.kernels._triton import HAS_TRITON
from moelora.kernels.sample_triton import gumbel_argmax


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A small host list as a device tensor without a stream synchronisation. (torch.tensor(values, device=cuda)
    copies with non_blocking=False: cudaMemcpyAsync and then cudaStreamSynchronize, which waits for every kernel
    queued before it — the whole forward when sampling follows a graph replay, and the next step's forward under
    asynchronous scheduling.) A non-blocking copy from pageable memory returns once the bytes are staged."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded for one request, or None (use the global RNG) when seed is None."""
    return None if seed is None else torch.Generator(device=torch.device(device)).manual_seed(seed)


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """counts[b, v] = how often token v occurs in token_ids[b]. Returns [B, V] fp32."""
    max_len = max((len(t) for t in token_ids), default=0)
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32, device=device)
    if max_len:  # padded with the extra column vocab_size, dropped afterwards
        padded = torch.tensor([t + [vocab_size] * (max_len - len(t)) for t in token_ids], dtype=torch.int64,
                              device=device)  # [B, L]
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits[b, v] + params[b].logit_bias[v] for every biased (row, token); a new fp32 tensor when any row has a
    bias, else logits itself. The bias is copied to the device without a synchronisation, so this also runs
    between an asynchronous step's forward and its sampling. logits: [B, V]. Token ids must be < V (the engine
    checks them when the request is added)."""
    biased = [(b, t, float(v)) for b, p in enumerate(params) for t, v in (p.logit_bias or {}).items()]
    if not biased:
        return logits
    rows, cols, vals = (list(c) for c in zip(*biased))
    device = logits.device
    out = logits.float().clone()
    out.index_put_((to_device(rows, torch.int64, device), to_device(cols, torch.int64, device)),
                   to_device(vals, torch.float32, device), accumulate=True)
    return out


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
                    params: list[SamplingParams]) -> torch.Tensor:
    """Return penalized logits (a new tensor; the input is not modified).

    Semantics, for each row b and token v:
        if v in prompt[b] + output[b]:          # repetition penalty (vLLM / transformers)
            logits[b, v] = logits[b, v] / rp if logits[b, v] > 0 else logits[b, v] * rp
        logits[b, v] -= frequency_penalty * count(v in output[b])      # OpenAI
        logits[b, v] -= presence_penalty * (count(v in output[b]) > 0)  # OpenAI
    logits: [B, V] fp32"""
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    out = logits.clone()
    sub = out[rows]  # [R, V]
    idx = torch.tensor(rows, dtype=torch.int64, device=device)
    rep, freq, pres = torch.tensor([[params[i].repetition_penalty, params[i].frequency_penalty,
                                     params[i].presence_penalty] for i in rows], dtype=torch.float32, device=device).T

    out_counts = _token_counts([list(output_token_ids[i]) for i in rows], vocab_size, device)  # [R, V]
    prompt_counts = _token_counts([list(prompt_token_ids[i]) for i in rows], vocab_size, device)  # [R, V]
    seen = (out_counts + prompt_counts) > 0  # [R, V]

    rep = rep[:, None].expand_as(sub)
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub = sub - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0).float()
    out.index_copy_(0, idx, sub)
    return out


@dataclass
class SamplerOutput:
    """One sampled token per row.

    logprobs[b]: log_softmax(penalized logits)[b, token_ids[b]], i.e. before temperature and filters; None for
    rows that did not ask for logprobs (no [B, V] log-softmax is computed for them).
    top_logprobs[b]: the params.logprobs most likely (token_id, logprob) under that same distribution,
    best first; None for rows that did not ask for logprobs."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k / top-p remove. logits: [B, V] · top_k: [B] int64 (V = off) · top_p: [B]."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending: [B, V]
    vocab_size = logits.shape[1]
    if top_k is not None:
        # keep everything >= the k-th largest value (ties at the threshold are kept, as vLLM)
        kth = sorted_logits.gather(1, (vocab_size - top_k).clamp(0, vocab_size - 1)[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)  # mass of this token and all less likely ones
        drop = cum <= (1.0 - top_p)[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (probability of the most likely token)."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


# From how many rows Sampler(fused=None) takes the kernel. Synchronous scheduling (the host waits for each step):
# 256 — faster end to end there at batch 256, slower at 64 (its two Triton launches cost the host more than the
# GPU passes saved). Asynchronous scheduling (the host's launches hide behind the GPU): 1 — faster at
# batch 64 (6,003 against 5,920 tok/s) and 128 (10,654 against 10,406).
FUSED_SAMPLER_MIN_ROWS = 256
FUSED_SAMPLER_MIN_ROWS_ASYNC = 1


def fused_sampler_min_rows(async_scheduling: bool) -> int:
    return FUSED_SAMPLER_MIN_ROWS_ASYNC if async_scheduling else FUSED_SAMPLER_MIN_ROWS


class Sampler:
    """Turns a batch of (already penalized) logits into one token per row.

    fused: the one-pass kernel (kernels/sample_triton.py: Gumbel-max over the raw logits, greedy rows in the same
    pass; the torch path's distribution, from other random numbers) for batches whose rows ask for nothing but a
    temperature (no top-k / top-p / min-p, no per-request seed) and that sample at least one row (an all-greedy batch
    is one argmax: the torch path is faster there); None (default) = on for CUDA logits of at least `min_rows` rows
    (None: FUSED_SAMPLER_MIN_ROWS, see above) when Triton is present; True: the kernel whatever the size; False:
    never. Measured: docs/performance-history.md (the one-pass sampling row). last_path: "fused" or "torch", the path
    the last call took."""

    def __init__(self, fused: bool | None = None, min_rows: int | None = None) -> None:
        self.fused = fused
        self.min_rows = fused_sampler_min_rows(False) if min_rows is None else min_rows
        self.last_path = ""

    def _fast_path_ok(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None]) -> bool:
        if self.fused is False or not HAS_TRITON:
            return False
        if self.fused is None and (not logits.is_cuda or logits.shape[0] < self.min_rows):
            return False
        if all(p.greedy for p in params):  # argmax alone: the torch path is faster (0.09 against 0.21 ms, b64)
            return False
        return all(not p.top_k_enabled and p.top_p >= 1.0 and p.min_p <= 0.0 and (p.greedy or g is None)
                   for p, g in zip(params, generators))

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> SamplerOutput:
        """logits: [B, V] (fp32 after penalties, else the model's dtype), penalties already applied (see
        apply_penalties). params, generators: one per row; a None generator draws from torch's global RNG."""
        token_ids = self.sample_tokens(logits, params, generators)
        wants = any(p.logprobs is not None for p in params)
        return self._with_logprobs(logits.float() if wants else logits, params, token_ids)

    def sample_tokens(self, logits: torch.Tensor, params: list[SamplingParams],
                      generators: list[torch.Generator | None]) -> torch.Tensor:
        """The tokens of sample(), left on the logits' device ([B] int64; no logprobs, no host synchronisation)."""
        batch, vocab_size = logits.shape
        if len(params) != batch or len(generators) != batch:
            raise ValueError(f"Sampler.sample: logits have {batch} rows but got {len(params)} params and "
                             f"{len(generators)} generators")
        device = logits.device
        if self._fast_path_ok(logits, params, generators):
            self.last_path = "fused"
            inv_temp = to_device([0.0 if p.greedy else 1.0 / p.temperature for p in params], torch.float32, device)
            seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)  # no host synchronisation
            return gumbel_argmax(logits, inv_temp, seed)
        self.last_path = "torch"
        logits = logits.float()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        # greedy rows: the first maximum (lowest id); not computed when every row samples
        token_ids = logits.argmax(dim=-1) if len(random_rows) < batch else None  # [B]
        if random_rows:
            rp = [params[i] for i in random_rows]
            every = len(random_rows) == batch  # no row gather (a [B, V] copy) when every row samples
            idx = None if every else to_device(random_rows, torch.int64, device)
            x = (logits if every else logits.index_select(0, idx)) / to_device([p.temperature for p in rp], torch.float32, device)[:, None]
            top_k = top_p = None
            if any(p.top_k_enabled for p in rp):
                top_k = to_device([p.top_k if p.top_k_enabled else vocab_size for p in rp], torch.int64, device)
            if any(p.top_p < 1.0 for p in rp):
                top_p = to_device([p.top_p for p in rp], torch.float32, device)
            if top_k is not None or top_p is not None:
                x = _apply_top_k_top_p(x, top_k, top_p)
            if any(p.min_p > 0.0 for p in rp):
                x = _apply_min_p(x, to_device([p.min_p for p in rp], torch.float32, device))
            probs = x.softmax(dim=-1)  # [R, V]
            drawn = self._draw(probs, [generators[i] for i in random_rows])  # [R]; probs overwritten
            if every:
                token_ids = drawn
            else:
                token_ids.index_copy_(0, idx, drawn)
        return token_ids

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, params: list[SamplingParams], token_ids: torch.Tensor) -> SamplerOutput:
        """The output for token_ids [B], with the logprobs the rows ask for (log_softmax of logits [B, V], fp32 when
        any row asks)."""
        batch, vocab_size = logits.shape
        top: list[list[tuple[int, float]] | None] = [None] * batch
        chosen: list[float | None] = [None] * batch
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            every = len(want) == batch
            logprobs = torch.log_softmax(logits if every else logits[want], dim=-1)  # [W, V]
            rows = token_ids if every else token_ids[want]
            for i, lp in zip(want, logprobs.gather(1, rows[:, None])[:, 0].tolist()):
                chosen[i] = lp
            k_max = min(max(params[i].logprobs for i in want), vocab_size)  # type: ignore[type-var]
            vals, ids = logprobs.topk(k_max, dim=-1) if k_max > 0 else (None, None)
            for j, i in enumerate(want):
                k = min(params[i].logprobs, vocab_size)  # type: ignore[type-var]
                top[i] = list(zip(ids[j, :k].tolist(), vals[j, :k].tolist())) if k else []  # type: ignore[index]
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=chosen, top_logprobs=top)

    @staticmethod
    def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row by the exponential race: argmax(p / q), q ~ Exp(1), which samples p exactly.

        probs: [R, V], divided in place. Each seeded row draws its own V exponentials from its own generator;
        the unseeded rows draw theirs together from torch's global RNG, in row order (the same numbers whether
        or not seeded rows sit between them)."""
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            q = torch.empty_like(probs).exponential_()  # no gather or scatter of a [R, V] buffer
        else:
            q = torch.empty_like(probs)
            if unseeded:
                rows = to_device(unseeded, torch.int64, probs.device)
                q.index_copy_(0, rows, torch.empty((len(unseeded), probs.shape[1]), dtype=probs.dtype,
                                                   device=probs.device).exponential_())
            for j, g in enumerate(generators):
                if g is not None:
                    q[j].exponential_(generator=g)
        # a zero draw would turn a filtered token (p = 0) into 0/0 = nan, which argmax prefers
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[dict | None]:
    """Logprobs of the prompt's own tokens, as vLLM's prompt_logprobs.

    logits: [P, V], row i holds the prediction for position i + 1 (P >= len(prompt_ids) - 1).
    Returns one entry per prompt position; position 0 is None (nothing predicts it). Entry i >= 1:
        {"token_id": prompt_ids[i], "logprob": log_softmax(logits[i-1])[prompt_ids[i]],
         "rank": 1 + #tokens with a strictly higher logprob, "top": [(token_id, logprob)] * k, best first}"""
    n = len(prompt_ids)
    if n == 0:
        return []
    if logits.shape[0] < n - 1:
        raise ValueError(f"prompt_logprobs: need at least {n - 1} logits rows for {n} prompt tokens, "
                         f"got {logits.shape[0]}")
    result: list[dict | None] = [None]
    if n == 1:
        return result
    lp = torch.log_softmax(logits[: n - 1].float(), dim=-1)  # [n-1, V]
    targets = torch.tensor(prompt_ids[1:], dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, targets[:, None])  # [n-1, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1  # [n-1]
    k = min(k, lp.shape[1])
    top_vals, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
    rows = zip(prompt_ids[1:], chosen[:, 0].tolist(), ranks.tolist(), top_vals.tolist(), top_ids.tolist())
    return result + [{"token_id": tok, "logprob": c, "rank": r, "top": list(zip(ti, tv))} for tok, c, r, tv, ti in rows]
