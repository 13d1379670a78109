"""PPO for language models (RLHF) in one file.

    python rm.py && python ppo.py                  # embedded task: reward model, then PPO, CPU, a few minutes
    torchrun --nproc_per_node 2 ppo.py             # the same PPO on 2 processes
    torchrun --nproc_per_node 8 ppo.py --sft_model_path EleutherAI/pythia-1b-deduped \
        --reward_model_path runs/rm --dataset_name trl-lib/tldr --response_length 53 --bf16
    python ppo.py --help                           # every option, documented

Four models: the policy (trained), a frozen reference copy of it, a critic (trained; by default initialised from the
reward model) and the frozen reward model. Each update:
  1. roll out: sample a response to every prompt of the batch (KV-cached, seeded per prompt);
  2. score: reward model at the response's last real token, log-probs of policy and reference, values;
  3. rewards = -kl_coef * KL per token + score at the last token; advantages by GAE, whitened;
  4. learn: num_ppo_epochs passes of clipped-surrogate policy loss and clipped value loss over shuffled mini-batches;
  5. adapt kl_coef, log, checkpoint.
Schulman et al. 2017 (PPO); Ziegler et al. 2019 and Stiennon et al. 2020 (PPO for language); Huang et al. 2024
("The N implementation details of RLHF with PPO").
"""

import copy
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from tqdm import tqdm

import common


@dataclass
class Args:
    # --- models and data
    sft_model_path: str = "embedded-llama"
    """The initial policy: a Hugging Face causal LM name or path, or embedded-llama / embedded-neox (a tiny model built
    and briefly fine-tuned on the embedded task locally)."""
    reward_model_path: str = "runs/rm"
    """A reward model saved by rm.py (its normalization is applied), or any AutoModelForSequenceClassification."""
    critic_init: Literal["reward", "policy"] = "reward"
    """Initialise the critic from the reward model (value head = reward head) or from the policy (new head)."""
    dataset_name: str = "embedded"
    """Prompts: hub name, local .jsonl/.json/.parquet/.csv(.gz) with a `prompt` (text or messages), `messages` or
    preference columns, or `embedded`."""
    dataset_config: str | None = None
    """Hub dataset configuration name."""
    dataset_train_split: str = "train"
    """Split to take prompts from."""
    max_prompt_length: int = 256
    """Longer prompts keep their last tokens."""
    output_dir: str = "runs/ppo"
    """Where the final policy, metrics.jsonl, samples.jsonl, curves.png and checkpoints are written."""
    # --- sizes
    total_episodes: int = 12288
    """Episodes (prompt, response) to train on in all."""
    per_device_train_batch_size: int = 16
    """Episodes per device per forward/backward pass of the learning phase (a micro-batch)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    num_mini_batches: int = 2
    """Optimizer steps per PPO epoch. Rollout batch = micro-batch x accumulation x mini-batches x world size."""
    num_collect_steps: int = 1
    """Each rank generates its share of the rollout batch in this many chunks, collected into one buffer."""
    num_ppo_epochs: int = 4
    """Passes over each rollout batch."""
    # --- optimisation
    learning_rate: float | None = None
    """AdamW learning rate of policy and critic (default: 3e-4 for the embedded models, 3e-6 for pretrained ones)."""
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    """Learning-rate schedule over the updates."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm over policy and critic together (0 disables)."""
    seed: int = 1
    """Seed of data order and sampling (each episode's sampling is seeded by its global index)."""
    # --- sampling
    response_length: int = 16
    """Maximum new tokens per response."""
    temperature: float = 1.0
    """Sampling temperature; log-probs in training use the same temperature."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0: off)."""
    top_p: float = 1.0
    """Nucleus sampling: smallest set of tokens with this much probability (1.0: off)."""
    stop_token: str = "eos"
    """Token that ends a response: `eos`, a token string, or `none`. Tokens after it are padding."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of responses that never emit the stop token."""
    # --- PPO
    kl_coef: float = 0.1
    """Initial coefficient of the per-token KL penalty to the reference policy."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """Per-token KL estimate: k1 = log p - log q, k3 = (q/p - 1) - log(q/p) (Schulman 2020, non-negative)."""
    target_kl: float | None = None
    """Adaptive KL controller target (sum over the response); None keeps kl_coef fixed (Ziegler et al. 2019)."""
    kl_horizon: int = 10000
    """Horizon in episodes of the adaptive KL controller."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange: float = 0.2
    """Clip range of the policy ratio."""
    cliprange_value: float = 0.2
    """Clip range of the value prediction around its rollout value."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (scale only) before GAE."""
    ptx_coef: float = 0.0
    """Weight of a language-modelling loss on --ptx_dataset_name (InstructGPT's PPO-ptx, Ouyang et al. 2022)."""
    ptx_dataset_name: str | None = None
    """Text for the ptx loss: a dataset with a `text` column, or `embedded`."""
    # --- logging, checkpoints, systems
    sample_every: int = 10
    """Print and save a table of sample completions every this many updates."""
    num_samples: int = 4
    """Rows in each sample table."""
    save_steps: int = 0
    """Write a resumable checkpoint every this many updates (0: never)."""
    resume: bool = False
    """Continue from the latest checkpoint in --output_dir."""
    track: bool = False
    """Log to Weights & Biases (works with WANDB_MODE=offline)."""
    wandb_project: str = "rlhf-ppo"
    """Weights & Biases project."""
    run_name: str | None = None
    """Run name for Weights & Biases."""
    offload_inference_models: bool = False
    """Keep the reference and reward models on the CPU during the learning phase (GPU memory)."""
    fsdp: bool = False
    """Shard policy and critic per transformer block with FSDP2 (default: DDP)."""
    bf16: bool = False
    """bfloat16 autocast."""


