"""DeepSeek-style routing: softmax or sigmoid scores, greedy or group-limited top-k, score-correction bias
(noaux_tc), optional renormalization and a routed scaling factor. The softmax + top-k router of the other
families is moe.route_topk_ref.
"""

from __future__ import annotations

import torch


def grouped_topk_ref(router_logits: torch.Tensor, top_k: int, scoring_func: str, topk_method: str, n_group: int,
                     topk_group: int, renormalize: bool, routed_scaling_factor: float,
                     e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics (as transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter), per token, in fp32:
        s = softmax(logits) or sigmoid(logits)                                   # [E]
        greedy:               ids = topk(s, K); w = s[ids]
        group_limited_greedy: group score = max of s over the group's E/G experts; keep the topk_group best
                              groups, s = 0 elsewhere; ids = topk(s, K); w = s[ids]
        noaux_tc:             b = s + e_score_correction_bias; group score = sum of the group's two best b;
                              keep the topk_group best groups, b = -inf elsewhere; ids = topk(b, K); w = s[ids]
        if renormalize: w /= w.sum() + 1e-20
        w *= routed_scaling_factor
    router_logits: [T, E] · e_score_correction_bias: [E] (noaux_tc only)
    returns topk_weights [T, K] fp32, topk_ids [T, K] int64 (in no particular order within a row)
    """
    logits = router_logits.float()
    T, E = logits.shape
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"scoring_func {scoring_func!r}: use 'softmax' or 'sigmoid'")
    if topk_method == "greedy":
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    elif topk_method in ("group_limited_greedy", "noaux_tc"):
        noaux = topk_method == "noaux_tc"
        choice = scores + e_score_correction_bias.float() if noaux else scores  # [T, E]
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if noaux else grouped.max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(T, E).bool()
        choice = choice.masked_fill(~score_mask, float("-inf") if noaux else 0.0)
        weights, ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)
        if noaux:
            weights = scores.gather(1, ids)
    else:
        raise ValueError(f"topk_method {topk_method!r}: use 'greedy', 'group_limited_greedy' or 'noaux_tc'")
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
