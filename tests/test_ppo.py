import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch._inductor.config
import tyro
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    SchedulerType,
    get_scheduler,
)

import common
import ppo
from conftest import (
    ROOT,
    assert_saved_models_equal,
    read_checkpoint,
    read_metrics,
    replayed_samples,
    run_main,
    run_ranks,
    run_script,
    write_jsonl,
)

TOK = common.embedded_tokenizer()


# --- the math -------------------------------------------------------------------------------------------------------


def test_gae_matches_float64_reference_with_masked_tails():
    g = torch.Generator().manual_seed(0)
    B, T, gamma, lam = 5, 7, 0.99, 0.9
    rewards, values = (
        torch.randn(B, T, generator=g, dtype=torch.float64),
        torch.randn(B, T, generator=g, dtype=torch.float64),
    )
    lengths = [7, 1, 4, 3, 6]
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).double()
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    for b, n in enumerate(lengths):
        r, v = rewards[b, :n].tolist(), values[b, :n].tolist() + [0.0]  # the value after the last token is 0
        delta = [r[t] + gamma * v[t + 1] - v[t] for t in range(n)]
        expected = [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]  # A_t, the sum
        assert np.allclose(adv[b, :n].numpy(), expected, atol=1e-12)
        assert np.allclose(ret[b, :n].numpy(), np.array(expected) + np.array(v[:n]), atol=1e-12)
        assert (adv[b, n:] == 0).all()


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -100.0, -100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).float()
    real = torch.tensor([1.0, 2, 3, 4, 5])
    w = ppo.masked_whiten(x, mask)
    assert torch.allclose(w[mask.bool()], (real - real.mean()) / real.std(), atol=1e-4)
    assert (w[~mask.bool()] == 0).all()
    kept = ppo.masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(kept[mask.bool()], (real - real.mean()) / real.std() + real.mean(), atol=1e-4)


def test_policy_and_value_losses_match_formulas():
    g = torch.Generator().manual_seed(1)
    new, old, adv = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    loss, stats = ppo.policy_loss(new, old, adv, 0.2, torch.ones(3, 4))
    for i in range(3):
        for j in range(4):
            ratio = math.exp(new[i, j] - old[i, j])
            a, b = -adv[i, j].item() * ratio, -adv[i, j].item() * min(max(ratio, 0.8), 1.2)
            assert loss[i, j].item() == pytest.approx(max(a, b), abs=1e-6)
            assert stats["clipfrac"][i, j].item() == float(b > a)
            assert stats["ratio"][i, j].item() == pytest.approx(ratio, rel=1e-6)
    v, old_v, ret = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    vloss, vclip = ppo.value_loss(v, old_v, ret, 0.2)
    for i in range(3):
        for j in range(4):
            vc = old_v[i, j] + min(max(v[i, j] - old_v[i, j], -0.2), 0.2)
            unclipped, clipped = (v[i, j] - ret[i, j]) ** 2, (vc - ret[i, j]) ** 2
            assert vloss[i, j].item() == pytest.approx(0.5 * max(unclipped, clipped).item(), abs=1e-6)
            assert vclip[i, j].item() == float(clipped > unclipped)