# ---------------------------------------------------------------------------------------------------------------------
# The math.


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the real tokens (unbiased variance); shift_mean=False keeps the mean (reward whitening)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * mask.sum() / (mask.sum() - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * mask


def kl_per_token(logprobs, ref_logprobs, estimator="k1"):
    """Estimates of KL(policy || reference) from samples of the policy (Schulman 2020, "Approximating KL divergence")."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    log_ratio = ref_logprobs - logprobs
    return log_ratio.exp() - 1 - log_ratio


def gae(rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16) over the real tokens of each response: the
    value after the last real token is 0. Returns advantages and returns (= advantages + values, the value targets)."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange):
    """Clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss, averaged over real tokens."""
    ratio = (logprobs - old_logprobs).exp()
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    stats = {"clipfrac": masked_mean((clipped > unclipped).float(), mask),
             "approxkl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask),
             "ratio": masked_mean(ratio, mask), "ratio_var": masked_mean((ratio - masked_mean(ratio, mask)) ** 2, mask)}
    return loss, stats


def value_loss(values, old_values, returns, mask, cliprange_value):
    """0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped within cliprange_value of the rollout value."""
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_sq, clipped_sq = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * masked_mean(torch.maximum(unclipped_sq, clipped_sq), mask), \
        masked_mean((clipped_sq > unclipped_sq).float(), mask)


def adaptive_kl_coef(kl_coef, kl, target, horizon, n_episodes):
    """Ziegler et al. 2019, eq. 2: move kl_coef by a proportional error clipped to +-20%, at rate n / horizon."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_episodes / horizon)


def truncate_after_stop(responses, stop_id, pad_id):
    """Tokens after the first stop token become padding. Returns the responses and their real-token mask (the stop
    token itself is real: the reward model reads the response there)."""
    if stop_id is None:
        return responses, torch.ones_like(responses, dtype=torch.bool)
    is_stop = responses == stop_id
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0
    return responses.masked_fill(after_stop, pad_id), ~after_stop


def last_token_index(mask):
    """Index of the last real token of each row (any padding side, pad id == eos id included)."""
    return (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(1)


def filter_logits(logits, top_k, top_p):
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative - sorted_logits.softmax(-1) >= top_p  # keep up to and including the token crossing top_p
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


# ---------------------------------------------------------------------------------------------------------------------
# Sampling: each episode has its own random stream (seeded by its global index), so samples do not depend on the
# batch they are in, nor on the number of ranks.


@torch.no_grad()
def generate(model, query, query_mask, generators, args, stop_id, pad_id, collective=False):
    """KV-cached sampling (Gumbel-max with per-row noise). Returns responses (B, response_length) and the log-probs of
    the sampled tokens at the sampling temperature."""
    position = (query_mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=query, attention_mask=query_mask, position_ids=position, use_cache=True)
    mask, tokens, logprobs = query_mask, [], []
    done = torch.zeros(len(query), dtype=torch.bool, device=query.device)
    for t in range(args.response_length):
        logits = out.logits[:, -1].float() / args.temperature
        noise = torch.stack([torch.rand(logits.shape[-1], generator=g) for g in generators]).to(logits.device)
        gumbel = -torch.log(-torch.log(noise.clamp(1e-20, 1.0 - 1e-7)))
        token = (filter_logits(logits, args.top_k, args.top_p) + gumbel).argmax(-1)
        logprobs.append(torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1))
        tokens.append(token)
        done |= token == stop_id
        all_done = done.all()
        if collective:  # FSDP: every rank must run the same number of forward passes
            all_done = torch.tensor(float(all_done), device=query.device)
            dist.all_reduce(all_done, op=dist.ReduceOp.MIN)
        if all_done or t == args.response_length - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, -1:] + t + 1,
                    past_key_values=out.past_key_values, use_cache=True)
    responses, logprobs = torch.stack(tokens, 1), torch.stack(logprobs, 1)
    width = args.response_length - responses.shape[1]
    return F.pad(responses, (0, width), value=pad_id), F.pad(logprobs, (0, width))


