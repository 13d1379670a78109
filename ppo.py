"""PPO for language models (RLHF) in one file.

    python rm.py && python ppo.py                  # the embedded task: a reward model, then PPO, on a CPU in minutes
    torchrun --nproc_per_node 2 ppo.py             # the same PPO on 2 processes
    torchrun --nproc_per_node 8 ppo.py --sft_model_path EleutherAI/pythia-1b-deduped \
        --reward_model_path runs/rm --dataset_name trl-lib/tldr --response_length 53 --bf16
    python ppo.py --reward_fn common:gold_rewards  # a rule instead of a reward model: the embedded task's true reward
    python ppo.py --eval_only --sft_model_path runs/ppo  # a policy's scores on the held-out prompts
    python ppo.py --help                           # every option

Each update hands one Rollout batch through the phases of main():
  1. rollout: sample a response to each prompt, K per prompt, token by token with a KV cache.
  2. log-probs and values: each response token's log-prob under the policy and the reference, and the critic's values.
  3. score: the reward of each response, read at its last real token.
  4. advantages: a reward of -kl_coef * KL at each token (grpo: a loss term), plus the score at the last; GAE, whitened.
  5. learn: num_ppo_epochs passes of the clipped policy and value losses over shuffled mini-batches.
  6. with --target_kl, adapt kl_coef; log, evaluate on held-out prompts when scheduled, and checkpoint.

The four models: what each is, and which options change it. build_models prints what each is at start-up.
  policy     the initial policy (--sft_model_path), trained; with --lora_r, an adapter on it is trained instead.
  reference  a frozen copy of the initial policy; with --lora_r, the policy itself with its adapter off.
  reward     the frozen reward model (--reward_model_path), plus --reward_fn if given, or that function alone. With
             --lora_r and a critic from the reward model, it is that critic with its adapter off.
  critic     gae's alone: a copy of the reward model, trained, its output normalized, if it reads the policy's tokens;
             else, or with --critic_init policy, the policy's network with a new head. --lora_r trains an adapter on it.
Sampling and every response log-prob use logits / --temperature, with no top-k or top-p. In one process, the helpers
that share rows between processes (process_share, all_gather_cat, rows_of_every_process) return their input.

Schulman et al. 2017 (PPO); Ziegler et al. 2019 and Stiennon et al. 2020 (PPO for language); Huang et al. 2024, "The
N implementation details of RLHF with PPO". README.md lists what is left out. The method ends at the FENCE after
main(). Below it are the pieces a reader may trust by their docstrings, then the opt-in speed paths.
"""

import contextlib
import copy
import dataclasses
import datetime
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import runpy
import sys
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from tqdm import tqdm

import common


@dataclass
class Args:
    """Train a language model with PPO against a reward model or a reward function (RLHF)."""

    # --- the method. gae needs a critic (Schulman et al. 2016); rloo (Ahmadian et al. 2024), grpo (Shao et al. 2024)
    # and reinforce_pp (Hu 2025) need none.

    # How advantages are estimated, each with its paper's KL and loss mean, which flags override: gae, rloo and
    # reinforce_pp put the KL in the reward with k1 and take token_mean; grpo puts it in the loss with k3 and takes
    # sequence_mean (Shao et al. 2024, eq. 3); rloo and grpo sample 4 responses per prompt (Shao et al. 64), the
    # others 1
    advantage_estimator: Literal["gae", "rloo", "grpo", "reinforce_pp"] = "gae"
    num_samples_per_prompt: int | None = None  # Responses per prompt in a batch (default: 4 for rloo and grpo, else 1)
    scale_rewards: bool = True  # grpo: divide by the std of the prompt's returns; --no_scale_rewards is Dr. GRPO
    # The KL in each token's reward (Ziegler et al. 2019) or in the loss (default: loss for grpo, else reward)
    kl_penalty: Literal["reward", "loss"] | None = None
    # A mini-batch's loss mean: token_mean averages tokens, sequence_mean averages each response's mean (GRPO), and
    # constant divides the sum by responses x response_length (Dr. GRPO, Liu et al. 2025) (default: sequence_mean for
    # grpo, else token_mean)
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] | None = None
    kl_coef: float = 0.1  # Initial coefficient of the KL penalty
    # k1 is log p - log q. k3 is (q/p - 1) - log(q/p) (Schulman 2020). In the loss, k1's gradient is zero in
    # expectation on the policy's own samples, so k3 is the loss's default.
    kl_estimator: Literal["k1", "k3"] | None = None  # Per-token KL estimate (default: k1 in the reward, k3 in the loss)
    target_kl: float | None = None  # KL per response that the adaptive controller aims at (default: a fixed kl_coef)
    kl_horizon: int = 10000  # Horizon in episodes of the adaptive KL controller
    gamma: float = 1.0  # Discount factor (gae and reinforce_pp)
    lam: float = 0.95  # GAE lambda
    cliprange: float = 0.2  # Clip range of the policy ratio
    cliprange_value: float = 0.2  # Clip range of the value around its rollout value
    vf_coef: float = 0.1  # Weight of the value loss
    ent_coef: float = 0.0  # Weight of the entropy bonus
    whiten_rewards: bool = False  # Whiten the per-token rewards, keeping their mean (gae and reinforce_pp)
    missing_eos_penalty: float | None = None  # Subtracted from a response's score if it never stops (default: none)
    ptx_coef: float = 0.0  # Weight of a language-modelling loss on --ptx_dataset_name (PPO-ptx, Ouyang et al. 2022)
    ptx_dataset_name: str | None = None  # Text for the ptx loss: a dataset with a `text` column, or `embedded`
    # --- models and data
    sft_model_path: str = "embedded-llama"  # The initial policy: a causal LM, a peft adapter, or embedded-llama/-neox
    reward_model_path: str | None = None  # rm.py's reward model or any sequence classifier (default: runs/rm)
    reward_fn: str | None = None  # A rule `module:function`, fn(prompts, responses) -> scores (default: none)
    # auto takes the reward model where it reads the policy's tokens, else the policy with a new head.
    critic_init: Literal["auto", "reward", "policy"] = "auto"  # The critic's start
    dataset_name: str = "embedded"  # Prompts: a hub name, a .jsonl/.json/.parquet/.csv(.gz) file, or `embedded`
    dataset_config: str | None = None  # Hub dataset configuration (default: none)
    dataset_train_split: str = "train"  # Split to take training prompts from
    # Longer prompts keep their end and BOS (default: 256, or what the declared positions leave after --response_length)
    max_prompt_length: int | None = None
    output_dir: str = "runs/ppo"  # Policy, metrics.jsonl, samples, curves.png and checkpoints
    # --- held-out evaluation
    eval_split: str | None = None  # Split of eval prompts (default: validation, else test, else --eval_holdout)
    eval_holdout: float = 0.1  # Without an eval split, this fraction of the prompts is held out by text
    num_eval_prompts: int = 256  # Distinct eval prompts, the same at every evaluation; all if fewer
    eval_seed: int = 0  # Draws the eval prompts and their streams, whatever --seed: runs compare prompt by prompt
    # Evaluations spread evenly over training, the last at its end, plus one before it: N + 1 in all (at most one per
    # update); 0: none
    num_evals: int = 5
    eval_only: bool = False  # Evaluate --sft_model_path on the eval prompts and train nothing
    # --- sizes. A rollout batch is micro-batch x gradient_accumulation_steps x num_mini_batches x processes.
    total_episodes: int = 12288  # Episodes (prompt and response) in all
    per_device_train_batch_size: int = 16  # Episodes per process in one forward and backward pass
    gradient_accumulation_steps: int = 1  # Micro-batches per optimizer step
    num_mini_batches: int = 2  # Optimizer steps per PPO epoch
    num_ppo_epochs: int = 4  # Passes over each rollout batch
    # --- optimisation
    learning_rate: float | None = None  # AdamW learning rate (default: 3e-4 for the embedded models, else 3e-6)
    critic_learning_rate: float | None = None  # The critic's learning rate (default: the policy's)
    weight_decay: float = 0.0  # AdamW weight decay
    # The learning-rate schedule over the updates, with no warm-up
    lr_scheduler_type: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
    ] = "linear"
    # One clip for both models gives the same gold score at equal KL (benchmarks/README.md, Gradient clipping).
    max_grad_norm: float = 1.0  # Clip the gradient norm of policy and critic together; 0: no clipping
    seed: int = 1  # Seed of the data order and of sampling in training
    # --- sampling. No top-k or top-p: the ratio and the KL need the distribution a token was drawn from.
    response_length: int = 16  # Maximum new tokens per response
    temperature: float = 1.0  # Sampling temperature, used by every log-prob too
    stop_token: str = "eos"  # Token that ends a response: `eos`, a token as the tokenizer spells it, or `none`
    # --- LoRA (peft)
    lora_r: int = 0  # LoRA rank (Hu et al. 2021) on the policy's and critic's linear layers; 0: full fine-tuning
    lora_alpha: float = 16.0  # LoRA scale: an adapter adds (lora_alpha / lora_r) B A to its layer
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])  # Layers adapted
    # --- logging, checkpoints and systems
    sample_every: int = 10  # Print and save sample completions every this many updates
    num_samples: int = 4  # Rows in each sample table
    save_steps: int | None = None  # Checkpoint every this many updates (default: every 30 minutes); 0: never
    resume: bool = False  # Continue from the latest checkpoint in --output_dir, on any number of processes
    overwrite_output_dir: bool = False  # Train afresh where a finished run or checkpoints are, deleting them
    track: bool = False  # Log to Weights & Biases
    tensorboard: bool = False  # Also write TensorBoard events to --output_dir/tensorboard
    wandb_project: str = "rlhf-ppo"  # Weights & Biases project
    run_name: str | None = None  # Weights & Biases run name (default: its own)
    fsdp: bool = False  # Shard every model per transformer block with FSDP2 (default: DDP and replicated frozen models)
    offload_inference_models: bool = False  # With --fsdp on GPUs, keep frozen models' shards in host memory
    gradient_checkpointing: bool = False  # Recompute the policy's and critic's activations in the backward pass
    bf16: bool = False  # bfloat16 autocast; weights and optimizer state stay float32, a frozen LoRA base bfloat16
    # --- opt-in speed paths below the fence, each tested to give the plain path's numbers
    group_by_length: bool = False  # Rows of similar length forward together, with less padding
    fused_logits: bool = False  # Response log-probs in one pass over the vocabulary, block by block, bounded memory
    compile: bool = False  # Decode the rollout compiled, with CUDA graphs on a GPU; not with --fsdp


def fill_defaults(args, position_limit, rank=0):
    """Fills the defaults that depend on another option or on the model, and prints them: the estimator's paper's
    responses per prompt, KL placement and loss mean, the KL estimator, the learning rates and --max_prompt_length.
    ppo_results.json saves them with the run."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    group, grpo = args.advantage_estimator in ("rloo", "grpo"), args.advantage_estimator == "grpo"
    args.num_samples_per_prompt = args.num_samples_per_prompt or (4 if group else 1)  # A group baseline needs K > 1.
    args.kl_penalty = args.kl_penalty or ("loss" if grpo else "reward")
    args.loss_aggregation = args.loss_aggregation or ("sequence_mean" if grpo else "token_mean")
    args.kl_estimator = args.kl_estimator or ("k1" if args.kl_penalty == "reward" else "k3")
    if args.learning_rate is None:  # The embedded models are tiny and learn fast.
        args.learning_rate = 3e-4 if args.sft_model_path.startswith("embedded-") else 3e-6
    args.critic_learning_rate = args.learning_rate if args.critic_learning_rate is None else args.critic_learning_rate
    args.max_prompt_length = args.max_prompt_length or min(256, (position_limit or 1 << 30) - args.response_length)
    if args.max_prompt_length < 1:
        raise common.UserError(
            f"--response_length {args.response_length} leaves no room for a prompt in the "
            f"{position_limit} positions the models declare; lower it"
        )
    if rank == 0:
        print("defaults: " + ", ".join(f"--{k} {v}" for k, v in vars(args).items() if k not in given and v is not None))


# --- The math. --------------------------------------------------------------------------------------------------------
def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    """Returns (x - mean) / std over the real tokens, with the unbiased variance. shift_mean=False adds the mean back,
    which is how rewards are whitened."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


def kl_per_token(logprobs, ref_logprobs, estimator="k1"):
    """Estimates KL(policy || reference) at each sampled token (Schulman 2020, "Approximating KL divergence")."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator != "k3":
        raise ValueError(f"unknown KL estimator {estimator!r}: k1 or k3")
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio  # exp(x) - 1 - x. expm1 avoids float32's cancellation near 0.


def gae(rewards, values, mask, gamma, lam):
    """Returns generalized advantage estimates and returns, the critic's targets (Schulman et al. 2016, eq. 16).

    The value after the last real token is 0. A response cut at --response_length is treated as ended, as TRL does."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, advantages + values


def rloo_advantages(returns, k):
    """RLOO (Ahmadian et al. 2024): each return minus the mean of its prompt's other k - 1 returns. A prompt's k
    episodes are consecutive rows."""
    group = returns.view(-1, k)
    return (group - (group.sum(1, keepdim=True) - group) / (k - 1)).flatten()


def grpo_advantages(returns, k, scale=True, eps=1e-4):
    """GRPO (Shao et al. 2024, sec. 4.1.2): each return minus its prompt's mean, over the prompt's std plus eps.

    The std is unbiased, as TRL's. scale=False keeps return - mean (Dr. GRPO, Liu et al. 2025)."""
    group = returns.view(-1, k)
    centered = group - group.mean(1, keepdim=True)
    return (centered / (group.std(1, keepdim=True) + eps) if scale else centered).flatten()


def reinforce_pp_advantages(rewards, mask, gamma):
    """REINFORCE++ (Hu 2025): each token's discounted return, whitened over the batch."""
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)  # GAE with values 0 and lambda 1
    return masked_whiten(returns, mask)