def test_policy_loss_statistics_stay_finite_on_padding_whose_log_prob_is_minus_infinity():
    """A model may give a pad token the log-prob -inf (a masked vocabulary entry): the ratio and approxkl statistics
    are masked before they are computed, so no inf x 0 = NaN reaches the logs, and the real tokens' numbers stand."""
    new = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, float("-inf"), float("-inf")]])
    old = torch.tensor([[-1.2, -2.0, 0.0], [-0.4, 0.0, 0.0]])
    adv, mask = torch.tensor([[1.0, -1.0, 0.0], [2.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, stats = ppo.policy_loss(new, old, adv, 0.2, mask)
    for name, value in stats.items():
        assert torch.isfinite(value).all() and torch.isfinite((value * mask).sum()), name
    assert torch.isfinite(loss * mask).all()
    assert stats["ratio"][0, 0].item() == pytest.approx(math.exp(0.2)) and stats["approxkl"][
        1, 0
    ].item() == pytest.approx(0.5 * 0.1**2)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_the_loss_mean_is_its_formula_whatever_the_micro_batches(aggregation, monkeypatch):
    """learn()'s policy loss for one mini-batch of 4 responses of 4, 2, 1 and 3 tokens, on-policy (ratio 1: each
    token's loss is -advantage): its mean as --loss_aggregation says, written out here, whether the mini-batch runs as
    one micro-batch or as 2 x 2 accumulated; its statistics plain token means. clip_and_step, which names the policy
    loss if the run diverges, gets the step's, not the last micro-batch's."""
    g = torch.Generator().manual_seed(2)
    policy = ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=1)
    prompts = sample_prompts(4)
    query, qmask = ppo.pad_left(prompts, max(map(len, prompts)), TOK.pad_token_id)
    lengths = [4, 2, 1, 3]
    mask = torch.arange(4)[None] < torch.tensor(lengths)[:, None]
    responses = torch.randint(20, len(TOK), (4, 4), generator=g).masked_fill(~mask, TOK.pad_token_id)
    adv = torch.randn(4, 4, generator=g) * mask
    real = [(-adv[i, :n]).tolist() for i, n in enumerate(lengths)]
    expected = {
        "token_mean": sum(map(sum, real)) / 10,
        "sequence_mean": sum(sum(r) / len(r) for r in real) / 4,
        "constant": sum(map(sum, real)) / (4 * 4),
    }[aggregation]
    stepped, real = [], ppo.clip_and_step
    monkeypatch.setattr(ppo, "clip_and_step", lambda *a: stepped.append(a[-1].item()) or real(*a))
    for micro, accumulation in ((4, 1), (2, 2)):
        args = ppo.Args(
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=accumulation,
            num_mini_batches=1,
            num_ppo_epochs=1,
            response_length=4,
            loss_aggregation=aggregation,
        )
        batch = ppo.Rollout(torch.cat([query, responses], 1), torch.cat([qmask, mask], 1).long(), query.shape[1], mask)
        ppo.logprobs_and_values(policy, policy, None, batch, args, 0, contextlib.nullcontext)
        batch.advantages = adv
        trainable = torch.nn.ModuleDict({"policy": policy})
        stats = ppo.learn(
            policy,
            None,
            trainable,
            torch.optim.SGD(policy.parameters(), lr=0.0),
            batch,
            0.1,
            args,
            0,
            None,
            TOK.pad_token_id,
        )
        assert stats["loss/policy"] == pytest.approx(expected, abs=1e-6), (micro, accumulation)
        assert stepped[-1] == pytest.approx(expected, abs=1e-6), (micro, accumulation)
        assert stats["policy/ratio"] == pytest.approx(1.0, abs=1e-6) and stats["policy/clipfrac"] == 0.0


def test_critic_free_estimators_match_their_formulas():
    g = torch.Generator().manual_seed(3)
    k, returns = 4, torch.randn(12, generator=g, dtype=torch.float64)
    rloo, grpo = ppo.rloo_advantages(returns, k), ppo.grpo_advantages(returns, k)
    dr_grpo = ppo.grpo_advantages(returns, k, scale=False)
    for i in range(12):
        group = returns[i // k * k : (i // k + 1) * k].tolist()
        others = group[: i % k] + group[i % k + 1 :]
        assert rloo[i].item() == pytest.approx(returns[i].item() - sum(others) / (k - 1), abs=1e-12)
        mean = sum(group) / k
        std = (sum((r - mean) ** 2 for r in group) / (k - 1)) ** 0.5
        assert grpo[i].item() == pytest.approx((returns[i].item() - mean) / (std + 1e-4), abs=1e-12)
        assert dr_grpo[i].item() == pytest.approx(returns[i].item() - mean, abs=1e-12)
    # a prompt whose K returns are equal teaches nothing: zero advantage, with and without the std division
    equal = torch.tensor([1.5] * 4 + [0.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    for adv in (
        ppo.rloo_advantages(equal, 4),
        ppo.grpo_advantages(equal, 4),
        ppo.grpo_advantages(equal, 4, scale=False),
    ):
        assert (adv[:4] == 0).all() and (adv[4:] != 0).all()
    # REINFORCE++: each token's discounted return of the rewards, whitened over the batch's real tokens
    B, T, gamma = 3, 5, 0.9
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.arange(T)[None] < torch.tensor([5, 2, 3])[:, None]).double()
    ret = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        n = int(mask[b].sum())
        for t in range(n):
            ret[b, t] = sum(gamma ** (s - t) * rewards[b, s] for s in range(t, n))
    real = ret[mask.bool()]
    expected = torch.zeros_like(ret)
    expected[mask.bool()] = (real - real.mean()) / real.std()
    assert torch.allclose(ppo.reinforce_pp_advantages(rewards, mask, gamma), expected, atol=1e-6)


@pytest.mark.parametrize("estimator", ["gae", "rloo", "grpo", "reinforce_pp"])
@pytest.mark.parametrize("kl_penalty", ["reward", "loss"])
def test_advantages_phase_puts_the_kl_where_asked(estimator, kl_penalty):
    """The phase as main() calls it: under --kl_penalty reward an episode's return is its score minus kl_coef x its
    summed KL; under loss, its score alone (the KL goes to learn()). GAE's returns are its critic's targets."""
    g = torch.Generator().manual_seed(4)
    B, T, coef = 8, 5, 0.3
    mask = torch.arange(T)[None] < torch.tensor([5, 2, 3, 1, 4, 5, 2, 3])[:, None]
    drawn = lambda: torch.randn(B, T, generator=g) * mask  # noqa: E731
    batch = ppo.Rollout(
        torch.zeros(B, T + 2, dtype=torch.long),
        torch.ones(B, T + 2, dtype=torch.long),
        2,
        mask,
        logprobs=drawn(),
        scores=torch.randn(B, generator=g),
        values=drawn(),
        ref_logprobs=drawn(),
    )
    args = ppo.Args(advantage_estimator=estimator, kl_penalty=kl_penalty)
    ppo.fill_defaults(args, None)
    kl, non_score = ppo.advantages(batch, coef, args)
    expected_kl = (
        (batch.logprobs - batch.ref_logprobs)
        if args.kl_estimator == "k1"
        else ppo.kl_per_token(batch.logprobs, batch.ref_logprobs, "k3")
    )
    assert torch.allclose(kl, expected_kl * mask)
    assert torch.allclose(non_score, -coef * kl if kl_penalty == "reward" else torch.zeros_like(kl))
    returns = batch.scores + non_score.sum(1)
    if estimator in ("rloo", "grpo"):
        adv = (ppo.rloo_advantages if estimator == "rloo" else ppo.grpo_advantages)(returns, 4)
        ppo.advantages(batch, coef, args)
        assert torch.allclose(batch.advantages, adv[:, None] * mask, atol=1e-6) and batch.returns is None
        with pytest.raises(common.UserError, match="--whiten_rewards whitens per-token rewards for gae"):
            ppo.check_args(dataclasses.replace(args, whiten_rewards=True))  # refused, not silently ignored
    else:
        rewards = non_score.clone()
        for b in range(B):
            rewards[b, int(mask[b].sum()) - 1] += batch.scores[b]
        if estimator == "gae":
            adv, ret = ppo.gae(rewards, batch.values, mask.float(), 1.0, 0.95)
            assert torch.allclose(batch.advantages, ppo.masked_whiten(adv, mask.float()), atol=1e-6)
            assert torch.allclose(batch.returns, ret, atol=1e-6)
        else:
            assert torch.allclose(batch.advantages, ppo.reinforce_pp_advantages(rewards, mask.float(), 1.0), atol=1e-6)
            # undiscounted: the first token's return is the episode's return
            first = ppo.gae(rewards, torch.zeros_like(rewards), mask.float(), 1.0, 1.0)[0][:, 0]
            assert torch.allclose(first, returns, atol=1e-5)


def test_each_estimator_runs_its_papers_defaults_and_a_flag_overrides_them(capsys):
    """--advantage_estimator alone runs its paper: grpo puts the KL in the loss with k3 and averages each response's
    tokens first (Shao et al. 2024, eq. 3); gae, rloo (Ahmadian et al. 2024) and reinforce_pp (Hu 2025) put it in each
    token's reward with k1 and average tokens. fill_defaults prints what it filled, and a given flag keeps its value."""
    papers = {
        "gae": ("reward", "k1", "token_mean", 1),
        "rloo": ("reward", "k1", "token_mean", 4),
        "grpo": ("loss", "k3", "sequence_mean", 4),
        "reinforce_pp": ("reward", "k1", "token_mean", 1),
    }
    for estimator, expected in papers.items():
        args = ppo.Args(advantage_estimator=estimator, reward_fn="common:gold_rewards")
        ppo.check_args(args)  # (before fill_defaults, as main() runs them)
        ppo.fill_defaults(args, None)
        assert (args.kl_penalty, args.kl_estimator, args.loss_aggregation, args.num_samples_per_prompt) == expected
        printed = capsys.readouterr().out.split("defaults: ")[1].splitlines()[0]
        assert f"--kl_penalty {expected[0]}" in printed and f"--loss_aggregation {expected[2]}" in printed
    args = ppo.Args(advantage_estimator="grpo", kl_penalty="reward", loss_aggregation="constant")
    ppo.fill_defaults(args, None)
    assert (args.kl_penalty, args.kl_estimator, args.loss_aggregation) == ("reward", "k1", "constant")
    assert "--kl_penalty" not in capsys.readouterr().out.split("defaults: ")[1].split(", --kl_estimator")[0]


def test_kl_in_the_loss_stays_finite_when_padding_is_improbable(tmp_path, monkeypatch):
    """--kl_penalty loss (k3) over micro-batches whose padding columns the policy finds very improbable (a pad token
    at a low temperature: log-prob -200): exp(ref - new) there would overflow, and inf x a zero mask is NaN. The run
    must train on the real tokens alone, its KL loss finite."""
    real_forward = ppo.response_logprobs

    def improbable_padding(policy, ids, mask, context, *args, **kwargs):
        logprobs, entropy = real_forward(policy, ids, mask, context, *args, **kwargs)
        return logprobs.masked_fill(mask[:, context:] == 0, -200.0), entropy

    monkeypatch.setattr(ppo, "response_logprobs", improbable_padding)
    history = ppo.main(
        ppo.Args(
            kl_penalty="loss",
            reward_fn="common:gold_rewards",
            total_episodes=32,
            per_device_train_batch_size=8,
            output_dir=str(tmp_path),
        )
    )
    losses = [m["loss/kl"] for m in read_metrics(tmp_path)]
    assert len(history) == 2 and all(math.isfinite(x) for x in losses), losses


def test_kl_estimators_are_unbiased_for_known_distributions_and_an_unknown_one_is_refused():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    exact = (p * (p / q).log()).sum().item()
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, lq = p.log()[samples], q.log()[samples]
    k1, k3 = ppo.kl_per_token(lp, lq, "k1"), ppo.kl_per_token(lp, lq, "k3")
    assert k1.mean().item() == pytest.approx(exact, abs=0.01)
    assert k3.mean().item() == pytest.approx(exact, abs=0.01)
    assert (k3 >= 0).all()
    r = lq - lp
    assert torch.allclose(k3, r.exp() - 1 - r)
    for estimator in (None, "k2", "K3"):  # not read as k3
        with pytest.raises(ValueError, match="unknown KL estimator"):
            ppo.kl_per_token(lp, lq, estimator)


def test_adaptive_kl_controller():
    assert ppo.adaptive_kl_coef(0.1, kl=6.0, target=6.0, horizon=10000, n_episodes=100) == pytest.approx(0.1)
    # too much KL raises the coefficient, proportionally to the error, clipped at +-20%, at rate n / horizon
    assert ppo.adaptive_kl_coef(0.1, kl=6.6, target=6.0, horizon=10000, n_episodes=100) == pytest.approx(0.1 * 1.001)
    assert ppo.adaptive_kl_coef(0.1, kl=60, target=6.0, horizon=1000, n_episodes=100) == pytest.approx(0.1 * 1.02)
    assert ppo.adaptive_kl_coef(0.1, kl=0.0, target=6.0, horizon=1000, n_episodes=100) == pytest.approx(0.1 * 0.98)


def test_truncate_after_stop_and_score_index():
    stop, pad = 3, 0
    responses = torch.tensor([[5, 6, 3, 7, 8], [3, 5, 6, 7, 8], [5, 6, 7, 8, 9], [5, 3, 3, 7, 3]])
    out, mask = ppo.truncate_after_stop(responses, stop, pad)
    assert out.tolist() == [[5, 6, 3, 0, 0], [3, 0, 0, 0, 0], [5, 6, 7, 8, 9], [5, 3, 0, 0, 0]]
    assert mask.sum(1).tolist() == [3, 1, 5, 2]
    # the reward is read at the stop token itself (not the token after it, nor the last position)
    query_mask = torch.tensor([[0, 1, 1]] * 4).bool()
    full = torch.cat([query_mask, mask], 1)
    assert ppo.last_token_index(full.long()).tolist() == [5, 3, 7, 4]
    # with pad == stop id, the mask still finds the real EOS
    out, mask = ppo.truncate_after_stop(responses, stop, pad_id=stop)
    assert mask.sum(1).tolist() == [3, 1, 5, 2]


def test_length_groups_cover_every_row_once_near_the_least_padded_cost():
    """The greedy groups against every way of cutting the length-sorted rows, cost written out: rows x (longest prompt
    + longest response) per group, plus the overhead per group. Within 15% of the best cut on small random batches,
    within 3% on batches shaped like the benchmark's long-8k workload."""
    rng = random.Random(0)
    cases = [(n, overhead, 60, 30) for n, overhead in [(7, 0), (7, 10), (8, 40), (6, 10**6), (1, 5)] * 20]
    for n, overhead, max_p, max_r in cases + [(13, 64, 256, 48)] * 3:
        p = torch.tensor([rng.randint(1, max_p) for _ in range(n)])
        r = torch.tensor([rng.randint(1, max_r) for _ in range(n)])
        groups = ppo.length_groups(p, r, overhead)
        assert sorted(torch.cat(groups).tolist()) == list(range(n))
        cost = lambda gs: sum(len(g) * (max(p[g].tolist()) + max(r[g].tolist())) + overhead for g in gs)  # noqa
        order = sorted(range(n), key=lambda i: (p[i] + r[i], p[i]))
        assert [i for g in groups for i in g.tolist()] == order  # consecutive runs of the sorted rows
        best = min(
            cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (n,))])
            for k in range(n)
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert cost([g.tolist() for g in groups]) <= best * (1.03 if n == 13 else 1.15)
        if overhead == 10**6:
            assert len(groups) == 1
    # no overhead: rows of one length form one group, and every group is unpadded
    groups = ppo.length_groups(torch.tensor([5, 9, 5, 9]), torch.tensor([3, 3, 3, 3]), 0)
    assert sorted(sorted(g.tolist()) for g in groups) == [[0, 2], [1, 3]]


# --- sampling ---------------------------------------------------------------------------------------------------------


def sample_prompts(n, seed=0):
    rng = random.Random(seed)  # (varied lengths)
    return common.tokenize_prompts(TOK, [common.embedded_prompt(rng) + " cat" * rng.randint(0, 3) for _ in range(n)])


@pytest.mark.parametrize("arch", ["embedded-llama", "embedded-neox"])
def test_sampler_draws_from_the_learning_distribution_and_does_not_depend_on_batch(arch):
    policy = ppo.embedded_sft_policy(arch, TOK, seed=0, steps=20)
    args = ppo.Args(temperature=0.7, response_length=8)
    prompts = sample_prompts(5)
    query, qmask = ppo.pad_left(prompts, max(map(len, prompts)), TOK.pad_token_id)
    seeds = torch.arange(100, 105)
    raw = ppo.generate(policy, query, qmask, seeds, args, TOK.eos_token_id, TOK.pad_token_id)
    drawn, steps = replayed_samples(policy, query, qmask, raw, seeds, args.temperature, TOK.eos_token_id)
    assert torch.equal(drawn, raw[:, :steps])  # each token: argmax of the learning forward's logits + its noise
    responses, mask = ppo.truncate_after_stop(raw, TOK.eos_token_id, TOK.pad_token_id)
    # each prompt alone (no padding, other batch) samples the same response: streams are per episode
    for i in range(5):
        q = torch.tensor([prompts[i]])
        alone = ppo.generate(
            policy, q, torch.ones_like(q, dtype=torch.bool), seeds[i : i + 1], args, TOK.eos_token_id, TOK.pad_token_id
        )
        alone, alone_mask = ppo.truncate_after_stop(alone, TOK.eos_token_id, TOK.pad_token_id)
        assert alone[0][alone_mask[0]].tolist() == responses[i][mask[i]].tolist()


def test_sampler_draws_softmax_with_each_episodes_own_uniforms_whatever_the_batch():
    """Counter-based uniforms: an episode's is the same alone or in any batch, another at the next step; they fill 64
    bins evenly (chi-square), uncorrelated across steps and consecutive seeds. The tokens drawn with them follow
    softmax(logits) (chi-square, against the probabilities written out here), never a token of weight zero."""
    seeds = torch.tensor([common.seed_of(1, "sampling", e) for e in range(20000)])
    u = ppo.episode_uniform(seeds, 3)
    assert u.dtype == torch.float64 and 0 < u.min() and u.max() < 1
    for i in (0, 17, 63):
        assert torch.equal(ppo.episode_uniform(seeds[i : i + 1], 3), u[i : i + 1])
        assert ppo.episode_uniform(seeds[[i, 5, 2]], torch.tensor(3))[0] == u[i]
    counts, expected = torch.histc(u, bins=64, min=0, max=1), len(u) / 64
    assert ((counts - expected) ** 2 / expected).sum() < 120  # 63 degrees of freedom: P(chi2 > 120) < 1e-4
    z, later = u - 0.5, ppo.episode_uniform(seeds, 4) - 0.5
    for a, b in ((z[1:], z[:-1]), (z, later)):
        assert abs((a * b).mean() / (a.std() * b.std())) < 0.035  # (n = 20k: a null correlation's std is 0.007)
    row = torch.tensor([2.0, 0.5, -float("inf"), 0.0, 1.0, -1.0] * 2)
    logits, p = row[None].expand(len(seeds), -1), row.exp() / row.exp().sum()
    drawn = torch.cat([ppo.sample_tokens(logits[i : i + 5000], seeds[i : i + 5000], 7) for i in range(0, 20000, 5000)])
    assert torch.equal(drawn[[9, 4, 0]], ppo.sample_tokens(logits[:3], seeds[[9, 4, 0]], 7))  # (another batch)
    counts, real = torch.bincount(drawn, minlength=12).double(), p > 0
    assert counts[2] == 0 and counts[8] == 0
    assert ((counts[real] - len(drawn) * p[real]) ** 2 / (len(drawn) * p[real])).sum() < 33  # 9 dof: P < 1e-4


def test_compiled_decode_samples_the_plain_decodes_tokens(monkeypatch):
    """--compile (torch.compile of the one-token step over the static cache; on a CPU no CUDA graph) gives the plain
    path's raw output in float32, every row stopping before STOP_CHECK_EVERY tokens (the tokens sampled after it
    padded), on prompts of varied lengths, twice in a row (the cache reset and reused, not compiled again)."""
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", False)  # (scalar C++: compiled in half the time)
    policy = ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=20).eval()
    args = ppo.Args(temperature=0.7, response_length=20, max_prompt_length=16)
    widths = []
    for first in (0, 6):  # the second rollout's prompts of another width: compiled once all the same
        if first:
            monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        prompts = [p[: len(p) - first // 3] for p in sample_prompts(6, seed=1)]  # (2 tokens shorter)
        query, qmask = ppo.pad_left(prompts, max(map(len, prompts)), TOK.pad_token_id)
        widths.append(query.shape[1])
        seeds = torch.arange(first, first + 6)
        plain = ppo.generate(policy, query, qmask, seeds, args, TOK.eos_token_id, TOK.pad_token_id)
        compiled = ppo.generate(
            policy, query, qmask, seeds, dataclasses.replace(args, compile=True), TOK.eos_token_id, TOK.pad_token_id
        )
        assert torch.equal(compiled, plain), (compiled, plain)
        assert (plain == TOK.eos_token_id).any(1).all() and (plain[:, -1] == TOK.pad_token_id).all()  # (all stop)
    assert widths[0] != widths[1] and max(widths) <= 16
    assert len(ppo.DECODES) == 1 and ppo.DECODES[policy].cache_length == 16 + 20
    del policy
    gc.collect()
    assert len(ppo.DECODES) == 0  # (the model is not kept alive, nor its cache)


# --- training runs ----------------------------------------------------------------------------------------------------

TINY = [
    "--total_episodes",
    "64",
    "--per_device_train_batch_size",
    "4",
    "--num_mini_batches",
    "2",
    "--num_ppo_epochs",
    "2",
    "--sample_every",
    "1",
    "--response_length",
    "12",
]


ESTIMATORS = {  # the default, and two critic-free estimators with the KL in the loss and the other two averages
    "gae": [],
    "rloo": ["--advantage_estimator", "rloo", "--kl_penalty", "loss", "--loss_aggregation", "sequence_mean"],
    "dr-grpo": [
        "--advantage_estimator",
        "grpo",
        "--no_scale_rewards",
        "--kl_penalty",
        "loss",
        "--loss_aggregation",
        "constant",
    ],
}


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory, reward_model_path):
    """Each estimator's run with ptx: the same rollout batch of 16 and mini-batches of 8, split three ways: 4 x 2
    accumulation in one process, 4 x 2 ranks under DDP, 2 x 2 accumulation x 2 ranks under FSDP (it reduce-scatters
    every micro-batch's gradients); the 2-rank runs in one launch. Losses are averages over the whole mini-batch
    (weighted per token as --loss_aggregation says), so every split is one run. rloo's runs take --fused_logits, whose
    output layer FSDP gathers and reduces as its own unit. (8 x 1 against 4 x 2 accumulation in one process: also on
    every decoder family, in test_families.py.)"""
    root, jobs = tmp_path_factory.mktemp("split"), []
    for estimator, flags in ESTIMATORS.items():
        base = [
            "ppo.py",
            "--reward_model_path",
            reward_model_path,
            *TINY,
            *flags,
            *(["--fused_logits"] if estimator == "rloo" else []),
            "--ptx_coef",
            "0.1",
            "--ptx_dataset_name",
            "embedded",
            "--num_evals",
            "1",
            "--num_eval_prompts",
            "5",
        ]
        run_main(base + ["--gradient_accumulation_steps", "2", "--output_dir", str(root / estimator / "one")])
        jobs += [
            base + ["--output_dir", str(root / estimator / "ddp")],
            base
            + [
                "--fsdp",
                "--per_device_train_batch_size",
                "2",
                "--gradient_accumulation_steps",
                "2",
                "--output_dir",
                str(root / estimator / "fsdp"),
            ],
        ]
    run_ranks(jobs, root)
    return root


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_two_process_ddp_and_fsdp_match_one_process(estimator, split_runs):
    tmp_path = split_runs / estimator
    runs = {k: [m for m in read_metrics(tmp_path / k) if "eval/score" not in m] for k in ("one", "ddp", "fsdp")}
    evals = {k: [m for m in read_metrics(tmp_path / k) if "eval/score" in m] for k in ("one", "ddp", "fsdp")}
    assert len(runs["one"]) == 4 and [m["step"] for m in evals["one"]] == [0, 4]
    for key in ("eval/score", "eval/gold", "eval/kl", "eval/length", "eval/score_se"):  # the held-out evaluation too
        whole = [m[key] for m in evals["one"]]
        for k in ("ddp", "fsdp"):
            assert np.allclose([m[key] for m in evals[k]], whole, atol=1e-5, rtol=1e-5), (key, k, evals[k], whole)
    critic = ("loss/value",) if estimator == "gae" else ("loss/kl",)
    assert all((k in runs["one"][0]) == (estimator == "gae") for k in ("loss/value", "val/mean", "val/clipfrac"))
    for key in (
        "objective/scores",
        "objective/kl",
        "gold/mean",
        "loss/policy",
        "loss/ptx",
        "policy/entropy",
        "policy/approxkl",
        "policy/grad_norm",
        *critic,
    ):
        whole = [m[key] for m in runs["one"]]
        for k in ("ddp", "fsdp"):
            assert np.allclose([m[key] for m in runs[k]], whole, atol=1e-5, rtol=1e-5), (key, k, runs[k], whole)
    assert runs["one"][-1]["objective/kl"] != 0  # the policy moved
    assert_saved_models_equal([tmp_path / k for k in runs], "AutoModelForCausalLM")
    for k, run in runs.items():  # the first update logs the peak memory of every rank, once
        ranks = [f"memory/peak_gb_rank{r}" for r in range(1 if k == "one" else 2)]
        assert [m for m in run[0] if m.startswith("memory/")] == ranks and all(run[0][m] > 0.1 for m in ranks)
        assert not any(m.startswith("memory/") for later in run[1:] for m in later)


def test_resume_on_another_number_of_ranks_continues_where_the_episodes_left_off(tmp_path, reward_model_path):
    """Rollout batch 16: 2 ranks cut after 2 updates, resumed on 1 (accumulating 2 micro-batches); 1 rank cut, resumed
    on 2: each of the 64 episodes rolled out once, the linear schedule continued (an update's logged lr, the rate its
    steps used, = lr0 (1 - episodes before it / 64)), the steps rising by one; --resume again, elsewhere: complete."""
    base = ["tests/faults.py", "ppo.py", "--reward_model_path", reward_model_path, *TINY]
    one = ["--gradient_accumulation_steps", "2"]
    for cut, resumed in (("two_cut", "one_resumed"), ("one_cut", "two_resumed")):
        trace = dict(TRACE=str(tmp_path / f"{cut}.trace"))
        proc = run_script(
            base + (one if "one" in cut else []) + ["--save_steps", "2", "--output_dir", str(tmp_path / resumed)],
            check=False,
            nproc=2 if "two" in cut else 1,
            env=dict(STOP_AFTER_SAVE="2", **trace),
        )
        assert proc.returncode == (1 if "two" in cut else 3), proc.stderr[-2000:]
        run_script(
            base + (one if "one" in resumed else []) + ["--resume", "--output_dir", str(tmp_path / resumed)],
            nproc=2 if "two" in resumed else 1,
            env=trace,
        )
        seeds = [
            e
            for r in (0, 1)
            if os.path.exists(f"{trace['TRACE']}.rank{r}")
            for line in open(f"{trace['TRACE']}.rank{r}")
            for e in json.loads(line)
        ]
        assert sorted(seeds) == sorted(common.seed_of(1, "sampling", e) for e in range(64)), cut
        metrics = read_metrics(tmp_path / resumed)
        assert [m["episodes"] for m in metrics] == [16, 32, 48, 64]
        assert [m["step"] for m in metrics] == [1, 2, 3, 4]
        before = [0] + [m["episodes"] for m in metrics[:-1]]  # the episodes done when each update began
        assert np.allclose([m["lr"] for m in metrics], [3e-4 * (1 - e / 64) for e in before])
        again = run_script(
            base + (one if "two" in resumed else []) + ["--resume", "--output_dir", str(tmp_path / resumed)],
            nproc=1 if "two" in resumed else 2,
        )  # on the other number of ranks: finished
        assert "the run is complete" in again.stdout, again.stdout[-2000:]


def test_embedded_sft_policy_is_trained_once_then_read_from_its_cache_file(tmp_path, monkeypatch):
    """The first call trains and writes the cache file, the next reads it (no training): the same weights and the same
    random state left behind, so the run goes on as it would have. Another setting has its own file; a file written by
    other code, or that cannot be read, is trained again and rewritten."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def made(steps=3):
        model = ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=steps)
        return model.state_dict(), torch.get_rng_state()

    def same(a, b):
        return (
            a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and torch.equal(a[1], b[1])
        )

    trained = made()
    files = list((tmp_path / "rlhf").iterdir())
    assert len(files) == 1 and files[0].name.startswith("embedded-llama-") and files[0].suffix == ".pt"
    with monkeypatch.context() as m:
        m.setattr(torch.optim, "AdamW", None)  # any training would fail
        assert same(made(), trained)
    assert not same(made(steps=4), trained) and len(list((tmp_path / "rlhf").iterdir())) == 2
    saved = torch.load(files[0])
    torch.save(dict(saved, key="an earlier version of ppo.py"), files[0])
    assert same(made(), trained) and torch.load(files[0])["key"] == saved["key"]  # trained again
    files[0].write_bytes(b"not a checkpoint")
    assert same(made(), trained) and torch.load(files[0])["key"] == saved["key"]


def test_two_copies_of_the_scripts_that_differ_keep_an_sft_policy_cache_each(tmp_path, monkeypatch):
    """The cache file's name carries the hash of the code: a copy of ppo.py with an edit writes a file of its own, and
    then each copy reads its own file and trains nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    edited = tmp_path / "ppo.py"
    edited.write_text(open(ppo.__file__).read() + "\n# an edit\n")

    def made(script):
        with monkeypatch.context() as m:
            m.setattr(ppo, "__file__", str(script))  # the copy whose code the cache key hashes
            return ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=2).state_dict()

    made(ppo.__file__), made(edited)
    files = list((tmp_path / "cache" / "rlhf").iterdir())
    assert len(files) == 2 and len({torch.load(f)["key"] for f in files}) == 2
    assert all(torch.load(f)["key"][:16] in f.name for f in files)
    with monkeypatch.context() as m:
        m.setattr(torch.optim, "AdamW", None)  # any training would fail
        made(ppo.__file__), made(edited)


def test_embedded_run_improves_gold_score_and_saved_policy_reloads(tmp_path, reward_model_path):
    out = tmp_path / "ppo"
    history = ppo.main(
        ppo.Args(reward_model_path=reward_model_path, output_dir=str(out), total_episodes=1280, sample_every=100)
    )
    results = json.load(open(out / "ppo_results.json"))
    # half the initial spread of the gold score: a run that does not learn moves the mean of 5 x 32 episodes by about
    # 0.05 (0.44 / sqrt(160) per window), a tenth of this margin
    assert results["gold_last"] - results["gold_first"] >= 0.5 * results["gold_std_first"], results
    assert results["proxy_last"] > results["proxy_first"] and results["kl_last"] > 0
    assert os.path.getsize(out / "curves.png") > 1000 and len(history) == 40
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is the caller's again after main

    trained = AutoModelForCausalLM.from_pretrained(out).eval()
    initial = ppo.embedded_sft_policy("embedded-llama", TOK, seed=1)
    prompts = sample_prompts(48, seed=3)
    query, qmask = ppo.pad_left(prompts, max(map(len, prompts)), TOK.pad_token_id)
    golds = {}
    for name, model in (("trained", trained), ("initial", initial)):
        r = ppo.generate(model, query, qmask, torch.arange(48), ppo.Args(), TOK.eos_token_id, TOK.pad_token_id)
        r, m = ppo.truncate_after_stop(r, TOK.eos_token_id, TOK.pad_token_id)
        golds[name] = np.mean(
            [
                common.gold_reward(TOK.decode(q[qm]), TOK.decode(x[k & (x != TOK.eos_token_id)]))
                for q, qm, x, k in zip(query, qmask, r, m)
            ]
        )
    assert golds["trained"] > golds["initial"] + 0.2, golds


@pytest.mark.parametrize(
    "estimator",
    [{}, dict(advantage_estimator="grpo", kl_penalty="loss", loss_aggregation="sequence_mean")],
    ids=["gae", "grpo"],
)
def test_resume_after_interruption_reproduces_uninterrupted_run(estimator, tmp_path, reward_model_path, monkeypatch):
    args = dict(
        reward_model_path=reward_model_path,
        total_episodes=96,
        per_device_train_batch_size=4,
        num_mini_batches=2,
        num_ppo_epochs=2,
        save_steps=4,
        target_kl=0.5,
        kl_horizon=100,
        **estimator,
    )
    ppo.main(ppo.Args(output_dir=str(tmp_path / "full"), **args))
    real_save = common.commit_checkpoint

    def save_then_crash(root, name, state, keep=2):
        real_save(root, name, state, keep)
        if state["step"] == 8:
            raise KeyboardInterrupt

    monkeypatch.setattr(common, "commit_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        ppo.main(ppo.Args(output_dir=str(tmp_path / "cut"), **args))
    monkeypatch.setattr(common, "commit_checkpoint", real_save)
    shutil.copytree(tmp_path / "cut", tmp_path / "short")
    ppo.main(ppo.Args(output_dir=str(tmp_path / "cut"), resume=True, **args))

    def strip(ms):
        return [{k: v for k, v in m.items() if not k.startswith(("perf/", "memory/"))} for m in ms]

    full, cut = strip(read_metrics(tmp_path / "full")), strip(read_metrics(tmp_path / "cut"))
    assert len(full) == 12 and cut == full
    samples = [open(tmp_path / k / "samples.jsonl").read() for k in ("full", "cut")]
    assert samples[0] == samples[1]  # no rows written twice by the resumed run
    assert full[-1]["kl_coef"] != full[0]["kl_coef"]  # the adaptive controller's state was resumed too
    saved = read_checkpoint(common.latest_checkpoint(tmp_path / "cut"))["model"]
    assert any(k.startswith("critic.") for k in saved) == (not estimator)  # without GAE no critic, nor its state
    # resumed with a total the checkpoint (update 8) has passed: the checkpoint's policy is saved, the log closed
    ppo.main(ppo.Args(output_dir=str(tmp_path / "short"), resume=True, **dict(args, total_episodes=48)))
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "short").state_dict()
    at_8 = read_checkpoint(common.latest_checkpoint(tmp_path / "short"))["model"]
    assert all(torch.equal(policy[k.removeprefix("policy.")], v) for k, v in at_8.items() if k.startswith("policy."))
    assert strip(read_metrics(tmp_path / "short")) == full[:8]
    # the finished run, resumed again: nothing to do, nothing rewritten
    before = {f: os.path.getmtime(tmp_path / "cut" / f) for f in os.listdir(tmp_path / "cut")}
    assert ppo.main(ppo.Args(output_dir=str(tmp_path / "cut"), resume=True, **args)) is None
    assert before == {f: os.path.getmtime(tmp_path / "cut" / f) for f in os.listdir(tmp_path / "cut")}


def test_a_killed_or_stopped_rank_ends_the_job_and_its_checkpoint_resumes_on_one_process(tmp_path):
    """kill -9 one of 2 FSDP ranks after their first checkpoint (written in shards by both): torchrun ends the whole job
    within a minute (no rank left waiting in a collective). A cluster's SIGTERM reaching one of 2 DDP ranks: every rank
    stops after the same update (they agree in a collective, so none waits for the other), they save a checkpoint
    together and exit 143 without a traceback, the one line on how to resume last. Each checkpoint resumes in one
    process, and the run ends as the uninterrupted one-process run does."""
    base = [
        "--reward_fn",
        "common:gold_rewards",
        *TINY,
        "--total_episodes",
        "128",
        "--gradient_accumulation_steps",
        "2",
        "--num_evals",
        "0",
    ]
    jobs = {}
    for cut, flags in (("killed", ["--fsdp", "--save_steps", "2"]), ("stopped", [])):
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(29500 + (os.getpid() + 7) % 1000),
            "--log-dir",
            str(tmp_path / f"{cut}-logs"),
            "--redirects",
            "3",
        ]
        job = subprocess.Popen(
            launcher
            + ["ppo.py", *base, "--per_device_train_batch_size", "2", *flags, "--output_dir", str(tmp_path / cut)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        ready = tmp_path / cut / ("checkpoints/latest" if cut == "killed" else "metrics.jsonl")
        deadline = time.time() + 300
        while not (ready.exists() and ready.read_text()) and job.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        assert job.poll() is None, "the run ended before it could be signalled"
        workers = open(f"/proc/{job.pid}/task/{job.pid}/children").read().split()
        rank1 = next(
            p for p in workers if b"RANK=1\0" in open(f"/proc/{p}/environ", "rb").read().replace(b"LOCAL_RANK=1\0", b"")
        )
        sent = time.time()
        os.kill(int(rank1), signal.SIGKILL if cut == "killed" else signal.SIGTERM)
        job.wait(timeout=120)
        assert job.returncode != 0 and time.time() - sent < 60 and not (tmp_path / cut / "model.safetensors").exists()
        jobs[cut] = common.load_latest_checkpoint(tmp_path / cut)["step"]
    assert 1 <= jobs["stopped"] < 8
    for rank in (0, 1):  # torchrun reports its workers' exit codes in its own error file
        stderr = next((tmp_path / "stopped-logs").rglob(f"attempt_0/{rank}/stderr.log")).read_text()
        assert "Traceback" not in stderr, stderr[-3000:]
    last = next((tmp_path / "stopped-logs").rglob("attempt_0/0/stderr.log")).read_text().strip().splitlines()[-1]
    assert last.startswith(f"stopped by SIGTERM after step {jobs['stopped']}") and "--resume" in last, last
    for folder, resume in (
        (tmp_path / "killed", ["--resume"]),
        (tmp_path / "stopped", ["--resume"]),
        (tmp_path / "one", []),
    ):  # in this process: no imports to wait for
        run_main(["ppo.py", *base, *resume, "--output_dir", str(folder)])
    runs = {k: read_metrics(tmp_path / k) for k in ("one", "killed", "stopped")}
    for cut in ("killed", "stopped"):
        assert [m["step"] for m in runs[cut]] == list(range(1, 9))
        for key in ("objective/scores", "objective/kl", "loss/policy", "loss/value", "policy/grad_norm"):
            # the updates before the stop ran on 2 ranks, which sum in another order than one process: 1e-7
            # differences that the KL, a sum over tokens, carries to ~1e-4 (a replayed or skipped episode: far more)
            assert np.allclose([m[key] for m in runs[cut]], [m[key] for m in runs["one"]], atol=1e-5, rtol=1e-3), key
    assert_saved_models_equal([tmp_path / k for k in runs], "AutoModelForCausalLM")


def test_gradient_checkpointing_changes_no_number(tmp_path, reward_model_path):
    args = dict(
        reward_model_path=reward_model_path,
        total_episodes=32,
        per_device_train_batch_size=4,
        num_mini_batches=2,
        num_ppo_epochs=2,
        response_length=8,
        ptx_coef=0.1,
        ptx_dataset_name="embedded",
    )
    for name in ("plain", "recomputed"):
        ppo.main(ppo.Args(output_dir=str(tmp_path / name), gradient_checkpointing=name == "recomputed", **args))
    plain, recomputed = (
        [
            {k: v for k, v in m.items() if not k.startswith(("perf/", "memory/"))}  # (the process's)
            for m in read_metrics(tmp_path / k)
        ]
        for k in ("plain", "recomputed")
    )
    assert len(plain) == len(recomputed) == 4
    assert all(a == pytest.approx(b, abs=1e-6, rel=1e-6) for a, b in zip(plain, recomputed)), (plain, recomputed)
    assert plain[-1]["policy/approxkl"] > 0


def test_neox_policy_with_chat_template_prompts_and_ptx(tmp_path, reward_model_path):
    rng = random.Random(0)
    prompts = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": [{"role": "user", "content": "tell me about " + rng.choice(list(common.TOPICS))}]}
            for _ in range(64)
        ],
    )
    run_main(
        [
            "ppo.py",
            "--sft_model_path",
            "embedded-neox",
            "--reward_model_path",
            reward_model_path,
            "--dataset_name",
            prompts,
            "--critic_init",
            "policy",
            "--ptx_coef",
            "0.1",
            "--ptx_dataset_name",
            "embedded",
            "--kl_estimator",
            "k3",
            "--missing_eos_penalty",
            "1.0",
            *TINY,
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    samples = [json.loads(line) for line in open(tmp_path / "out" / "samples.jsonl")]
    assert samples[0]["prompt"].endswith("user: tell me about " + samples[0]["prompt"].split()[-2] + " assistant:")
    assert all(m["objective/kl"] >= 0 for m in read_metrics(tmp_path / "out"))  # k3 is non-negative


def test_missing_eos_penalty_lowers_scores_by_penalty_times_missing_rate(tmp_path, reward_model_path):
    base = dict(
        reward_model_path=reward_model_path, total_episodes=16, per_device_train_batch_size=8, response_length=4
    )
    for name, flags in (("a", {}), ("b", dict(missing_eos_penalty=10)), ("none", dict(stop_token="none"))):
        ppo.main(ppo.Args(output_dir=str(tmp_path / name), **flags, **base))
    a, b, none = (read_metrics(tmp_path / k)[0] for k in ("a", "b", "none"))
    assert a["response/eos_rate"] < 1
    assert "response/eos_rate" not in none and none["response/length"] == 4  # --stop_token none: no response stops
    assert b["objective/scores"] == pytest.approx(a["objective/scores"] - 10 * (1 - a["response/eos_rate"]), abs=1e-4)


def test_missing_reward_model_and_unknown_stop_token_are_clear_errors(tmp_path, reward_model_path):
    proc = run_script(["ppo.py", "--reward_model_path", str(tmp_path / "nothing")], check=False)
    assert proc.returncode == 2 and "python rm.py --output_dir" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_main(["ppo.py", "--reward_model_path", reward_model_path, "--stop_token", "<nope>"], check=False)
    assert proc.returncode == 2 and "--stop_token '<nope>' is not a token" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_ptx_loss_of_a_left_padded_batch_is_the_mean_over_real_transitions():
    policy = ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=5)
    seqs = [[2, 4, 6, 20, 21, 3], [2, 30, 3], [4, 40, 41, 42, 43, 44, 3]]
    n = sum(len(s) - 1 for s in seqs)
    with torch.no_grad():
        batch = ppo.language_modelling_loss(policy, seqs, TOK.pad_token_id, n, "cpu")
        alone = [
            torch.nn.functional.cross_entropy(
                policy(input_ids=torch.tensor([s])).logits[0, :-1], torch.tensor(s[1:]), reduction="sum"
            )
            for s in seqs
        ]
    assert batch.item() == pytest.approx(sum(alone).item() / n, rel=1e-5)


def test_num_evals_counts_the_evaluations_after_the_one_before_training_and_says_when_they_are_too_many(capsys):
    """--num_evals N: N evaluations spread over training, the last at its end, and one before it: N + 1 in all. More
    than the updates gives one after each update, said in one line, as rm.py says it."""
    assert ppo.eval_schedule(5, 10) == {0, 2, 4, 6, 8, 10} and capsys.readouterr().out == ""
    assert ppo.eval_schedule(0, 10) == set()
    assert ppo.eval_schedule(5, 3) == {0, 1, 2, 3}
    assert capsys.readouterr().out == "--num_evals 5: 3, one after each of the 3 updates, and one before\n"
    assert ppo.eval_schedule(5, 3, rank=1) == {0, 1, 2, 3} and capsys.readouterr().out == ""
    with pytest.raises(SystemExit):
        tyro.cli(next(c for c in ppo.Args.__mro__ if c.__module__ == "ppo"), args=["--help"], use_underscores=True)
    assert "plus one before it: N + 1 in all" in " ".join(capsys.readouterr().out.replace("│", " ").split())


def test_a_response_length_that_fills_the_position_table_is_refused_in_one_line():
    """The default --max_prompt_length: what a position table leaves after --response_length; none left is refused."""
    args = ppo.Args(response_length=16)
    ppo.fill_defaults(args, position_limit=20)
    assert args.max_prompt_length == 4
    with pytest.raises(common.UserError, match="--response_length 16 leaves no room for a prompt in the 16 positions"):
        ppo.fill_defaults(ppo.Args(response_length=16), position_limit=16)


@pytest.mark.parametrize(
    "flags,expected",
    [
        (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size 0: must be at least 1"),
        (["--learning_rate", "-1"], "--learning_rate -1.0: must be a finite number >= 0"),
        (["--ptx_coef", "0.5"], "--ptx_coef 0.5 needs --ptx_dataset_name"),
        (["--reward_fn", "nonexistent_module_xyz:f"], "--reward_fn nonexistent_module_xyz:f: cannot import"),
        (["--compile", "--fsdp"], "--compile compiles the decode of a whole model; --fsdp shards it: drop one of them"),
        (
            ["--advantage_estimator", "grpo", "--num_samples_per_prompt", "1"],
            "--num_samples_per_prompt 1: "
            "--advantage_estimator grpo compares each response with the others to its prompt; it needs at least 2",
        ),
        (
            ["--advantage_estimator", "rloo", "--num_samples_per_prompt", "1"],
            "--num_samples_per_prompt 1: --advantage_estimator rloo compares",
        ),
        (["--no_scale_rewards"], "--no_scale_rewards is grpo's (Dr. GRPO)"),
        (
            ["--advantage_estimator", "grpo", "--num_samples_per_prompt", "3", "--reward_fn", "common:gold_rewards"],
            "--num_samples_per_prompt 3: must divide the rollout batch (32 episodes)",
        ),
        (
            ["--sft_model_path", "embedded-gpt", "--reward_fn", "common:gold_rewards"],
            "--sft_model_path embedded-gpt: unknown embedded model",
        ),
        (["--stop_token", "none", "--missing_eos_penalty", "1.0"], "--missing_eos_penalty needs a stop token"),
    ],
)
def test_bad_flags_are_one_line_errors_before_anything_is_written(tmp_path, flags, expected):
    out = tmp_path / "out"  # (the first in a process as a user runs it; the others through its entry point, here)
    proc = (run_script if "0" in flags else run_main)(["ppo.py", "--output_dir", str(out), *flags], check=False)
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_reward_function_that_pays_for_a_word_makes_ppo_say_it(tmp_path):
    (tmp_path / "pay_for_owl.py").write_text(
        "def reward(prompts, responses):\n    return [float(r.split().count('owl')) for r in responses]\n"
    )
    history = ppo.main(
        ppo.Args(
            reward_fn=str(tmp_path / "pay_for_owl.py") + ":reward",
            output_dir=str(tmp_path / "o"),
            total_episodes=1024,
            sample_every=100,
            kl_coef=0.02,
            learning_rate=1e-3,
        )
    )
    first, last = history[0]["objective/scores"], np.mean([h["objective/scores"] for h in history[-4:]])
    assert first < 0.5 and last > 2.0, (first, last)  # from under one 'owl' per response to several


@pytest.mark.parametrize(
    "body,expected",
    [
        ("def reward(p, r):\n    raise ValueError('no answer key')\n", "raised ValueError: no answer key"),
        ("def reward(p, r):\n    return ['good'] * len(p)\n", "returned 'good'; it must return one finite number"),
        ("def reward(p, r):\n    return [1.0]\n", "returned 1 values for 32 episodes"),
        ("def reward(p, r):\n    return [float('nan')] * len(p)\n", "returned nan"),
    ],
)
def test_reward_function_errors_name_the_function(tmp_path, body, expected, capsys):
    (tmp_path / "bad_reward.py").write_text(body)
    spec = str(tmp_path / "bad_reward.py") + ":reward"
    argv = ["--reward_fn", spec, "--total_episodes", "32", "--output_dir", str(tmp_path / "o")]
    if "raise" in body:  # as a user runs it: a process of its own
        proc = run_script(["ppo.py", *argv], check=False)
        code, stderr = proc.returncode, proc.stderr
    else:  # the same entry point in this process (a process costs seconds of imports)
        with pytest.raises(SystemExit) as exit_:
            common.exit_on_user_error(ppo.main, tyro.cli(ppo.Args, args=argv, use_underscores=True))
        code, stderr = exit_.value.code, capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    if "raise" in body:  # the user's own code: its traceback, from the function in (none of ppo.py's frames)
        assert 'bad_reward.py", line 2, in reward' in stderr and 'ppo.py", line' not in stderr, stderr[-2000:]
    else:
        assert "Traceback" not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]  # (under the progress bar: the function ran during the first update)
    assert last.startswith("error: ") and f"--reward_fn {spec} {expected}" in last, last


def test_a_reward_function_that_raises_mid_run_leaves_a_folder_that_resume_continues(tmp_path, capsys, monkeypatch):
    """--reward_fn raising in the third update: its traceback, exit 2, and the folder as a rerun expects it (the
    checkpoint of update 2, the log still open): a rerun without --resume stops in one line, and --resume with the
    function fixed continues from update 2, each update logged once."""
    (tmp_path / "flaky.py").write_text(
        "import os\n\ncalls = 0\n\n\ndef reward(prompts, responses):\n    global calls\n    calls += 1\n"
        "    if calls == int(os.environ.get('FAIL_AT_CALL', 0)):\n        raise KeyError('answer')\n"
        "    return [float(len(r.split())) for r in responses]\n"
    )
    out = tmp_path / "out"
    argv = [
        "--reward_fn",
        f"{tmp_path / 'flaky.py'}:reward",
        *TINY,
        "--total_episodes",
        "32",
        "--save_steps",
        "1",
        "--output_dir",
        str(out),
    ]

    def run(*flags):  # the scripts' entry point, in this process (a process costs seconds of imports)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            common.exit_on_user_error(ppo.main, tyro.cli(ppo.Args, args=argv + list(flags), use_underscores=True))
        return exit_.value.code, capsys.readouterr().err

    monkeypatch.setenv("FAIL_AT_CALL", "3")
    code, err = run()
    assert (
        code == 2
        and 'flaky.py", line 10, in reward' in err
        and err.strip().splitlines()[-1].startswith("error: --reward_fn")
    ), err[-2000:]
    assert common.load_latest_checkpoint(out)["step"] == 2 and [m["step"] for m in read_metrics(out)] == [1, 2]
    monkeypatch.delenv("FAIL_AT_CALL")
    code, err = run()
    assert code == 2 and "holds checkpoints: pass --resume" in err, err[-2000:]
    ppo.main(tyro.cli(ppo.Args, args=argv + ["--resume"], use_underscores=True))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]