class ScalarHeadModel(torch.nn.Module):
    """A sequence-classification model's scalar head applied at every position: the critic's values, and the reward
    model's score (read at the last real token)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, attention_mask):
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        hidden = self.hf.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False).last_hidden_state
        return self.hf.score(hidden).squeeze(-1).float()


def policy_forward(policy, query_response, mask, context_length, temperature):
    """Log-probs and entropies of the response tokens under the policy, at the sampling temperature."""
    position = (mask.cumsum(1) - 1).clamp(min=0)
    logits = policy(input_ids=query_response, attention_mask=mask, position_ids=position).logits
    logits = logits[:, context_length - 1:-1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logprobs = logp_all.gather(-1, query_response[:, context_length:, None]).squeeze(-1)
    return logprobs, -(logp_all.exp() * logp_all).sum(-1)


# ---------------------------------------------------------------------------------------------------------------------
# Models and data.


def load_tokenizer(args):
    from transformers import AutoTokenizer

    if args.sft_model_path.startswith("embedded-"):
        return common.embedded_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe here: every mask comes from lengths, never from pad ids
    return tokenizer


def load_policy(args, tokenizer):
    from transformers import AutoModelForCausalLM

    if args.sft_model_path.startswith("embedded-"):
        return common.embedded_sft_policy(args.sft_model_path, tokenizer, args.seed)
    return AutoModelForCausalLM.from_pretrained(args.sft_model_path)


def load_reward_model(path):
    """A reward model and its tokenizer; rm.py's normalization (config.reward_shift/scale) applied to its head, so the
    returned model gives normalized rewards."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    looks_local = os.path.exists(path) or path.startswith((".", "/")) or path == Args.reward_model_path
    if looks_local and not os.path.exists(os.path.join(path, "config.json")):
        raise common.UserError(f"--reward_model_path {path}: no reward model there; train one first with "
                               f"`python rm.py --output_dir {path}` (or pass a hub reward model)")
    model = AutoModelForSequenceClassification.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    shift, scale = getattr(model.config, "reward_shift", 0.0), getattr(model.config, "reward_scale", 1.0)
    with torch.no_grad():  # r' = (w.h - shift) / scale: fold the scale into w, keep the shift as an explicit offset
        model.score.weight /= scale
    model.reward_offset = shift / scale
    return model, tokenizer


