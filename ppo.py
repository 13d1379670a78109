"""PPO for language models (RLHF) in one file.

    python rm.py && python ppo.py                  # embedded task: reward model, then PPO, CPU, a few minutes
    torchrun --nproc_per_node 2 ppo.py             # the same PPO on 2 processes
    torchrun --nproc_per_node 8 ppo.py --sft_model_path EleutherAI/pythia-1b-deduped \
        --reward_model_path runs/rm --dataset_name trl-lib/tldr --response_length 53 --bf16
    python ppo.py --reward_fn common:gold_rewards  # a rule (here the embedded task's true reward) instead of a model
    python ppo.py --help                           # every option

Models: the policy (trained), a frozen reference (the initial policy; with LoRA, the policy with its adapter off), a
critic (trained; by default the reward model's network) and the reward (a frozen reward model and/or a function).
Each update hands one Rollout batch through the phases of main():
  1. rollout: sample a response to each prompt (K per prompt), token by token, KV-cached, one random stream per episode;
  2. log-probs and values: the policy's (the ratio's "old"), the reference's and the critic's, each token's;
  3. score: the reward at the response's last real token;
  4. advantages: rewards = -kl_coef * KL per token, plus the score at the last token; GAE, whitened;
  5. learn: num_ppo_epochs passes of the clipped policy loss and clipped value loss over shuffled mini-batches;
  6. adapt kl_coef, log, checkpoint.
Sampling and every log-prob of a response use logits / --temperature (no top-k / top-p; the ptx loss: 1), every
log-prob from one function (response_logprobs). Trained weights and optimizer state are float32; --bf16 autocasts the
transformer blocks (frozen LoRA bases and FSDP's frozen shards held in bfloat16), while the output layer, log-softmax,
entropy, values and rewards stay float32.
Schulman et al. 2017 (PPO); Ziegler et al. 2019, Stiennon et al. 2020 (PPO for language); Huang et al. 2024 ("The N
implementation details of RLHF with PPO"). Also: critic-free advantages (--advantage_estimator rloo, grpo,
reinforce_pp), the KL in the loss (--kl_penalty loss), other loss means (--loss_aggregation), PPO-ptx, LoRA, FSDP2.
Left out (README.md): value-model warm-up, top-k/top-p sampling, several reward models, multi-turn rollouts.

The method is all above the FENCE, after main(); below it, what a reader may trust by its docstring, then opt-in paths.
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
    """ppo.py's options, the method's first (help: the comment after each field; the why of a default: above it)."""
    # --- the method. gae: a critic and GAE (Schulman et al. 2016). No critic: rloo (Ahmadian et al. 2024), grpo (Shao
    # et al. 2024), reinforce_pp (Hu 2025)
    advantage_estimator: Literal["gae", "rloo", "grpo", "reinforce_pp"] = "gae"  # How advantages are estimated
    num_samples_per_prompt: int | None = None  # K responses per prompt in a batch (default 4 for rloo, grpo; else 1)
    scale_rewards: bool = True  # grpo: divide by the std of the prompt's returns (no: Dr. GRPO, Liu et al. 2025)
    kl_penalty: Literal["reward", "loss"] = "reward"  # KL in the per-token reward (Ziegler et al. 2019) or loss (GRPO)
    # token_mean: of its tokens; sequence_mean: of responses' means (GRPO); constant (Dr. GRPO): sum / (responses x T)
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"  # A mini-batch's loss mean
    kl_coef: float = 0.1  # Initial coefficient of the per-token KL penalty
    # k1 = log p - log q; k3 = (q/p - 1) - log(q/p) (Schulman 2020). k3 in the loss: k1's gradient there is zero in
    # expectation on the policy's own samples
    kl_estimator: Literal["k1", "k3"] | None = None  # Per-token KL estimate (default: k1 in the reward, k3 in the loss)
    target_kl: float | None = None  # KL per response the adaptive controller aims at (Ziegler 2019); None: fixed
    kl_horizon: int = 10000  # Horizon in episodes of the adaptive KL controller
    gamma: float = 1.0  # Discount factor (gae and reinforce_pp only)
    lam: float = 0.95  # GAE lambda (gae only)
    cliprange: float = 0.2  # Clip range of the policy ratio
    cliprange_value: float = 0.2  # Clip range of the value around its rollout value (gae only)
    vf_coef: float = 0.1  # Weight of the value loss (gae only)
    ent_coef: float = 0.0  # Weight of the entropy bonus
    whiten_rewards: bool = False  # Whiten the per-token rewards, keeping their mean (gae and reinforce_pp)
    missing_eos_penalty: float | None = None  # Subtracted from the score of a response that never stops
    ptx_coef: float = 0.0  # Weight of a language-modelling loss on --ptx_dataset_name (PPO-ptx, Ouyang et al. 2022)
    ptx_dataset_name: str | None = None  # Text for the ptx loss: a dataset with a `text` column, or `embedded`
    # --- models and data
    sft_model_path: str = "embedded-llama"  # The initial policy: a causal LM or peft adapter, or embedded-llama/-neox
    # rm.py's (its normalization applied), or any sequence classifier, decoder or encoder
    reward_model_path: str | None = None  # The reward model (default: runs/rm; none with --reward_fn)
    reward_fn: str | None = None  # A rule `module:function`: fn(full prompts, responses) -> scores to add
    # auto: the reward model where it reads the policy's tokens (its head the value head), else the policy, new head
    critic_init: Literal["auto", "reward", "policy"] = "auto"  # The critic's start
    # a file with `prompt` (text or messages), `messages` or preference pairs
    dataset_name: str = "embedded"  # Prompts: hub name, .jsonl/.json/.parquet/.csv(.gz), or `embedded`
    dataset_config: str | None = None  # Hub dataset configuration
    dataset_train_split: str = "train"  # Split to take prompts from
    max_prompt_length: int | None = None  # Longer prompts keep their end and BOS, as rm.py's (default 256, or less)
    output_dir: str = "runs/ppo"  # Policy, metrics.jsonl, samples.jsonl, curves.png, checkpoints
    # --- sizes: rollout batch = per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches x ranks
    total_episodes: int = 12288  # Episodes (prompt, response) in all
    per_device_train_batch_size: int = 16  # Episodes per rank per forward and backward of the learning phase
    gradient_accumulation_steps: int = 1  # Micro-batches per optimizer step
    num_mini_batches: int = 2  # Optimizer steps per PPO epoch
    num_ppo_epochs: int = 4  # Passes over each rollout batch
    # --- optimisation
    learning_rate: float | None = None  # AdamW learning rate (default 3e-4 for the embedded models, else 3e-6)
    critic_learning_rate: float | None = None  # The critic's (default: the policy's)
    weight_decay: float = 0.0  # AdamW weight decay
    # any of transformers' SchedulerType that needs no metric and no arguments of its own (get_scheduler)
    lr_scheduler_type: str = "linear"  # Learning-rate schedule over the updates, no warm-up (linear, cosine, ...)
    # one clip, not one per model: the same gold score at equal KL (benchmarks/README.md, Gradient clipping)
    max_grad_norm: float = 1.0  # Clip the gradient norm of policy and critic together (0: no clipping)
    seed: int = 1  # Seed of the data order and of sampling (each episode's stream seeded by its index)
    # --- sampling. No top-k / top-p: the ratio and KL need the distribution a token was drawn from
    response_length: int = 16  # Maximum new tokens per response
    temperature: float = 1.0  # Sampling temperature, used by every log-prob too
    stop_token: str = "eos"  # Token that ends a response: `eos`, a token as the tokenizer spells it, or `none`
    # --- LoRA (peft): the reference is the policy with its adapter off
    lora_r: int = 0  # LoRA rank (Hu et al. 2021) on the policy's and critic's linear layers; 0: full fine-tuning
    lora_alpha: float = 16.0  # LoRA scale: an adapter adds (lora_alpha / lora_r) B A to its layer
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])  # Layers adapted
    # --- logging, checkpoints, systems
    sample_every: int = 10  # Print and save sample completions every this many updates
    num_samples: int = 4  # Rows in each sample table
    save_steps: int | None = None  # Checkpoint every this many updates (default: every 30 minutes; 0: none)
    resume: bool = False  # Continue from the latest checkpoint in --output_dir, on any number of ranks
    overwrite_output_dir: bool = False  # Train afresh where a finished run or checkpoints are (deleted at start)
    track: bool = False  # Log to Weights & Biases
    tensorboard: bool = False  # Also write TensorBoard events to --output_dir/tensorboard
    wandb_project: str = "rlhf-ppo"  # Weights & Biases project
    run_name: str | None = None  # Weights & Biases run name
    fsdp: bool = False  # Shard every model per transformer block with FSDP2 (default: DDP, frozen models replicas)
    offload_inference_models: bool = False  # --fsdp on GPUs: frozen models' shards in host memory until they compute
    gradient_checkpointing: bool = False  # Recompute the policy's and critic's activations in the backward pass
    bf16: bool = False  # bfloat16 autocast (weights, optimizer state float32; a frozen LoRA base in bfloat16)
    # --- opt-in speed paths, each the plain path's numbers (below the fence)
    group_by_length: bool = False  # Rows of similar length forward together, less their shared padding
    blocked_logits: bool = False  # Response logits in checkpointed blocks: memory bounded whatever the vocabulary
    compile: bool = False  # Decode the rollout compiled: CUDA graphs on a GPU, the same samples (not with --fsdp)


def fill_defaults(args, position_limit, rank=0):
    """The defaults that depend on another option or on the model, filled here only (said at start-up, saved in
    ppo_results.json): K, the KL estimator, learning rates, --max_prompt_length (256, or a position table's room)."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    group = args.advantage_estimator in ("rloo", "grpo")  # (a group baseline needs K > 1)
    args.num_samples_per_prompt = args.num_samples_per_prompt or (4 if group else 1)
    args.kl_estimator = args.kl_estimator or ("k1" if args.kl_penalty == "reward" else "k3")
    if args.learning_rate is None:  # (the embedded models are tiny and learn fast)
        args.learning_rate = 3e-4 if args.sft_model_path.startswith("embedded-") else 3e-6
    args.critic_learning_rate = args.learning_rate if args.critic_learning_rate is None else args.critic_learning_rate
    args.max_prompt_length = args.max_prompt_length or min(256, (position_limit or 1 << 30) - args.response_length)
    if args.max_prompt_length < 1:
        raise common.UserError(f"--response_length {args.response_length} leaves no room for a prompt in the "
                               f"{position_limit} positions of a model's position table; lower it")
    if rank == 0:
        print("defaults: " + ", ".join(f"--{k} {v}" for k, v in vars(args).items() if k not in given and v is not None))


# --- The math. --------------------------------------------------------------------------------------------------------
def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the real tokens (unbiased variance); shift_mean=False keeps the mean (reward whitening)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


def kl_per_token(logprobs, ref_logprobs, estimator="k1"):
    """KL(policy || reference) estimated from the policy's samples (Schulman 2020, "Approximating KL divergence")."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator != "k3":
        raise ValueError(f"unknown KL estimator {estimator!r}: k1 or k3")
    log_ratio = ref_logprobs - logprobs
    return torch.expm1(log_ratio) - log_ratio  # exp(x) - 1 - x, without float32's cancellation near 0 (never < 0)


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16); the value after the last real token is 0, also
    for a response cut at --response_length (ended, as TRL has it). Returns advantages and returns (targets: A + V)."""
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
    """RLOO (Ahmadian et al. 2024): each return minus the mean of the other k - 1 of its prompt (consecutive rows)."""
    group = returns.view(-1, k)
    return (group - (group.sum(1, keepdim=True) - group) / (k - 1)).flatten()


def grpo_advantages(returns, k, scale=True, eps=1e-4):
    """GRPO (Shao et al. 2024, 4.1.2): (return - mean) / (std + eps) over a prompt's k returns (unbiased std, as TRL);
    scale=False keeps return - mean (Dr. GRPO, Liu et al. 2025)."""
    group = returns.view(-1, k)
    centered = group - group.mean(1, keepdim=True)
    return (centered / (group.std(1, keepdim=True) + eps) if scale else centered).flatten()


def reinforce_pp_advantages(rewards, mask, gamma):
    """REINFORCE++ (Hu 2025): each token's discounted return (GAE with values 0, lambda 1), whitened over the batch."""
    returns, _ = gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)
    return masked_whiten(returns, mask)