def test_the_critic_reads_values_in_evaluation_mode_and_learns_in_training_mode(tmp_path, monkeypatch):
    """logprobs_and_values() reads the values with the critic in evaluation mode after every update, as the policy
    samples in it; learn() trains both in training mode. (With the gold reward, the critic at its own learning rate.)"""
    modes, real_values, real_learn = [], ppo.logprobs_and_values, ppo.learn

    monkeypatch.setattr(
        ppo,
        "logprobs_and_values",
        lambda policy, ref, critic, *a, **k: (
            modes.append(("values", critic.training)) or real_values(policy, ref, critic, *a, **k)
        ),
    )
    monkeypatch.setattr(
        ppo,
        "learn",
        lambda policy, critic, *a, **k: (
            modes.append(("learn", policy.training and critic.training)) or real_learn(policy, critic, *a, **k)
        ),
    )
    history = ppo.main(
        ppo.Args(
            reward_fn="common:gold_rewards", critic_learning_rate=1e-4, total_episodes=96, output_dir=str(tmp_path)
        )
    )
    assert modes == [("values", False), ("learn", True)] * 3
    assert all(m["objective/scores"] == pytest.approx(m["gold/mean"], abs=1e-5) for m in read_metrics(tmp_path))
    assert len(history) == 3 and os.path.getsize(tmp_path / "curves.png") > 10_000