def critic_from(args, policy, reward_hf):
    from transformers import AutoModelForSequenceClassification

    if args.critic_init == "reward":
        return copy.deepcopy(reward_hf)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    critic = AutoModelForSequenceClassification.from_config(config)
    critic.load_state_dict(policy.state_dict(), strict=False)  # same backbone weights, new zero-mean head
    torch.nn.init.normal_(critic.score.weight, std=1 / (config.hidden_size + 1) ** 0.5)
    return critic


def load_prompts(args, tokenizer):
    """Prompt token ids (end kept within max_prompt_length) and the prompt texts."""
    if args.dataset_name == "embedded":
        rng = random.Random(args.seed)
        texts = [common.embedded_prompt(rng) for _ in range(4096)]
    else:
        rows = common.mix_rows([args.dataset_name, "1.0"], args.dataset_train_split, args.seed, args.dataset_config)
        if not rows:
            raise common.UserError(f"{args.dataset_name}: no split '{args.dataset_train_split}'")
        texts = [prompt_text(r, tokenizer, f"{r['_source']}: row {r['_row']}") for r in rows]
    ids = [p[-args.max_prompt_length:] for p in common.tokenize_prompts(tokenizer, texts)]
    return ids, texts


def prompt_text(row, tokenizer, where):
    prompt = row.get("prompt", row.get("messages"))
    if isinstance(prompt, list):  # chat messages: everything up to the assistant's turn, then the generation prompt
        if prompt and prompt[-1].get("role") == "assistant":
            prompt = prompt[:-1]
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    if isinstance(prompt, str):
        return prompt
    if "chosen" in row:
        return common.split_pair(row, tokenizer, where)[0]
    raise common.UserError(f"{where}: no 'prompt', 'messages' or 'chosen' field to take a prompt from")


def load_ptx(args, tokenizer):
    if args.ptx_dataset_name == "embedded":
        rng = random.Random(args.seed + 1)
        texts = [common.embedded_prompt(rng) + common.embedded_response(rng) for _ in range(4096)]
    else:
        rows = common.mix_rows([args.ptx_dataset_name, "1.0"], "train", args.seed)
        if not rows or "text" not in rows[0]:
            raise common.UserError(f"{args.ptx_dataset_name}: --ptx_dataset_name needs a 'text' column")
        texts = [r["text"] for r in rows]
    limit = args.max_prompt_length + args.response_length
    return [ids[:limit] for ids in common.tokenize_responses(tokenizer, texts)]


def pad_left(seqs, width, pad_id):
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
    return ids, torch.arange(width) >= width - torch.tensor([len(s) for s in seqs])[:, None]


# ---------------------------------------------------------------------------------------------------------------------
# Distributed set-up (torchrun's environment variables; `python ppo.py` is world size 1).


def setup_distributed():
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def parallelize(model, args, device, num_layers):
    model.to(device)
    if not dist.is_initialized():
        return model
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers)
        for block in blocks:
            fully_shard(block)
        return fully_shard(model)
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                     broadcast_buffers=False)