def policy_loss(logprobs, old_logprobs, advantages, cliprange):
    """The clipped surrogate objective (Schulman et al. 2017, eq. 7) as a per-token loss; per-token statistics."""
    ratio = (logprobs - old_logprobs).exp()
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    stats = {"clipfrac": (clipped > unclipped).float(), "approxkl": 0.5 * (logprobs - old_logprobs) ** 2,
             "ratio": ratio, "ratio_sq": ratio ** 2}
    return torch.maximum(unclipped, clipped), stats


def value_loss(values, old_values, returns, cliprange_value):
    """0.5 * max((v - R)^2, (v_clipped - R)^2) per token, v_clipped within cliprange_value of the rollout value (Huang
    et al. 2024), and where the clipped term is the larger (the clipped fraction's tokens)."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_sq, clipped_sq), (clipped_sq > unclipped_sq).float()


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_episodes):
    """Ziegler et al. 2019, eq. 2: move kl_coef by a proportional error clipped to +-20%, at rate n / horizon."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_episodes / horizon)


def truncate_after_stop(responses, stop_id, pad_id):
    """Tokens after the first stop token become padding; returns them and their real-token mask (the stop is real)."""
    if stop_id is None:
        return responses, torch.ones_like(responses, dtype=torch.bool)
    is_stop = responses == stop_id
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0
    return responses.masked_fill(after_stop, pad_id), ~after_stop


def response_logprobs(model, query_response, attention_mask, context_length, temperature, entropy=False,
                      entropy_grad=True, blocked=False):
    """THE log-probs of every phase (old, reference, learning, ptx): each response token's at the sampling temperature,
    position t predicting token t + 1. The model's float32 logits (output_layer_in_float32; its own transforms, e.g.
    Gemma's softcapping, its own) at those positions only (logits_to_keep), / temperature, a float32 log-softmax,
    gathered. entropy: each position's too (its gradient if entropy_grad). blocked (--blocked_logits): the same
    numbers in memory bounded whatever the vocabulary (below the fence)."""
    predicting = query_response.shape[1] - context_length + 1  # positions context_length - 1 .. T - 1
    keep = {"logits_to_keep": predicting} if takes_argument(type(unwrap(model)), "logits_to_keep") else {}
    inputs = dict(input_ids=query_response, attention_mask=attention_mask, use_cache=False, **keep,
                  position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0))  # counts real tokens only (left padding)
    targets = query_response[:, context_length:]
    if blocked:
        return blocked_response_logprobs(model, inputs, predicting, targets, temperature, entropy, entropy_grad)
    logits = model(**inputs).logits[:, -predicting:-1]  # (the last position predicts nothing)
    logp_all = torch.log_softmax(logits.float() / temperature, -1)
    logprobs = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):  # (entropy_of: -sum p log p, 0 log 0 = 0)
        return logprobs, entropy_of(logp_all) if entropy else None


# --- The method's conventions, the same as rm.py's (tests/test_rm.py checks that they agree). Dropout is off in every
# model (disable_dropout, below): rollout, scoring and learning read one network, and the ratio starts at 1. ----------
def truncate_prompt(ids, max_prompt_length, bos_id=None):
    """A prompt longer than max_prompt_length keeps its END (the turn being answered) and its leading BOS/[CLS]."""
    if len(ids) <= max_prompt_length:
        return ids
    keep = 1 if bos_id is not None and ids and ids[0] == bos_id else 0
    return ids[:keep] + ids[len(ids) - max_prompt_length + keep:]


def last_token_index(mask):
    """Where a response ends: its last real token (its stop token, or the last of a response cut at
    --response_length), read from the mask (a pad id may equal EOS), right or left padded."""
    return (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(1)


def sequence_reward(model, ids, mask):
    """A reward model's output: a decoder's scalar head at the last real token (where rm.py trains it); an encoder's."""
    if not hasattr(model, "score"):  # BERT, RoBERTa, DeBERTa: a pooled `classifier`
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False,
                              position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state  # ALiBi: ignored
    return model.score(hidden[torch.arange(len(ids), device=ids.device), last_token_index(mask)]).squeeze(-1).float()


# --- The phases of an update, in the order main() runs them, handing one Rollout batch along. -------------------------
@dataclass
class Rollout:
    """One row per episode (a prompt's K in consecutive rows), every rank's rows (rollout gathers them): learning is the
    same for any number of ranks. Each phase fills its fields; (B, T): (rows, response_length), 0 after the response."""
    query_response: torch.Tensor  # (B, context_length + response_length): the left-padded prompt, the response
    attention_mask: torch.Tensor  # the same shape: 1 on real tokens
    context_length: int  # prompt columns: the response starts there
    mask: torch.Tensor  # (B, T) bool: the response's real tokens, through its stop token
    logprobs: torch.Tensor | None = None  # (B, T) 2. the policy's log-probs of the sampled tokens: the ratio's "old"
    ref_logprobs: torch.Tensor | None = None  # (B, T) 2. the reference policy's
    values: torch.Tensor | None = None  # (B, T) 2. the critic's value of each state (None without a critic)
    scores: torch.Tensor | None = None  # (B,) 3. reward model and/or function, missing-EOS penalty
    has_stop: torch.Tensor | None = None  # (B,) 3. whether the response emitted the stop token (None: no stop token)
    gold: torch.Tensor | None = None  # (B,) 3. the embedded task's true reward, for the logs (None elsewhere)
    advantages: torch.Tensor | None = None  # (B, T) 4.
    returns: torch.Tensor | None = None  # (B, T) 4. the critic's targets (GAE only)

    @property
    def responses(self):
        return self.query_response[:, self.context_length:]


def rollout(policy, prompt_ids, episodes, args, stop_id, pad_id, device, collective):
    """1. A response to each of this rank's episodes, sampled from softmax(logits / --temperature) with the episode's
    own random stream (sample_tokens); tokens after the stop token become padding. All ranks get all rows."""
    width = all_reduce(torch.tensor(max(map(len, prompt_ids)), device=device), dist.ReduceOp.MAX)  # same on all ranks
    query, query_mask = (t.to(device) for t in pad_left(prompt_ids, int(width), pad_id))
    seeds = torch.tensor([common.seed_of(args.seed, "sampling", e) for e in episodes], device=device)
    with gathered_once(policy, collective), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
        responses = generate(policy, query, query_mask, seeds, args, stop_id, pad_id, collective)
    responses, mask = truncate_after_stop(responses, stop_id, pad_id)
    batch = Rollout(torch.cat([query, responses], 1), torch.cat([query_mask, mask], 1).long(), query.shape[1], mask)
    return dataclasses.replace(batch, **{k: all_gather_cat(v) for k, v in vars(batch).items() if torch.is_tensor(v)})


@torch.no_grad()
def generate(model, query, query_mask, seeds, args, stop_id, pad_id, collective=False):
    """KV-cached sampling from softmax(logits / --temperature), the logits float32 as response_logprobs reads them, each
    token drawn by sample_tokens with its episode's own uniform. The cache is allocated once for prompt + response,
    the mask that width from the start, causality hiding tokens not yet sampled (--compile: compiled_generate)."""
    if args.compile:
        return compiled_generate(model, query, query_mask, seeds, args, stop_id, pad_id)
    position = (query_mask.long().cumsum(1) - 1).clamp(min=0)
    mask = F.pad(query_mask.long(), (0, args.response_length), value=1)
    cache = ComputeDtypeCache(config=unwrap(model).config, max_cache_len=mask.shape[1])
    last_only = {"logits_to_keep": 1} if takes_argument(type(unwrap(model)), "logits_to_keep") else {}
    inputs = dict(input_ids=query, attention_mask=mask, past_key_values=cache, use_cache=True, position_ids=position,
                  **last_only)  # the prompt's last position only, not B x prompt x V
    tokens = []
    done = torch.zeros(len(query), dtype=torch.bool, device=query.device)
    for t in range(args.response_length):
        logits = model(**inputs).logits[:, -1].float() / args.temperature
        token = sample_tokens(logits, seeds, t)
        tokens.append(token)
        done |= token == stop_id
        all_done = all_reduce(done.all().float(), dist.ReduceOp.MIN) if collective else done.all()  # (FSDP: on all)
        if all_done or t == args.response_length - 1:
            break
        inputs = dict(input_ids=token[:, None], attention_mask=mask, past_key_values=cache, use_cache=True,
                      position_ids=position[:, -1:] + t + 1)
    responses = torch.stack(tokens, 1)
    return F.pad(responses, (0, args.response_length - responses.shape[1]), value=pad_id)


def sample_tokens(logits, seeds, step):
    """Token `step` of each row's episode drawn from softmax(logits) by inversion: the first token whose cumulative
    probability (summed in float64) exceeds the episode's uniform u for this step (episode_uniform: a function of its
    seed and the step alone). Row by row: the same token in any batch, on any number of ranks, compiled or not."""
    cdf = torch.exp(logits - logits.amax(-1, keepdim=True)).cumsum(-1, dtype=torch.float64)  # the last: the total
    target = episode_uniform(seeds, step).to(cdf.device)[:, None] * cdf[:, -1:]  # u < 1: below the total
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)  # (a zero weight: never)