@pytest.mark.parametrize(
    "run,expected",
    [
        (
            {},
            [
                "policy embedded-llama (trained, ",
                "reference a frozen copy of the initial policy",
                "reward model {rm} (frozen)",
                "critic from the reward model (trained, ",
            ],
        ),
        (
            {"lora_r": 4},
            [
                "policy embedded-llama (trained, ",
                ", LoRA rank 4)",
                "reference the policy with its adapter off",
                "reward model {rm} (frozen, the critic with its adapter off)",
                "critic from the reward model",
            ],
        ),
        (
            {"reward_fn": "common:gold_rewards", "reward_model_path": None},
            [
                "reference a frozen copy of the initial policy",
                "reward function common:gold_rewards",
                "critic from the policy, with a new head (trained, ",
            ],
        ),
        ({"advantage_estimator": "grpo"}, ["reward model {rm} (frozen)", "critic none (grpo learns no values)"]),
    ],
    ids=["default", "lora", "reward_fn", "grpo"],
)
def test_build_models_names_each_of_the_four_roles_at_start_up(run, expected, reward_model_path, capsys):
    """build_models prints one line that names what policy, reference, reward and critic are in this run."""
    args = ppo.Args(**{"reward_model_path": reward_model_path, **run})
    ppo.fill_defaults(args, ppo.position_limit(args))
    ppo.build_models(args, ppo.load_tokenizer(args), torch.device("cpu"), 0, 1)
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("models: ")]
    assert [line.count(f"; {role} ") for role in ("reference", "reward", "critic")] == [1, 1, 1], line
    assert line.startswith("models: policy ") and line.endswith("; 1 x cpu"), line
    for part in expected:
        assert part.format(rm=reward_model_path) in line, line