def unwrap(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def set_grad_sync(models, enabled):
    for model in models:
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(enabled)
        elif hasattr(model, "require_backward_grad_sync"):  # DDP
            model.require_backward_grad_sync = enabled


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


# ---------------------------------------------------------------------------------------------------------------------


def main(args):
    rank, world, device = setup_distributed()
    micro = args.per_device_train_batch_size
    local_mini_batch = micro * args.gradient_accumulation_steps
    local_batch = local_mini_batch * args.num_mini_batches  # episodes each rank rolls out per update
    batch_size = local_batch * world
    chunk = common.exact_div(local_batch, args.num_collect_steps, "episodes per rank per update / --num_collect_steps")
    num_updates = args.total_episodes // batch_size
    if num_updates == 0:
        raise common.UserError(f"--total_episodes {args.total_episodes} is less than one rollout batch ({batch_size})")
    embedded = args.sft_model_path.startswith("embedded-")
    lr = args.learning_rate or (3e-4 if embedded else 3e-6)
    os.makedirs(args.output_dir, exist_ok=True)

    tokenizer = load_tokenizer(args)
    stop_id = {"eos": tokenizer.eos_token_id, "none": None}.get(args.stop_token, tokenizer.get_vocab().get(
        args.stop_token, -1))
    if stop_id == -1:
        raise common.UserError(f"--stop_token {args.stop_token!r} is not a token of {args.sft_model_path}'s tokenizer; "
                               "pass eos, none, or one token as the tokenizer spells it")

    # Models: policy and critic are trained; reference and reward model are frozen.
    reward_hf, reward_tokenizer = load_reward_model(args.reward_model_path)
    torch.manual_seed(args.seed)
    policy_hf = load_policy(args, tokenizer)
    for module in policy_hf.modules():  # no dropout: log-probs of rollout and learning must come from one network
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ref_policy = copy.deepcopy(policy_hf).eval().requires_grad_(False).to(device)
    critic_hf = critic_from(args, policy_hf, reward_hf)
    reward_model = ScalarHeadModel(reward_hf).eval().requires_grad_(False).to(device)
    same_vocab = all(reward_tokenizer.convert_tokens_to_ids(t) == i for t, i in tokenizer.get_vocab().items())
    policy = parallelize(policy_hf, args, device, policy_hf.config.num_hidden_layers)
    critic = parallelize(ScalarHeadModel(critic_hf), args, device, critic_hf.config.num_hidden_layers)
    trainable = torch.nn.ModuleDict({"policy": policy, "critic": critic})
    optimizer = torch.optim.AdamW(trainable.parameters(), lr=lr, eps=1e-5, fused=True)
    from transformers import get_scheduler

    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=0, num_training_steps=num_updates)
    prompts, prompt_texts = load_prompts(args, tokenizer)
    ptx = load_ptx(args, tokenizer) if args.ptx_coef > 0 else None

    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    start, kl_coef, history = 0, args.kl_coef, []
    if args.resume and (ckpt := common.load_latest_checkpoint(args.output_dir)) is not None:
        set_state_dict(trainable, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(ckpt["scheduler"])
        common.set_rng_state(ckpt["rng"])
        start, kl_coef, history = ckpt["update"], ckpt["kl_coef"], ckpt["history"]
    metrics_file = common.open_metrics(args.output_dir, start if args.resume else None) if rank == 0 else None
    samples_file = open(os.path.join(args.output_dir, "samples.jsonl"), "a" if args.resume else "w") if rank == 0 else None
    wandb_run = common.start_wandb(args, args.wandb_project) if args.track and rank == 0 else None
    if rank == 0:
        print(f"policy {args.sft_model_path} ({sum(p.numel() for p in policy_hf.parameters()) / 1e6:.2f}M), reward "
              f"model {args.reward_model_path}, critic from {args.critic_init}; world size {world} ({device.type}, "
              f"{'FSDP2' if args.fsdp and world > 1 else 'DDP' if world > 1 else 'single process'})")
        print(f"rollout batch {batch_size} episodes = {micro} x {args.gradient_accumulation_steps} accumulation x "
              f"{args.num_mini_batches} mini-batches x {world} ranks; {num_updates} updates x {args.num_ppo_epochs} "
              f"epochs; lr {lr:g}; {len(prompts)} prompts; response_length {args.response_length}")

    orders = {}
    bar = tqdm(range(start, num_updates), disable=rank != 0, initial=start, total=num_updates, desc="ppo")
    for update in bar:
        t0 = time.time()
        # 1. Rollout: this rank's contiguous share of the update's episodes, each with its own sampling stream.
        episodes = range(update * batch_size + rank * local_batch, update * batch_size + (rank + 1) * local_batch)
        for e in episodes:
            epoch = e // len(prompts)
            if epoch not in orders:
                orders[epoch] = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(args.seed + epoch))
        prompt_index = [orders[e // len(prompts)][e % len(prompts)].item() for e in episodes]
        width = all_reduce(torch.tensor(max(len(prompts[i]) for i in prompt_index), device=device), dist.ReduceOp.MAX)
        query, query_mask = (t.to(device) for t in pad_left([prompts[i] for i in prompt_index], int(width),
                                                            tokenizer.pad_token_id))
        context_length = query.shape[1]
        if args.offload_inference_models:
            ref_policy.to(device), reward_model.to(device)
        policy.eval()
        responses, sample_logprobs = [], []
        for c in range(0, local_batch, chunk):
            gens = [torch.Generator().manual_seed(args.seed * 1_000_003 + e) for e in episodes[c:c + chunk]]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                r, lp = generate(policy if args.fsdp else unwrap(policy), query[c:c + chunk], query_mask[c:c + chunk],
                                 gens, args, stop_id, tokenizer.pad_token_id, collective=args.fsdp and world > 1)
            responses.append(r)
            sample_logprobs.append(lp)
        responses, mask = truncate_after_stop(torch.cat(responses), stop_id, tokenizer.pad_token_id)
        logprobs = torch.cat(sample_logprobs).masked_fill(~mask, 0.0)

        # 2. Score: reference log-probs, values, reward at the last real token (+ missing-EOS penalty).
        query_response = torch.cat([query, responses], 1)
        qr_mask = torch.cat([query_mask, mask], 1).long()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            ref_logprobs = policy_forward(ref_policy, query_response, qr_mask, context_length, args.temperature)[0]
            values = critic(query_response, qr_mask)[:, context_length - 1:-1]
            if same_vocab:
                rm_ids, rm_mask = query_response, qr_mask
            else:  # a reward model with another tokenizer reads the text
                texts = [prompt_texts[i] + tokenizer.decode(r[m], skip_special_tokens=True)
                         for i, r, m in zip(prompt_index, responses, mask)]
                enc = reward_tokenizer(texts, return_tensors="pt", padding=True)
                rm_ids, rm_mask = enc.input_ids.to(device), enc.attention_mask.to(device)
            scores = reward_model(rm_ids, rm_mask).gather(1, last_token_index(rm_mask)[:, None]).squeeze(1)
            scores = scores - reward_hf.reward_offset
        has_stop = (responses == stop_id).any(1) if stop_id is not None else torch.ones_like(scores, dtype=torch.bool)
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~has_stop).float()
        if embedded and args.dataset_name == "embedded":
            gold = torch.tensor([common.gold_reward(prompt_texts[i], tokenizer.decode(r[m & (r != tokenizer.eos_token_id)]))
                                 for i, r, m in zip(prompt_index, responses.cpu(), mask.cpu())], device=device)
        else:
            gold = torch.full_like(scores, float("nan"))
        if args.offload_inference_models:
            ref_policy.to("cpu"), reward_model.to("cpu")

        # Every rank takes the whole rollout batch, so the learning phase is the same for any number of ranks.
        (query_response, qr_mask, mask, logprobs, ref_logprobs, values, scores, has_stop, gold) = (
            all_gather_cat(t) for t in (query_response, qr_mask, mask, logprobs, ref_logprobs, values, scores,
                                        has_stop, gold))
        mask_f = mask.float()

        # 3. Rewards (KL penalty per token, score at the last real token) and advantages.
        kl = kl_per_token(logprobs, ref_logprobs, args.kl_estimator) * mask_f
        non_score_reward = -kl_coef * kl
        rewards = non_score_reward.clone()
        rows = torch.arange(len(rewards), device=device)
        rewards[rows, last_token_index(mask_f)] += scores
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask_f, shift_mean=False)
        values = values * mask_f
        advantages, returns = gae(rewards, values, mask_f, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask_f)

        # 4. Learn: num_ppo_epochs x num_mini_batches optimizer steps, each accumulating micro-batches.
        policy.train(), critic.train()
        stats = []
        for ppo_epoch in range(args.num_ppo_epochs):
            order = torch.randperm(batch_size, generator=torch.Generator().manual_seed(
                args.seed * 7919 + update * 131 + ppo_epoch)).to(device)
            for mb in range(args.num_mini_batches):
                mini = order[mb * local_mini_batch * world:(mb + 1) * local_mini_batch * world]
                mine = mini[rank * local_mini_batch:(rank + 1) * local_mini_batch]
                for m in range(args.gradient_accumulation_steps):
                    idx = mine[m * micro:(m + 1) * micro]
                    set_grad_sync([policy, critic], m == args.gradient_accumulation_steps - 1)
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                        new_logprobs, entropy = policy_forward(policy, query_response[idx], qr_mask[idx],
                                                               context_length, args.temperature)
                        new_values = critic(query_response[idx], qr_mask[idx])[:, context_length - 1:-1]
                    pg_loss, pg_stats = policy_loss(new_logprobs, logprobs[idx], advantages[idx], mask_f[idx],
                                                    args.cliprange)
                    vf_loss, vf_clipfrac = value_loss(new_values, values[idx], returns[idx], mask_f[idx],
                                                      args.cliprange_value)
                    ent = masked_mean(entropy, mask_f[idx])
                    loss = pg_loss + args.vf_coef * vf_loss - args.ent_coef * ent
                    if ptx is not None:
                        first = ((update * args.num_ppo_epochs + ppo_epoch) * args.num_mini_batches + mb) * \
                            local_mini_batch * world + (rank * args.gradient_accumulation_steps + m) * micro
                        seqs = [ptx[i % len(ptx)] for i in range(first, first + micro)]
                        ptx_ids, ptx_mask = pad_left(seqs, max(map(len, seqs)), tokenizer.pad_token_id)
                        ptx_ids, ptx_mask = ptx_ids.to(device), ptx_mask.long().to(device)
                        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                            ptx_logits = policy(input_ids=ptx_ids, attention_mask=ptx_mask,
                                                position_ids=(ptx_mask.cumsum(1) - 1).clamp(min=0)).logits[:, :-1]
                        ptx_loss = F.cross_entropy(ptx_logits.float().flatten(0, 1), ptx_ids[:, 1:].flatten(),
                                                   reduction="none")
                        ptx_loss = masked_mean(ptx_loss, ptx_mask[:, 1:].flatten().float())
                        loss = loss + args.ptx_coef * ptx_loss
                    (loss / args.gradient_accumulation_steps).backward()
                    stats.append(torch.stack([pg_loss, vf_loss, vf_clipfrac, ent, pg_stats["clipfrac"],
                                              pg_stats["approxkl"], pg_stats["ratio"], pg_stats["ratio_var"]]).detach())
                grad_norm = torch.nn.utils.clip_grad_norm_(trainable.parameters(), args.max_grad_norm or float("inf"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        scheduler.step()

        # 5. Adapt the KL coefficient; log; save samples and checkpoints.
        mean_kl = kl.sum(1).mean().item()
        update_stats = all_reduce(torch.stack(stats).mean(0)) / world
        m = {"step": update + 1, "episodes": (update + 1) * batch_size,
             "objective/kl": mean_kl, "objective/entropy": (-logprobs * mask_f).sum(1).mean().item(),
             "objective/non_score_reward": non_score_reward.sum(1).mean().item(),
             "objective/scores": scores.mean().item(),
             "objective/rlhf_reward": (scores + non_score_reward.sum(1)).mean().item(),
             **dict(zip(["loss/policy", "loss/value", "val/clipfrac", "policy/entropy", "policy/clipfrac",
                         "policy/approxkl", "policy/ratio", "policy/ratio_var"], update_stats.tolist())),
             "val/mean": masked_mean(values, mask_f).item(), "policy/grad_norm": float(grad_norm.full_tensor()
                                                                                        if hasattr(grad_norm, "full_tensor") else grad_norm),
             "response/length": mask_f.sum(1).mean().item(), "response/eos_rate": has_stop.float().mean().item(),
             "kl_coef": kl_coef, "lr": scheduler.get_last_lr()[0]}
        if not torch.isnan(gold).all():
            m["gold/mean"], m["gold/std"] = gold.mean().item(), gold.std().item()
        elapsed = time.time() - t0
        m["perf/episodes_per_s"] = batch_size / elapsed
        m["perf/tokens_per_s"] = qr_mask.sum().item() * (1 + args.num_ppo_epochs) / elapsed
        if args.target_kl is not None:
            kl_coef = adaptive_kl_coef(kl_coef, mean_kl, args.target_kl, args.kl_horizon, batch_size)
        history.append({k: m[k] for k in ("step", "objective/scores", "objective/kl", "gold/mean", "gold/std") if k in m})
        if rank == 0:
            common.log_metrics(metrics_file, m, wandb_run)
            bar.set_postfix(score=f"{m['objective/scores']:.3f}", kl=f"{mean_kl:.3f}",
                            **({"gold": f"{m['gold/mean']:.3f}"} if "gold/mean" in m else {}))
            if update % args.sample_every == 0 or update == num_updates - 1:
                table = [{"step": update + 1, "prompt": tokenizer.decode(query_response[i, :context_length][
                          qr_mask[i, :context_length].bool()]), "response": tokenizer.decode(
                          query_response[i, context_length:][mask[i]]), "score": scores[i].item(),
                          **({"gold": gold[i].item()} if "gold/mean" in m else {})} for i in range(args.num_samples)]
                bar.write(common.format_metrics(m))
                for row in table:
                    bar.write(f"  {row['prompt'][-60:]!r} -> {row['response'][:80]!r}  score {row['score']:.3f}"
                              + (f"  gold {row['gold']:.3f}" if "gold" in row else ""))
                    samples_file.write(json.dumps(row) + "\n")
                samples_file.flush()
                if wandb_run is not None:
                    import wandb

                    wandb_run.log({"samples": wandb.Table(columns=list(table[0]), data=[list(r.values()) for r in table])},
                                  step=update + 1)
        if args.save_steps and (update + 1) % args.save_steps == 0 and update + 1 < num_updates:
            model_sd, optim_sd = get_state_dict(trainable, optimizer, options=full)
            if rank == 0:
                common.save_checkpoint(args.output_dir, update + 1, {
                    "model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(), "update": update + 1,
                    "kl_coef": kl_coef, "history": history, "rng": common.rng_state()})

    # The final policy in transformers' format, its tokenizer, the curves and a summary.
    model_sd = get_model_state_dict(trainable, options=full)
    if rank == 0:
        policy_sd = {k.removeprefix("policy."): v for k, v in model_sd.items() if k.startswith("policy.")}
        policy_hf.save_pretrained(args.output_dir, state_dict=policy_sd)
        tokenizer.save_pretrained(args.output_dir)
        series = {"proxy score (reward model)": "objective/scores", "gold score": "gold/mean", "KL to reference":
                  "objective/kl"}
        common.plot_png(os.path.join(args.output_dir, "curves.png"),
                        {name: ([h["step"] for h in history if key in h], [h[key] for h in history if key in h])
                         for name, key in series.items() if any(key in h for h in history)})
        summary = summarize(history)
        with open(os.path.join(args.output_dir, "ppo_results.json"), "w") as f:
            json.dump({**summary, "args": dataclasses.asdict(args)}, f, indent=2)
        print(" ".join(f"{k}={v:.4g}" for k, v in summary.items()) + f"; saved to {args.output_dir}")
        metrics_file.close()
        samples_file.close()
        if wandb_run is not None:
            wandb_run.finish()
    if dist.is_initialized():
        dist.destroy_process_group()
    return history


def summarize(history, window=5):
    """First and last `window` updates' averages of the proxy score, KL and (embedded task) gold score."""
    out = {}
    for key, name in (("objective/scores", "proxy"), ("objective/kl", "kl"), ("gold/mean", "gold"),
                      ("gold/std", "gold_std")):
        xs = [h[key] for h in history if key in h]
        if xs:
            out[f"{name}_first"] = sum(xs[:window]) / len(xs[:window])
            out[f"{name}_last"] = sum(xs[-window:]) / len(xs[-window:])
    return out


if __name__ == "__main__":
    common.exit_on_user_error(main, tyro.cli(Args, use_underscores=True))