def policy_loss(logprobs, old_logprobs, advantages, cliprange, mask):
    """Returns the clipped surrogate objective as a loss per token, and statistics per token.

    Schulman et al. 2017, eq. 7. Padding's log-ratios are set to 0 first, so that the statistics stay finite there."""
    log_ratio = (logprobs - old_logprobs).masked_fill(mask == 0, 0.0)
    ratio = log_ratio.exp()
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    stats = {
        "clipfrac": (clipped > unclipped).float(),
        "approxkl": 0.5 * log_ratio**2,
        "ratio": ratio,
        "ratio_sq": ratio**2,
    }
    return torch.maximum(unclipped, clipped), stats


def value_loss(values, old_values, returns, cliprange_value):
    """Returns 0.5 * max((v - R)^2, (v_clipped - R)^2) per token, and where the clipped term is the larger.

    v_clipped stays within cliprange_value of the rollout's value (Huang et al. 2024)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_sq, clipped_sq), (clipped_sq > unclipped_sq).float()


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_episodes):
    """Moves kl_coef by the error kl / target - 1, clipped to 20%, at rate n_episodes / horizon (Ziegler et al. 2019,
    sec. 2.2)."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_episodes / horizon)


def truncate_after_stop(responses, stop_id, pad_id):
    """Turns the tokens after the first stop token into padding, and returns them and the mask of real tokens. The
    stop token itself is a real token."""
    if stop_id is None:
        return responses, torch.ones_like(responses, dtype=torch.bool)
    is_stop = responses == stop_id
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0
    return responses.masked_fill(after_stop, pad_id), ~after_stop


def response_logprobs(
    model, query_response, attention_mask, context_length, temperature, entropy=False, entropy_grad=True, fused=False
):
    """Returns each response token's log-prob at `temperature`, and optionally each position's entropy.

    Every phase reads log-probs here at --temperature: the old ones, the reference's and learning's; the ptx loss at
    1. Position t predicts token t + 1. The logits are float32 (output_layer_in_float32), computed only where a
    response token is predicted, divided by the temperature and normalized by a float32 log-softmax.
    --fused_logits gives the same numbers, to float32 rounding, in one pass over the vocabulary in bounded memory."""
    predicting = query_response.shape[1] - context_length + 1  # positions context_length - 1 to T - 1
    keep = {"logits_to_keep": predicting} if takes_argument(type(unwrap(model)), "logits_to_keep") else {}
    # Position ids count real tokens only, so that left padding changes nothing.
    inputs = dict(
        input_ids=query_response,
        attention_mask=attention_mask,
        use_cache=False,
        **keep,
        position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
    )
    targets = query_response[:, context_length:]
    if fused:
        return fused_response_logprobs(model, inputs, predicting, targets, temperature, entropy, entropy_grad)
    logits = model(**inputs).logits[:, -predicting:-1]  # The last position predicts nothing.
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    logprobs = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        return logprobs, entropy_of(logp_all) if entropy else None


# --- The method's conventions. rm.py states the same ones, and tests/test_rm.py checks that they agree. Dropout is off
# in every model (disable_dropout, below the fence), so that rollout, scoring and learning read one network. ----------
def truncate_prompt(ids, max_prompt_length, bos_id=None):
    """Cuts a prompt longer than max_prompt_length, keeping its end, the turn being answered, and its leading BOS or
    [CLS] token."""
    if len(ids) <= max_prompt_length:
        return ids
    keep = 1 if bos_id is not None and ids and ids[0] == bos_id else 0
    return ids[:keep] + ids[len(ids) - max_prompt_length + keep :]


def last_token_index(mask):
    """Returns the index of each row's last real token, where a response ends and its reward is read.

    That token is the stop token, or the last token of a response cut at --response_length. It is read from the
    mask, right or left padded, because a pad id may equal EOS."""
    return (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(1)


def sequence_reward(model, ids, mask):
    """Returns a reward model's output: a decoder's scalar head at the last real token, where rm.py trains it.

    An encoder (BERT, RoBERTa, DeBERTa) returns its pooled classifier's output instead."""
    if not hasattr(model, "score"):
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    hidden = model.base_model(
        input_ids=ids, attention_mask=mask, use_cache=False, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
    ).last_hidden_state
    return model.score(hidden[torch.arange(len(ids), device=ids.device), last_token_index(mask)]).squeeze(-1).float()


# --- The phases of an update, in the order main() runs them, handing one Rollout batch along. -------------------------
@dataclass
class Rollout:
    """One row per episode, and every process holds every row. A prompt's K episodes are consecutive rows.

    Each phase fills its fields. (B, T) is (rows, response_length); a (B, T) field is 0 after a response ends."""

    query_response: torch.Tensor  # (B, context_length + T): the left-padded prompt, then the response
    attention_mask: torch.Tensor  # the same shape, 1 on real tokens
    context_length: int  # the response starts at this column
    mask: torch.Tensor  # (B, T) bool: the response's real tokens, through its stop token
    logprobs: torch.Tensor | None = None  # (B, T) phase 2: the policy's log-probs, the ratio's "old" ones
    ref_logprobs: torch.Tensor | None = None  # (B, T) phase 2: the reference's log-probs
    values: torch.Tensor | None = None  # (B, T) phase 2: the critic's values; None without a critic
    scores: torch.Tensor | None = None  # (B,) phase 3: the reward of each response
    has_stop: torch.Tensor | None = None  # (B,) phase 3: whether the response stopped; None without a stop token
    gold: torch.Tensor | None = None  # (B,) phase 3: the embedded task's true reward, for the logs; else None
    advantages: torch.Tensor | None = None  # (B, T) phase 4
    returns: torch.Tensor | None = None  # (B, T) phase 4: the critic's targets, GAE only

    @property
    def responses(self):
        return self.query_response[:, self.context_length :]


def rollout(policy, prompt_ids, seeds, args, stop_id, pad_id):
    """1. Samples a response to each prompt from softmax(logits / --temperature), each with its own random stream.

    seeds holds each episode's seed (sample_tokens). Tokens after the stop token become padding. Each process
    samples its own share of the rows, and every process receives all of them."""
    device = next(policy.parameters()).device
    query, query_mask = (t.to(device) for t in pad_left(prompt_ids, max(map(len, prompt_ids)), pad_id))
    mine = process_share(torch.arange(len(prompt_ids), device=device))
    seeds = torch.tensor(seeds, device=device)[mine]
    with gathered_once(policy, collective(args)), torch.autocast(device.type, torch.bfloat16, enabled=args.bf16):
        responses = generate(unwrap(policy), query[mine], query_mask[mine], seeds, args, stop_id, pad_id)
    responses, mask = truncate_after_stop(all_gather_cat(responses), stop_id, pad_id)
    return Rollout(torch.cat([query, responses], 1), torch.cat([query_mask, mask], 1).long(), query.shape[1], mask)


@torch.no_grad()
def generate(model, query, query_mask, seeds, args, stop_id, pad_id):
    """Samples up to --response_length tokens after each query with a KV cache, each by sample_tokens.

    The logits are float32, as response_logprobs reads them. The cache holds prompt and response from the start, and
    the mask covers that width: causality hides the tokens not yet sampled. --compile runs compiled_generate."""
    if args.compile:
        return compiled_generate(model, query, query_mask, seeds, args, stop_id, pad_id)
    position = (query_mask.long().cumsum(1) - 1).clamp(min=0)
    mask = F.pad(query_mask.long(), (0, args.response_length), value=1)
    cache = ComputeDtypeCache(config=model.config, max_cache_len=mask.shape[1])
    # The first forward returns logits at the prompt's last position only, not at every position.
    last_only = {"logits_to_keep": 1} if takes_argument(type(model), "logits_to_keep") else {}
    inputs = dict(
        input_ids=query, attention_mask=mask, past_key_values=cache, use_cache=True, position_ids=position, **last_only
    )
    tokens = []
    done = torch.zeros(len(query), dtype=torch.bool, device=query.device)
    for t in range(args.response_length):
        logits = model(**inputs).logits[:, -1].float() / args.temperature
        token = sample_tokens(logits, seeds, t)
        tokens.append(token)
        done |= token == stop_id
        if all_processes_done(done, args) or t == args.response_length - 1:
            break
        inputs = dict(
            input_ids=token[:, None],
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            position_ids=position[:, -1:] + t + 1,
        )
    responses = torch.stack(tokens, 1)
    return F.pad(responses, (0, args.response_length - responses.shape[1]), value=pad_id)


def sample_tokens(logits, seeds, step):
    """Draws token `step` of each row's episode from softmax(logits) by inverting its cumulative distribution.

    The token is the first whose cumulative probability, summed in float64, exceeds the episode's uniform for this
    step. episode_uniform computes that uniform from the seed and the step alone. So a row draws the same token in
    any batch, on any number of processes, compiled or not."""
    cdf = torch.exp(logits - logits.amax(-1, keepdim=True)).cumsum(-1, dtype=torch.float64)
    target = episode_uniform(seeds, step).to(cdf.device)[:, None] * cdf[:, -1:]  # below the total, as u < 1
    # A token of probability 0 is never drawn. The clamp guards the last index against rounding.
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)