def test_seed_streams_are_independent_across_seeds():
    """Seed s + 1 replays neither seed s's next epoch (prompt order) nor its episodes (sampling): independent runs."""
    orders = {}
    first = ppo.episode_prompts(range(0, 64), 64, seed=1, orders=orders)
    second_epoch = ppo.episode_prompts(range(64, 128), 64, seed=1, orders=orders)
    next_seed = ppo.episode_prompts(range(0, 64), 64, seed=2, orders={})
    assert sorted(first) == sorted(second_epoch) == list(range(64))
    assert next_seed != second_epoch and next_seed != first
    seeds = {common.seed_of(s, "sampling", e) for s in range(20) for e in range(200)}
    assert len(seeds) == 20 * 200  # no two (seed, episode) share a stream


def test_an_empty_prompt_without_bos_is_named(tmp_path, monkeypatch):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "User: tell me about animals Assistant:"}\n{"prompt": ""}\n')
    assert common.leading_id(TOK) is None  # the embedded tokenizer adds no BOS
    with pytest.raises(common.UserError, match=r"prompts.jsonl: line 2: the prompt is empty and .* adds no BOS"):
        ppo.load_prompts(ppo.Args(dataset_name=str(path), max_prompt_length=256), TOK)
    monkeypatch.setattr(common, "embedded_prompt", lambda rng, split="train": "")
    monkeypatch.setattr(common, "embedded_split", functools.cache(common.embedded_split.__wrapped__))  # drawn anew
    with pytest.raises(common.UserError, match=r"^embedded: row 0: the prompt is empty"):
        ppo.load_prompts(ppo.Args(max_prompt_length=256), TOK)