class Critic(torch.nn.Module):
    """The value of each state: a sequence classifier's scalar head (float32) at every position, minus an offset. Its
    start (critic_from): --critic_init reward, a copy of the reward model, head / rm.py's scale, offset shift / scale
    (each prefix's value starts as the normalized score of that prefix); policy, the policy's backbone and a new head as
    rm.py's (std 1 / sqrt(hidden + 1)). With LoRA: an adapter on that network, and a critic from the reward model is,
    with its adapter off, the reward model (reward.model: critic_as_reward; no second copy)."""

    def __init__(self, hf_model, offset=0.0):
        super().__init__()
        self.hf, self.offset = hf_model, offset

    def forward(self, input_ids, attention_mask):
        hidden = self.hf.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                    position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
        return self.hf.score(hidden).squeeze(-1).float() - self.offset


@torch.no_grad()
def logprobs_and_values(policy, ref_policy, critic, batch, args, update, rank, world, reference_mode):
    """2. Each sampled token's log-prob under the policy (the ratio's "old") and the reference, and the critic's values,
    on epoch 0's micro-batches, as learn() computes its first steps (the same rows, columns and autocast): in any
    precision the first ratio is exactly 1, the KL at initialisation 0, the first value clip centred on the learning
    forward's values. Each rank computes its rows; the sum over ranks gives every rank all."""
    out = torch.zeros(3, *batch.mask.shape, device=batch.mask.device)  # old log-probs, the reference's, values
    with torch.autocast(batch.mask.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        for step in epoch_plan(batch, args, update, 0, rank, world):
            for f in step.forwards:
                out[0, f.rows, :f.kept] = response_logprobs(policy, f.ids, f.attention_mask, f.context,
                                                            args.temperature, blocked=args.blocked_logits)[0]
                with reference_mode():  # the frozen copy of the initial policy (LoRA: the policy with its adapter off)
                    out[1, f.rows, :f.kept] = response_logprobs(ref_policy, f.ids, f.attention_mask, f.context,
                                                                args.temperature, blocked=args.blocked_logits)[0]
                if critic is not None:
                    out[2, f.rows, :f.kept] = critic(f.ids, f.attention_mask)[:, f.context - 1:-1]
    batch.logprobs, batch.ref_logprobs, values = all_reduce(out).masked_fill(~batch.mask, 0.0)
    batch.values = values if critic is not None else None


@torch.no_grad()
def score(reward, batch, rows, prompt_texts, tokenizer, stop_id, args, collective=False):
    """3. The score of this rank's rows (every rank gets all): the reward model's output at the response's last real
    token (sequence_reward), normalized as rm.py saved it, (output - shift) / scale, in the policy's tokens or on the
    text in its own (reward_model_tokens); plus --reward_fn, minus --missing_eos_penalty. Returns the texts."""
    responses, mask = batch.responses[rows], batch.mask[rows]
    texts = [tokenizer.decode(r[m & (r != stop_id)] if stop_id is not None else r[m], skip_special_tokens=True)
             for r, m in zip(responses.cpu(), mask.cpu())]
    scores = torch.zeros(len(batch.mask), device=mask.device)  # (by the batch's rows; this rank's filled)
    with torch.autocast(mask.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        for f in micro_batches(batch, rows, args, collective) if reward.model is not None else []:
            ids, ids_mask = (f.ids, f.attention_mask) if reward.tokenizer is None else reward_model_tokens(
                batch, f.rows, stop_id, tokenizer, reward, args)  # (its own tokens: the text, as rm.py made a pair)
            scores[f.rows] = reward.model(ids.to(mask.device), ids_mask.to(mask.device))  # (output - shift) / scale
    scores = scores[rows]
    if reward.fn is not None:
        scores += common.agreed(lambda: reward.fn(prompt_texts, texts)).to(scores.device)
    batch.has_stop = (batch.responses == stop_id).any(1) if stop_id is not None else None
    if args.missing_eos_penalty is not None:
        scores -= args.missing_eos_penalty * (~batch.has_stop[rows]).float()
    batch.scores = all_gather_cat(scores)
    if args.sft_model_path.startswith("embedded-") and args.dataset_name == "embedded":  # (for the logs)
        batch.gold = all_gather_cat(torch.tensor(common.gold_rewards(prompt_texts, texts), device=scores.device))
    return texts


def advantages(batch, kl_coef, args):
    """4. Per-token rewards: -kl_coef * KL to the reference (--kl_penalty reward), plus the score at the last real
    token (Ziegler et al. 2019, eq. 2); then --advantage_estimator: GAE, whitened (and the critic's targets); RLOO or
    GRPO from each episode's return and its prompt's other K - 1; REINFORCE++ from each token's return. Returns the
    per-token KL and the KL part of the rewards, for the logs."""
    mask = batch.mask.float()
    kl = kl_per_token(batch.logprobs, batch.ref_logprobs, args.kl_estimator) * mask
    non_score_reward = -kl_coef * kl if args.kl_penalty == "reward" else torch.zeros_like(kl)
    rewards = non_score_reward.clone()
    rewards[torch.arange(len(rewards), device=rewards.device), last_token_index(mask)] += batch.scores
    if args.whiten_rewards and args.advantage_estimator in ("gae", "reinforce_pp"):  # (as its help says)
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    if args.advantage_estimator == "gae":
        adv, batch.returns = gae(rewards, batch.values, mask, args.gamma, args.lam)
        batch.advantages = masked_whiten(adv, mask)
    elif args.advantage_estimator == "reinforce_pp":
        batch.advantages = reinforce_pp_advantages(rewards, mask, args.gamma)
    else:  # one advantage per episode, at each of its tokens; a prompt's K episodes are consecutive rows
        k, returns = args.num_samples_per_prompt, rewards.sum(1)
        adv = rloo_advantages(returns, k) if args.advantage_estimator == "rloo" else \
            grpo_advantages(returns, k, args.scale_rewards)
        batch.advantages = adv[:, None] * mask
    return kl, non_score_reward


@dataclass
class MicroBatch:
    """One forward's rows of the batch, every column (--group_by_length: less those all padding in these rows)."""
    rows: torch.Tensor
    ids: torch.Tensor
    attention_mask: torch.Tensor
    context: int  # the response starts at this column
    kept: int  # response columns kept

    def take(self, field):  # a (B, response_length) field at these rows and columns
        return field[self.rows][:, :self.kept]


def micro_batches(batch, rows, args, collective):
    """rows as forwards of --per_device_train_batch_size rows each, in order (--group_by_length: length_grouped; not
    under FSDP on several ranks, where every rank must make the same calls)."""
    if args.group_by_length and not collective:
        return length_grouped(batch, rows, args.per_device_train_batch_size)
    return [MicroBatch(r, batch.query_response[r], batch.attention_mask[r], batch.context_length, batch.mask.shape[1])
            for r in rows.split(args.per_device_train_batch_size)]


def epoch_plan(batch, args, update, epoch, rank, world):
    """One PPO epoch's optimizer steps: the batch shuffled (seeded by update and epoch), cut into --num_mini_batches.
    Each an OptimizerStep: rows, the mini-batch's (every rank's); forwards, this rank's gradient_accumulation_steps
    micro-batches of it (its per_device_train_batch_size x gradient_accumulation_steps rows, in order)."""
    share = args.per_device_train_batch_size * args.gradient_accumulation_steps  # a rank's rows of a mini-batch
    order = torch.randperm(len(batch.mask), generator=torch.Generator().manual_seed(
        common.seed_of(args.seed, "mini-batches", update, epoch))).to(batch.mask.device)
    collective = args.fsdp and world > 1  # (FSDP: every rank the same calls)
    return [OptimizerStep(mini, micro_batches(batch, mini[rank * share:(rank + 1) * share], args, collective))
            for mini in order.split(share * world)]


def learn(policy, critic, trainable, optimizer, batch, kl_coef, args, update, rank, world, ptx, pad_id):
    """5. num_ppo_epochs passes over the batch, num_mini_batches optimizer steps each, every loss its mini-batch's mean
    whatever the micro-batches, accumulation and ranks. Returns each statistic's mean over the optimizer steps, each
    model's gradient norm (before clipping) among them."""
    autocast = functools.partial(torch.autocast, batch.mask.device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def backward(loss):  # DDP and FSDP average gradients over ranks; the mini-batch's gradient is the sum of theirs
        (loss * world).backward()

    stats, norms = [], []  # per optimizer step: name -> this rank's share of the mini-batch's value; the norms
    for epoch in range(args.num_ppo_epochs):
        for mb, step in enumerate(epoch_plan(batch, args, update, epoch, rank, world)):
            # THE loss mean. Every rank holds the whole batch (rollout gathers it), so each counts the mini-batch's
            # tokens (every rank's, every accumulation step's) itself: each micro-batch's loss is its share of the mean
            tokens_in_mini_batch, responses = batch.mask[step.rows].sum(), len(step.rows)

            def mean(loss_per_token, mask):
                if args.loss_aggregation == "token_mean":
                    return (loss_per_token * mask).sum() / tokens_in_mini_batch
                if args.loss_aggregation == "sequence_mean":  # each response's token mean, then over responses (GRPO)
                    return ((loss_per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / responses
                return (loss_per_token * mask).sum() / (responses * args.response_length)  # constant (Dr. GRPO)

            sums = {}
            if ptx is not None:  # PPO-ptx (Ouyang et al. 2022, eq. 2): language modelling on pretraining text
                sums["loss/ptx"] = ptx_backward(policy, ptx, step, update, epoch, mb, args, rank, world, pad_id,
                                                backward)
            for i, f in enumerate(step.forwards):
                sync_gradients([policy, critic], last=i == len(step.forwards) - 1)  # (DDP: all-reduce once)
                mask = f.take(batch.mask).float()
                # (policy and critic share no weights: each loss backward on its own graph, one's activations at a time)
                with autocast():
                    new_logprobs, entropy = response_logprobs(
                        policy, f.ids, f.attention_mask, f.context, args.temperature, entropy=True,
                        entropy_grad=args.ent_coef > 0, blocked=args.blocked_logits)
                pg_loss, per_token = policy_loss(new_logprobs, f.take(batch.logprobs), f.take(batch.advantages),
                                                 args.cliprange)
                losses = {"loss/policy": mean(pg_loss, mask)}
                loss = losses["loss/policy"] - args.ent_coef * mean(entropy, mask)
                if args.kl_penalty == "loss":  # GRPO (Shao et al. 2024, eq. 3): the current policy's KL, in the loss
                    # (padding's log-probs 0, as the reference's: k3 of a pad token could overflow, and inf x 0 is NaN)
                    losses["loss/kl"] = mean(kl_per_token(new_logprobs.masked_fill(mask == 0, 0.0),
                                                          f.take(batch.ref_logprobs), args.kl_estimator), mask)
                    loss = loss + kl_coef * losses["loss/kl"]
                backward(loss)
                per_token = {"policy/entropy": entropy, **{f"policy/{k}": v for k, v in per_token.items()}}
                if critic is not None:
                    with autocast():
                        new_values = critic(f.ids, f.attention_mask)[:, f.context - 1:-1]
                    vf_loss, per_token["val/clipfrac"] = value_loss(new_values, f.take(batch.values),
                                                                    f.take(batch.returns), args.cliprange_value)
                    losses["loss/value"] = mean(vf_loss, mask)
                    backward(args.vf_coef * losses["loss/value"])
                for name, value in losses.items():
                    sums[name] = sums.get(name, 0) + value.detach()
                for name, value in per_token.items():  # statistics: plain means over the mini-batch's tokens
                    sums[name] = sums.get(name, 0) + (value.detach() * mask).sum() / tokens_in_mini_batch
            norms.append(clip_and_step(trainable, optimizer, args.max_grad_norm, update, losses["loss/policy"]))
            stats.append(sums)  # (this rank's shares: mean_over_steps sums them over ranks)
    return {**mean_over_steps(stats), **{k: sum(n[k] for n in norms) / len(norms) for k in norms[0]}}


def main(args):
    check_args(args)
    rank, world, device = setup_distributed()
    fill_defaults(args, position_limit(args), rank)
    if (sizes := start_up(args, rank, world)) is None:  # finished already: nothing to do
        return None
    batch_size, local_batch, num_updates = sizes.batch_size, sizes.local_batch, sizes.num_updates

    tokenizer = load_tokenizer(args)
    stop_id = stop_token_id(args, tokenizer)
    prompts, prompt_texts = load_prompts(args, tokenizer)  # before the models: a data mistake is found in seconds
    ptx = load_ptx(args, tokenizer) if args.ptx_coef > 0 else None
    # The policy; the reference, a frozen copy of it (LoRA: the policy with its adapter off); GAE's critic
    # (critic_from); the reward: a frozen reward model and/or a function.
    models = build_models(args, tokenizer, device, rank, world)
    policy, critic, reward, lora = models.policy, models.critic, models.reward, models.lora
    bos_id = common.leading_id(tokenizer)  # (once: it tokenizes)
    prompts = [truncate_prompt(p, args.max_prompt_length, bos_id) for p in prompts]
    ptx = ptx and [ids[:args.max_prompt_length + args.response_length] for ids in ptx]
    # AdamW (eps 1e-5) over policy and critic, each at its learning rate; --lr_scheduler_type, stepped once per update
    trainable, optimizer, scheduler = build_optimizer(policy, critic, args, num_updates)
    start, kl_coef, history = 0, args.kl_coef, []
    if args.resume and (ckpt := common.resume_training(trainable, optimizer, scheduler, args.output_dir, args, world)):
        start, kl_coef, history = ckpt["step"], ckpt["kl_coef"], ckpt["history"]
    logs = open_logs(args, rank, start if args.resume else None)

    orders, collective = {}, args.fsdp and world > 1  # under FSDP every rank must make the same forward calls
    mine = torch.arange(rank * local_batch, (rank + 1) * local_batch, device=device)  # this rank's rows of a batch
    bar = tqdm(range(start, num_updates), disable=rank != 0, initial=start, total=num_updates, desc="ppo")
    t_saved = time.time()
    common.stop_on_signals()
    for update in bar:
        t0 = time.time()
        # 1. Rollout: this rank's share of the update's episodes; then every rank takes the whole batch.
        episodes = range(update * batch_size + rank * local_batch, update * batch_size + (rank + 1) * local_batch)
        prompt_index = episode_prompts([e // args.num_samples_per_prompt for e in episodes], len(prompts), args.seed,
                                       orders)  # the K episodes of a prompt are consecutive
        trainable.eval()  # (sampling and scoring in evaluation mode)
        batch = rollout(policy if args.fsdp else unwrap(policy), [prompts[i] for i in prompt_index], episodes, args,
                        stop_id, tokenizer.pad_token_id, device, collective)
        t_rollout = time.time()

        # 2. Log-probs under the policy (old) and the reference, and the values.
        with resharded([None if lora else models.reference]):
            logprobs_and_values(policy, models.reference, critic, batch, args, update, rank, world,
                                reference_mode=lora.disable_adapter if lora else contextlib.nullcontext)

        # 3. Score: the reward at the response's last real token.
        texts = [prompt_texts[i] for i in prompt_index]
        with resharded([reward.model]):
            score(reward, batch, mine, texts, tokenizer, stop_id, args, collective)
        t_score = time.time()

        # 4. Advantages: KL-penalised per-token rewards; GAE, whitened, or a critic-free estimator.
        kl, non_score_reward = advantages(batch, kl_coef, args)

        # 5. Learn: num_ppo_epochs x num_mini_batches optimizer steps on the clipped policy loss (and value loss).
        trainable.train()
        update_stats = learn(policy, critic, trainable, optimizer, batch, kl_coef, args, update, rank, world, ptx,
                             tokenizer.pad_token_id)
        lr = scheduler.get_last_lr()[0]  # (the rate this update's steps used)
        scheduler.step()
        t_learn = time.time()

        # 6. Adapt the KL coefficient; log; save samples and checkpoints.
        m = {"step": update + 1, "episodes": (update + 1) * batch_size, "kl_coef": kl_coef, "lr": lr, **update_stats,
             **update_metrics(batch, kl, non_score_reward, [t0, t_rollout, t_score, t_learn, time.time()], args,
                              peak_memory_of=device if update == start else None)}
        if args.target_kl is not None:  # (objective/kl: the KL summed over each response, mean over the batch)
            kl_coef = adaptive_kl_coef(kl_coef, m["objective/kl"], args.target_kl, args.kl_horizon, batch_size)
        history.append({k: m[k] for k in ("step", "episodes", "objective/scores", "objective/kl", "gold/mean",
                                          "gold/std") if k in m})
        if rank == 0:
            log_update(logs, bar, m, update == num_updates - 1, args, tokenizer, batch)
        save, stop = common.step_end(update + 1, args.save_steps, t_saved, device)
        if save and update + 1 < num_updates:
            common.save_training(trainable, optimizer, scheduler, update + 1, rank, args.output_dir, batch_size,
                                 kl_coef=kl_coef, history=history)
            t_saved = time.time()
        if stop and update + 1 < num_updates:
            common.exit_stopped(stop, update + 1, args, rank, bar)
    common.stop_on_signals(False)

    common.agreed(lambda: save_final(trainable, models.policy_hf, lora, tokenizer, history, logs, args, rank))
    common.leave_together()  # (under torchrun: every rank done)
    return history


# ======================================================================================================================
# THE FENCE. The method ends here: a first read can stop. Below, what a default run calls and a reader may trust by its
# docstring (checks, loading, the reward's plumbing, learning's bookkeeping, distributed set-up, logs); then the opt-in
# speed paths, each in its own section (--group_by_length, --blocked_logits, --compile), tested equal to the plain path.
# ======================================================================================================================


# --- Checks and sizes, before anything is loaded or written. ---------------------------------------------------------
def check_args(args):
    """Every size and range, and every model and dataset found, before anything is loaded or written."""
    for names, ok, must in (
            (("total_episodes", "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches",
              "num_ppo_epochs", "response_length", "max_prompt_length", "sample_every", "kl_horizon",
              "num_samples_per_prompt"), lambda v: v >= 1, "at least 1"),
            (("learning_rate", "critic_learning_rate", "weight_decay", "max_grad_norm", "kl_coef", "cliprange",
              "cliprange_value", "vf_coef", "ent_coef", "ptx_coef", "save_steps", "num_samples", "missing_eos_penalty",
              "lora_r", "lora_alpha"), lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0"),
            (("gamma", "lam"), lambda v: 0 <= v <= 1, "within [0, 1]"),
            (("temperature", "target_kl"), lambda v: v > 0, "above 0")):
        for name in names:  # (None: a default filled later)
            if (value := getattr(args, name)) is not None and not ok(value):
                raise common.UserError(f"--{name} {value}: must be {must}")
    if args.advantage_estimator in ("rloo", "grpo") and args.num_samples_per_prompt == 1:
        raise common.UserError(f"--num_samples_per_prompt 1: --advantage_estimator {args.advantage_estimator} "
                               "compares each response with the others to its prompt; it needs at least 2")
    if not args.scale_rewards and args.advantage_estimator != "grpo":
        raise common.UserError(f"--no_scale_rewards is grpo's (Dr. GRPO); --advantage_estimator "
                               f"{args.advantage_estimator} does not divide by a group's std")
    if args.missing_eos_penalty is not None and args.stop_token == "none":
        raise common.UserError("--missing_eos_penalty needs a stop token: with --stop_token none no response stops")
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    try:  # the schedule built and stepped as the run does: once per update, no metric, no arguments of its own
        scheduler = transformers.get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=0, num_training_steps=2)
        opt.step()
        scheduler.step()
    except (ValueError, TypeError) as e:
        raise common.UserError(f"--lr_scheduler_type {args.lr_scheduler_type}: {common.first_line(e)} (ppo.py steps "
                               "the schedule once per update, with no metric and no arguments of its own)") from None
    if args.compile and args.fsdp:
        raise common.UserError("--compile compiles the decode of a whole model; --fsdp shards it: drop one of them")
    if args.offload_inference_models and not args.fsdp:
        raise common.UserError("--offload_inference_models holds FSDP shards on the host: pass --fsdp too")
    if args.ptx_coef > 0 and args.ptx_dataset_name is None:
        raise common.UserError(f"--ptx_coef {args.ptx_coef} needs --ptx_dataset_name (a dataset with a 'text' column)")
    for name, flag, kind in ((args.sft_model_path, "--sft_model_path", "model"),
                             (reward_model_source(args), "--reward_model_path", "model"),
                             (args.dataset_name, "--dataset_name", "dataset"),
                             (args.ptx_dataset_name if args.ptx_coef > 0 else None, "--ptx_dataset_name", "dataset")):
        if name is not None:
            common.check_source(name, flag, kind)


@dataclass
class Sizes:
    local_batch: int  # episodes each rank rolls out per update: micro-batch x accumulation x mini-batches
    batch_size: int  # the rollout batch: local_batch x ranks
    num_updates: int


def start_up(args, rank, world):
    """The run's sizes, checked, and its output folder (one for all ranks, writable); None if it holds this run done."""
    common.check_shared_output_dir(args.output_dir, rank)
    local_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    batch_size, num_updates = local_batch * world, args.total_episodes // (local_batch * world)
    if num_updates == 0:
        raise common.UserError(f"--total_episodes {args.total_episodes} is less than one rollout batch ({batch_size})")
    if args.total_episodes % batch_size and rank == 0:
        trained = num_updates * batch_size
        print(f"--total_episodes {args.total_episodes}: {trained} trained, whole rollout batches of {batch_size} (the "
              f"nearest to train all: {trained} or {trained + batch_size})")
    if batch_size % args.num_samples_per_prompt:
        raise common.UserError(f"--num_samples_per_prompt {args.num_samples_per_prompt}: must divide the rollout "
                               f"batch ({batch_size} episodes), so that a prompt's responses are in one batch")
    common.check_output_dir(args, rank)
    return None if common.run_complete(args, num_updates, rank) else Sizes(local_batch, batch_size, num_updates)


def position_limit(args):
    """The policy's and reward model's shortest learned position table, from configs (no weight read); else None."""
    limits = []
    for path, flag, loader in ((args.sft_model_path, "--sft_model_path", transformers.AutoModelForCausalLM),
                               (reward_model_source(args), "--reward_model_path",
                                transformers.AutoModelForSequenceClassification)):
        if path is not None and not path.startswith("embedded-"):
            config = common.load_pretrained(transformers.AutoConfig, path, flag)
            limits.append(common.position_table(common.meta_model(lambda: loader.from_config(config))))
    return min((n for n in limits if n), default=None)


# --- Models and data. -------------------------------------------------------------------------------------------------
def without_dropout(config):
    """Every dropout probability of the config 0 (some models, OPT, call F.dropout with it, past nn.Dropout), and other
    training-mode randomness: layer drop (OPT, BART), MoE routers' jitter."""
    for key in [k for k, v in vars(config).items() if isinstance(v, float) and any(
            s in k for s in ("dropout", "pdrop", "layerdrop", "jitter"))]:
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
    tokenizer = common.load_pretrained(transformers.AutoTokenizer, args.sft_model_path, "--sft_model_path",
                                       padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe here: every mask comes from lengths, never from pad ids
    return tokenizer


def stop_token_id(args, tokenizer):
    stop_id = {**tokenizer.get_vocab(), "eos": tokenizer.eos_token_id, "none": None}.get(args.stop_token, -1)
    if stop_id == -1 or (args.stop_token == "eos" and stop_id is None):
        raise common.UserError(f"--stop_token {args.stop_token!r} is not a token of {args.sft_model_path}'s tokenizer; "
                               "pass eos (if it has one), none, or one token as the tokenizer spells it")
    return stop_id


def embedded_sft_policy(name, tokenizer, seed, steps=150, batch_size=64):
    """The embedded task's SFT policy: a tiny causal LM trained briefly to answer with a few words and EOS, cached in
    ($XDG_CACHE_HOME or ~/.cache)/rlhf by this code and versions; training draws no random number (a run goes on)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(common.embedded_model_config(name, len(tokenizer),
                                                                                      flag="--sft_model_path"))
    code = open(__file__).read() + open(common.__file__).read()  # this function and the task
    key = hashlib.sha256(repr((len(tokenizer), torch.__version__, transformers.__version__, code)).encode()).hexdigest()
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rlhf",
                         f"{name}-seed{seed}-steps{steps}-batch{batch_size}.pt")
    with contextlib.suppress(Exception):  # (none yet, unreadable, or another key's: trained again)
        if (saved := torch.load(cache))["key"] == key:
            model.load_state_dict(saved["model"])
            return model.eval()
    opt, rng = torch.optim.AdamW(model.parameters(), lr=2e-3), random.Random(seed)
    for _ in range(steps):
        texts = [common.embedded_prompt(rng) for _ in range(batch_size)]
        prompts = common.tokenize_prompts(tokenizer, texts)
        responses = common.tokenize_responses(tokenizer, texts, [common.embedded_response(rng) for _ in texts])
        batch = tokenizer.pad({"input_ids": [p + r for p, r in zip(prompts, responses)]}, padding_side="right",
                              return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        for i, p in enumerate(prompts):
            labels[i, :len(p)] = -100  # learn the responses, not the prompts
        model(**batch, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    with contextlib.suppress(OSError):  # (a folder that cannot be written: trained again next time)
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        torch.save({"key": key, "model": model.state_dict()}, f"{cache}.{os.getpid()}.tmp")
        os.replace(f"{cache}.{os.getpid()}.tmp", cache)  # whole or not at all, whichever rank writes it
    return model.eval()


def load_policy(args, tokenizer, on_meta=False):
    """The initial policy (a causal LM, or a peft adapter folder merged into its base), dropout off, its output layer
    computing in float32 (output_layer_in_float32). on_meta: no weight read (common.load_model)."""
    if args.sft_model_path.startswith("embedded-"):
        return output_layer_in_float32(disable_dropout(embedded_sft_policy(args.sft_model_path, tokenizer, args.seed)))
    config = without_dropout(common.load_pretrained(transformers.AutoConfig, args.sft_model_path, "--sft_model_path"))
    # float32 whatever the stored dtype: AdamW's updates (lr x ~1e-3) would round away in bfloat16 weights; a frozen
    # LoRA base is only read, so it may be held in bfloat16
    dtype = torch.bfloat16 if args.lora_r and args.bf16 else torch.float32
    model = common.load_model(transformers.AutoModelForCausalLM, args.sft_model_path, "--sft_model_path", on_meta,
                              config=config, dtype=dtype)
    return output_layer_in_float32(disable_dropout(model))


def output_layer_in_float32(model):
    """The causal LM, its output layer (an nn.Linear) computing in float32 whatever autocast asks (Float32Linear):
    model(...).logits are float32, and so the transforms after the layer. A tied layer keeps the embedding's weight."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        head.__class__ = common.Float32Linear
    return model


@dataclass
class Models:
    policy: torch.nn.Module  # trained: DDP- or FSDP-wrapped
    critic: torch.nn.Module | None  # trained (a Critic, wrapped so); None without GAE
    reference: torch.nn.Module  # frozen: the initial policy (LoRA: the policy, read with its adapter off)
    reward: "Reward"
    policy_hf: torch.nn.Module  # the policy's transformers model, for the final save
    lora: object = None  # with LoRA: the peft model holding the policy's adapter


def build_models(args, tokenizer, device, rank, world):
    """The policy and critic (trained; DDP or FSDP), the frozen reference and the reward (under FSDP only rank 0 reads
    weights: parallelize); lengths checked against the position tables of the models reading the policy's tokens."""
    on_meta = args.fsdp and world > 1 and rank != 0
    reward = load_reward(args, tokenizer, on_meta)
    critic_init = args.critic_init if args.advantage_estimator == "gae" else None  # the others have no critic
    if critic_init == "auto":
        critic_init = "reward" if reward.reads_policy_tokens else "policy"
    elif critic_init == "reward" and not reward.reads_policy_tokens:
        raise common.UserError("--critic_init reward: the critic reads the policy's tokens at every position, so it "
                               "needs a decoder reward model with the policy's tokenizer; use --critic_init policy")
    torch.manual_seed(args.seed)
    policy_hf = load_policy(args, tokenizer, on_meta)
    if args.blocked_logits:  # (its own output_logits: the model's logits, checked)
        common.agreed(lambda: on_meta or check_output_logits(policy_hf, "--sft_model_path", args.sft_model_path))
    length = args.max_prompt_length + args.response_length
    for model in [policy_hf] + ([reward.model.hf] if reward.reads_policy_tokens else []):
        common.check_position_table(model, length, f"--max_prompt_length + --response_length ({length})")
    critic_hf = critic_init and critic_from(dataclasses.replace(args, critic_init=critic_init), policy_hf, reward)
    offset = reward.model.shift / reward.model.scale if critic_init == "reward" else 0.0
    lora = None
    if args.lora_r:  # the frozen bases may be held in bfloat16; adapters and value head train in float32
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        lora = common.add_lora(policy_hf.to(dtype), args, "CAUSAL_LM")
        if critic_hf is not None:  # (its head float32: the trained copy peft makes of it, and the reward model's)
            critic_lora = common.add_lora(heads_in_float32(critic_hf.to(dtype)), args, "SEQ_CLS")
    shared = lora and critic_init == "reward"  # the reward model is the critic with its adapter off: no second copy
    if reward.model is not None:  # sharded first, so that rank 0 holds at most three models whole
        reward.model = None if shared else parallelize(reward.model, args, device, frozen=True)
    if not lora:  # computed as the policy is (sharded the same way under FSDP): the KL at initialisation is 0
        ref_policy = parallelize(copy.deepcopy(policy_hf).eval().requires_grad_(False), args, device, frozen=True)
    if args.gradient_checkpointing:  # (in training mode only: sampling keeps its KV cache)
        for model in [m for m in (policy_hf, critic_hf) if m is not None]:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    policy = parallelize(policy_hf, args, device)
    critic = None if critic_hf is None else parallelize(Critic(critic_hf, offset), args, device)
    if shared:
        reward.model = functools.partial(critic_as_reward, critic, critic_lora.disable_adapter)
    if rank == 0:
        n_trained = sum(p.numel() for m in (policy, critic) if m is not None for p in m.parameters() if p.requires_grad)
        path = reward_model_source(args)  # (None: no reward model)
        sources = [f"model {path}" + ("" if reward.reads_policy_tokens else " (reads the text)")] * bool(path)
        print(f"policy {args.sft_model_path} ({n_trained / 1e6:.2f}M trained{f', LoRA rank {args.lora_r}' * bool(lora)}"
              f"); reward {' + '.join(sources + [f'function {args.reward_fn}'] * bool(reward.fn))}; "
              + (f"critic from the {critic_init}" if critic else "no critic") + f"; {world} x {device.type}")
    return Models(policy, critic, policy if lora else ref_policy, reward, policy_hf, lora)


def build_optimizer(policy, critic, args, num_updates):
    """AdamW over the trainable parameters of policy and critic, each at its own learning rate, and the schedule."""
    trainable = torch.nn.ModuleDict({"policy": policy, **({"critic": critic} if critic is not None else {})})
    rates = {"policy": args.learning_rate, "critic": args.critic_learning_rate}
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.requires_grad], "lr": rates[name]}
                                   for name, model in trainable.items()], lr=args.learning_rate, eps=1e-5,
                                  weight_decay=args.weight_decay, fused=True)  # (lr: the polynomial schedule's start)
    scheduler = transformers.get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=0,
                                           num_training_steps=num_updates)
    return trainable, optimizer, scheduler


def load_prompts(args, tokenizer):
    """Prompt token ids (main truncates them) and the prompt texts."""
    if args.dataset_name == "embedded":
        rng = random.Random(args.seed)
        rows = [{"prompt": common.embedded_prompt(rng), "_source": "embedded", "_row": i} for i in range(4096)]
    else:
        rows = common.load_rows(args.dataset_name, args.dataset_config, args.dataset_train_split)
        if not rows:
            raise common.UserError(f"{args.dataset_name}: no split '{args.dataset_train_split}'")
    texts = [prompt_text(r, tokenizer, common.where(r)) for r in rows]
    ids = common.tokenize_prompts(tokenizer, texts)
    common.check_vocabulary(tokenizer, ids, args.dataset_name, args.sft_model_path, "--sft_model_path")
    if not all(ids):  # no BOS and no text: the first response token would attend to nothing
        raise common.UserError(f"{common.where(rows[ids.index([])])}: the prompt is empty and {args.sft_model_path}'s "
                               "tokenizer adds no BOS token, so the policy has nothing to continue; give it a prompt")
    return ids, texts


def prompt_text(row, tokenizer, where):
    """A row's prompt as the policy continues it: a preference row's, as rm.py trained on it (common.split_pair); a
    `prompt` or `messages` list rendered by the chat template up to the assistant's turn; else the text."""
    if "chosen" in row:
        return common.split_pair(row, tokenizer, where)[0]
    field = "prompt" if "prompt" in row else "messages"
    prompt = row.get(field)
    if isinstance(prompt, list):
        prompt = common.checked_messages(prompt, tokenizer, where, field)
        prompt = prompt[:-1] if prompt and prompt[-1]["role"] == "assistant" else prompt  # (up to the assistant's turn)
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
    end = common.end_id(tokenizer)
    return [ids + [end] for ids in common.tokenize_prompts(tokenizer, texts)]  # (main cuts them to the length)


def pad_left(seqs, width, pad_id):
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
    return ids, torch.arange(width) >= width - torch.tensor([len(s) for s in seqs])[:, None]


def episode_prompts(episodes, n_prompts, seed, orders):
    """Each episode's prompt: pass e = episode // n_prompts over the prompts follows a permutation seeded by (seed, e),
    so an episode's prompt depends only on its index (the same on any rank count, after any resume)."""
    for p in {e // n_prompts for e in episodes} - orders.keys():  # (each pass's permutation drawn once)
        orders[p] = torch.randperm(n_prompts, generator=torch.Generator().manual_seed(
            common.seed_of(seed, "prompt order", p)))
    return [orders[e // n_prompts][e % n_prompts].item() for e in episodes]


# --- Reward plumbing: a reward model (rm.py's normalization applied), a function, or both. ----------------------------
def critic_from(args, policy, reward):
    """The critic's network, as the Critic's docstring says."""
    if args.critic_init == "reward":
        critic = copy.deepcopy(reward.model.hf).requires_grad_(True)
        with torch.no_grad():
            for p in critic.score.parameters():  # (a bias too, where a head has one)
                p /= reward.model.scale
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


class SequenceReward(torch.nn.Module):
    """rm.py's normalized reward, (sequence_reward - shift) / scale, one module (FSDP gathers every weight it reads)."""

    def __init__(self, hf_model, shift, scale):
        super().__init__()
        self.hf, self.shift, self.scale = hf_model, shift, scale

    def forward(self, input_ids, attention_mask):
        return (sequence_reward(self.hf, input_ids, attention_mask) - self.shift) / self.scale


def critic_as_reward(critic, adapter_off, input_ids, attention_mask):
    """LoRA, a critic from the reward model: with its adapter off, the reward model normalized (Critic's docstring),
    read at the response's last real token as sequence_reward reads it."""
    with adapter_off():
        values = critic(input_ids, attention_mask)
    return values.gather(1, last_token_index(attention_mask)[:, None])[:, 0]


@dataclass
class Reward:
    """Where an episode's score comes from: a reward model, a function, or both."""
    model: object = None  # (ids, mask) -> normalized scores: a SequenceReward (sharded like the policy under FSDP)
    tokenizer: object = None  # None: the model reads the policy's tokens; else its own, reading the decoded text
    fn: object = None  # (prompts, responses) -> (B,) scores: load_reward_fn's
    reads_policy_tokens: bool = False  # a reward model that reads the policy's tokens (tokenizer None)


def reward_model_source(args):
    """The reward model's path or hub name (None: a reward function alone)."""
    path = args.reward_model_path if args.reward_model_path is not None else None if args.reward_fn else "runs/rm"
    looks_local = path is not None and (os.path.exists(path) or path.startswith((".", "/")) or path == "runs/rm")
    if looks_local and not any(os.path.exists(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        raise common.UserError(f"--reward_model_path {path}: no reward model there; train one first with "
                               f"`python rm.py --output_dir {path}` (or pass a hub reward model)")
    return path


def load_reward(args, tokenizer, on_meta=False):
    reward = Reward(fn=load_reward_fn(args.reward_fn) if args.reward_fn else None)
    if (path := reward_model_source(args)) is None:
        return reward
    config = without_dropout(common.load_pretrained(transformers.AutoConfig, path, "--reward_model_path"))
    adapter = common.adapter_base(path)
    if adapter:  # a reward adapter's base config is its causal LM's; the head it saved is a scalar
        config.num_labels = 1
    if not common.adapter_holds_head(path) if adapter else \
            not any("SequenceClassification" in a for a in config.architectures or ["SequenceClassification"]):
        # transformers would give it a head at random: a reward of noise, trained on without a word
        raise common.UserError(f"--reward_model_path {path}: not a reward model (no trained scalar head: "
                               f"{'an adapter without one' if adapter else config.architectures[0]}); train one with "
                               "rm.py, or pass --reward_fn")
    if config.num_labels != 1:
        raise common.UserError(f"--reward_model_path {path}: the model has {config.num_labels} labels; a reward model "
                               "has one (a scalar)")
    # float32, as rm.py trained it; with LoRA and --bf16 held in bfloat16, as every frozen base weight is then
    dtype = torch.bfloat16 if args.lora_r and args.bf16 else torch.float32
    model = disable_dropout(common.load_model(transformers.AutoModelForSequenceClassification, path,
                                              "--reward_model_path", on_meta, config=config, dtype=dtype))
    heads_in_float32(common.scalar_head_in_float32(model)).eval().requires_grad_(False)
    own = common.load_pretrained(transformers.AutoTokenizer, path, "--reward_model_path")
    if own.pad_token is None:
        own.pad_token = own.eos_token  # read by the mask, never by pad ids
    same_tokens = hasattr(model, "score") and all(own.convert_tokens_to_ids(t) == i
                                                  for t, i in tokenizer.get_vocab().items())
    shift, scale = getattr(model.config, "reward_shift", 0.0), getattr(model.config, "reward_scale", 1.0)
    return dataclasses.replace(reward, model=SequenceReward(model, shift, scale),  # rm.py's normalization
                               tokenizer=None if same_tokens else own, reads_policy_tokens=same_tokens)


def load_reward_fn(spec):
    """module:function (the module importable from the working directory, or a .py file), each call's output checked."""
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
        except Exception as e:  # the user's own code: its traceback (from the function in), then where it was called
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            raise common.UserError(f"--reward_fn {spec} raised {type(e).__name__}: {e} (traceback above; called by "
                                   f"ppo.py's score() on {len(prompts)} prompts and responses)") from None
        bad = [v for v in out if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if len(out) != len(prompts) or bad:
            got = f"{len(out)} values for {len(prompts)} episodes" if len(out) != len(prompts) else f"{bad[0]!r}"
            raise common.UserError(f"--reward_fn {spec} returned {got}; it must return one finite number per episode")
        return torch.tensor(out, dtype=torch.float)

    return checked


def reward_model_tokens(batch, rows, stop_id, tokenizer, reward, args):
    """The rows' episodes in the reward model's own tokens (another vocabulary, an encoder), made as rm.py makes a
    pair: the prompt as the policy saw it (its BOS the reward model's), the response decoded in context (word
    boundaries kept), ended with the reward model's end token where the policy stopped (always, for an encoder)."""
    lead, prompts, texts, stopped = tokenizer.decode(common.special_affixes(tokenizer)[0]), [], [], []
    query, query_mask = (t[rows, :batch.context_length].cpu() for t in (batch.query_response, batch.attention_mask))
    for q, qm, r, m in zip(query, query_mask.bool(), batch.responses[rows].cpu(), batch.mask[rows].cpu()):
        p_ids, r_ids = q[qm].tolist(), r[m].tolist()
        stopped.append(stop_id is not None and bool(r_ids) and r_ids[-1] == stop_id)
        r_ids = r_ids[:-1] if stopped[-1] else r_ids
        p_text = tokenizer.decode(p_ids, skip_special_tokens=False)
        full = tokenizer.decode(p_ids + r_ids, skip_special_tokens=False)
        texts.append(full[len(p_text):] if full.startswith(p_text) else tokenizer.decode(r_ids))
        prompts.append(p_text[len(lead):] if lead and p_text.startswith(lead) else p_text)
    rm_tokenizer, encoder = reward.tokenizer, not hasattr(reward.model.hf, "score")
    bos_id, table = common.leading_id(rm_tokenizer), common.position_table(reward.model.hf)
    r_ids = common.tokenize_responses(rm_tokenizer, prompts, texts)
    r_ids = [r if s or encoder else r[:-1] for r, s in zip(r_ids, stopped)]
    # within the reward model's position table (its tokens may be more than the policy's): the prompt cut further, its
    # end and BOS kept, as rm.py cuts a prompt; a response longer than the whole table (never in practice) its start
    seqs = [truncate_prompt(p, min(args.max_prompt_length, max((table or 1 << 62) - len(r), 1)), bos_id) + r
            for p, r in zip(common.tokenize_prompts(rm_tokenizer, prompts), r_ids)]
    seqs = [s[:1] + s[len(s) - table + 1:] if table and len(s) > table else s for s in seqs]
    batch = rm_tokenizer.pad({"input_ids": seqs}, return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


# --- The sampler: each episode its own uniforms (seeded by its index, whatever the batch or ranks), its cache. --------
def episode_uniform(seeds, step):
    """u ~ Uniform(0, 1) for token `step` of each row's episode, counter-based (Salmon et al. 2011): 52 random bits
    hashed from (seeds[b], step) alone, the same in any batch, on any number of ranks, compiled or not (no generator,
    no kernel per row); u = (bits + 1/2) / 2^52 (float64, never 0 or 1)."""
    low32 = 0xFFFFFFFF

    def mix(x):  # lowbias32 (Wellons 2018), a bijection of 32 bits; its constants < 2^31, so x * c < 2^63 (int64)
        for shift, c in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
            x = (x ^ (x >> shift)) * c & low32
        return x ^ (x >> 15)

    low, high, at = seeds & low32, seeds >> 32, mix(step & low32)  # (step: an int, or a tensor in a compiled graph)
    bits = (mix(low ^ mix(high ^ at)) << 20) | (mix(high ^ mix(low ^ mix(at ^ 0x9E3779B9))) >> 12)  # 32 + 20 bits
    return (bits.double() + 0.5) / 2 ** 52


class ComputeDtypeCache(transformers.StaticCache):
    """transformers' StaticCache, keys and values held in the dtype attention computes in (under bfloat16 autocast a
    rotary family's keys are float32, its values bfloat16: StaticCache sizes both from the keys, then refuses the
    values). Attention casts both to bfloat16 anyway (autocast's list), so this changes no number."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kind = key_states.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else value_states.dtype
        return super().update(key_states.to(dtype), value_states.to(dtype), layer_idx, *args, **kwargs)


@functools.cache
def takes_argument(model_class, name):
    """Every causal LM of transformers takes logits_to_keep; a remote-code model may not."""
    return name in inspect.signature(model_class.forward).parameters


# --- The learning phase's bookkeeping. --------------------------------------------------------------------------------
def entropy_of(logp_all):
    """-sum p log p over the last dimension, 0 log 0 = 0 (a -inf logit gives 0, not NaN). With a graph, a clamp that
    changes no term (p = 0 below -104) keeps the gradient finite; without one, the terms are computed in p's memory."""
    p = logp_all.exp()
    if torch.is_grad_enabled():
        return -(p * logp_all.clamp(min=-1e4)).sum(-1)
    return torch.special.entr(p, out=p).sum(-1)


@dataclass
class OptimizerStep:  # one mini-batch of a PPO epoch, as this rank runs it
    rows: torch.Tensor  # the mini-batch's rows (every rank's)
    forwards: list  # this rank's MicroBatches: its rows of each of the step's gradient_accumulation_steps


def language_modelling_loss(policy, seqs, pad_id, n_tokens, device, blocked=False):
    """The ptx loss (Ouyang et al. 2022, eq. 2): next-token cross-entropy on pretraining text, summed over real
    transitions and divided by n_tokens (those of the whole mini-batch)."""
    ids, ids_mask = (t.to(device) for t in pad_left(seqs, max(map(len, seqs)), pad_id))
    logprobs, _ = response_logprobs(policy, ids, ids_mask.long(), 1, 1.0, blocked=blocked)
    real = (ids_mask[:, 1:] & ids_mask[:, :-1]).float()  # a target counts only after a real token (left padding)
    return (-logprobs * real).sum() / n_tokens


def ptx_backward(policy, ptx, step, update, epoch, mb, args, rank, world, pad_id, backward):
    """PPO-ptx's gradient for one optimizer step: as many pretraining sequences as the mini-batch has episodes, taken
    in order by the step's global index (any rank count, any resume), divided by all their tokens; this rank's share."""
    first = ((update * args.num_ppo_epochs + epoch) * args.num_mini_batches + mb) * len(step.rows)
    seqs = [ptx[i % len(ptx)] for i in range(first, first + len(step.rows))]
    micro, share, total = args.per_device_train_batch_size, len(step.rows) // world, 0
    sync_gradients([policy], last=False)  # (all-reduced with the PPO losses' under DDP)
    for i in range(rank * share, (rank + 1) * share, micro):
        with torch.autocast(step.rows.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss = language_modelling_loss(policy, seqs[i:i + micro], pad_id, sum(len(s) - 1 for s in seqs),
                                           step.rows.device, args.blocked_logits)
        backward(args.ptx_coef * loss)
        total = total + loss.detach()
    return total


def sync_gradients(models, last):
    """DDP all-reduces gradients in a step's last backward only (FSDP2, as left, reduce-scatters every backward's)."""
    for model in (m for m in models if isinstance(m, torch.nn.parallel.DistributedDataParallel)):
        model.require_backward_grad_sync = last


def clip_and_step(trainable, optimizer, max_grad_norm, update, pg_loss):
    """Policy's and critic's gradients clipped together (0: not clipped), the step, the gradients cleared; each model's
    norm before clipping returned. A norm that is not finite stops the run before the step (the checkpoint good)."""
    def full(norm):  # (FSDP: a DTensor, each rank's shards' part)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    norms = {f"{name}/grad_norm": full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                                       if p.grad is not None]))
             for name, model in trainable.items()}
    norm = full(torch.nn.utils.clip_grad_norm_(trainable.parameters(), max_grad_norm or float("inf")))
    if not math.isfinite(norm):
        raise common.UserError(f"update {update + 1}: the gradient norm is {norm} (policy loss {pg_loss.item():.4g}); "
                               "training diverged: lower --learning_rate; --resume continues from the last checkpoint")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norms


def mean_over_steps(stats):
    """Each statistic's mean over the update's steps (a step's: its ranks' shares summed), the ratio's variance too."""
    names = list(stats[0])
    per_step = dict(zip(names, all_reduce(torch.stack([torch.stack([s[k] for s in stats]) for k in names]))))
    means = {k: v.mean().item() for k, v in per_step.items() if k != "policy/ratio_sq"}
    means["policy/ratio_var"] = (per_step["policy/ratio_sq"] - per_step["policy/ratio"] ** 2).mean().item()
    return means


# --- Distributed set-up (torchrun's environment variables; `python ppo.py` is world size 1). --------------------------
def setup_distributed():
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    common.attention_without_nan(device)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # an hour, not the default 10 minutes: the ranks wait in a collective while rank 0 writes the final model
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
    return rank, world, device


def parallelize(model, args, device, frozen=False):
    """DDP, or FSDP2 (a unit per transformer block, the input embeddings, a float32 head) from rank 0's weights. A
    frozen model: sharded too under FSDP (on the host with --offload_inference_models), a replica under DDP."""
    host = frozen and args.offload_inference_models and device.type == "cuda"
    if not dist.is_initialized() or (frozen and not args.fsdp):
        return model.to(device)
    if args.fsdp:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        # bf16 is compute only: the sharded parameters, and so the optimizer's steps, stay in their own dtype
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.bf16 else None, reduce_dtype=torch.float32)
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=True)} if host else {}

        def shard(model):
            hf = next(m for m in model.modules() if hasattr(m, "get_input_embeddings"))
            # its own unit, gathered in float32: a scalar head (a Float32Linear, or peft's wrapper of one), or a causal
            # LM's untied float32 output layer (gathered only to compute logits, not held with the root)
            if getattr(hf, "score", None) is not None:
                linears = [m for m in hf.score.modules() if isinstance(m, torch.nn.Linear)]
                head = hf.score if linears and all(isinstance(m, common.Float32Linear) for m in linears) else None
            else:
                output = hf.get_output_embeddings()
                untied = isinstance(output, torch.nn.Linear) and output.weight is not hf.get_input_embeddings().weight
                head = output if untied and output.weight.dtype == torch.float32 else None
            in_float32 = set(head.parameters()) if head is not None else set()
            if frozen and args.bf16:  # gathered in bfloat16 to compute: held so, the same numbers at half the memory
                for p in set(model.parameters()) - in_float32:  # (parameters only: RoPE's buffers stay float32)
                    p.data = p.data.to(torch.bfloat16)
            for block in next(m for m in model.modules()
                              if isinstance(m, torch.nn.ModuleList) and len(m) == hf.config.num_hidden_layers):
                fully_shard(block, mp_policy=mp, **offload)
            common.shard_input_embeddings(model, fully_shard, mp_policy=mp, **offload)
            if head is not None:  # gathered in float32, its inputs cast to it: the logits, values, rewards in float32
                fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32), **offload)
            fully_shard(model, mp_policy=mp, **offload)

        return common.shard_from_rank0(model, shard, device, host)
    model.to(device)
    # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, not a second copy of them
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index],
                                                     broadcast_buffers=False, gradient_as_bucket_view=True)


def heads_in_float32(model):
    """A sequence classifier's scalar head held in float32 (the rest may be bfloat16: README's precision table)."""
    (getattr(model, "score", None) or getattr(model, "classifier", None) or torch.nn.Identity()).float()
    return model


@contextlib.contextmanager
def gathered_once(model, enabled):
    """Under FSDP: the weights gathered at the first forward inside and kept for every forward after (a rollout's
    one-token decodes: one all-gather per block, not one per token), then sharded again as parallelize left them."""
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


@contextlib.contextmanager
def resharded(models):
    """Frozen sharded models' weights released after they compute (FSDP's root keeps them, for a backward never run)."""
    try:
        yield
    finally:
        for unit in (u for m in models if isinstance(m, torch.nn.Module) for u in m.modules() if hasattr(u, "reshard")):
            unit.reshard()


# --- Logging, the final save, figures. --------------------------------------------------------------------------------
def open_logs(args, rank, saved):
    """Rank 0's metrics logger and samples.jsonl (on resume, continued after the checkpoint's update, saved)."""
    return None if rank != 0 else (common.Logger(args, args.wandb_project, saved),
                                   common.open_log(os.path.join(args.output_dir, "samples.jsonl"), saved))


def log_update(logs, bar, m, last, args, tokenizer, batch):
    """The update's metrics to every log; every --sample_every updates, and at the last, a table of samples."""
    logger, samples_file = logs
    logger.log(m)
    shown = {"score": "objective/scores", "kl": "objective/kl", "gold": "gold/mean"}  # (gold: the embedded task's)
    bar.set_postfix(**{name: f"{m[key]:.3f}" for name, key in shown.items() if key in m})
    if (m["step"] - 1) % args.sample_every and not last:
        return
    bar.write(common.format_metrics(m))
    c = batch.context_length
    for i in range(min(args.num_samples, len(batch.scores))):
        prompt = tokenizer.decode(batch.query_response[i, :c][batch.attention_mask[i, :c].bool()])
        row = {"step": m["step"], "prompt": prompt, "response": tokenizer.decode(batch.responses[i][batch.mask[i]]),
               **{name: v[i].item() for name, v in (("score", batch.scores), ("gold", batch.gold)) if v is not None}}
        bar.write(f"  {prompt[-60:]!r} -> {row['response'][:80]!r}"
                  + "".join(f"  {name} {row[name]:.3f}" for name in ("score", "gold") if name in row))
        samples_file.write(json.dumps(row) + "\n")
    samples_file.flush()


def update_metrics(batch, kl, non_score_reward, times, args, peak_memory_of=None):
    """The rollout's statistics (TRL's names), episodes and tokens per second, each phase's time; peak_memory_of: a
    device, whose peak memory so far (what each rank held at most) is added."""
    mask, elapsed = batch.mask.float(), times[-1] - times[0]
    # objective/entropy: -log p of the sampled tokens, summed over the response (TRL's name): a one-sample estimate
    m = {"objective/kl": kl.sum(1).mean(), "objective/entropy": (-batch.logprobs * mask).sum(1).mean(),
         "objective/non_score_reward": non_score_reward.sum(1).mean(), "objective/scores": batch.scores.mean(),
         "objective/rlhf_reward": (batch.scores + non_score_reward.sum(1)).mean(),
         "response/length": mask.sum(1).mean(), "perf/episodes_per_s": len(mask) / elapsed,
         **{f"perf/time_{p}": t1 - t0 for p, t0, t1 in zip(("rollout", "score", "learn"), times, times[1:])},
         "perf/tokens_per_s": batch.attention_mask.sum().item() * (1 + args.num_ppo_epochs) / elapsed}
    if batch.values is not None:
        m["val/mean"] = masked_mean(batch.values, mask)
    if batch.has_stop is not None:  # None with --stop_token none: no response can stop
        m["response/eos_rate"] = batch.has_stop.float().mean()
    if batch.gold is not None:
        m["gold/mean"], m["gold/std"] = batch.gold.mean(), batch.gold.std()
    return {**{k: float(v) for k, v in m.items()}, **(common.peak_memory(peak_memory_of) if peak_memory_of else {})}


def save_final(trainable, policy_hf, lora, tokenizer, history, logs, args, rank):
    """The final policy in transformers' format (LoRA: merged, the adapter in output_dir/adapter), its tokenizer, the
    curves, the first and last 5 updates' means of proxy score, KL and gold score; the logs closed."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    policy_sd = get_model_state_dict(trainable["policy"], options=options)
    if rank != 0:
        return
    if lora is not None:
        policy_hf = common.save_lora(policy_hf, lora, policy_sd, tokenizer, args.output_dir)
        policy_sd = policy_hf.state_dict()
    common.save_pretrained_atomic(policy_hf, tokenizer, args.output_dir, state_dict=policy_sd)
    # scores and KL against episodes, and the scores against sqrt(KL): the axis on which Gao et al. 2022 show the gold
    # score rising, then falling (reward model overoptimization)
    from matplotlib.figure import Figure
    episodes, kl = [h["episodes"] for h in history], [h["objective/kl"] for h in history]
    scores = {name: [h.get(key, float("nan")) for h in history]  # (gold: the embedded task's true reward)
              for name, key in (("proxy", "objective/scores"), ("gold", "gold/mean")) if any(key in h for h in history)}
    axes = Figure(figsize=(15, 4)).subplots(1, 3)
    for name, ys in scores.items():
        axes[0].plot(episodes, ys, label=name)
        axes[2].plot([max(k, 0.0) ** 0.5 for k in kl], ys, ".", alpha=0.5, label=name)
    axes[1].plot(episodes, kl)
    axes[0].set(title="Score (mean per episode)", xlabel="episodes")
    axes[1].set(title="KL to the reference (summed over the response)", xlabel="episodes")
    axes[2].set(title="Score against sqrt(KL), one dot per update", xlabel="sqrt(KL)")
    axes[0].legend()
    common.save_figure(axes[0].figure, os.path.join(args.output_dir, "curves.png"))
    summary = {}
    for key, name in {"objective/scores": "proxy", "objective/kl": "kl", "gold/mean": "gold",
                      "gold/std": "gold_std"}.items():
        if xs := [h[key] for h in history if key in h]:
            summary[f"{name}_first"], summary[f"{name}_last"] = (sum(p) / len(p) for p in (xs[:5], xs[-5:]))
    common.write_json_atomic(os.path.join(args.output_dir, "ppo_results.json"),
                             {**summary, "args": dataclasses.asdict(args)})
    for log in logs:
        log.close()
    print(" ".join(f"{k}={v:.4g}" for k, v in summary.items()) + f"; saved to {args.output_dir}")


# --- Opt-in: length grouping (--group_by_length). Less padding, the same numbers (tests/test_ppo.py checks a run). ---
GROUP_OVERHEAD_TOKENS = 64  # the cost of one more forward and backward, in tokens (~30 on 2 CPU cores; more on GPUs)


def length_groups(prompt_lengths, response_lengths, overhead=None):
    """Rows in groups of similar length, one trimmed forward each: sorted by length, a row joins the group before it
    unless the padding that adds (width: longest prompt + longest response) costs more than one more call."""
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


def length_grouped(batch, rows, micro):
    """micro_batches under --group_by_length: each micro-batch's rows as length_groups, each one forward less the
    columns all padding in its rows (position ids come from the mask: the real tokens' outputs are unchanged)."""
    context, out = batch.context_length, []
    prompt_lengths, response_lengths = batch.attention_mask[:, :context].sum(1), batch.mask.sum(1)
    for r in rows.split(micro):
        for group in (r[g.to(r.device)] for g in length_groups(prompt_lengths[r], response_lengths[r])):
            real = batch.attention_mask[group].bool().any(0)
            first = min(int(real.int().argmax()), context - 1)
            last = max(len(real) - int(real.flip(0).int().argmax()), context + 1)
            out.append(MicroBatch(group, batch.query_response[group][:, first:last],
                                  batch.attention_mask[group][:, first:last], context - first, last - context))
    return out


# --- Opt-in: the output layer in bounded memory (--blocked_logits). response_logprobs' numbers and gradients. --------
LOGIT_BLOCK = 2 ** 25  # elements (128 MB in float32) of one block of response logits


def output_logits(model, hidden, temperature=1.0):
    """A causal LM's logits / temperature in float32 from the hidden states its output layer reads, whatever the
    autocast and dtype: the layer, then the families' transforms (Gemma's softcapping, Cohere's logit scale, Granite's
    scaling; check_output_logits confirms them). All linear: (h / T) W = (h W) / T, hidden- not vocabulary-wide."""
    head, cap = model.get_output_embeddings(), getattr(model.config, "final_logit_softcapping", None)
    linear = cap is None and getattr(head, "bias", None) is None
    with torch.autocast(hidden.device.type, enabled=False):
        hidden = hidden.float() / temperature if linear else hidden.float()
        # a module call (FSDP gathers the layer where it is its own unit); in float32 (output_layer_in_float32)
        logits = head(hidden if isinstance(head, common.Float32Linear) else hidden.to(head.weight.dtype)).float()
        if cap:
            logits = cap * torch.tanh(logits / cap)
        if (scale := getattr(model, "logit_scale", None)) is not None:
            logits = logits * scale
        if divisor := getattr(model.config, "logits_scaling", None):
            logits = logits / divisor
        return logits if linear else logits / temperature


def head_inputs(model, **inputs):
    """The hidden states the model's output layer reads, from its own forward (through DDP or FSDP), the layer handed
    an empty slice instead: the model's own logits are never computed."""
    captured = []

    def capture(module, args):
        captured.append(args[0])
        return (args[0][:, :0],) + args[1:]

    with unwrap(model).get_output_embeddings().register_forward_pre_hook(capture):
        model(**inputs)
    return captured[0]


def blocked_response_logprobs(policy, inputs, predicting, targets, temperature, entropy=False, entropy_grad=True):
    """response_logprobs in memory bounded whatever the vocabulary: its forward's positions predicting a response token
    through the output layer (head_inputs) in blocks of LOGIT_BLOCK elements, each recomputed in the backward pass
    (Chen et al. 2016), so a micro-batch's logits (16 x 128 x 152k floats: 1.2 GB) are never held whole."""
    model, hidden = unwrap(policy), head_inputs(policy, **inputs)[:, -predicting:-1]

    def block(h, y):  # float32 throughout: logits, log-softmax and entropy
        logp_all = torch.log_softmax(output_logits(model, h, temperature), -1)
        logprobs = logp_all.gather(-1, y[..., None]).squeeze(-1)
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            return logprobs, entropy_of(logp_all) if entropy else torch.zeros_like(logprobs)

    step = max(1, LOGIT_BLOCK // max(len(hidden) * model.get_output_embeddings().weight.shape[0], 1))
    recompute = torch.is_grad_enabled() and step < hidden.shape[1]  # (one block: computed directly)
    run = functools.partial(torch.utils.checkpoint.checkpoint, block, use_reentrant=False) if recompute else block
    parts = [run(hidden[:, s:s + step], targets[:, s:s + step]) for s in range(0, hidden.shape[1], step)]
    logprobs, entropies = (torch.cat(t, 1) for t in zip(*parts))
    return logprobs, entropies if entropy else None


@torch.no_grad()
def check_output_logits(model, flag, name):
    """output_logits must give the model's own logits: an output transform it does not know is named before training."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(1, 9, device=next(model.parameters()).device)[None] % vocab
    own = model(input_ids=ids).logits.float()
    ours = output_logits(model, head_inputs(model, input_ids=ids)).float()
    # a model held in bfloat16 rounds its own logits to bfloat16 (2^-8 relative); an unknown transform moves them more
    tol = 1e-4 if model.get_output_embeddings().weight.dtype == torch.float32 else 1e-2
    if not torch.allclose(own, ours, atol=tol, rtol=tol):
        raise common.UserError(f"{flag} {name}: ppo.py's output_logits does not reproduce this model's logits (an "
                               f"output transform it does not know, in {type(model).__name__}); add it there")


# --- --compile: the decode step through CUDA graphs. ------------------------------------------------------------------
STOP_CHECK_EVERY = 16  # --compile: tokens between two reads of whether every row has stopped (a read waits for the GPU)
DECODES = weakref.WeakKeyDictionary()  # a model -> its CompiledDecode (which holds no reference to the model)


@torch.no_grad()
def compiled_generate(model, query, query_mask, seeds, args, stop_id, pad_id):
    """generate's tokens, each after the first from CompiledDecode's step; whether every row has stopped read every
    STOP_CHECK_EVERY tokens (a read waits for the device), the tokens after padded as generate pads them (not FSDP)."""
    model, kind = unwrap(model), query.device.type
    # the rows and --max_prompt_length + --response_length columns, every rollout's: compiled (its graph recorded) once
    key = (len(query), max(query.shape[1], args.max_prompt_length or 0) + args.response_length, args.temperature,
           torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
    if (decode := DECODES.get(model)) is None or decode.key != key:
        decode = DECODES[model] = CompiledDecode(model, key)
    decode.cache.reset()
    position = (query_mask.long().cumsum(1) - 1).clamp(min=0)
    mask = F.pad(query_mask.long(), (0, decode.cache_length - query.shape[1]), value=1)
    last_only = {"logits_to_keep": 1} if takes_argument(type(model), "logits_to_keep") else {}
    tokens = [decode.forward(model, query, 0, position, mask, seeds, **last_only)]  # (the prompt: not compiled)
    step = torch.zeros((), dtype=torch.long, device=query.device)  # (the index: on device)
    position = position[:, -1:].contiguous()  # (strides too the same for every rollout)
    for t in range(1, args.response_length):
        if t % STOP_CHECK_EVERY == 0 and stop_id is not None and (torch.cat(tokens, 1) == stop_id).any(1).all():
            break
        step.fill_(t)
        torch.compiler.cudagraph_mark_step_begin()
        tokens.append(decode.step(model, tokens[-1], step, position, mask, seeds).clone())  # (graphs reuse outputs)
    responses = torch.cat(tokens, 1)
    if stop_id is not None:  # as generate: padding after the first token where every row had stopped
        all_stopped = (responses == stop_id).cumsum(1).gt(0).all(0)  # (T,)
        responses = responses.masked_fill(F.pad(all_stopped[:-1], (1, 0), value=False), pad_id)
    return F.pad(responses, (0, args.response_length - responses.shape[1]), value=pad_id)


class CompiledDecode:
    """generate's one-token step through torch.compile(mode="reduce-overhead") (gpt-fast): the plain step's function
    (in float32 on a CPU the same tokens) on fixed shapes (a static cache of cache_length columns, the step index on
    the device): compiled once, on a GPU one CUDA graph replayed per token, no host sync. Holds no model reference."""

    def __init__(self, model, key):
        self.key, self.cache_length, self.temperature = key, key[1], key[2]
        self.cache = ComputeDtypeCache(config=model.config, max_cache_len=self.cache_length)
        self.step = torch.compile(self.forward, mode="reduce-overhead", dynamic=False)

    def forward(self, model, ids, t, position, mask, seeds, **last_only):  # token t (B, 1) from the prompt or t - 1
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=self.cache, use_cache=True,
                       position_ids=position + t, **last_only).logits[:, -1].float() / self.temperature
        return sample_tokens(logits, seeds, t)[:, None]


if __name__ == "__main__":
    common.exit_on_user_error(main, common.cli(Args))