@torch.no_grad()
def logprobs_and_values(policy, reference, critic, batch, args, update, reference_mode):
    """2. Fills in each response token's log-prob under the policy and the reference, and the critic's values.

    The policy's log-probs are the ratio's "old" ones. Each process computes its own rows in micro-batches of the
    shape learn() uses, and every process receives all rows. A row gives the same numbers in any micro-batch of one
    shape, so each update's first ratio is exactly 1, in any precision. At the first update the KL is exactly 0."""
    out = torch.zeros(3, *batch.mask.shape, device=batch.mask.device)  # the old log-probs, the reference's, values
    with torch.autocast(batch.mask.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        for f in old_logprob_micro_batches(batch, args, update):
            out[0, f.rows, : f.kept] = response_logprobs(
                policy, f.ids, f.attention_mask, f.context, args.temperature, fused=args.fused_logits
            )[0]
            with reference_mode():
                out[1, f.rows, : f.kept] = response_logprobs(
                    reference, f.ids, f.attention_mask, f.context, args.temperature, fused=args.fused_logits
                )[0]
            if critic is not None:
                out[2, f.rows, : f.kept] = critic(f.ids, f.attention_mask)[:, f.context - 1 : -1]
    batch.logprobs, batch.ref_logprobs, values = rows_of_every_process(out).masked_fill(~batch.mask, 0.0)
    batch.values = values if critic is not None else None


@torch.no_grad()
def score(reward, batch, prompt_texts, tokenizer, stop_id, args):
    """3. Fills in each response's score and returns the responses' texts.

    The score is the reward model's output at the response's last real token, normalized as rm.py saved it, plus
    --reward_fn, minus --missing_eos_penalty for a response that never stopped. A reward model with other tokens
    than the policy reads the text in its own tokens (reward_model_tokens). Each process scores its own rows."""
    rows = process_share(torch.arange(len(batch.mask), device=batch.mask.device))
    responses, mask = batch.responses[rows], batch.mask[rows]
    texts = [
        tokenizer.decode(r[m & (r != stop_id)] if stop_id is not None else r[m], skip_special_tokens=True)
        for r, m in zip(responses.cpu(), mask.cpu())
    ]
    mine = [prompt_texts[i] for i in rows.tolist()]
    scores = torch.zeros(len(batch.mask), device=mask.device)
    with torch.autocast(mask.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        for f in micro_batches(batch, rows, args) if reward.model is not None else []:
            ids, ids_mask = (
                (f.ids, f.attention_mask)
                if reward.tokenizer is None
                else reward_model_tokens(batch, f.rows, stop_id, tokenizer, reward, args)
            )
            scores[f.rows] = reward.model(ids.to(mask.device), ids_mask.to(mask.device))
    scores = scores[rows]
    if reward.fn is not None:
        scores += common.agreed(lambda: reward.fn(mine, texts)).to(scores.device)
    batch.has_stop = (batch.responses == stop_id).any(1) if stop_id is not None else None
    if args.missing_eos_penalty is not None:
        scores -= args.missing_eos_penalty * (~batch.has_stop[rows]).float()
    batch.scores = all_gather_cat(scores)
    if args.dataset_name == "embedded":  # the embedded task: its true reward, for the logs
        batch.gold = all_gather_cat(torch.tensor(common.gold_rewards(mine, texts), device=scores.device))
    return all_gather_objects(texts)


def advantages(batch, kl_coef, args):
    """4. Fills in the advantages and returns the per-token KL and the KL part of the rewards, for the logs.

    Each token's reward is -kl_coef * KL to the reference (--kl_penalty reward), and the last real token's adds the
    score (Ziegler et al. 2019, eq. 2). GAE gives whitened advantages and the critic's targets. RLOO and GRPO compare
    each episode's return with its prompt's other K - 1. REINFORCE++ uses each token's return."""
    mask = batch.mask.float()
    kl = kl_per_token(batch.logprobs, batch.ref_logprobs, args.kl_estimator) * mask
    non_score_reward = -kl_coef * kl if args.kl_penalty == "reward" else torch.zeros_like(kl)
    rewards = non_score_reward.clone()
    rewards[torch.arange(len(rewards), device=rewards.device), last_token_index(mask)] += batch.scores
    if args.whiten_rewards:  # gae and reinforce_pp only: check_args refuses it with the others.
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    if args.advantage_estimator == "gae":
        adv, batch.returns = gae(rewards, batch.values, mask, args.gamma, args.lam)
        batch.advantages = masked_whiten(adv, mask)
    elif args.advantage_estimator == "reinforce_pp":
        batch.advantages = reinforce_pp_advantages(rewards, mask, args.gamma)
    else:  # One advantage per episode, at each of its tokens.
        k, returns = args.num_samples_per_prompt, rewards.sum(1)
        adv = (
            rloo_advantages(returns, k)
            if args.advantage_estimator == "rloo"
            else grpo_advantages(returns, k, args.scale_rewards)
        )
        batch.advantages = adv[:, None] * mask
    return kl, non_score_reward


@dataclass
class MicroBatch:
    """The rows of one forward pass, with every column of the batch (--group_by_length drops all-padding columns)."""

    rows: torch.Tensor
    ids: torch.Tensor
    attention_mask: torch.Tensor
    context: int  # the response starts at this column
    kept: int  # response columns kept

    def take(self, field):
        """A (B, T) field of the batch at these rows and columns."""
        return field[self.rows][:, : self.kept]


def micro_batches(batch, rows, args):
    """Cuts rows, in order, into forwards of --per_device_train_batch_size rows (--group_by_length: length_grouped)."""
    if args.group_by_length:
        return length_grouped(batch, rows, args)
    return [
        MicroBatch(r, batch.query_response[r], batch.attention_mask[r], batch.context_length, batch.mask.shape[1])
        for r in rows.split(args.per_device_train_batch_size)
    ]


@dataclass
class OptimizerStep:
    rows: torch.Tensor  # the mini-batch's rows
    forwards: list  # the MicroBatches this process computes: its share of the rows, gradient_accumulation_steps of them


def epoch_plan(batch, args, update, epoch):
    """Returns one PPO epoch's optimizer steps: the batch shuffled, seeded by update and epoch, in --num_mini_batches.

    Each process computes its own share of each mini-batch (process_share)."""
    order = torch.randperm(
        len(batch.mask),
        generator=torch.Generator().manual_seed(common.seed_of(args.seed, "mini-batches", update, epoch)),
    ).to(batch.mask.device)
    return [
        OptimizerStep(mini, micro_batches(batch, process_share(mini), args))
        for mini in order.chunk(args.num_mini_batches)
    ]


def learn(policy, critic, trainable, optimizer, batch, kl_coef, args, update, ptx, pad_id):
    """5. Runs --num_ppo_epochs passes over the batch, each of --num_mini_batches optimizer steps.

    Each loss is its mini-batch's mean: a micro-batch's loss is its sum over tokens divided by the mini-batch's
    count. Gradients are summed over micro-batches and processes (sum_gradients, below the fence), so the step's
    gradient is that of the mini-batch's mean. Returns each statistic's mean over the optimizer steps, and each
    model's gradient norm before clipping."""
    autocast = functools.partial(torch.autocast, batch.mask.device.type, dtype=torch.bfloat16, enabled=args.bf16)
    stats, norms = [], []
    for epoch in range(args.num_ppo_epochs):
        for mb, step in enumerate(epoch_plan(batch, args, update, epoch)):
            tokens_in_mini_batch, responses = batch.mask[step.rows].sum(), len(step.rows)

            def mean(loss_per_token, mask):
                if args.loss_aggregation == "token_mean":
                    return (loss_per_token * mask).sum() / tokens_in_mini_batch  # noqa: B023, used in this step
                if args.loss_aggregation == "sequence_mean":  # each response's token mean, then over responses
                    return ((loss_per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / responses  # noqa: B023
                return (loss_per_token * mask).sum() / (responses * args.response_length)  # noqa: B023, Dr. GRPO

            sums = {}
            if ptx is not None:  # PPO-ptx (Ouyang et al. 2022, eq. 2): language modelling on pretraining text
                sums["loss/ptx"] = ptx_backward(policy, ptx, step, update, epoch, mb, args, pad_id)
            for i, f in enumerate(step.forwards):
                sync_gradients([policy, critic], last=i == len(step.forwards) - 1)
                mask = f.take(batch.mask).float()
                with autocast():
                    new_logprobs, entropy = response_logprobs(
                        policy,
                        f.ids,
                        f.attention_mask,
                        f.context,
                        args.temperature,
                        entropy=True,
                        entropy_grad=args.ent_coef > 0,
                        fused=args.fused_logits,
                    )
                pg_loss, per_token = policy_loss(
                    new_logprobs, f.take(batch.logprobs), f.take(batch.advantages), args.cliprange, mask
                )
                losses = {"loss/policy": mean(pg_loss, mask)}
                loss = losses["loss/policy"] - args.ent_coef * mean(entropy, mask)
                if args.kl_penalty == "loss":  # GRPO (Shao et al. 2024, eq. 3): the current policy's KL
                    # Padding's log-probs are 0, as the reference's are: k3 of a pad token could overflow.
                    losses["loss/kl"] = mean(
                        kl_per_token(
                            new_logprobs.masked_fill(mask == 0, 0.0), f.take(batch.ref_logprobs), args.kl_estimator
                        ),
                        mask,
                    )
                    loss = loss + kl_coef * losses["loss/kl"]
                loss.backward()  # Policy and critic share no weights, so each loss has its own graph.
                per_token = {"policy/entropy": entropy, **{f"policy/{k}": v for k, v in per_token.items()}}
                if critic is not None:
                    with autocast():
                        new_values = critic(f.ids, f.attention_mask)[:, f.context - 1 : -1]
                    vf_loss, per_token["val/clipfrac"] = value_loss(
                        new_values, f.take(batch.values), f.take(batch.returns), args.cliprange_value
                    )
                    losses["loss/value"] = mean(vf_loss, mask)
                    (args.vf_coef * losses["loss/value"]).backward()
                for name, value in losses.items():
                    sums[name] = sums.get(name, 0) + value.detach()
                for name, value in per_token.items():  # Statistics are plain means over the mini-batch's tokens.
                    sums[name] = sums.get(name, 0) + (value.detach() * mask).sum() / tokens_in_mini_batch
            norms.append(clip_and_step(trainable, optimizer, args.max_grad_norm, update, sums["loss/policy"]))
            stats.append(sums)
    return {**mean_over_steps(stats), **{k: sum(n[k] for n in norms) / len(norms) for k in norms[0]}}


@torch.no_grad()
def evaluate(models, prompts, args, tokenizer, stop_id, baseline=None):
    """Scores the policy on the held-out prompts, one response each, sampled at --temperature.

    Each prompt has its own random stream, seeded by --eval_seed, the same at every evaluation and in every run. Two
    evaluations then differ only by the policy, and their difference is a paired comparison: given the first
    evaluation's rows as `baseline`, each measure's change from it is logged with its paired standard error. The prompts
    go through phases 1 to 3 in rollout batches. Returns each measure's mean over the distinct prompts with its
    standard error, the changes, the responses' distinct-n, and one row per prompt for eval_samples.jsonl."""
    rows, start = [], time.time()
    for model in (m for m in (models.policy, models.critic) if m is not None):  # as sampling in training
        model.eval()
    plan = dataclasses.replace(args, seed=args.eval_seed)  # --group_by_length's micro-batches follow --eval_seed too
    for chunk in eval_batches(prompts, args):
        seeds = [common.seed_of(args.eval_seed, "evaluation", i) for i in chunk.index]
        batch = rollout(models.policy, chunk.ids, seeds, args, stop_id, tokenizer.pad_token_id)
        with resharded([models.separate_reference]):
            logprobs_and_values(models.policy, models.reference, None, batch, plan, 0, models.reference_mode)
        with resharded([models.reward.model]):
            texts = score(models.reward, batch, chunk.texts, tokenizer, stop_id, args)
        measured = {
            "score": batch.scores,
            "gold": batch.gold,
            "length": batch.mask.sum(1),
            "stop_rate": batch.has_stop,
            "kl": (kl_per_token(batch.logprobs, batch.ref_logprobs, args.kl_estimator) * batch.mask).sum(1),
        }
        rows += [
            {
                "prompt": chunk.texts[i],
                "response": texts[i],
                **{k: float(v[i]) for k, v in measured.items() if v is not None},
            }
            for i in range(chunk.real)
        ]  # The rows after chunk.real repeat a prompt to fill the batch.
    names = ("score", "gold", "kl", "length", "stop_rate")
    measures = mean_and_standard_error(rows, names, "eval/")
    changes = paired_change(rows, baseline, names, "eval/") if baseline else {}
    # Output diversity across the prompts' responses (Kirk et al. 2024): a policy that says one thing to every prompt
    # has few distinct words.
    diversity = {f"eval/distinct_{n}": distinct_ngrams([r["response"] for r in rows], n) for n in (1, 2)}
    return {**measures, **changes, **diversity, "perf/time_eval": time.time() - start}, rows


def main(args):
    check_args(args)
    rank, world, device = setup_distributed()
    fill_defaults(args, position_limit(args, rank), rank)
    tokenizer = load_tokenizer(args)
    stop_id = stop_token_id(args, tokenizer)
    # The prompts are read before anything is written or loaded, so that a mistake in the data shows in seconds.
    prompts, eval_prompts = train_and_eval_prompts(args, tokenizer)
    if (sizes := start_up(args, rank, world)) is None:  # The run in --output_dir is finished.
        return None
    batch_size, num_updates = sizes.batch_size, sizes.num_updates
    ptx = load_ptx(args, tokenizer) if args.ptx_coef > 0 and not args.eval_only else None
    models = build_models(args, tokenizer, device, rank, world)
    policy, critic = models.policy, models.critic
    if args.eval_only:
        return evaluate_only(models, eval_prompts, args, tokenizer, stop_id)
    # AdamW over policy and critic, each at its learning rate; --lr_scheduler_type is stepped once per update.
    trainable, optimizer, scheduler = build_optimizer(policy, critic, args, num_updates)
    start, kl_coef, history, baseline = 0, args.kl_coef, [], None
    if args.resume and (ckpt := common.resume_training(trainable, optimizer, scheduler, args.output_dir, args, world)):
        start, kl_coef, history, baseline = ckpt["step"], ckpt["kl_coef"], ckpt["history"], ckpt.get("eval_baseline")
    logs = open_logs(args, rank, start or None)
    evals_at = eval_schedule(args.num_evals, num_updates, rank)  # 0, before the first update, and --num_evals more
    if start == 0 and 0 in evals_at:  # The initial policy's rows: the baseline of every later evaluation.
        metrics, baseline = evaluate(models, eval_prompts, args, tokenizer, stop_id)
        history.append(log_evaluation(logs, 0, 0, metrics, baseline))

    orders = {}
    bar = tqdm(range(start, num_updates), disable=rank != 0, initial=start, total=num_updates, desc="ppo")
    t_saved = time.time()
    common.stop_on_signals()
    for update in bar:
        t0 = time.time()
        # 1. Rollout. An episode's prompt and random stream depend only on its index, whatever the processes.
        episodes = range(update * batch_size, (update + 1) * batch_size)
        prompt_index = episode_prompts(
            [e // args.num_samples_per_prompt for e in episodes], len(prompts.ids), args.seed, orders
        )  # A prompt's K episodes are consecutive.
        seeds = [common.seed_of(args.seed, "sampling", e) for e in episodes]
        trainable.eval()  # Sampling and scoring run in evaluation mode.
        batch = rollout(policy, [prompts.ids[i] for i in prompt_index], seeds, args, stop_id, tokenizer.pad_token_id)
        t_rollout = time.time()

        # 2. Log-probs under the policy (old) and the reference, and the values.
        with resharded([models.separate_reference]):
            logprobs_and_values(policy, models.reference, critic, batch, args, update, models.reference_mode)

        # 3. Score: the reward at the response's last real token.
        with resharded([models.reward.model]):
            score(models.reward, batch, [prompts.texts[i] for i in prompt_index], tokenizer, stop_id, args)
        t_score = time.time()

        # 4. Advantages: KL-penalised per-token rewards, then GAE, whitened, or a critic-free estimator.
        kl, non_score_reward = advantages(batch, kl_coef, args)

        # 5. Learn: num_ppo_epochs x num_mini_batches optimizer steps on the clipped policy and value losses.
        trainable.train()
        update_stats = learn(
            policy, critic, trainable, optimizer, batch, kl_coef, args, update, ptx, tokenizer.pad_token_id
        )
        lr = scheduler.get_last_lr()[0]  # the rate this update's steps used
        scheduler.step()
        t_learn = time.time()

        # 6. With --target_kl, adapt the KL coefficient. Log, evaluate when scheduled, save samples and checkpoints.
        m = {
            "step": update + 1,
            "episodes": (update + 1) * batch_size,
            "kl_coef": kl_coef,
            "lr": lr,
            **update_stats,
            **update_metrics(
                batch,
                kl,
                non_score_reward,
                [t0, t_rollout, t_score, t_learn, time.time()],
                args,
                peak_memory_of=device if update == start else None,
            ),
        }
        if args.target_kl is not None:  # objective/kl is the KL summed over each response, averaged over the batch.
            kl_coef = adaptive_kl_coef(kl_coef, m["objective/kl"], args.target_kl, args.kl_horizon, batch_size)
        kept = ("step", "episodes", "objective/scores", "objective/kl", "gold/mean", "gold/std")  # in checkpoints
        history.append({k: m[k] for k in kept if k in m})
        if rank == 0:
            log_update(logs, bar, m, update == num_updates - 1, args, tokenizer, batch)
        if update + 1 in evals_at:
            evaluation = evaluate(models, eval_prompts, args, tokenizer, stop_id, baseline)
            history.append(log_evaluation(logs, m["step"], m["episodes"], *evaluation))
        save, stop = common.step_end(update + 1, args.save_steps, t_saved, device)
        if save and update + 1 < num_updates:
            state = dict(kl_coef=kl_coef, history=history, eval_baseline=baseline)
            common.save_training(
                trainable, optimizer, scheduler, update + 1, rank, args.output_dir, batch_size, **state
            )
            t_saved = time.time()
        if stop and update + 1 < num_updates:
            common.exit_stopped(stop, update + 1, args, rank, bar)
    common.stop_on_signals(False)

    common.agreed(lambda: save_final(trainable, models.policy_hf, models.lora, tokenizer, history, logs, args, rank))
    common.leave_together()  # Under torchrun, every process is done.
    return history


# ======================================================================================================================
# THE FENCE. The method ends here, and a first read can stop. Below are the pieces a default run calls, each trusted by
# its docstring: checks, loading, the reward, evaluation, learning's bookkeeping, processes and logs. The opt-in speed
# paths come last, each in its own section and tested to give the plain path's numbers.
# ======================================================================================================================
# --- Checks and sizes, before anything is loaded or written. ---------------------------------------------------------
def check_args(args):
    """Raises a UserError for an option out of range, options that conflict, or a model or dataset not found."""
    for names, ok, must in (
        (
            (
                "total_episodes",
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "num_mini_batches",
                "num_ppo_epochs",
                "response_length",
                "max_prompt_length",
                "sample_every",
                "kl_horizon",
                "num_samples_per_prompt",
                "num_eval_prompts",
            ),
            lambda v: v >= 1,
            "at least 1",
        ),
        (
            (
                "learning_rate",
                "critic_learning_rate",
                "weight_decay",
                "max_grad_norm",
                "kl_coef",
                "cliprange",
                "cliprange_value",
                "vf_coef",
                "ent_coef",
                "ptx_coef",
                "save_steps",
                "num_samples",
                "missing_eos_penalty",
                "lora_r",
                "lora_alpha",
                "num_evals",
            ),
            lambda v: v >= 0 and math.isfinite(v),
            "a finite number >= 0",
        ),
        (("gamma", "lam"), lambda v: 0 <= v <= 1, "within [0, 1]"),
        (("eval_holdout",), lambda v: 0 < v < 1, "a fraction within (0, 1)"),
        (("temperature", "target_kl"), lambda v: v > 0, "above 0"),
    ):
        for name in names:  # None is a default filled later.
            if (value := getattr(args, name)) is not None and not ok(value):
                raise common.UserError(f"--{name} {value}: must be {must}")
    if args.advantage_estimator in ("rloo", "grpo") and args.num_samples_per_prompt == 1:
        raise common.UserError(
            f"--num_samples_per_prompt 1: --advantage_estimator {args.advantage_estimator} "
            "compares each response with the others to its prompt; it needs at least 2"
        )
    if not args.scale_rewards and args.advantage_estimator != "grpo":
        raise common.UserError(
            f"--no_scale_rewards is grpo's (Dr. GRPO); --advantage_estimator "
            f"{args.advantage_estimator} does not divide by a group's std"
        )
    if args.whiten_rewards and args.advantage_estimator not in ("gae", "reinforce_pp"):
        raise common.UserError(
            f"--whiten_rewards whitens per-token rewards for gae and reinforce_pp; --advantage_"
            f"estimator {args.advantage_estimator} compares each response's return with its group's"
        )
    if args.eval_split is not None and args.eval_split == args.dataset_train_split:
        raise common.UserError(
            f"--eval_split {args.eval_split} is the training split: the evaluation would read "
            "prompts trained on; pass another split, or none to hold out --eval_holdout of them"
        )
    if args.missing_eos_penalty is not None and args.stop_token == "none":
        raise common.UserError("--missing_eos_penalty needs a stop token: with --stop_token none no response stops")
    if args.compile and args.fsdp:
        raise common.UserError("--compile compiles the decode of a whole model; --fsdp shards it: drop one of them")
    if args.offload_inference_models and not args.fsdp:
        raise common.UserError("--offload_inference_models holds FSDP shards on the host: pass --fsdp too")
    if args.ptx_coef > 0 and args.ptx_dataset_name is None:
        raise common.UserError(f"--ptx_coef {args.ptx_coef} needs --ptx_dataset_name (a dataset with a 'text' column)")
    for name, flag, kind in (
        (args.sft_model_path, "--sft_model_path", "model"),
        (reward_model_source(args), "--reward_model_path", "model"),
        (args.dataset_name, "--dataset_name", "dataset"),
        (args.ptx_dataset_name if args.ptx_coef > 0 else None, "--ptx_dataset_name", "dataset"),
        (reference_source(args) if args.eval_only else None, "--sft_model_path", "model"),
    ):
        if name is not None:
            common.check_source(name, flag, kind)


@dataclass
class Sizes:
    local_batch: int  # Episodes per process and update: micro-batch x accumulation steps x mini-batches
    batch_size: int  # The rollout batch, local_batch x processes
    num_updates: int


def start_up(args, rank, world):
    """Returns the run's sizes, checked, or None if --resume finds the run finished in --output_dir."""
    if args.eval_only and args.output_dir == Args.output_dir:  # A trained policy's own folder is never written.
        args.output_dir = "runs/ppo-eval"
    common.check_shared_output_dir(args.output_dir, rank)
    local_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    batch_size, num_updates = local_batch * world, args.total_episodes // (local_batch * world)
    if num_updates == 0:
        raise common.UserError(f"--total_episodes {args.total_episodes} is less than one rollout batch ({batch_size})")
    if args.total_episodes % batch_size and rank == 0:
        trained = num_updates * batch_size
        print(
            f"--total_episodes {args.total_episodes}: {trained} trained, whole rollout batches of {batch_size} (the "
            f"nearest to train all: {trained} or {trained + batch_size})"
        )
    if batch_size % args.num_samples_per_prompt:
        raise common.UserError(
            f"--num_samples_per_prompt {args.num_samples_per_prompt}: must divide the rollout "
            f"batch ({batch_size} episodes), so that a prompt's responses are in one batch"
        )
    common.check_output_dir(args, rank)
    done = not args.eval_only and common.run_complete(args, num_updates, rank)
    return None if done else Sizes(local_batch, batch_size, num_updates)


def position_limit(args, rank=0):
    """Returns the fewest positions the policy and reward model declare, learned, rotary or ALiBi, or None. It reads no
    weight. A default --max_prompt_length that the limit shortens is said in one line."""
    limits = []
    for path, flag in ((args.sft_model_path, "--sft_model_path"), (reward_model_source(args), "--reward_model_path")):
        if path is not None:
            config = (
                common.embedded_model_config(path, len(common.embedded_tokenizer()), flag=flag)
                if path.startswith("embedded-")
                else common.load_pretrained(transformers.AutoConfig, path, flag)
            )
            limits.append(common.declared_positions(config))
    limit, key = min((x for x in limits if x[0]), default=(None, None))
    if limit and args.max_prompt_length is None and 0 < limit - args.response_length < 256 and rank == 0:
        print(
            f"--max_prompt_length {limit - args.response_length}: what the {limit} positions the models declare "
            f"({key}) leave after --response_length {args.response_length}, fewer than the default 256"
        )
    return limit


# --- Models and data. -------------------------------------------------------------------------------------------------
def without_dropout(config):
    """Returns the config with every dropout probability, layer drop (OPT, BART) and MoE router jitter set to 0.
    Some models, OPT among them, pass the config's dropout to F.dropout rather than use nn.Dropout."""
    for key in [
        k
        for k, v in vars(config).items()
        if isinstance(v, float) and any(s in k for s in ("dropout", "pdrop", "layerdrop", "jitter"))
    ]:
        setattr(config, key, 0.0)
    return config


def disable_dropout(model):
    without_dropout(model.config)
    for module in (m for m in model.modules() if isinstance(m, torch.nn.Dropout)):
        module.p = 0.0
    return model


def load_tokenizer(args):
    if args.sft_model_path.startswith("embedded-"):
        return common.embedded_tokenizer()
    tokenizer = common.load_pretrained(
        transformers.AutoTokenizer, args.sft_model_path, "--sft_model_path", padding_side="left"
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # Safe: every mask comes from lengths, never from pad ids.
    return tokenizer


def stop_token_id(args, tokenizer):
    stop_id = {**tokenizer.get_vocab(), "eos": tokenizer.eos_token_id, "none": None}.get(args.stop_token, -1)
    if stop_id == -1 or (args.stop_token == "eos" and stop_id is None):
        raise common.UserError(
            f"--stop_token {args.stop_token!r} is not a token of {args.sft_model_path}'s tokenizer; "
            "pass eos (if it has one), none, or one token as the tokenizer spells it"
        )
    return stop_id


def embedded_sft_policy(name, tokenizer, seed, steps=150, batch_size=64):
    """Returns the embedded task's SFT policy, a tiny causal LM trained briefly to answer with a few words and EOS.
    It is cached in ($XDG_CACHE_HOME or ~/.cache)/rlhf, in a file named by a hash of the code and versions. So two
    copies of the scripts that differ keep a cache each. Its draws are seeded by seed."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        common.embedded_model_config(name, len(tokenizer), flag="--sft_model_path")
    )
    code = open(__file__).read() + open(common.__file__).read()  # This function and the task
    key = hashlib.sha256(repr((len(tokenizer), torch.__version__, transformers.__version__, code)).encode()).hexdigest()
    cache = os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "rlhf",
        f"{name}-seed{seed}-steps{steps}-batch{batch_size}-{key[:16]}.pt",
    )
    with contextlib.suppress(Exception):  # A missing, unreadable or stale cache is trained again.
        if (saved := torch.load(cache))["key"] == key:
            model.load_state_dict(saved["model"])
            return model.eval()
    opt, rng = torch.optim.AdamW(model.parameters(), lr=2e-3), random.Random(seed)
    for _ in range(steps):  # Training prompts only, answered as the pairs answer them
        texts = [common.embedded_prompt(rng, "train") for _ in range(batch_size)]
        prompts = common.tokenize_prompts(tokenizer, texts)
        responses = common.tokenize_responses(tokenizer, texts, [common.embedded_response(rng) for _ in texts])
        batch = tokenizer.pad(
            {"input_ids": [p + r for p, r in zip(prompts, responses)]}, padding_side="right", return_tensors="pt"
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        for i, p in enumerate(prompts):
            labels[i, : len(p)] = -100  # Learn the responses, not the prompts.
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    with contextlib.suppress(OSError):  # A folder that cannot be written: trained again next time
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        torch.save({"key": key, "model": model.state_dict()}, f"{cache}.{os.getpid()}.tmp")
        os.replace(f"{cache}.{os.getpid()}.tmp", cache)  # Whole or not at all, whichever process writes it
    return model.eval()


def load_policy(args, tokenizer, on_meta=False):
    """Returns the initial policy, an adapter merged into its base, with dropout off and a float32 output layer."""
    if args.sft_model_path.startswith("embedded-"):
        # One initial policy whatever --seed, as a pretrained checkpoint is one, so that runs compare from one start.
        return output_layer_in_float32(disable_dropout(embedded_sft_policy(args.sft_model_path, tokenizer, seed=1)))
    config = without_dropout(common.load_pretrained(transformers.AutoConfig, args.sft_model_path, "--sft_model_path"))
    # float32, as AdamW's small updates would round away in bfloat16. A frozen LoRA base is only read: bfloat16 will do.
    dtype = torch.bfloat16 if args.lora_r and args.bf16 else torch.float32
    model = common.load_model(
        transformers.AutoModelForCausalLM, args.sft_model_path, "--sft_model_path", on_meta, config=config, dtype=dtype
    )
    return output_layer_in_float32(disable_dropout(model))


def output_layer_in_float32(model):
    """Makes an nn.Linear output layer a Float32Linear, so the logits are float32 under autocast; returns the model."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        head.__class__ = common.Float32Linear
    return model


@dataclass
class Models:
    policy: torch.nn.Module  # Trained, wrapped in DDP or FSDP
    critic: torch.nn.Module | None  # A trained Critic, wrapped the same way, or None without GAE
    reference: torch.nn.Module  # The frozen initial policy. With LoRA, the policy with its adapter off.
    reward: "Reward"
    policy_hf: torch.nn.Module  # The policy's transformers model, for the final save
    lora: object = None  # With LoRA, the peft model that holds the policy's adapter

    @property
    def reference_mode(self):
        """Returns the context in which the reference computes. With LoRA it turns the policy's adapter off."""
        return self.lora.disable_adapter if self.lora else contextlib.nullcontext

    @property
    def separate_reference(self):
        """Returns the reference if it is a model of its own, for resharded to release, and None with LoRA."""
        return None if self.lora else self.reference


def build_models(args, tokenizer, device, rank, world):
    """Returns the trained policy and critic, frozen reference and reward. Under FSDP only rank 0 reads weights."""
    on_meta = args.fsdp and world > 1 and rank != 0
    reward = load_reward(args, tokenizer, on_meta)
    critic_init = args.critic_init if args.advantage_estimator == "gae" and not args.eval_only else None
    if critic_init == "auto":
        critic_init = "reward" if reward.reads_policy_tokens else "policy"
    elif critic_init == "reward" and not reward.reads_policy_tokens:
        raise common.UserError(
            "--critic_init reward: the critic reads the policy's tokens at every position, so it "
            "needs a decoder reward model with the policy's tokenizer; use --critic_init policy"
        )
    torch.manual_seed(args.seed)
    policy_hf = load_policy(args, tokenizer, on_meta)
    if args.fused_logits:  # output_logits, whose transforms the fused path applies, must reproduce the model's logits.
        common.agreed(lambda: on_meta or check_output_logits(policy_hf, "--sft_model_path", args.sft_model_path))
    length = args.max_prompt_length + args.response_length
    for model in [policy_hf] + ([reward.model.hf] if reward.reads_policy_tokens else []):
        common.check_position_table(model, length, f"--max_prompt_length + --response_length ({length})")
    critic_hf = critic_init and critic_from(dataclasses.replace(args, critic_init=critic_init), policy_hf, reward)
    offset = reward.model.shift / reward.model.scale if critic_init == "reward" else 0.0
    lora = None
    if args.lora_r and not args.eval_only:  # Frozen bases may be bfloat16. Adapters and heads train in float32.
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        lora = common.add_lora(policy_hf.to(dtype), args, "CAUSAL_LM")
        if critic_hf is not None:  # The head stays float32, both the copy peft trains and the reward model's.
            critic_lora = common.add_lora(heads_in_float32(critic_hf.to(dtype)), args, "SEQ_CLS")
    shared = lora and critic_init == "reward"  # The reward model is then the critic with its adapter off.
    if reward.model is not None:  # Sharded first, so that rank 0 holds at most three models whole
        reward.model = None if shared else parallelize(reward.model, args, device, frozen=True)
    if not lora:  # Sharded and computed as the policy is, so that the KL at initialisation is 0
        path = reference_source(args)
        ref_hf = (
            copy.deepcopy(policy_hf)
            if path == args.sft_model_path
            else load_policy(dataclasses.replace(args, sft_model_path=path), tokenizer, on_meta)
        )
        ref_policy = parallelize(ref_hf.eval().requires_grad_(False), args, device, frozen=True)
    if args.gradient_checkpointing:  # In training mode only, so sampling keeps its KV cache
        for model in [m for m in (policy_hf, critic_hf) if m is not None]:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    policy = parallelize(policy_hf, args, device)
    critic = None if critic_hf is None else parallelize(Critic(critic_hf, offset), args, device)
    if shared:
        reward.model = functools.partial(critic_as_reward, critic, critic_lora.disable_adapter)
        if collective(args):  # FSDP sets its units up at the first forward. It must see the adapter on, or
            with torch.no_grad(), resharded([critic]):  # peft marks the head's trained copy frozen.
                critic(*[torch.ones(1, 2, dtype=torch.long, device=device)] * 2)
    if rank == 0:
        print(describe_models(args, policy, critic, critic_init, reward, bool(lora)) + f"; {world} x {device.type}")
    return Models(policy, critic, policy if lora else ref_policy, reward, policy_hf, lora)


def describe_models(args, policy, critic, critic_init, reward, lora):
    """Returns the start-up line that names what each of the four roles is in this run: policy, reference, reward
    and critic."""

    def trained(model):
        n = sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6
        return f"trained, {n:.2f}M" + (f", LoRA rank {args.lora_r}" if lora else "")

    path = reward_model_source(args)  # None without a reward model
    notes = (
        ["frozen"]
        + ["reads the text"] * (not reward.reads_policy_tokens)
        + ["the critic with its adapter off"] * bool(lora and critic_init == "reward")
    )
    sources = [f"model {path} ({', '.join(notes)})"] * bool(path) + [f"function {args.reward_fn}"] * bool(reward.fn)
    policy_text = args.sft_model_path + (" (evaluated, not trained)" if args.eval_only else f" ({trained(policy)})")
    reference = (
        f"{reference_source(args)}, frozen"
        if args.eval_only
        else "the policy with its adapter off"
        if lora
        else "a frozen copy of the initial policy"
    )
    why_none = "--eval_only trains nothing" if args.eval_only else f"{args.advantage_estimator} learns no values"
    critic_text = (
        f"none ({why_none})"
        if critic is None
        else f"from the {'reward model' if critic_init == 'reward' else 'policy, with a new head'} ({trained(critic)})"
    )
    return f"models: policy {policy_text}; reference {reference}; reward {' + '.join(sources)}; critic {critic_text}"


def build_optimizer(policy, critic, args, num_updates):
    """Returns policy and critic as one module, AdamW at each one's learning rate, and the learning-rate schedule."""
    trainable = torch.nn.ModuleDict({"policy": policy, **({"critic": critic} if critic is not None else {})})
    rates = {"policy": args.learning_rate, "critic": args.critic_learning_rate}
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in model.parameters() if p.requires_grad], "lr": rates[name]}
            for name, model in trainable.items()
        ],
        lr=args.learning_rate,
        eps=1e-5,
        weight_decay=args.weight_decay,
        fused=True,
    )  # The polynomial schedule starts at lr.
    scheduler = transformers.get_scheduler(
        args.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=num_updates
    )
    return trainable, optimizer, scheduler


def load_prompts(args, tokenizer, split=None, rows=None):
    """Returns a split's prompts as token ids, not yet cut, and as texts: the training split's, or `split`'s `rows`."""
    if rows is None:
        rows = common.load_rows(args.dataset_name, args.dataset_config, split or args.dataset_train_split)
        if not rows:
            raise common.UserError(f"{args.dataset_name}: no split '{split or args.dataset_train_split}'")
    texts = [prompt_text(r, tokenizer, common.where(r)) for r in rows]
    distinct = list(dict.fromkeys(texts))  # Each text tokenized once: datasets repeat prompts.
    ids_of = dict(zip(distinct, common.tokenize_prompts(tokenizer, distinct)))
    ids = [ids_of[t] for t in texts]
    common.check_vocabulary(tokenizer, ids, args.dataset_name, args.sft_model_path, "--sft_model_path")
    if not all(ids):  # No BOS and no text: the first response token would attend to nothing.
        raise common.UserError(
            f"{common.where(rows[ids.index([])])}: the prompt is empty and {args.sft_model_path}'s "
            "tokenizer adds no BOS token, so the policy has nothing to continue; give it a prompt"
        )
    return ids, texts


@dataclass
class Prompts:
    ids: list  # Token ids, cut to --max_prompt_length
    texts: list  # The whole texts, as --reward_fn receives them


def train_and_eval_prompts(args, tokenizer):
    """Returns the training prompts and the eval prompts, no eval prompt's text among the training prompts.
    The eval prompts are --eval_split's, else the validation split's, else the test split's. Without one,
    --eval_holdout of the texts are held out with all their rows (common.hold_out). Eval prompts are deduplicated by
    text, and --num_eval_prompts distinct ones are drawn by seed, or all if fewer. Training prompts with an eval
    prompt's text are left out."""
    ids, texts = load_prompts(args, tokenizer)
    splits = (
        [args.eval_split] if args.eval_split else [s for s in ("validation", "test") if s != args.dataset_train_split]
    )
    read = ((s, common.load_rows(args.dataset_name, args.dataset_config, s)) for s in splits)  # each read once
    found, eval_rows = next(((s, rows) for s, rows in read if rows is not None), (None, None))
    if args.eval_split and found is None:
        names = common.split_names(args.dataset_name, args.dataset_config)
        raise common.UserError(
            f"{args.dataset_name}: no split {args.eval_split!r} (--eval_split); its splits: "
            f"{', '.join(map(str, names))}; pass one, or no --eval_split to hold out --eval_holdout "
            "of the training prompts"
        )
    if found is not None and not eval_rows:
        raise common.UserError(
            f"{args.dataset_name}: split {found!r} has no prompt to evaluate on; pass another --eval_split"
        )
    if found is not None:
        eval_ids, eval_texts = load_prompts(args, tokenizer, found, eval_rows)
        held, source = set(eval_texts), f"split {found!r}"
    else:
        held = common.hold_out(texts, args.eval_holdout, args.eval_seed)
        eval_ids, eval_texts = [i for i, t in zip(ids, texts) if t in held], [t for t in texts if t in held]
        source = f"{args.eval_holdout:g} of the prompts, held out by text"
    trained = [i for i, t in enumerate(texts) if t not in held]
    if not trained and not args.eval_only:
        raise common.UserError(
            f"{args.dataset_name}: every training prompt is an eval prompt ({source}); pass "
            "another --eval_split or more distinct prompts"
        )
    if not eval_ids:
        raise common.UserError(f"{args.dataset_name}: no eval prompt ({source}); pass --eval_split")
    # Each distinct text once, so that the standard errors are over distinct prompts.
    first_of_text = {}
    for i, text in enumerate(eval_texts):
        first_of_text.setdefault(text, i)
    first_of_text = list(first_of_text.values())
    chosen = sorted(
        random.Random(common.seed_of(args.eval_seed, "eval prompts")).sample(
            first_of_text, min(args.num_eval_prompts, len(first_of_text))
        )
    )
    bos_id = common.leading_id(tokenizer)
    cut = lambda p: truncate_prompt(p, args.max_prompt_length, bos_id)  # noqa: E731
    if not dist.is_initialized() or dist.get_rank() == 0:
        dropped = len(texts) - len(trained) if found is not None else 0
        fewer = f"; only {len(chosen)} distinct, each evaluated once" if len(chosen) < args.num_eval_prompts else ""
        print(
            f"prompts: {len(trained)} train, {len(chosen)} distinct eval prompts ({source}, {len(first_of_text)} "
            f"distinct in {len(eval_ids)} rows{fewer})"
            + (f"; {dropped} training prompts left out as eval prompts too" if dropped else "")
        )
    return (
        Prompts([cut(ids[i]) for i in trained], [texts[i] for i in trained]),
        Prompts([cut(eval_ids[i]) for i in chosen], [eval_texts[i] for i in chosen]),
    )


def prompt_text(row, tokenizer, where):
    """Returns a row's prompt: a pair's as rm.py splits it, a chat rendered up to the assistant's turn, or the text."""
    if "chosen" in row:
        return common.split_pair(row, tokenizer, where)[0]
    field = "prompt" if "prompt" in row else "messages"
    prompt = row.get(field)
    if isinstance(prompt, list):
        prompt = common.checked_messages(prompt, tokenizer, where, field)
        prompt = prompt[:-1] if prompt and prompt[-1]["role"] == "assistant" else prompt
        return common.render_chat(tokenizer, prompt, where, generation_prompt=True)
    if isinstance(prompt, str):
        return prompt
    raise common.UserError(f"{where}: no 'prompt', 'messages' or 'chosen' field to take a prompt from")


def load_ptx(args, tokenizer):
    if args.ptx_dataset_name == "embedded":
        rng = random.Random(args.seed + 1)
        texts = [common.embedded_prompt(rng) + common.embedded_response(rng) for _ in range(4096)]
    else:
        rows = common.load_rows(args.ptx_dataset_name)
        if not rows or "text" not in rows[0]:
            raise common.UserError(f"{args.ptx_dataset_name}: --ptx_dataset_name needs a 'text' column")
        texts = [r["text"] for r in rows]
    end, length = common.end_id(tokenizer), args.max_prompt_length + args.response_length
    return [(ids + [end])[:length] for ids in common.tokenize_prompts(tokenizer, texts)]


def pad_left(seqs, width, pad_id):
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
    return ids, torch.arange(width) >= width - torch.tensor([len(s) for s in seqs])[:, None]


def episode_prompts(episodes, n_prompts, seed, orders):
    """Returns each episode's prompt, the same on any number of processes and after any resume.
    Pass p = episode // n_prompts over the prompts follows a permutation seeded by seed and p."""
    for p in {e // n_prompts for e in episodes} - orders.keys():  # Each pass's permutation is drawn once.
        orders[p] = torch.randperm(
            n_prompts, generator=torch.Generator().manual_seed(common.seed_of(seed, "prompt order", p))
        )
    return [orders[e // n_prompts][e % n_prompts].item() for e in episodes]


# --- Reward plumbing: a reward model with rm.py's normalization, a function, or both. ---------------------------------
def critic_from(args, policy, reward):
    """Returns the critic's network, from the reward model or from the policy, as Critic's docstring says."""
    if args.critic_init == "reward":
        critic = copy.deepcopy(reward.model.hf).requires_grad_(True)
        with torch.no_grad():
            for p in critic.score.parameters():
                p /= reward.model.scale  # A bias too, where the head has one
        return critic
    config = without_dropout(copy.deepcopy(policy.config))
    config.num_labels = 1
    critic = common.meta_model(lambda: transformers.AutoModelForSequenceClassification.from_config(config))
    setattr(critic, critic.base_model_prefix, copy.deepcopy(policy.base_model))
    critic.score.to_empty(device=policy.device)
    torch.nn.init.normal_(critic.score.weight, std=1 / (config.hidden_size + 1) ** 0.5)
    if critic.score.bias is not None:
        torch.nn.init.zeros_(critic.score.bias)
    return common.scalar_head_in_float32(critic)


class Critic(torch.nn.Module):
    """Returns the value of each state: a sequence classifier's scalar head at every position, minus an offset.
    From the reward model, its head is divided by the reward's scale and its offset is shift / scale, so each prefix's
    value starts as its normalized score. From the policy, it has the policy's network and a new head, as rm.py's."""

    def __init__(self, hf_model, offset=0.0):
        super().__init__()
        self.hf, self.offset = hf_model, offset

    def forward(self, input_ids, attention_mask):
        hidden = self.hf.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=False,
            position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0),
        ).last_hidden_state
        return self.hf.score(hidden).squeeze(-1).float() - self.offset


class SequenceReward(torch.nn.Module):
    """Returns rm.py's normalized reward, (sequence_reward - shift) / scale, as one module that FSDP can gather."""

    def __init__(self, hf_model, shift, scale):
        super().__init__()
        self.hf, self.shift, self.scale = hf_model, shift, scale

    def forward(self, input_ids, attention_mask):
        return (sequence_reward(self.hf, input_ids, attention_mask) - self.shift) / self.scale


def critic_as_reward(critic, adapter_off, input_ids, attention_mask):
    """Returns the normalized reward as a LoRA critic from the reward model computes it with its adapter off."""
    with adapter_off():
        values = critic(input_ids, attention_mask)
    return values.gather(1, last_token_index(attention_mask)[:, None])[:, 0]


@dataclass
class Reward:
    """The sources of an episode's score: a reward model, a function, or both."""

    model: object = None  # A SequenceReward, sharded like the policy under FSDP
    tokenizer: object = None  # The reward model's own, for the decoded text; None if it reads the policy's tokens
    fn: object = None  # load_reward_fn's function, (prompts, responses) -> scores
    reads_policy_tokens: bool = False  # Whether a reward model reads the policy's tokens


def reward_model_source(args):
    """Returns the reward model's path or hub name, or None for a reward function alone."""
    path = args.reward_model_path if args.reward_model_path is not None else None if args.reward_fn else "runs/rm"
    looks_local = path is not None and (os.path.exists(path) or path.startswith((".", "/")) or path == "runs/rm")
    if looks_local and not any(os.path.exists(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        raise common.UserError(
            f"--reward_model_path {path}: no reward model there; train one first with "
            f"`python rm.py --output_dir {path}` (or pass a hub reward model)"
        )
    return path


def load_reward(args, tokenizer, on_meta=False):
    reward = Reward(fn=load_reward_fn(args.reward_fn) if args.reward_fn else None)
    if (path := reward_model_source(args)) is None:
        return reward
    config = without_dropout(common.load_pretrained(transformers.AutoConfig, path, "--reward_model_path"))
    adapter = common.adapter_base(path)
    if adapter:
        config.num_labels = 1  # An adapter's base config is a causal LM's; the head it saved is a scalar.
    if (
        not common.adapter_holds_head(path)
        if adapter
        else not any("SequenceClassification" in a for a in config.architectures or ["SequenceClassification"])
    ):
        # Else transformers would draw a random head, and PPO would train on noise without a word.
        raise common.UserError(
            f"--reward_model_path {path}: not a reward model (no trained scalar head: "
            f"{'an adapter without one' if adapter else config.architectures[0]}); train one with "
            "rm.py, or pass --reward_fn"
        )
    if config.num_labels != 1:
        raise common.UserError(
            f"--reward_model_path {path}: the model has {config.num_labels} labels; a reward model has one (a scalar)"
        )
    # float32, as rm.py trained it. With LoRA and --bf16 it is bfloat16, as every frozen base weight is then.
    dtype = torch.bfloat16 if args.lora_r and args.bf16 else torch.float32
    model = disable_dropout(
        common.load_model(
            transformers.AutoModelForSequenceClassification,
            path,
            "--reward_model_path",
            on_meta,
            config=config,
            dtype=dtype,
        )
    )
    heads_in_float32(common.scalar_head_in_float32(model)).eval().requires_grad_(False)
    own = common.load_pretrained(transformers.AutoTokenizer, path, "--reward_model_path")
    if own.pad_token is None:
        own.pad_token = own.eos_token  # Padding is read from the mask, never from pad ids.
    same_tokens = hasattr(model, "score") and all(
        own.convert_tokens_to_ids(t) == i for t, i in tokenizer.get_vocab().items()
    )
    shift, scale = getattr(model.config, "reward_shift", 0.0), getattr(model.config, "reward_scale", 1.0)
    return dataclasses.replace(
        reward,
        model=SequenceReward(model, shift, scale),  # rm.py's normalization
        tokenizer=None if same_tokens else own,
        reads_policy_tokens=same_tokens,
    )


def load_reward_fn(spec):
    """Returns --reward_fn's function, wrapped to check each call's output. Its module is a .py file or importable."""
    module, _, name = spec.rpartition(":")
    if not module or not name:
        raise common.UserError(f"--reward_fn {spec}: expected module:function, e.g. my_rewards:exact_match")
    try:
        if module.endswith(".py"):
            fn = runpy.run_path(module).get(name)
        else:
            sys.path.insert(0, os.getcwd())
            fn = getattr(importlib.import_module(module), name, None)
    except Exception as e:
        raise common.UserError(f"--reward_fn {spec}: cannot import {module} ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise common.UserError(f"--reward_fn {spec}: {module} has no function {name}")

    def checked(prompts, responses):
        try:
            out = list(fn(prompts, responses))
        except Exception as e:  # The user's code: its traceback from the function in, then where it was called
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            raise common.UserError(
                f"--reward_fn {spec} raised {type(e).__name__}: {e} (traceback above; called by "
                f"ppo.py's score() on {len(prompts)} prompts and responses)"
            ) from None
        bad = [v for v in out if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if len(out) != len(prompts) or bad:
            got = f"{len(out)} values for {len(prompts)} episodes" if len(out) != len(prompts) else f"{bad[0]!r}"
            raise common.UserError(f"--reward_fn {spec} returned {got}; it must return one finite number per episode")
        return torch.tensor(out, dtype=torch.float)

    return checked


def reward_model_tokens(batch, rows, stop_id, tokenizer, reward, args):
    """Returns the rows' episodes in the reward model's own tokens, built as rm.py builds a pair.
    The prompt is the text the policy saw, with the reward model's BOS. The response is decoded in context, which keeps
    word boundaries. It ends with the reward model's end token where the policy stopped, and always for an encoder."""
    lead, prompts, texts, stopped = tokenizer.decode(common.special_affixes(tokenizer)[0]), [], [], []
    query, query_mask = (t[rows, : batch.context_length].cpu() for t in (batch.query_response, batch.attention_mask))
    for q, qm, r, m in zip(query, query_mask.bool(), batch.responses[rows].cpu(), batch.mask[rows].cpu()):
        p_ids, r_ids = q[qm].tolist(), r[m].tolist()
        stopped.append(stop_id is not None and bool(r_ids) and r_ids[-1] == stop_id)
        r_ids = r_ids[:-1] if stopped[-1] else r_ids
        p_text = tokenizer.decode(p_ids, skip_special_tokens=False)
        full = tokenizer.decode(p_ids + r_ids, skip_special_tokens=False)
        texts.append(full[len(p_text) :] if full.startswith(p_text) else tokenizer.decode(r_ids))
        prompts.append(p_text[len(lead) :] if lead and p_text.startswith(lead) else p_text)
    rm_tokenizer, encoder = reward.tokenizer, not hasattr(reward.model.hf, "score")
    bos_id, table = common.leading_id(rm_tokenizer), common.position_table(reward.model.hf)
    r_ids = common.tokenize_responses(rm_tokenizer, prompts, texts)
    r_ids = [r if s or encoder else r[:-1] for r, s in zip(r_ids, stopped)]
    # The reward model may need more tokens than the policy. To fit its position table, the prompt is cut as rm.py cuts
    # one, keeping its end and BOS. A response longer than the whole table, never seen in practice, loses its start.
    seqs = [
        truncate_prompt(p, min(args.max_prompt_length, max((table or 1 << 62) - len(r), 1)), bos_id) + r
        for p, r in zip(common.tokenize_prompts(rm_tokenizer, prompts), r_ids)
    ]
    seqs = [s[:1] + s[len(s) - table + 1 :] if table and len(s) > table else s for s in seqs]
    batch = rm_tokenizer.pad({"input_ids": seqs}, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


# --- Held-out evaluation: the reference of --eval_only, the batches, the schedule, the statistics and the logs. -----
def reference_source(args):
    """Returns the reference's path: with --eval_only, the initial policy of the run that trained --sft_model_path, read
    from its ppo_results.json in the folder or an adapter's parent. Else the policy is its own reference, with KL 0.
    No seed is needed: the embedded initial policy is one checkpoint whatever --seed."""
    if args.eval_only and os.path.isdir(args.sft_model_path):
        for folder in (args.sft_model_path, os.path.dirname(os.path.abspath(args.sft_model_path))):
            if os.path.isfile(results := os.path.join(folder, "ppo_results.json")):
                with open(results) as f:
                    saved = json.load(f)["args"]
                return saved["sft_model_path"]
    return args.sft_model_path


@dataclass
class EvalBatch:
    ids: list
    texts: list
    index: list  # Each prompt's position in the eval set, which seeds its random stream
    real: int  # The rows before those that repeat a prompt to fill the batch


def eval_batches(prompts, args):
    """Yields the eval prompts in rollout batches of the training's size, so that they fit where training fits.
    The last batch repeats its first prompt up to that size, so that every process makes the same calls."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches * world
    for start in range(0, len(prompts.ids), size):
        part = [x[start : start + size] for x in (prompts.ids, prompts.texts, list(range(len(prompts.ids))))]
        fill = size - len(part[0])
        yield EvalBatch(*[x + x[:1] * fill for x in part], real=len(part[0]))


def eval_schedule(num_evals, num_updates, rank=0):
    """Returns the updates after which evaluate() runs: 0, before the first, and num_evals spread evenly to the end.
    A num_evals above the updates gives one after each update, and rank 0 says so in one line."""
    if not num_evals:
        return set()
    after = {math.ceil(k * num_updates / num_evals) for k in range(1, num_evals + 1)}
    if len(after) < num_evals and rank == 0:
        print(f"--num_evals {num_evals}: {len(after)}, one after each of the {num_updates} updates, and one before")
    return {0} | after


def mean_and_standard_error(rows, names, prefix):
    """Returns each measure's mean over the rows that have it, and as NAME_se its sample std over sqrt(n)."""
    out = {f"{prefix}prompts": len(rows)}
    for name, values in ((k, torch.tensor([r[k] for r in rows if k in r], dtype=torch.float64)) for k in names):
        if not len(values):
            continue
        se = values.std() / len(values) ** 0.5 if len(values) > 1 else torch.tensor(0.0)
        out[f"{prefix}{name}"], out[f"{prefix}{name}_se"] = values.mean().item(), se.item()
    return out


def paired_change(rows, baseline, names, prefix):
    """Returns each measure's mean change from the baseline's rows, as NAME_change, and its paired standard error, as
    NAME_change_se: the sample std of the per-prompt differences over sqrt(n). Rows pair by position, which is the
    prompt's position in the eval set, and each pair is checked to be one prompt."""
    if any(r["prompt"] != b["prompt"] for r, b in zip(rows, baseline, strict=True)):
        raise RuntimeError("paired_change: the rows and the baseline are not of the same prompts")
    diffs = [{k: r[k] - b[k] for k in names if k in r and k in b} for r, b in zip(rows, baseline)]
    stats = mean_and_standard_error(diffs, names, "")
    return {f"{prefix}{k}_change{se}": stats[k + se] for k in names if k in stats for se in ("", "_se")}


def distinct_ngrams(texts, n):
    """Returns distinct-n (Li et al. 2016): the distinct word n-grams of all the texts over their count, 0 if none.
    Words are split at whitespace. A set of responses that repeats one word has distinct-1 near 0."""
    grams = [tuple(words[i : i + n]) for words in (t.split() for t in texts) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def log_evaluation(logs, step, episodes, metrics, rows):
    """Writes an evaluation to metrics.jsonl and its rows to eval_samples.jsonl, and returns its record."""
    record = {"step": step, "episodes": episodes, **metrics}
    if logs is not None:  # Rank 0
        logs[0].log(record)
        logs[2].writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        logs[2].flush()
        tqdm.write("evaluation " + common.format_metrics(record))
    return record


def evaluate_only(models, prompts, args, tokenizer, stop_id):
    """Runs evaluate() once for --eval_only and writes eval_results.json and eval_samples.jsonl in --output_dir."""
    metrics, rows = evaluate(models, prompts, args, tokenizer, stop_id)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        common.write_atomic(
            os.path.join(args.output_dir, "eval_samples.jsonl"),
            "".join(json.dumps({"step": 0, **row}) + "\n" for row in rows),
        )
        common.write_json_atomic(
            os.path.join(args.output_dir, "eval_results.json"),
            {**metrics, "reference": reference_source(args), "args": dataclasses.asdict(args)},
        )
        print(
            f"{common.format_metrics(metrics)}\nevaluated {args.sft_model_path} on {len(rows)} prompts; "
            f"eval_results.json in {args.output_dir}"
        )
    common.leave_together()
    return metrics


# --- The sampler: each episode's own uniforms, seeded by its index, and the KV cache. ---------------------------------
def episode_uniform(seeds, step):
    """Returns u ~ Uniform(0, 1) for token `step` of each row's episode, in float64 and never 0 or 1.
    u = (bits + 1/2) / 2^52, the 52 bits hashed from seeds[b] and step alone (counter-based, Salmon et al. 2011). With
    no generator and no kernel per row, u is the same in any batch, on any number of processes, compiled or not."""
    low32 = 0xFFFFFFFF

    def mix(x):  # lowbias32 (Wellons 2018), a bijection of 32 bits. As c < 2^31, x * c fits in int64.
        for shift, c in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
            x = (x ^ (x >> shift)) * c & low32
        return x ^ (x >> 15)

    low, high, at = seeds & low32, seeds >> 32, mix(step & low32)  # step is an int, or a tensor in a compiled graph
    bits = (mix(low ^ mix(high ^ at)) << 20) | (mix(high ^ mix(low ^ mix(at ^ 0x9E3779B9))) >> 12)  # 32 + 20 bits
    return (bits.double() + 0.5) / 2**52


class ComputeDtypeCache(transformers.StaticCache):
    """transformers' StaticCache, holding keys and values in the dtype attention casts them to, so no number changes.
    Under bfloat16 autocast a rotary family's keys are float32 and its values bfloat16, which StaticCache refuses."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kind = key_states.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else value_states.dtype
        return super().update(key_states.to(dtype), value_states.to(dtype), layer_idx, *args, **kwargs)


@functools.cache
def takes_argument(model_class, name):
    """Returns whether the model's forward takes the argument name. A remote-code model may lack logits_to_keep."""
    return name in inspect.signature(model_class.forward).parameters


# --- The learning phase's bookkeeping. --------------------------------------------------------------------------------
def entropy_of(logp_all):
    """Returns -sum p log p over the last dimension, with 0 log 0 = 0, so a -inf logit gives 0, not NaN.
    With autograd a clamp keeps gradients finite, changing no term as p is 0 below -104. Else p's memory is reused."""
    p = logp_all.exp()
    if torch.is_grad_enabled():
        return -(p * logp_all.clamp(min=-1e4)).sum(-1)
    return torch.special.entr(p, out=p).sum(-1)


def language_modelling_loss(policy, seqs, pad_id, n_tokens, device, fused=False):
    """Returns the ptx loss (Ouyang et al. 2022, eq. 2): next-token cross-entropy summed, divided by n_tokens."""
    ids, ids_mask = (t.to(device) for t in pad_left(seqs, max(map(len, seqs)), pad_id))
    logprobs, _ = response_logprobs(policy, ids, ids_mask.long(), 1, 1.0, fused=fused)
    real = (ids_mask[:, 1:] & ids_mask[:, :-1]).float()  # A target counts only after a real token.
    return (-logprobs * real).sum() / n_tokens


def ptx_backward(policy, ptx, step, update, epoch, mb, args, pad_id):
    """Runs PPO-ptx's backward pass for one optimizer step and returns the loss of this process's share.
    The step takes as many pretraining sequences as its mini-batch has episodes, in order by the step's index. They
    are the same on any number of processes and after any resume. The loss divides by all their tokens."""
    first = ((update * args.num_ppo_epochs + epoch) * args.num_mini_batches + mb) * len(step.rows)
    seqs = [ptx[i % len(ptx)] for i in range(first, first + len(step.rows))]
    n_tokens, total = sum(len(s) - 1 for s in seqs), 0
    sync_gradients([policy], last=False)  # DDP all-reduces them with the PPO losses' gradients.
    for rows in process_share(torch.arange(len(seqs))).split(args.per_device_train_batch_size):
        with torch.autocast(step.rows.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = language_modelling_loss(
                policy, [seqs[i] for i in rows.tolist()], pad_id, n_tokens, step.rows.device, args.fused_logits
            )
        (args.ptx_coef * loss).backward()
        total = total + loss.detach()
    return total


def sync_gradients(models, last):
    """Makes DDP all-reduce gradients in a step's last backward pass only. FSDP2 reduce-scatters every one's, since
    skipping it (set_requires_gradient_sync) would keep whole unsharded gradients on every process."""
    for model in (m for m in models if isinstance(m, torch.nn.parallel.DistributedDataParallel)):
        model.require_backward_grad_sync = last


def clip_and_step(trainable, optimizer, max_grad_norm, update, pg_loss):
    """Clips both models' gradients together, steps, clears them, and returns each model's norm before clipping.
    max_grad_norm 0 clips nothing. A norm that is not finite stops the run before the step, so checkpoints stay good.
    pg_loss is the step's policy loss, the sum of its micro-batches' parts on this process."""

    def full(norm):  # Under FSDP a DTensor, each rank holding its shards' part
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    norms = {
        f"{name}/grad_norm": full(
            torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        )
        for name, model in trainable.items()
    }
    norm = full(torch.nn.utils.clip_grad_norm_(trainable.parameters(), max_grad_norm or float("inf")))
    if not math.isfinite(norm):
        raise common.UserError(
            f"update {update + 1}: the gradient norm is {norm} (the step's policy loss "
            f"{pg_loss.item():.4g}); training diverged: lower --learning_rate; --resume continues "
            "from the last checkpoint"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norms


def mean_over_steps(stats):
    """Returns each statistic's mean over the update's optimizer steps, and the ratio's variance.
    A step's statistic is the sum of every process's part, each a sum over its tokens divided by the step's count."""
    names = list(stats[0])
    per_step = dict(zip(names, all_reduce(torch.stack([torch.stack([s[k] for s in stats]) for k in names]))))
    means = {k: v.mean().item() for k, v in per_step.items() if k != "policy/ratio_sq"}
    means["policy/ratio_var"] = (per_step["policy/ratio_sq"] - per_step["policy/ratio"] ** 2).mean().item()
    return means


# --- Processes: torchrun's environment variables, or one process under `python ppo.py`. -------------------------------
def setup_distributed():
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    common.attention_without_nan(device)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # An hour, not the default 10 minutes, as the ranks wait in a collective while rank 0 writes the final model.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
    return rank, world, device


def parallelize(model, args, device, frozen=False):
    """Returns the model under DDP, or under FSDP2 from rank 0's weights with a unit per block, embeddings and head.
    A frozen model is a replica under DDP. Under FSDP it is sharded too, on the host with --offload_inference_models."""
    host = frozen and args.offload_inference_models and device.type == "cuda"
    if not dist.is_initialized() or (frozen and not args.fsdp):
        return model.to(device)
    if args.fsdp:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        # bf16 is for compute only. The sharded parameters, and so the optimizer's steps, keep their own dtype.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32)
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=True)} if host else {}

        def shard(model):
            hf = next(m for m in model.modules() if hasattr(m, "get_input_embeddings"))
            # The head is its own unit, gathered in float32: a scalar head of Float32Linear layers, in peft's wrapper
            # or not, or a causal LM's untied float32 output layer, gathered for the logits rather than with the root.
            if getattr(hf, "score", None) is not None:
                linears = [m for m in hf.score.modules() if isinstance(m, torch.nn.Linear)]
                head = hf.score if linears and all(isinstance(m, common.Float32Linear) for m in linears) else None
            else:
                output = hf.get_output_embeddings()
                untied = isinstance(output, torch.nn.Linear) and output.weight is not hf.get_input_embeddings().weight
                head = output if untied and output.weight.dtype == torch.float32 else None
            in_float32 = set(head.parameters()) if head is not None else set()
            if frozen and args.bf16:  # Gathered in bfloat16 anyway, so stored so: the same numbers in half the memory
                for p in set(model.parameters()) - in_float32:  # Parameters only: RoPE's buffers stay float32.
                    p.data = p.data.to(torch.bfloat16)
            for block in next(
                m
                for m in model.modules()
                if isinstance(m, torch.nn.ModuleList) and len(m) == hf.config.num_hidden_layers
            ):
                fully_shard(block, mp_policy=mp, **offload)
            common.shard_input_embeddings(model, fully_shard, mp_policy=mp, **offload)
            if head is not None:  # Its inputs are cast to float32, and so are logits, values and rewards.
                fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32), **offload)
            fully_shard(model, mp_policy=mp, **offload)

        sharded = common.shard_from_rank0(model, shard, device, host)
        return sharded if frozen else sum_gradients(sharded)
    model.to(device)
    # gradient_as_bucket_view makes the gradients views into DDP's all-reduce buckets, not a second copy.
    return sum_gradients(
        torch.nn.parallel.DistributedDataParallel(
            model,
            device_ids=None if device.type == "cpu" else [device.index],
            broadcast_buffers=False,
            gradient_as_bucket_view=True,
        )
    )


def heads_in_float32(model):
    """Returns the sequence classifier with its scalar head in float32, the rest as it is (README's precision table)."""
    (getattr(model, "score", None) or getattr(model, "classifier", None) or torch.nn.Identity()).float()
    return model


@contextlib.contextmanager
def gathered_once(model, enabled):
    """Under FSDP, keeps the weights gathered through a rollout's decodes, one all-gather per block, then reshards."""
    if not enabled:
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        with resharded([model]):
            yield
    finally:
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)  # FSDP's own setting for the root


def unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def all_gather_cat(t):
    if not dist.is_initialized():
        return t
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def all_reduce(t, op=None):
    if dist.is_initialized():
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def all_gather_objects(items):
    """Returns every process's list, concatenated in process order."""
    if not dist.is_initialized():
        return items
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def process_share(rows):
    """Returns this process's equal share of rows, in order, or all of them in a single process."""
    if not dist.is_initialized():
        return rows
    return rows.chunk(dist.get_world_size())[dist.get_rank()]


def rows_of_every_process(t):
    """Returns the sum over processes of a (..., B, T) tensor in which each filled its own rows, the others 0."""
    return all_reduce(t)


def collective(args):
    """Returns whether all processes must make the same forward calls. FSDP on several gathers weights in them."""
    return args.fsdp and dist.is_initialized() and dist.get_world_size() > 1


def all_processes_done(done, args):
    """Returns whether every row has stopped. Under FSDP it asks every process, so that all decode the same steps."""
    return bool(all_reduce(done.all().float(), dist.ReduceOp.MIN)) if collective(args) else bool(done.all())


def sum_gradients(model):
    """Makes DDP or FSDP2 sum gradients over processes instead of averaging them.
    Each process's loss is then its part of the mini-batch's mean, with no factor for the number of processes."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):

        def all_reduce_sum(state, bucket):
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, all_reduce_sum)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):  # Each FSDP2 unit, reduced by SUM on gloo and NCCL alike
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


@contextlib.contextmanager
def resharded(models):
    """Releases frozen sharded models' weights after they compute. FSDP's root keeps them for a backward never run."""
    try:
        yield
    finally:
        for unit in (u for m in models if isinstance(m, torch.nn.Module) for u in m.modules() if hasattr(u, "reshard")):
            unit.reshard()


# --- Logging, the final save, figures. --------------------------------------------------------------------------------
def open_logs(args, rank, saved):
    """Returns rank 0's metrics logger, samples.jsonl and eval_samples.jsonl. On resume they go on after `saved`."""
    files = ("samples.jsonl", "eval_samples.jsonl")
    return (
        None
        if rank != 0
        else (
            common.Logger(args, args.wandb_project, saved),
            *(common.open_log(os.path.join(args.output_dir, f), saved) for f in files),
        )
    )


def log_update(logs, bar, m, last, args, tokenizer, batch):
    """Writes the update's metrics to every log, and a table of samples every --sample_every updates and at the last."""
    logger, samples_file, _ = logs
    logger.log(m)
    shown = {"score": "objective/scores", "kl": "objective/kl", "gold": "gold/mean"}  # gold is the embedded task's.
    bar.set_postfix(**{name: f"{m[key]:.3f}" for name, key in shown.items() if key in m})
    if (m["step"] - 1) % args.sample_every and not last:
        return
    bar.write(common.format_metrics(m))
    c = batch.context_length
    for i in range(min(args.num_samples, len(batch.scores))):
        prompt = tokenizer.decode(batch.query_response[i, :c][batch.attention_mask[i, :c].bool()])
        row = {
            "step": m["step"],
            "prompt": prompt,
            "response": tokenizer.decode(batch.responses[i][batch.mask[i]]),
            **{name: v[i].item() for name, v in (("score", batch.scores), ("gold", batch.gold)) if v is not None},
        }
        bar.write(
            f"  {prompt[-60:]!r} -> {row['response'][:80]!r}"
            + "".join(f"  {name} {row[name]:.3f}" for name in ("score", "gold") if name in row)
        )
        samples_file.write(json.dumps(row) + "\n")
    samples_file.flush()


def update_metrics(batch, kl, non_score_reward, times, args, peak_memory_of=None):
    """Returns the rollout's statistics under TRL's names, throughput, phase times and the peak memory if asked."""
    mask, elapsed = batch.mask.float(), times[-1] - times[0]
    # objective/entropy, TRL's name, is a one-sample estimate: -log p of the sampled tokens, summed over the response.
    m = {
        "objective/kl": kl.sum(1).mean(),
        "objective/entropy": (-batch.logprobs * mask).sum(1).mean(),
        "objective/non_score_reward": non_score_reward.sum(1).mean(),
        "objective/scores": batch.scores.mean(),
        "objective/rlhf_reward": (batch.scores + non_score_reward.sum(1)).mean(),
        "response/length": mask.sum(1).mean(),
        "perf/episodes_per_s": len(mask) / elapsed,
        **{f"perf/time_{p}": t1 - t0 for p, t0, t1 in zip(("rollout", "score", "learn"), times, times[1:])},
        "perf/tokens_per_s": batch.attention_mask.sum().item() * (1 + args.num_ppo_epochs) / elapsed,
    }
    if batch.values is not None:
        m["val/mean"] = masked_mean(batch.values, mask)
    if batch.has_stop is not None:  # None with --stop_token none, where no response can stop
        m["response/eos_rate"] = batch.has_stop.float().mean()
    if batch.gold is not None:
        m["gold/mean"], m["gold/std"] = batch.gold.mean(), batch.gold.std()
    return {**{k: float(v) for k, v in m.items()}, **(common.peak_memory(peak_memory_of) if peak_memory_of else {})}


def save_final(trainable, policy_hf, lora, tokenizer, history, logs, args, rank):
    """Saves the policy, merged under LoRA with its adapter in output_dir/adapter, its tokenizer, curves and results.
    ppo_results.json holds the first and last 5 updates' means of proxy score, KL and gold, and the last evaluation."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    policy_sd = get_model_state_dict(trainable["policy"], options=options)
    if rank != 0:
        return
    if lora is not None:
        policy_hf = common.save_lora(policy_hf, lora, policy_sd, tokenizer, args.output_dir)
        policy_sd = policy_hf.state_dict()
    common.save_pretrained_atomic(policy_hf, tokenizer, args.output_dir, state_dict=policy_sd)
    # Scores and KL against episodes, and scores against sqrt(KL), the axis on which Gao et al. 2022 show the gold
    # score rising, then falling (reward model overoptimization). Held-out evaluations are drawn beside training.
    from matplotlib.figure import Figure

    train, evals = [h for h in history if "objective/kl" in h], [h for h in history if "eval/score" in h]
    axes = Figure(figsize=(15, 4)).subplots(1, 3)
    for rows, x_key, kl_key, lines in (
        (train, "episodes", "objective/kl", (("proxy", "objective/scores"), ("gold", "gold/mean"))),
        (evals, "episodes", "eval/kl", (("held-out proxy", "eval/score"), ("held-out gold", "eval/gold"))),
    ):
        style = "-" if rows is train else "o--"
        for name, key in ((n, k) for n, k in lines if rows and k in rows[0]):
            axes[0].plot([h[x_key] for h in rows], [h[key] for h in rows], style, label=name)
            axes[2].plot(
                [max(h[kl_key], 0.0) ** 0.5 for h in rows],
                [h[key] for h in rows],
                "." if rows is train else "o",
                alpha=0.5 if rows is train else 1.0,
                label=name,
            )
        if rows:
            axes[1].plot(
                [h[x_key] for h in rows],
                [h[kl_key] for h in rows],
                style,
                label="training batches" if rows is train else "held-out prompts",
            )
    axes[0].set(title="Score (mean per episode)", xlabel="episodes")
    axes[1].set(title="KL to the reference (summed over the response)", xlabel="episodes")
    axes[2].set(title="Score against sqrt(KL), a dot per update or evaluation", xlabel="sqrt(KL)")
    for ax in axes[:2]:
        ax.legend()
    common.save_figure(axes[0].figure, os.path.join(args.output_dir, "curves.png"))
    summary = {}
    for key, name in {
        "objective/scores": "proxy",
        "objective/kl": "kl",
        "gold/mean": "gold",
        "gold/std": "gold_std",
    }.items():
        if xs := [h[key] for h in history if key in h]:
            summary[f"{name}_first"], summary[f"{name}_last"] = (sum(p) / len(p) for p in (xs[:5], xs[-5:]))
    final = {k.replace("/", "_") if "/" in k else f"eval_{k}": v for k, v in evals[-1].items()} if evals else {}
    common.write_json_atomic(
        os.path.join(args.output_dir, "ppo_results.json"), {**summary, **final, "args": dataclasses.asdict(args)}
    )
    for log in logs:
        log.close()
    print(
        " ".join(
            f"{k}={v:.4g}"
            for k, v in {**summary, **final}.items()
            if k.startswith(("gold", "proxy", "kl", "eval_score", "eval_gold", "eval_kl"))
        )
        + f"; saved to {args.output_dir}"
    )


# --- Opt-in: --group_by_length, less padding for the same numbers, as tests/test_ppo.py checks. -----------------------
GROUP_OVERHEAD_TOKENS = 64  # One more forward and backward's cost in tokens: 30 on 2 CPU cores, more on GPUs


def length_groups(prompt_lengths, response_lengths, overhead=None):
    """Returns the rows, sorted by length, in groups that each make one trimmed forward. A group's width is its longest
    prompt plus its longest response. A row joins the last group unless the padding added costs more than a call."""
    overhead = GROUP_OVERHEAD_TOKENS if overhead is None else overhead
    p, r = prompt_lengths.tolist(), response_lengths.tolist()
    groups, longest = [], (0, 0)
    for i in sorted(range(len(p)), key=lambda i: (p[i] + r[i], p[i])):
        grown = (max(longest[0], p[i]), max(longest[1], r[i]))
        if groups and (len(groups[-1]) + 1) * sum(grown) - len(groups[-1]) * sum(longest) <= p[i] + r[i] + overhead:
            groups[-1].append(i)
        else:
            groups.append([i])
            grown = (p[i], r[i])
        longest = grown
    return [torch.tensor(g) for g in groups]


def length_grouped(batch, rows, args):
    """Returns micro_batches under --group_by_length: each micro-batch's rows split by length_groups.
    A group's forward drops the columns that are padding in all its rows. Position ids come from the mask, so the real
    tokens' outputs do not change. Under collective FSDP the micro-batches stay plain."""
    if collective(args):
        return micro_batches(batch, rows, dataclasses.replace(args, group_by_length=False))
    context, out, micro = batch.context_length, [], args.per_device_train_batch_size
    prompt_lengths, response_lengths = batch.attention_mask[:, :context].sum(1), batch.mask.sum(1)
    for r in rows.split(micro):
        for group in (r[g.to(r.device)] for g in length_groups(prompt_lengths[r], response_lengths[r])):
            real = batch.attention_mask[group].bool().any(0)
            first = min(int(real.int().argmax()), context - 1)
            last = max(len(real) - int(real.flip(0).int().argmax()), context + 1)
            out.append(
                MicroBatch(
                    group,
                    batch.query_response[group][:, first:last],
                    batch.attention_mask[group][:, first:last],
                    context - first,
                    last - context,
                )
            )
    return out


def old_logprob_micro_batches(batch, args, update):
    """Returns phase 2's micro-batches: this process's rows in order, in micro-batches of learn()'s shape.
    Under --group_by_length they are the forwards of learn()'s first epoch, so that the first ratio is exactly 1. A
    row's numbers may differ in the last bits with its micro-batch's shape, and grouped shapes differ by phase."""
    if args.group_by_length and not collective(args):
        return [f for step in epoch_plan(batch, args, update, 0) for f in step.forwards]
    return micro_batches(batch, process_share(torch.arange(len(batch.mask), device=batch.mask.device)), args)


# --- Opt-in: --fused_logits, response_logprobs' numbers in one pass over the vocabulary, in bounded memory. ----------
FUSED_BLOCK = (256, 2048)  # Tokens x vocabulary rows in one block of logits: 2 MB in float32, which a cache holds


def output_logits(model, hidden, temperature=1.0):
    """Returns a causal LM's float32 logits / temperature from its output layer's inputs, whatever autocast and dtype.
    The layer is followed by Gemma's softcapping, Cohere's logit scale or Granite's scaling (check_output_logits). When
    all is linear, (h / T) W = (h W) / T divides the hidden states rather than the vocabulary-wide logits."""
    head, linear = model.get_output_embeddings(), logits_linear_in_hidden(model)
    with torch.autocast(hidden.device.type, enabled=False):
        hidden = hidden.float() / temperature if linear else hidden.float()
        # A module call, so that FSDP gathers the layer where it is its own unit. The layer computes in float32.
        logits = head(hidden if isinstance(head, common.Float32Linear) else hidden.to(head.weight.dtype)).float()
        return after_output_layer(model, logits, 1.0 if linear else temperature)


def logits_linear_in_hidden(model):
    """Returns whether the logits are linear in the output layer's inputs: no softcapping and no bias."""
    head = model.get_output_embeddings()
    return getattr(model.config, "final_logit_softcapping", None) is None and getattr(head, "bias", None) is None


def after_output_layer(model, logits, temperature):
    """Returns logits / temperature from the output layer's outputs, elementwise: Gemma's softcapping, then Cohere's
    logit scale or Granite's scaling, as each family's forward applies them."""
    if cap := getattr(model.config, "final_logit_softcapping", None):
        logits = cap * torch.tanh(logits / cap)
    if (scale := getattr(model, "logit_scale", None)) is not None:
        logits = logits * scale
    if divisor := getattr(model.config, "logits_scaling", None):
        logits = logits / divisor
    return logits if temperature == 1.0 else logits / temperature


def head_inputs(model, **inputs):
    """Returns the hidden states the output layer reads, from the model's own forward, and never computes its logits."""
    captured = []

    def capture(module, args):
        captured.append(args[0])
        return (args[0][:, :0],) + args[1:]

    with unwrap(model).get_output_embeddings().register_forward_pre_hook(capture):
        model(**inputs)
    return captured[0]


def fused_response_logprobs(policy, inputs, predicting, targets, temperature, entropy=False, entropy_grad=True):
    """Returns response_logprobs' numbers from one pass over the vocabulary, block by block (FusedLogprobs).
    No [tokens, vocabulary] tensor is held, in the forward or the backward: 1.2 GB for 16 x 128 x 152k floats."""
    model, hidden = unwrap(policy), head_inputs(policy, **inputs)[:, -predicting:-1]
    head, linear = model.get_output_embeddings(), logits_linear_in_hidden(model)
    if not isinstance(head, common.Float32Linear):  # e.g. an output layer that LoRA adapts
        raise common.UserError(
            f"--fused_logits: the output layer is a {type(head).__name__}, not a linear layer computed in float32; "
            "leave out --fused_logits"
        )
    transform = functools.partial(after_output_layer, model, temperature=1.0 if linear else temperature)
    with torch.autocast(hidden.device.type, enabled=False):
        x = (hidden.float() / temperature if linear else hidden.float()).flatten(0, 1)
        # Called as the layer, so that FSDP gathers its weight for the forward and the backward, and reduces its
        # gradient, as for the layer's own forward.
        head.forward = functools.partial(fused_output_layer, head, transform, entropy)
        try:
            logprobs, entropies = head(x, targets.flatten())
        finally:
            del head.forward
    entropies = entropies.view(targets.shape) if entropy else None
    return logprobs.view(targets.shape), entropies if entropy_grad or entropies is None else entropies.detach()


def fused_output_layer(head, transform, entropy, x, targets):
    """The output layer's forward under --fused_logits: each row's log-prob of its target, and its entropy."""
    return FusedLogprobs.apply(x, head.weight, head.bias, targets, transform, entropy)


def layer_blocks(x, weight, bias):
    """Yields (tokens, vocabulary rows, those rows' float32 weights, the output layer's outputs there) for every block
    of FUSED_BLOCK, vocabulary block by vocabulary block, so that each block of weights is read from memory once."""
    rows, cols = FUSED_BLOCK
    for v in range(0, weight.shape[0], cols):
        w = weight[v : v + cols].float()
        b = None if bias is None else bias[v : v + cols].float()
        for r in range(0, len(x), rows):
            yield slice(r, r + rows), slice(v, v + cols), w, F.linear(x[r : r + rows], w, b)


class FusedLogprobs(torch.autograd.Function):
    """Returns each row's log-prob of its target, and its entropy (or zeros), from the output layer's float32 inputs
    x, weight W and bias b, in one pass over the vocabulary, block by block (Milakov and Gimelshein 2018; Wijmans et
    al. 2025). A row's logits are z = transform(x W^T + b), logits / temperature after the family's transforms.

    With lse = logsumexp(z) and p = exp(z - lse): log p_y = z_y - lse, and H = -sum p log p = lse - sum p z. The
    forward keeps, per row, the running maximum m, s = sum exp(z - m) and t = sum exp(z - m) (z - m), each sum
    rescaled by exp(m_old - m_new) when m grows. Then lse = m + log s and H = log s - t / s. A -inf logit adds 0 to
    both, as entropy_of's clamp makes it. Only lse and H per row are saved, beside x, W, b and the targets.
    The backward recomputes each block's logits (a fourth matmul) and takes their gradient directly:
      d log p_y / dz = onehot_y - p,
      dH / dz = -p (z - sum p z) = -p (log p + H),
    so dL/dz = g_y onehot_y - p (g_y + g_H (log p + H)) for incoming gradients g_y and g_H. Autograd differentiates
    the family's transform on the block; then dL/dx += dL/da W and dL/dW += (dL/da)^T x, with a = x W^T + b."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, transform, entropy):
        m = torch.full_like(x[:, 0], torch.finfo(torch.float32).min)  # finite, so that m - m is 0, never NaN
        s, t, picked = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        for r, v, _, a in layer_blocks(x, weight, bias):
            z, y = transform(a), targets[r] - v.start
            inside = (y >= 0) & (y < z.shape[1])
            picked[r] = torch.where(inside, z.gather(1, y.clamp(0, z.shape[1] - 1)[:, None])[:, 0], picked[r])
            new_max = torch.maximum(m[r], z.amax(1))
            shift = m[r] - new_max  # at most 0: the sums so far are multiplied by exp(shift)
            z, rescale = z.sub_(new_max[:, None]), shift.exp()  # z - m, at most 0
            e = z.exp()
            if entropy:
                t[r] = rescale * (t[r] + s[r] * shift) + (e * z.clamp_(min=-1e4)).sum(1)
            s[r] = rescale * s[r] + e.sum(1)
            m[r] = new_max
        lse = m + s.log()
        entropies = s.log() - t / s if entropy else torch.zeros_like(lse)
        ctx.save_for_backward(x, weight, bias, targets, lse, entropies)
        ctx.transform, ctx.entropy = transform, entropy
        ctx.set_materialize_grads(False)  # An unused output's gradient is None, and its term is skipped.
        return picked - lse, entropies

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropies):
        x, weight, bias, targets, lse, entropies = ctx.saved_tensors
        grad_logprobs = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs
        with_entropy = ctx.entropy and grad_entropies is not None
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, device=x.device) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(bias.shape, device=x.device) if ctx.needs_input_grad[2] else None
        with torch.autocast(x.device.type, enabled=False):
            for r, v, w, a in layer_blocks(x, weight, bias):
                with torch.enable_grad():
                    z = ctx.transform(a.requires_grad_())
                logp = z.detach() - lse[r, None]
                p = logp.exp()
                if with_entropy:
                    grad = logp.clamp_(min=-1e4).add_(entropies[r, None]).mul_(grad_entropies[r, None])
                    grad = grad.add_(grad_logprobs[r, None]).mul_(p).neg_()
                else:
                    grad = p.mul_(-grad_logprobs[r, None])
                y = targets[r] - v.start
                inside = (y >= 0) & (y < grad.shape[1])
                grad.scatter_add_(1, y.clamp(0, grad.shape[1] - 1)[:, None], (grad_logprobs[r] * inside)[:, None])
                if z is not a:  # the family's transform, differentiated on the block
                    grad = torch.autograd.grad(z, a, grad)[0]
                if grad_x is not None:
                    grad_x[r].addmm_(grad, w)
                if grad_w is not None:
                    grad_w[v].addmm_(grad.T, x[r])
                if grad_b is not None:
                    grad_b[v] += grad.sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None


@torch.no_grad()
def check_output_logits(model, flag, name):
    """Raises a UserError before training if output_logits does not reproduce the model's own logits."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(1, 9, device=next(model.parameters()).device)[None] % vocab
    own = model(input_ids=ids).logits.float()
    ours = output_logits(model, head_inputs(model, input_ids=ids)).float()
    # bfloat16 weights round the model's own logits by 2^-8 relative. An unknown transform moves them more.
    tol = 1e-4 if model.get_output_embeddings().weight.dtype == torch.float32 else 1e-2
    if not torch.allclose(own, ours, atol=tol, rtol=tol):
        raise common.UserError(
            f"{flag} {name}: ppo.py's output_logits does not reproduce this model's logits (an "
            f"output transform it does not know, in {type(model).__name__}); add it there"
        )


# --- --compile: the decode step through CUDA graphs. ------------------------------------------------------------------
STOP_CHECK_EVERY = 16  # Tokens between two reads of whether every row has stopped. A read waits for the GPU.
DECODES = weakref.WeakKeyDictionary()  # Each model's CompiledDecode, which holds no reference to the model


@torch.no_grad()
def compiled_generate(model, query, query_mask, seeds, args, stop_id, pad_id):
    """Returns generate's tokens, the first from the prompt's forward and each after it from CompiledDecode's step."""
    model, kind = unwrap(model), query.device.type
    # Every rollout has these rows and --max_prompt_length + --response_length columns, so it compiles once.
    key = (
        len(query),
        max(query.shape[1], args.max_prompt_length or 0) + args.response_length,
        args.temperature,
        torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None,
    )
    if (decode := DECODES.get(model)) is None or decode.key != key:
        decode = DECODES[model] = CompiledDecode(model, key)
    decode.cache.reset()
    position = (query_mask.long().cumsum(1) - 1).clamp(min=0)
    mask = F.pad(query_mask.long(), (0, decode.cache_length - query.shape[1]), value=1)
    last_only = {"logits_to_keep": 1} if takes_argument(type(model), "logits_to_keep") else {}
    tokens = [decode.forward(model, query, 0, position, mask, seeds, **last_only)]  # The prompt is not compiled.
    step = torch.zeros((), dtype=torch.long, device=query.device)  # The index lives on the device.
    position = position[:, -1:].contiguous()  # Strides too are the same in every rollout.
    for t in range(1, args.response_length):
        if t % STOP_CHECK_EVERY == 0 and stop_id is not None and (torch.cat(tokens, 1) == stop_id).any(1).all():
            break
        step.fill_(t)
        torch.compiler.cudagraph_mark_step_begin()
        tokens.append(decode.step(model, tokens[-1], step, position, mask, seeds).clone())  # Graphs reuse outputs.
    responses = torch.cat(tokens, 1)
    if stop_id is not None:  # As generate, pad after the first token where every row had stopped.
        all_stopped = (responses == stop_id).cumsum(1).gt(0).all(0)  # (T,)
        responses = responses.masked_fill(F.pad(all_stopped[:-1], (1, 0), value=False), pad_id)
    return F.pad(responses, (0, args.response_length - responses.shape[1]), value=pad_id)


class CompiledDecode:
    """generate's one-token step, compiled once by torch.compile(mode="reduce-overhead") as in gpt-fast.
    Shapes are fixed: a static cache of cache_length columns and the step index on the device. On a GPU each token
    replays one CUDA graph, with no host sync. In float32 on a CPU it draws the plain step's tokens."""

    def __init__(self, model, key):
        self.key, self.cache_length, self.temperature = key, key[1], key[2]
        self.cache = ComputeDtypeCache(config=model.config, max_cache_len=self.cache_length)
        self.step = torch.compile(self.forward, mode="reduce-overhead", dynamic=False)

    def forward(self, model, ids, t, position, mask, seeds, **last_only):  # Token t from the prompt or token t - 1
        logits = (
            model(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=self.cache,
                use_cache=True,
                position_ids=position + t,
                **last_only,
            )
            .logits[:, -1]
            .float()
            / self.temperature
        )
        return sample_tokens(logits, seeds, t)[:, None]


if __name__ == "__main__":
    common.exit_on_user_error(main, common.cli(Args))
