"""GRPO maths: advantages, the clipped loss's gradients, the KL term, world-size invariance,
and per-token log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from resilient_rl.algo.grpo import group_advantages, grpo_loss, sequence_logprobs, sequence_logprobs_and_entropy

EPS = 0.2


def _tiny_lm(seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()  # eval: no dropout, deterministic


# ---------------------------------------------------------------- advantages


def test_advantages_per_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    adv = group_advantages(rewards)
    assert adv.shape == rewards.shape
    torch.testing.assert_close(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    std1 = math.sqrt(0.5)  # population std of [3, 1, 2, 2]
    torch.testing.assert_close(adv[1], torch.tensor([1.0, -1.0, 0.0, 0.0]) / std1, atol=1e-5, rtol=0)
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(2), atol=1e-6, rtol=0)


def test_equal_rewards_give_zero_advantages() -> None:
    adv = group_advantages(torch.tensor([[0.7, 0.7, 0.7], [0.0, 0.0, 0.0], [1.0, 2.0, 3.0]]))
    assert torch.equal(adv[:2], torch.zeros(2, 3))
    assert not torch.isnan(adv).any()
    assert adv[2].abs().sum() > 0


def test_advantages_without_std_normalisation() -> None:
    adv = group_advantages(torch.tensor([[4.0, 0.0], [1.0, 1.0]]), normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([[2.0, -2.0], [0.0, 0.0]]))
    normed = group_advantages(torch.tensor([[4.0, 0.0]]))
    torch.testing.assert_close(normed, torch.tensor([[1.0, -1.0]]), atol=1e-5, rtol=0)


def test_std_normalisation_blows_up_tiny_differences_and_plain_centring_does_not() -> None:
    # A nearly collapsed group (7 equal answers, one a hair worse) next to a diverse one.
    # With the std division the hair-thin gap gets advantages as large as the real one
    # (this sharpened wrong modes of the demo's tiny policy); plain centring keeps the
    # advantage proportional to the reward gap (Dr. GRPO), so diverse groups dominate.
    near = [1 / 3] * 7 + [1 / 4]
    diverse = [1.0] * 4 + [0.0] * 4
    rewards = torch.tensor([near, diverse], dtype=torch.float64)
    normed = group_advantages(rewards)
    assert normed[0].abs().max() > normed[1].abs().max()  # the 1/12 gap outweighs the 0-vs-1 split
    plain = group_advantages(rewards, normalize_std=False)
    assert float(plain[0].abs().max()) < 0.1
    assert float(plain[1].abs().max()) == pytest.approx(0.5)
    torch.testing.assert_close(plain.sum(dim=1), torch.zeros(2, dtype=torch.float64))


def test_advantages_keep_float_dtype() -> None:
    assert group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64)).dtype == torch.float64
    torch.testing.assert_close(group_advantages(torch.tensor([[1, 0]])), torch.tensor([[1.0, -1.0]]), atol=1e-5, rtol=0)


def test_advantages_shape_checked() -> None:
    with pytest.raises(ValueError, match="num_groups"):
        group_advantages(torch.zeros(8))


# ---------------------------------------------------------------- the loss


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_loss_value_matches_the_formula() -> None:
    new = torch.tensor([[0.0, -0.5, -1.0, -2.0]])
    old = torch.tensor([[0.0, -0.6, -0.7, -2.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    losses, stats = grpo_loss(new, old, torch.tensor([2.0]), mask, EPS)
    r1, r2 = math.exp(0.1), math.exp(-0.3)  # r2 < 1 - eps: clipped value, but A > 0 keeps the min at r2 A
    expected = -(min(r1 * 2, min(r1, 1 + EPS) * 2) + min(r2 * 2, max(r2, 1 - EPS) * 2)) / 2
    assert losses.shape == (1,)
    assert losses.item() == pytest.approx(expected, rel=1e-6)
    assert stats["ratio_mean"] == pytest.approx((r1 + r2) / 2, rel=1e-6)
    assert stats["num_tokens"] == 2 and stats["clip_frac"] == 0.0 and stats["kl"] == 0.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_gradient_direction_follows_the_advantage(sign: float) -> None:
    new = _leaf([[-1.0, -1.2, -0.8, -3.0]])
    mask = torch.tensor([[0, 1, 1, 0]])
    losses, _ = grpo_loss(new, new.detach().clone(), torch.tensor([sign]), mask, EPS)
    losses.sum().backward()
    assert new.grad is not None
    # Gradient descent moves the completion's log-probs up for A > 0 and down for A < 0 ...
    assert torch.all(-new.grad[0, 1:3] * sign > 0)
    # ... and leaves tokens outside the mask alone.
    assert new.grad[0, 0] == 0 and new.grad[0, 3] == 0
    stepped = (new - 0.1 * new.grad).detach()
    assert torch.all((stepped[0, 1:3] - new[0, 1:3].detach()) * sign > 0)


@pytest.mark.parametrize(
    ("ratio", "adv", "clipped"),
    [(1.5, 1.0, True), (0.5, -1.0, True), (0.5, 1.0, False), (1.5, -1.0, False), (1.1, 1.0, False), (0.9, -1.0, False)],
)
def test_clipping_removes_the_gradient_past_the_trust_region(ratio: float, adv: float, clipped: bool) -> None:
    new = _leaf([[0.0, math.log(ratio)]])
    losses, stats = grpo_loss(new, torch.zeros(1, 2), torch.tensor([adv]), torch.tensor([[0, 1]]), EPS)
    losses.sum().backward()
    assert new.grad is not None
    if clipped:
        assert new.grad[0, 1] == 0
        assert stats["clip_frac"] == 1.0
    else:
        # d/d(new) of -(r A) = -r A (r = exp(new - old)), the unclipped PPO gradient.
        assert new.grad[0, 1].item() == pytest.approx(-ratio * adv, rel=1e-6)
        assert stats["clip_frac"] == 0.0


def test_clip_frac_counts_tokens() -> None:
    new = torch.log(torch.tensor([[1.0, 1.5, 1.5, 1.0], [1.0, 0.5, 1.0, 1.0]]))
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    _, stats = grpo_loss(new, torch.zeros(2, 4), torch.tensor([1.0, -1.0]), mask, EPS)
    assert stats["num_tokens"] == 5
    assert stats["clip_frac"] == pytest.approx(3 / 5)


def test_kl_zero_when_reference_equals_policy() -> None:
    new = _leaf([[0.0, -0.5, -1.5]])
    mask = torch.tensor([[0, 1, 1]])
    adv = torch.tensor([0.7])
    with_kl, stats = grpo_loss(new, new.detach(), adv, mask, EPS, kl_coef=0.5, ref_logprobs=new.detach().clone())
    without, _ = grpo_loss(new, new.detach(), adv, mask, EPS)
    assert stats["kl"] == 0.0
    torch.testing.assert_close(with_kl, without)


def test_kl_positive_and_pulls_towards_the_reference() -> None:
    new = _leaf([[0.0, -0.5, -1.5]])
    ref = torch.tensor([[0.0, -0.2, -2.0]])
    mask = torch.tensor([[0, 1, 1]])
    zero_adv = torch.tensor([0.0])  # isolate the KL term
    losses, stats = grpo_loss(new, new.detach(), zero_adv, mask, EPS, kl_coef=0.5, ref_logprobs=ref)
    d = torch.tensor([0.3, -0.5])  # ref - new on the two completion tokens
    k3 = torch.exp(d) - d - 1
    assert stats["kl"] == pytest.approx(k3.mean().item(), rel=1e-6) and stats["kl"] > 0
    assert losses.item() == pytest.approx(0.5 * k3.mean().item(), rel=1e-6)
    losses.sum().backward()
    assert new.grad is not None
    assert new.grad[0, 1] < 0 < new.grad[0, 2]  # descent raises the token below ref, lowers the one above
    # Reported even with kl_coef = 0, without entering the loss.
    losses0, stats0 = grpo_loss(new, new.detach(), zero_adv, mask, EPS, kl_coef=0.0, ref_logprobs=ref)
    assert stats0["kl"] == pytest.approx(stats["kl"]) and losses0.item() == 0.0


def test_kl_needs_a_reference() -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2), EPS, kl_coef=0.1)


def test_empty_masks_give_zero_not_nan() -> None:
    new = _leaf([[-1.0, -1.0], [-1.0, -2.0]])
    # Garbage where the mask is 0 (an engine's padding) must not leak into value or gradient.
    old = torch.tensor([[-1e30, float("nan")], [-1.5, -1e30]])
    ref = torch.tensor([[1e30, float("nan")], [-1.0, 1e30]])
    mask = torch.tensor([[0, 0], [1, 0]])
    losses, stats = grpo_loss(new, old, torch.tensor([1.0, 1.0]), mask, EPS, kl_coef=0.1, ref_logprobs=ref)
    assert losses[0].item() == 0.0 and torch.isfinite(losses).all()
    losses.sum().backward()
    assert new.grad is not None and torch.isfinite(new.grad).all()
    assert torch.equal(new.grad[0], torch.zeros(2)) and new.grad[1, 1] == 0
    _, none = grpo_loss(new, old, torch.ones(2), torch.zeros(2, 2), EPS)
    assert none == {"clip_frac": 0.0, "kl": 0.0, "ratio_mean": 0.0, "num_tokens": 0.0}


def test_shapes_checked() -> None:
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), EPS)
    with pytest.raises(ValueError, match="share"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), EPS)


# ---------------------------------------------------------------- world-size invariance


def _batch(b: int = 8, t: int = 10) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 16, (b, t), generator=g)
    prompt_len = 3
    lengths = torch.randint(prompt_len + 1, t + 1, (b,), generator=g)  # varied completion lengths
    pos = torch.arange(t).unsqueeze(0)
    attn = (pos < lengths.unsqueeze(1)).long()
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))  # right padding
    completion = attn * (pos >= prompt_len).long()
    completion[0] = 0  # one sequence with an empty completion
    return ids, attn, completion


def _step_grads(
    model: Qwen2ForCausalLM, shards: int, old: torch.Tensor, adv: torch.Tensor
) -> tuple[float, list[torch.Tensor]]:
    """Accumulate sum(per-sequence loss) / GLOBAL batch over ``shards`` pieces (ranks or micro-batches)."""
    ids, attn, comp = _batch()
    model.zero_grad()
    total = 0.0
    for part in torch.arange(ids.shape[0]).chunk(shards):
        new = sequence_logprobs(model, ids[part], attn[part], comp[part])
        losses, _ = grpo_loss(new, old[part], adv[part], comp[part], EPS, kl_coef=0.1, ref_logprobs=old[part])
        loss = losses.sum() / ids.shape[0]
        loss.backward()
        total += loss.item()
    return total, [p.grad.clone() for p in model.parameters()]


def test_global_batch_split_invariance() -> None:
    model = _tiny_lm()
    ids, attn, comp = _batch()
    with torch.no_grad():
        # "old" policy a little off the current one so ratios differ from 1 and some clip.
        old = sequence_logprobs(model, ids, attn, comp) + 0.3 * torch.randn(
            ids.shape, generator=torch.Generator().manual_seed(2)
        )
        old = torch.where(comp.bool(), old, torch.zeros_like(old))
    adv = torch.linspace(-1.5, 1.5, ids.shape[0])
    full_loss, full_grads = _step_grads(model, 1, old, adv)
    for shards in (2, 4, 8):
        loss, grads = _step_grads(model, shards, old, adv)
        assert loss == pytest.approx(full_loss, rel=1e-5, abs=1e-7)
        for a, b in zip(full_grads, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- log-probabilities


def test_sequence_logprobs_matches_manual_log_softmax() -> None:
    model = _tiny_lm()
    ids, attn, comp = _batch(b=3)
    got = sequence_logprobs(model, ids, attn, comp)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
    manual = torch.zeros_like(got)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if comp[b, t]:
                manual[b, t] = logp[b, t - 1, ids[b, t]]
    torch.testing.assert_close(got.detach(), manual, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[comp == 0], torch.zeros(int((comp == 0).sum())))
    assert got.requires_grad


def test_the_entropy_beside_the_logprobs_is_the_policys_and_leaves_the_logprobs_bit_equal() -> None:
    """Per completion token, -sum p log p of the next-token distribution (0 elsewhere), the same
    for any chunking; the log-probabilities are the same bits as ``sequence_logprobs``'s and the
    entropy carries no gradient."""
    torch.manual_seed(0)
    model = _tiny_lm()
    ids, attn, comp = _batch(b=3)
    plain = sequence_logprobs(model, ids, attn, comp)
    lp, ent = sequence_logprobs_and_entropy(model, ids, attn, comp)
    _, ent2 = sequence_logprobs_and_entropy(model, ids, attn, comp, chunk=2)
    assert ent is not None and ent2 is not None
    assert torch.equal(lp, plain) and lp.requires_grad and not ent.requires_grad
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits.float(), dim=-1)
    manual = torch.zeros_like(ent)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if comp[b, t]:
                manual[b, t] = -(logp[b, t - 1].exp() * logp[b, t - 1]).sum()
    torch.testing.assert_close(ent, manual, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent2, ent, rtol=1e-6, atol=1e-6)
    assert float(ent[comp == 1].min()) > 0 and torch.equal(ent[comp == 0], torch.zeros(int((comp == 0).sum())))


def test_sequence_logprobs_ignore_left_padding() -> None:
    """Left-padded (as engines batch prompts) or not, a sequence's log-probs are the same."""
    model = _tiny_lm()
    seq = torch.tensor([[5, 6, 7, 8, 9]])
    comp = torch.tensor([[0, 0, 1, 1, 1]])
    plain = sequence_logprobs(model, seq, torch.ones_like(seq), comp)
    padded = sequence_logprobs(
        model,
        torch.tensor([[0, 0, 5, 6, 7, 8, 9]]),
        torch.tensor([[0, 0, 1, 1, 1, 1, 1]]),
        torch.tensor([[0, 0, 0, 0, 1, 1, 1]]),
    )
    torch.testing.assert_close(padded[:, 2:], plain, rtol=1e-5, atol=1e-5)