def test_fused_logits_give_the_plain_paths_log_probs_entropies_and_gradients(monkeypatch):
    """--fused_logits computes response log-probs and entropies block by block (FusedLogprobs): the plain path's
    (response_logprobs) numbers and gradients, in blocks of at most FUSED_BLOCK (ragged at both ends), each computed
    once forward and once backward; with an output layer whose bias is -inf
    at two tokens (0 log 0 = 0: no NaN), where the temperature divides the logits, and without one, where it divides
    the hidden states. The plain path's numbers are the formula written out on the model's own logits at 0.7; the
    entropy without a graph in one vocabulary-wide buffer (p's own)."""
    policy = ppo.output_layer_in_float32(ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=5))
    prompts = sample_prompts(4)
    query, qmask = ppo.pad_left(prompts, max(map(len, prompts)), TOK.pad_token_id)
    responses = torch.randint(20, len(TOK), (4, 7), generator=torch.Generator().manual_seed(0))
    qr, qr_mask = torch.cat([query, responses], 1), torch.cat([qmask, torch.ones_like(responses, dtype=torch.bool)], 1)
    blocks, real = [], ppo.layer_blocks
    monkeypatch.setattr(ppo, "layer_blocks", lambda *a: ((*b[:3], blocks.append(b[3].shape) or b[3]) for b in real(*a)))
    monkeypatch.setattr(ppo, "FUSED_BLOCK", (5, 37))  # 28 tokens in blocks of 5, the vocabulary in blocks of 37
    bias = torch.zeros(len(TOK)).index_fill(0, torch.tensor([3, 7]), -torch.inf)
    for with_bias in (False, True):
        policy.lm_head.bias = torch.nn.Parameter(bias.clone()) if with_bias else None
        results = {}
        for fused in (False, True):
            policy.zero_grad()
            blocks.clear()
            logprobs, entropy = ppo.response_logprobs(
                policy, qr, qr_mask.long(), query.shape[1], 0.7, entropy=True, fused=fused
            )
            (logprobs.sum() + entropy.sum()).backward()
            results[fused] = logprobs.detach(), entropy.detach(), *[p.grad.clone() for p in policy.parameters()]
        n_blocks = -(-4 * 7 // 5) * -(-len(TOK) // 37)  # each block once forward, once backward
        assert len(blocks) == 2 * n_blocks and max(b[0] * b[1] for b in blocks) <= 5 * 37, blocks
        for plain, fused in zip(results[False], results[True]):
            assert torch.allclose(plain, fused, atol=1e-6, rtol=1e-5), (plain - fused).abs().max()
        with torch.no_grad():
            logp = torch.log_softmax(
                policy(input_ids=qr, attention_mask=qr_mask.long()).logits[:, query.shape[1] - 1 : -1] / 0.7, -1
            )
            no_grad = [
                ppo.response_logprobs(policy, qr, qr_mask.long(), query.shape[1], 0.7, entropy=True, fused=f)[1]
                for f in (False, True)
            ]  # (without a graph: another formula)
        assert torch.allclose(results[False][0], logp.gather(-1, responses[..., None])[..., 0], atol=1e-5)
        assert all(torch.isfinite(g).all() for g in results[True][2:])
        assert (logp[..., 3] == -float("inf")).all() == with_bias
        for entropy in (results[False][1], *no_grad):
            assert torch.allclose(entropy, -torch.xlogy(logp.exp(), logp.exp()).sum(-1), atol=1e-5)
    policy.lm_head.__class__ = torch.nn.Linear  # (as a layer LoRA adapts: not one computed in float32)
    with pytest.raises(common.UserError, match="--fused_logits: the output layer is a Linear, not a linear layer"):
        ppo.response_logprobs(policy, qr, qr_mask.long(), query.shape[1], 0.7, fused=True)
    with torch.no_grad(), torch.profiler.profile(profile_memory=True) as prof:  # no graph: one vocabulary-wide buffer
        ppo.entropy_of(logp)
    assert sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0) < 1.5 * logp.nbytes


