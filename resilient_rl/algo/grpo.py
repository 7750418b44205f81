"""GRPO maths: group-normalised advantages, per-token log-probabilities, the clipped loss.

Pure torch, no Ray, no distributed calls: the trainer composes these. The loss is returned
per sequence so the caller can sum it over its shard and divide by the GLOBAL batch size
(prompts_per_step x samples), never by its own shard size. With that, the summed gradients
(DDP averages over ranks, so scale by world size or use a sum-reduction) do not depend on how
the batch is split over ranks or micro-batches: training is world-size invariant.
"""

from __future__ import annotations

import torch
from torch import nn


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages.

    ``rewards``: ``[num_groups, group_size]`` (one row per prompt, one column per sample).
    Returns a tensor of the same shape: ``r - mean(row)``, divided by ``std(row, unbiased=False) + eps``
    when ``normalize_std``. A row of equal rewards gives zeros (nothing to learn from it).
    The dtype is the input's floating dtype (float32 for integer rewards).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        # eps keeps an equal-reward group at exactly 0/eps = 0 instead of 0/0.
        centred = centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Per-token log-probabilities of ``input_ids`` under ``model`` (a causal LM returning ``.logits``).

    All inputs are ``[B, T]``. Returns float32 ``[B, T]``: entry ``t`` is
    ``log p(input_ids[:, t] | input_ids[:, :t])`` (read from the logits at ``t - 1``) where
    ``completion_mask`` is set, and exactly 0 elsewhere. Position 0 has no prefix, so
    ``completion_mask[:, 0]`` must be 0 (a completion always follows a prompt); ``ValueError`` otherwise.

    Position ids are derived from ``attention_mask`` so that left- and right-padded batches give
    the same log-probabilities as the unpadded sequences (as the inference engine computed them).
    Gradients flow to the model's parameters.
    """
    return sequence_logprobs_and_entropy(model, input_ids, attention_mask, completion_mask, entropy=False)[0]


def sequence_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    entropy: bool = True,
    chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_logprobs` and, from the same forward pass, the policy's per-token entropy
    ``[B, T]`` (nats; 0 outside ``completion_mask``; None with ``entropy=False``).

    The entropy is a statistic, not part of the loss: computed without gradient, ``chunk``
    positions at a time (one ``[B, chunk, V]`` softmax at once, not the whole ``[B, T, V]``),
    and the log-probabilities are the same bits as without it."""
    if not (input_ids.shape == attention_mask.shape == completion_mask.shape) or input_ids.dim() != 2:
        raise ValueError("input_ids, attention_mask and completion_mask must share one [B, T] shape")
    if bool(completion_mask[:, 0].any()):
        raise ValueError("completion_mask[:, 0] must be 0: the first token has no prefix to predict it from")
    attention_mask = attention_mask.long()
    # HF counts positions from the first column; with left padding that would shift every
    # real token's position (and its rotary embedding) by the pad length.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float()  # logits at t-1 predict token t
    targets = input_ids[:, 1:]
    # gather - logsumexp avoids materialising a second [B, T, V] log_softmax tensor.
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    out = nn.functional.pad(picked, (1, 0))  # position 0: no prediction
    # where, not multiply: whatever the logits at padding hold must not leak (inf * 0 is NaN).
    keep = completion_mask.bool()
    lp = torch.where(keep, out, torch.zeros_like(out))
    if not entropy:
        return lp, None
    with torch.no_grad():
        ent = torch.empty_like(lse)
        for a in range(0, ent.shape[1], chunk):  # H = logsumexp(z) - sum softmax(z) * z
            z = logits[:, a : a + chunk].detach()
            ent[:, a : a + chunk] = lse[:, a : a + chunk].detach() - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        ent = nn.functional.pad(ent, (1, 0))
        return lp, torch.where(keep, ent, torch.zeros_like(ent))


def grpo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    token_sum: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO surrogate, per sequence.

    Shapes: ``new_logprobs``, ``old_logprobs``, ``mask`` (and ``ref_logprobs``) ``[B, T]``;
    ``advantages`` ``[B]``. For sequence ``i`` with ``n_i = sum_t mask[i, t]`` tokens::

        loss_i = -(1/n_i) sum_t min(r_t A_i, clip(r_t, 1-eps, 1+eps) A_i) + kl_coef (1/n_i) sum_t k3_t
        r_t = exp(new_t - old_t),   k3_t = exp(ref_t - new_t) - (ref_t - new_t) - 1   (>= 0)

    ``token_sum``: ``loss_i`` is the sum over its tokens, not the mean (drop the ``1/n_i``), for
    the token-mean and sequence-mean-token-sum aggregations (the caller divides).

    Returns ``(losses [B], stats)``. A sequence with an empty mask has loss 0 (no NaN) and
    receives no gradient. Sum ``losses`` over the shard and divide by the global batch size.
    Gradients flow through ``new_logprobs`` only (``old``/``ref`` are treated as constants).

    ``stats`` (Python floats, token-weighted over this call's valid tokens, 0 when there are
    none): ``clip_frac`` (fraction of tokens whose gradient the clip removed), ``kl`` (mean k3),
    ``ratio_mean`` (mean r), and ``num_tokens`` (to weight these when merging shards).
    """
    if new_logprobs.shape != old_logprobs.shape or new_logprobs.shape != mask.shape or new_logprobs.dim() != 2:
        raise ValueError("new_logprobs, old_logprobs and mask must share one [B, T] shape")
    if advantages.shape != new_logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{new_logprobs.shape[0]}], got {tuple(advantages.shape)}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if ref_logprobs is not None and ref_logprobs.shape != new_logprobs.shape:
        raise ValueError("ref_logprobs must have the shape of new_logprobs")

    valid = mask.bool()
    maskf = valid.to(new_logprobs.dtype)
    zero = torch.zeros_like(new_logprobs)
    # Masked positions may hold anything (padding garbage): zero the log-ratio there *before*
    # exp so an overflow cannot turn into inf * 0 = NaN, in the value or in the gradient.
    log_ratio = torch.where(valid, new_logprobs - old_logprobs.detach(), zero)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(new_logprobs.dtype).unsqueeze(1)  # [B, 1] broadcasts over tokens
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)

    k3 = zero
    if ref_logprobs is not None:
        ref_minus_new = torch.where(valid, ref_logprobs.detach() - new_logprobs, zero)
        k3 = torch.exp(ref_minus_new) - ref_minus_new - 1.0
        if kl_coef > 0:
            per_token = per_token + kl_coef * k3

    n_tokens = maskf.sum(dim=1)
    # clamp(min=1): an empty sequence sums to 0 and divides by 1 -> loss 0, not 0/0.
    losses = (per_token * maskf).sum(dim=1)
    if not token_sum:
        losses = losses / n_tokens.clamp(min=1.0)

    with torch.no_grad():
        total = float(maskf.sum())
        # The clip removes the gradient where the ratio left the trust region in the
        # direction the advantage pushes it (PPO's "clipped" tokens).
        was_clipped = ((ratio > 1.0 + clip_eps) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
        denom = max(total, 1.0)
        stats = {
            "clip_frac": float((was_clipped & valid).sum()) / denom,
            "kl": float((k3 * maskf).sum()) / denom,
            "ratio_mean": float((ratio * maskf).sum()) / denom,
            "num_tokens": total,
        }
    return losses, stats