def test_sequence_logprobs_refuses_a_completion_at_position_zero() -> None:
    ids = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="no prefix"):
        sequence_logprobs(_tiny_lm(), ids, torch.ones_like(ids), torch.ones_like(ids))


def test_stale_samples_take_the_engines_logprobs_as_the_behaviour_policy() -> None:
    """async.max_staleness > 0: a trajectory from an older version gets the ratio against the
    engine's logprobs (so the clip can bind); an on-policy one keeps ratio exactly 1."""
    from resilient_rl.workers.trainer import batch_tensors, behaviour_logprobs

    samples = [
        {"prompt_ids": [1, 2], "token_ids": [3, 4], "logprobs": [-9.0, -9.0], "version": 5},  # current
        {"prompt_ids": [1], "token_ids": [5, 6, 7], "logprobs": [-0.5, None, -3.0], "version": 4},  # stale
    ]
    bt = batch_tensors(samples, pad=0)
    new = torch.full((2, 4), -1.0, requires_grad=True)
    old = behaviour_logprobs(samples, new, bt["completion_mask"], version=5)
    assert not old.requires_grad
    assert torch.equal(old[0], new.detach()[0])  # on-policy: the trainer's own values
    assert old[1].tolist() == [-1.0, -0.5, -1.0, -3.0]  # prompt and the missing logprob: trainer's
    _, stats = grpo_loss(new, old, torch.tensor([1.0, 1.0]), bt["completion_mask"], clip_eps=0.2)
    # stale tokens: ratios e^-0.5 (inside the clip for A > 0: no clip) and e^2 (clipped); 1 of 5 tokens
    assert stats["clip_frac"] == pytest.approx(1 / 5)
    # no staleness anywhere: the same tensor values as the plain on-policy path
    assert torch.equal(behaviour_logprobs(samples, new, bt["completion_mask"], version=4), new.detach())


def test_token_sum_drops_the_per_sequence_mean() -> None:
    torch.manual_seed(0)
    new, old = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
    adv = torch.tensor([1.0, -0.5, 2.0])
    mean, _ = grpo_loss(new, old, adv, mask, 0.2)
    total, _ = grpo_loss(new, old, adv, mask, 0.2, token_sum=True)
    assert torch.allclose(total, mean * mask.sum(dim=1))