def test_fused_logits_hold_no_tensor_of_the_micro_batchs_logits():
    """At a vocabulary of 20,000 and 384 response tokens, the plain path allocates the [tokens, vocabulary] float32
    logits (30 MB) in one piece, and --fused_logits nothing of even a quarter of it, forward and backward; a model's
    own weights' gradient (5 MB) is its largest. Without a graph, neither."""
    config = common.embedded_model_config("embedded-llama", 20_000)
    torch.manual_seed(0)
    policy = ppo.output_layer_in_float32(AutoModelForCausalLM.from_config(config))
    ids = torch.randint(20, 20_000, (4, 100), generator=torch.Generator().manual_seed(0))
    logits_bytes = 4 * 96 * 20_000 * 4
    for fused in (False, True):
        with torch.profiler.profile(profile_memory=True) as prof:
            logprobs, entropy = ppo.response_logprobs(
                policy, ids, torch.ones_like(ids), 4, 0.7, entropy=True, fused=fused
            )
            (logprobs.sum() + entropy.sum()).backward()
        largest = max(e.self_cpu_memory_usage for e in prof.events())
        assert (largest >= logits_bytes) if not fused else (largest < logits_bytes / 4), (fused, largest)
    with torch.no_grad(), torch.profiler.profile(profile_memory=True) as prof:
        ppo.response_logprobs(policy, ids, torch.ones_like(ids), 4, 0.7, fused=True)
    assert max(e.self_cpu_memory_usage for e in prof.events()) < logits_bytes / 4


def test_a_model_whose_output_transform_is_unknown_is_named_before_training(monkeypatch):
    policy = ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=1)
    ppo.check_output_logits(policy, "--sft_model_path", "embedded-llama")  # a plain output layer: reproduced
    monkeypatch.setattr(ppo, "output_logits", lambda m, h, t=1.0: m.get_output_embeddings()(h) * 2)
    with pytest.raises(common.UserError, match="does not reproduce this model's logits .* add it there"):
        ppo.check_output_logits(policy, "--sft_model_path", "embedded-llama")


def test_total_episodes_that_are_not_whole_rollout_batches_are_said(capsys, tmp_path):
    for total, said in (
        (100, "--total_episodes 100: 96 trained, whole rollout batches of 32 (the nearest to train all: 96 or 128)"),
        (96, None),
    ):
        ppo.fill_defaults(args := ppo.Args(total_episodes=total, output_dir=str(tmp_path / str(total))), None)
        ppo.start_up(args, 0, 1)  # (main's first step, before anything is loaded)
        out = capsys.readouterr().out
        assert (said in out) if said else "--total_episodes" not in out, out


# --- defects: each test failed before its fix ------------------------------------------------------------------------
def test_a_reward_model_with_its_own_tokens_reads_within_its_position_table(family_dir, monkeypatch):
    """An encoder reward model with its own tokenizer: a prompt and response that, in its tokens, overflow its learned
    position table are cut to fit it (the prompt keeps its end and [CLS]; the response whole), not read past it."""
    path = family_dir("bert")
    rm_tokenizer = AutoTokenizer.from_pretrained(path)
    reward = ppo.Reward(
        model=ppo.SequenceReward(AutoModelForSequenceClassification.from_pretrained(path), 0.0, 1.0),
        tokenizer=rm_tokenizer,
    )
    prompt = "User: tell me about foods such as pear and rice and honey and soup and bread Assistant:"
    query = torch.tensor(common.tokenize_prompts(TOK, [prompt]))
    responses = torch.tensor(common.tokenize_responses(TOK, [prompt], [" cat dog red blue"]))
    ids = torch.cat([query, responses], 1)
    batch = ppo.Rollout(ids, torch.ones_like(ids), query.shape[1], torch.ones_like(responses, dtype=torch.bool))
    args = ppo.Args(max_prompt_length=64)
    (whole,), (whole_mask,) = ppo.reward_model_tokens(batch, torch.arange(1), TOK.eos_token_id, TOK, reward, args)
    full = whole[whole_mask.bool()].tolist()
    monkeypatch.setattr(common, "position_table", lambda model: len(full) - 5)
    (cut,), (cut_mask,) = ppo.reward_model_tokens(batch, torch.arange(1), TOK.eos_token_id, TOK, reward, args)
    cut = cut[cut_mask.bool()].tolist()
    assert len(cut) == len(full) - 5 and cut[0] == full[0] == rm_tokenizer.cls_token_id and cut[-10:] == full[-10:]


def test_grad_norms_are_each_models_own_before_clipping_averaged_over_the_updates_steps(tmp_path, monkeypatch):
    """policy/grad_norm is the policy's gradient norm, critic/grad_norm the critic's, each before the joint clip: here
    3 and 4 (the joint norm 5, clipped to 1). The update logs their mean over its optimizer steps."""
    trainable = torch.nn.ModuleDict(
        {"policy": torch.nn.Linear(1, 1, bias=False), "critic": torch.nn.Linear(1, 1, bias=False)}
    )
    optimizer = torch.optim.SGD(trainable.parameters(), lr=0.0)
    trainable["policy"].weight.grad, trainable["critic"].weight.grad = torch.tensor([[3.0]]), torch.tensor([[4.0]])
    norms = ppo.clip_and_step(trainable, optimizer, 1.0, 0, torch.tensor(0.0))
    assert norms == {"policy/grad_norm": pytest.approx(3.0), "critic/grad_norm": pytest.approx(4.0)}
    seen, real, leading, real_leading = [], ppo.clip_and_step, [], common.leading_id
    monkeypatch.setattr(ppo, "clip_and_step", lambda *a: seen.append(real(*a)) or seen[-1])
    monkeypatch.setattr(common, "leading_id", lambda tokenizer: leading.append(1) or real_leading(tokenizer))
    ppo.main(ppo.Args(reward_fn="common:gold_rewards", total_episodes=32, output_dir=str(tmp_path)))
    m = read_metrics(tmp_path)[0]
    assert len(leading) == 1  # the prompts' leading token: found once per run
    assert len(seen) == 8 and len({s["policy/grad_norm"] for s in seen}) == 8
    for name in ("policy/grad_norm", "critic/grad_norm"):
        assert m[name] == pytest.approx(sum(s[name] for s in seen) / len(seen), rel=1e-6)


def test_every_schedule_of_transformers_is_taken_or_refused_in_one_line(tmp_path, capsys):
    """--lr_scheduler_type: those of transformers' SchedulerType that get_scheduler builds and steps without a metric
    or arguments of their own set the learning rate as transformers computes it; the rest are refused by the command
    line, which lists the choices."""
    for kind in SchedulerType:
        try:
            args = tyro.cli(
                ppo.Args,
                args=["--lr_scheduler_type", kind.value, "--reward_fn", "common:gold_rewards"],
                use_underscores=True,
            )
        except SystemExit as e:
            assert e.code == 2 and "linear" in capsys.readouterr().err
            assert kind.value in (
                "reduce_lr_on_plateau",
                "greedy",
                "cosine_with_min_lr",
                "cosine_warmup_with_min_lr",
                "warmup_stable_decay",
            ), kind  # (a metric to step on, or arguments of their own)
            continue
        ppo.check_args(args)
        ppo.fill_defaults(args, None)
        _, optimizer, scheduler = ppo.build_optimizer(torch.nn.Linear(2, 1), None, args, 10)
        lr = optimizer.param_groups[0]["initial_lr"]
        expected = get_scheduler(kind.value, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr), 0, 10)
        for _ in range(3):
            optimizer.step()
            scheduler.step()
            expected.optimizer.step()
            expected.step()
        assert scheduler.get_last_lr() == pytest.approx(expected.get_last_lr()), kind


def test_the_opt_in_speed_paths_give_the_plain_paths_run(tmp_path, monkeypatch):
    """--group_by_length (here a group per length: the most trimming) with --fused_logits (here in blocks of 3 tokens
    x 50 vocabulary rows): the same updates as the plain path, the same saved policy."""
    base = dict(reward_fn="common:gold_rewards", total_episodes=32, num_ppo_epochs=2, sample_every=1)
    ppo.main(ppo.Args(output_dir=str(tmp_path / "plain"), **base))
    monkeypatch.setattr(ppo, "GROUP_OVERHEAD_TOKENS", 0)
    monkeypatch.setattr(ppo, "FUSED_BLOCK", (3, 50))
    groups, real = [], ppo.length_grouped
    monkeypatch.setattr(ppo, "length_grouped", lambda *a: groups.append(len(real(*a))) or real(*a))
    ppo.main(ppo.Args(output_dir=str(tmp_path / "fast"), group_by_length=True, fused_logits=True, **base))
    assert max(groups) > 1  # (rows of several lengths: trimmed groups)
    plain, fast = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "fast")
    for key in (
        "objective/scores",
        "objective/kl",
        "loss/policy",
        "loss/value",
        "policy/entropy",
        "policy/approxkl",
        "policy/grad_norm",
        "critic/grad_norm",
    ):
        assert [m[key] for m in fast] == pytest.approx([m[key] for m in plain], abs=1e-5, rel=1e-5), key
    assert_saved_models_equal([tmp_path / "plain", tmp_path / "fast"], "AutoModelForCausalLM")
