"""Reward modeling (Bradley-Terry) in one file.

    python rm.py                                   # embedded task, tiny model, CPU, a few minutes
    torchrun --nproc_per_node 2 rm.py              # the same on 2 processes (gloo on CPU, nccl on GPU)
    torchrun --nproc_per_node 8 rm.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --dataset_name Anthropic/hh-rlhf --bf16 --learning_rate 1e-5 --per_device_train_batch_size 8
    python rm.py --help                            # every option, documented

A reward model is a language model with a scalar head read at the last real token of prompt + response. It is trained
so that r(prompt, chosen) - r(prompt, rejected) is large: loss = -log sigmoid(r_c - r_r - margin) (Bradley & Terry
1952; Ouyang et al. 2022, eq. 1). The method is read from the top to the end of `main`; below it, the machinery.
"""

import collections
import dataclasses
import datetime
import inspect
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import common


@dataclass
class Args:
    # --- reward model
    loss_type: Literal["sigmoid", "logexp"] = "sigmoid"
    """sigmoid: -log sigmoid(r_c - r_r - margin). logexp: log(1 + exp(r_r - r_c + margin)) (ColossalChat's LogExpLoss):
    the same function written another way (softplus), both computed without overflow at any reward gap."""
    center_rewards_coefficient: float = 0.0
    """Weight of mean((r_c + r_r)^2), which keeps rewards centred at 0 (Eisenstein et al. 2023)."""
    head_init_std: float | None = None
    """Std of the new scalar head's initial weights (default 1/sqrt(hidden_size + 1)). The head is new unless the model
    is a sequence classifier or an adapter folder holding the head's weights (as rm.py's do)."""
    reward_normalization: Literal["none", "shift", "shift_scale"] = "shift"
    """After training: make the mean reward over 2048 training pairs (never eval pairs) 0 (shift), and their std 1
    (shift_scale). Saved in config.json: reward = (logit - reward_shift) / reward_scale, as ppo.py reads it."""
    # --- model and data
    model_name_or_path: str = "embedded-llama"
    """Hugging Face model name or local path (any causal LM or sequence-classification checkpoint, or a peft adapter
    folder, merged into its base), or a tiny model built locally: embedded-llama, embedded-neox."""
    dataset_name: str = "embedded"
    """Hub dataset name, local .jsonl/.json/.parquet/.csv file (gzip too), or `embedded` (the built-in task)."""
    dataset_config: str | None = None
    """Hub dataset configuration name."""
    dataset_mixer_list: list[str] = field(default_factory=list)
    """Several datasets with weights, overriding --dataset_name: NAME WEIGHT NAME WEIGHT ... (weight <= 1: a fraction of
    the training rows, > 1: a number of them; a dataset without an eval split gives --eval_holdout of them to
    evaluation). Evaluation is reported per dataset and overall."""
    train_split: str = "train"
    """Split to train on."""
    eval_split: str | None = None
    """Split to evaluate on (default: validation, else test); a dataset with none holds out --eval_holdout instead."""
    eval_holdout: float = 0.1
    """Fraction of training pairs held out for evaluation, by prompt, when there is no eval split: no held-out prompt is
    trained on in any dataset of the mixture."""
    max_length: int | None = None
    """Maximum tokens of prompt + response (default: 512, or the model's learned position table if shorter). Longer
    pairs are truncated (see --max_prompt_length), never dropped."""
    max_prompt_length: int | None = None
    """Prompt tokens kept at least when prompt + longer response exceeds --max_length (default: 256 as in ppo.py, or
    3/4 of --max_length if less): the prompt keeps its end and BOS, the responses are then cut to fit."""
    output_dir: str = "runs/rm"
    """Where the reward model, tokenizer, metrics.jsonl, eval_results.json and checkpoints are written."""
    # --- optimisation
    learning_rate: float | None = None
    """AdamW learning rate (default: 1e-3 for the embedded models trained from scratch, 1e-5 for pretrained ones)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    num_train_epochs: float | None = None
    """Passes over the training pairs (ignored if --max_steps > 0). Default: 1 for pretrained models, as InstructGPT
    (Ouyang et al. 2022) and Llama 2 (Touvron et al. 2023) train reward models, which overfit after one; 3 for the
    embedded models, trained from scratch (README's numbers)."""
    max_steps: int = -1
    """Total optimizer steps; overrides --num_train_epochs when > 0."""
    per_device_train_batch_size: int = 32
    """Pairs per device per micro-step (chosen and rejected of each in the same forward pass)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step. Global batch = per-device batch x accumulation x world size."""
    per_device_eval_batch_size: int | None = None
    """Pairs per device per evaluation forward pass (default: --per_device_train_batch_size)."""
    lr_scheduler_type: Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                               "constant_with_warmup"] = "cosine"
    """Learning-rate schedule (transformers.get_scheduler)."""
    warmup_steps: int = 0
    """Linear warm-up steps (overrides --warmup_ratio when > 0)."""
    warmup_ratio: float = 0.05
    """Warm-up as a fraction of the total steps."""
    lr_end: float = 0.0
    """Final learning rate of the polynomial schedule."""
    num_cycles: float = 1.0
    """Cycles of cosine_with_restarts (a whole number); for cosine, half-cosines: 1 = from the peak down to 0."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables)."""
    seed: int = 1
    """Seed of model initialisation, head initialisation and data order."""
    # --- LoRA (through peft)
    lora_r: int = 0
    """Rank of the LoRA adapters on the backbone's linear layers (Hu et al. 2021), the scalar head trained in full
    beside them; 0 trains every weight. The final save is the merged model, with the adapter in output_dir/adapter."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter adds (lora_alpha / lora_r) * B A to its layer's weight."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Names (or name suffixes) of the layers that get adapters; all-linear: every linear layer of the backbone."""
    # --- evaluation, logging, checkpoints
    eval_steps: int = 0
    """Evaluate every this many steps (0: use --num_evals)."""
    num_evals: int = 5
    """Evaluations evenly spread over training, the last at its end (at most one per step)."""
    logging_steps: int = 50
    """Log train metrics every this many steps."""
    save_steps: int | None = None
    """Write a resumable checkpoint every this many steps (default: every 30 minutes; 0: none). SIGINT or SIGTERM
    ends a run after its current step with a checkpoint, whatever this is (exit 130 / 143)."""
    resume: bool = False
    """Continue from the latest checkpoint in --output_dir, at the pairs it had trained, on any number of ranks (none:
    start afresh; a finished run: nothing to do)."""
    overwrite_output_dir: bool = False
    """Train afresh in an --output_dir that holds a finished run or checkpoints (refused without this or --resume):
    its checkpoints are deleted when training starts, its other files replaced as this run writes them."""
    track: bool = False
    """Log to Weights & Biases (works with WANDB_MODE=offline)."""
    tensorboard: bool = False
    """Also write every logged metric as TensorBoard events to --output_dir/tensorboard."""
    wandb_project: str = "rlhf-rm"
    """Weights & Biases project."""
    run_name: str | None = None
    """Run name for Weights & Biases."""
    eval_only: bool = False
    """No training: evaluate --model_name_or_path (a model saved by rm.py or any sequence-classification reward model)
    on the eval split, or on every pair of a dataset without one; writes eval_results.json and eval.png."""
    push_to_hub: bool = False
    """Upload the final model and tokenizer to the Hugging Face hub."""
    hub_model_id: str | None = None
    """Hub repository for --push_to_hub (default: the output directory's name)."""
    # --- systems
    padding_free: bool = True
    """No pad tokens: a micro-batch's sequences end to end in one row, attention per block of whole pairs (same
    rewards). Encoders, ALiBi models and attention sinks take the padded batch. --no_padding_free: the padded batch."""
    prefix_sharing: bool = True
    """One sequence per pair: prompt + chosen + rejected, the rejected tokens seeing the prompt but not the chosen
    ones, so the shared prompt is computed once. Same rewards as two sequences. --no_prefix_sharing to turn off."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state per transformer block with FSDP2 (default: DDP)."""
    bf16: bool = False
    """bfloat16 autocast for the forward and backward passes (weights and optimizer state stay float32; with LoRA,
    the frozen base weights are held in bfloat16, the adapters and head in float32)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""


# ---------------------------------------------------------------------------------------------------------------------
# The math.


def preference_loss(r_chosen, r_rejected, margin, loss_type="sigmoid"):
    """Per-pair Bradley-Terry negative log-likelihood, with the Llama 2 margin (Touvron et al. 2023, eq. 2). Another
    pair loss goes here: training and evaluation both read it through reward_model_loss."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(r_chosen - r_rejected - margin)
    if loss_type == "logexp":
        return F.softplus(r_rejected - r_chosen + margin)  # log(1 + exp(x)): the same number
    raise ValueError(f"unknown loss_type {loss_type!r}: sigmoid or logexp")


def reward_model_loss(r_chosen, r_rejected, margin, loss_type="sigmoid", center_coefficient=0.0):
    """The objective train_step minimises and evaluate reports: the mean preference loss, plus center_coefficient *
    mean((r_c + r_r)^2), which keeps rewards centred at 0 (Eisenstein et al. 2023)."""
    return preference_loss(r_chosen, r_rejected, margin, loss_type).mean() + \
        center_coefficient * ((r_chosen + r_rejected) ** 2).mean()


def chosen_wins(r_chosen, r_rejected, margin, loss_type="sigmoid"):
    """P(chosen wins) as the pair loss models it, exp(-loss): the loss is that probability's negative log-likelihood
    (for both loss types, sigmoid(r_c - r_r - margin): the Bradley-Terry model's logistic link)."""
    return torch.exp(-preference_loss(r_chosen, r_rejected, margin, loss_type))


def reliability(p_chosen, n_bins=10):
    """Per bin of predicted P(chosen wins) (chosen_wins): how many predictions, their mean, and how often they came
    true. Each pair counts in both orders, (p, won) and (1 - p, lost)."""
    p = torch.cat([p_chosen, 1 - p_chosen]).double()
    won = torch.cat([torch.ones_like(p_chosen), torch.zeros_like(p_chosen)]).double()
    bins = (p * n_bins).long().clamp(max=n_bins - 1)
    count = torch.bincount(bins, minlength=n_bins)
    mean = lambda x: torch.bincount(bins, weights=x, minlength=n_bins) / count.clamp(min=1)  # noqa: E731
    return count, mean(p), mean(won)


def calibration_error(p_chosen, n_bins=10):
    """Expected calibration error: sum over bins of (bin size / N) * |mean prediction - frequency|, so a model that
    predicts 0.7 and is right 70% of the time scores 0."""
    count, confidence, frequency = reliability(p_chosen, n_bins)
    return (count / count.sum() * (confidence - frequency).abs()).sum().item()


def pearson(x, y):
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return (x * y).sum().item() / max(math.sqrt((x * x).sum().item() * (y * y).sum().item()), 1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# The method's conventions, the same as ppo.py's (tests/test_rm.py checks that they agree).


def truncate_prompt(ids, max_prompt_length, bos_id=None):
    """A prompt longer than max_prompt_length keeps its END (the turn being answered) and its leading BOS/[CLS]."""
    if len(ids) <= max_prompt_length:
        return ids
    keep = 1 if bos_id is not None and ids and ids[0] == bos_id else 0
    return ids[:keep] + ids[len(ids) - max_prompt_length + keep:]


def last_token_index(mask):
    """Where a reward is read: the last real token of each row (the EOS that ends every tokenized response, or the last
    token kept of one cut at --max_length), read from the mask (a pad id may equal EOS), right or left padded."""
    return (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(1)


def sequence_reward(model, ids, mask):
    """A padded batch's rewards: a decoder's scalar head at each row's last real token; an encoder's pooled head
    ([CLS])."""
    if not hasattr(model, "score"):  # BERT, RoBERTa, DeBERTa: a pooled `classifier`
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False,
                              position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state  # ALiBi: ignored
    return model.score(hidden[torch.arange(len(ids), device=ids.device), last_token_index(mask)]).squeeze(-1).float()


def without_dropout(config):
    """Dropout off: the chosen and rejected passes of a pair, training and evaluation, see one network. Every dropout
    probability of the config 0 (some models, OPT, call F.dropout with it, past nn.Dropout)."""
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def disable_dropout(model):
    without_dropout(model.config)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


# ---------------------------------------------------------------------------------------------------------------------
# The model, the data, one training step, evaluation.


class RewardModel(torch.nn.Module):
    """A transformers sequence classifier: its last hidden state at the last real token of each sequence, mapped to one
    number by the head `score` (reward_head). In a padded batch that token is the mask's last 1, right or left padded
    (sequence_reward, the reading ppo.py applies to the rewards it trains on): the EOS that ends every tokenized
    response, or the last token kept of one cut at --max_length. An encoder (BERT) reads its pooled [CLS] instead. A
    packed row (model_inputs) brings its read points: the same tokens."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, attention_mask, position_ids=None, read_at=None, segments=None):
        if segments is None:
            return sequence_reward(self.hf, input_ids, attention_mask)
        if self.hf.config._attn_implementation != "rm_segments":  # the model's own attention would cross pairs
            raise ValueError("a packed row needs the model's attention set by choose_layout")
        hidden = self.hf.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                    rm_segments=segments).last_hidden_state
        return self.hf.score(hidden[read_at[0], read_at[1]]).squeeze(-1).float()


def reward_head(model, args, trained_head):
    """The head `score`: a linear map from the hidden state to one number. A new one (the checkpoint brings none) is
    drawn normal with std 1/sqrt(hidden + 1), or --head_init_std, so that the first rewards are of order 1 (as in
    Ziegler et al. 2019's code). It is computed in float32 under any autocast (common.scalar_head_in_float32): a
    bfloat16 reward moves in steps of 1/128 of its size, and close pairs would tie."""
    if not trained_head and hasattr(model, "score"):  # encoders' pooled heads keep transformers' initialisation
        hidden = model.score.in_features
        std = args.head_init_std if args.head_init_std is not None else 1 / math.sqrt(hidden + 1)
        torch.nn.init.normal_(model.score.weight, std=std)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{args.model_name_or_path}: a new reward head (score, {hidden} -> 1, initial std {std:.3g}) on "
                  "its backbone")
    return common.scalar_head_in_float32(model)


def collate(pairs, pad_id, padding_side="right"):
    """The padded batch: 2B sequences, each pair's chosen in the first half and its rejected at the same place in the
    second, so that one forward pass gives both rewards (rewards.chunk(2) splits them). It equals two passes, one of
    chosen and one of rejected, because rows never attend to each other and dropout is off."""
    seqs = [p["prompt"] + p["chosen"] for p in pairs] + [p["prompt"] + p["rejected"] for p in pairs]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        span = slice(0, len(s)) if padding_side == "right" else slice(width - len(s), width)
        ids[i, span], mask[i, span] = torch.tensor(s), 1
    return ids, mask, torch.tensor([p["margin"] for p in pairs])


def model_inputs(pairs, pad_id, args, device="cpu"):
    """The model's inputs for B pairs, on device: (ids, mask, position ids, read points, segments); from them the model
    returns the B chosen rewards, then the B rejected ones. --no_padding_free: collate's padded batch. The default, the
    packed layout, is a swap for speed that computes the same rewards: the pairs end to end in one row without padding,
    each prompt once (--prefix_sharing), and an attention that lets each token see only the earlier tokens of its own
    sequence, at the positions it would have alone (pack_segments, segment_attention). A reward can be trusted without
    reading that code:
    - tests/test_rm.py::test_padded_packed_and_prefix_shared_rewards_and_gradients_agree compares its rewards and
      gradients with the padded batch's (tests/test_families.py on each supported model family);
    - at start-up, choose_layout runs random pairs (two longer than a block and the shortest sliding window) both ways
      on the run's model, device and precision, and checks that every layer called that attention with its configured
      sliding window and that the rewards agree; if not (or for an encoder, or a model without position ids), the run
      takes the padded batch and says why ("batch layout: ..." in its first lines, batch_layout in eval_results.json
      under --eval_only)."""
    if not args.padding_free:
        inputs = collate(pairs, pad_id)[:2] + (None, None, None)
    else:
        inputs = pack_segments(pairs, share_prompt=args.prefix_sharing)
    return [x.to(device) if torch.is_tensor(x) else x for x in inputs]


def truncate_pair(prompt_ids, chosen_ids, rejected_ids, max_length, max_prompt_length, bos_id=None):
    """The truncation policy: a pair that fits max_length is kept whole; otherwise the prompt keeps its end (the turn
    being answered) and its BOS (truncate_prompt, ppo.py's rule), as many tokens as the longer response leaves
    but no fewer than max_prompt_length, then each response is cut to fit after it (one cut so loses its EOS, and its
    reward is read at its last token kept). Returns the three id lists and whether anything was cut."""
    longest = max(len(chosen_ids), len(rejected_ids))
    p = truncate_prompt(prompt_ids, max(max_prompt_length, max_length - longest), bos_id)
    c, r = chosen_ids[:max_length - len(p)], rejected_ids[:max_length - len(p)]
    return p, c, r, (len(p), len(c), len(r)) != (len(prompt_ids), len(chosen_ids), len(rejected_ids))


def hold_out_by_prompt(rows, fraction, seed, tokenizer, others=()):
    """(train, eval): about `fraction` of the rows for evaluation, whole prompts at a time (drawn at random by seed),
    so that a dataset with several pairs per prompt leaks none into the evaluation; train also holds the rows of
    `others` (other datasets' training pairs) whose prompt is not held out. A dataset of one prompt is split by row."""
    prompts = [common.split_pair(r, tokenizer, common.where(r))[0] for r in rows]
    order = list(dict.fromkeys(prompts))
    random.Random(seed).shuffle(order)
    by_row = len(order) == 1
    if by_row:
        prompts, order = list(range(len(rows))), random.Random(seed).sample(range(len(rows)), len(rows))
    n_eval, held, count, n_held = max(1, int(len(rows) * fraction)), set(), collections.Counter(prompts), 0
    for p in order:
        if n_held >= n_eval:
            break
        held.add(p)
        n_held += count[p]
    if others and not by_row:
        others = [r for r in others if common.split_pair(r, tokenizer, common.where(r))[0] not in held]
    return [r for r, p in zip(rows, prompts) if p not in held] + list(others), \
        [r for r, p in zip(rows, prompts) if p in held]


def train_step(model, micro_batches, args, pad_id, device):
    """The forward and backward passes of one optimizer step: per micro-batch, chosen and rejected in one forward and
    the pair loss; the gradients clipped to --max_grad_norm. Returns the step's mean loss, accuracy, reward gap, token
    count and the gradient norm before clipping."""
    stats = dict.fromkeys(("loss", "accuracy", "reward_gap", "tokens"), 0.0)
    for m, pairs in enumerate(micro_batches):
        inputs = model_inputs(pairs, pad_id, args, device)
        margin = torch.tensor([p["margin"] for p in pairs], device=device)
        if hasattr(model, "require_backward_grad_sync"):  # DDP all-reduces the gradients on the last micro-batch only
            model.require_backward_grad_sync = m == len(micro_batches) - 1  # (FSDP reduce-scatters every one's)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            r_chosen, r_rejected = model(*inputs).chunk(2)
        loss = reward_model_loss(r_chosen, r_rejected, margin, args.loss_type, args.center_rewards_coefficient)
        # / accumulation: the summed gradients are the mean over this rank's pairs, and DDP/FSDP average the ranks',
        # so the step's gradient is that of the mean loss over the global batch (equal micro-batches)
        (loss / len(micro_batches)).backward()
        stats["loss"] += loss.item() / len(micro_batches)
        stats["accuracy"] += (r_chosen > r_rejected).float().mean().item() / len(micro_batches)
        stats["reward_gap"] += (r_chosen - r_rejected).mean().item() / len(micro_batches)
        # the tokens of both sequences, the prompt counted twice, whatever the layout: tokens/s compares layouts
        stats["tokens"] += sum(len(p["prompt"]) * 2 + len(p["chosen"]) + len(p["rejected"]) for p in pairs)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
    stats["grad_norm"] = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
    return stats


@torch.no_grad()
def evaluate(model, pairs, args, pad_id, device, rank, world):
    """Rewards of every pair (sharded across ranks, then gathered) and the metrics computed from them. Returns the
    metrics and, per pair, (r_chosen, r_rejected, margin). Run after the steps --eval_steps or --num_evals choose."""
    training = model.training
    model.eval()
    # longest first, so that a batch holds pairs of similar length (little padding) and the peak memory comes first
    by_length = sorted(range(len(pairs)), key=lambda i: -len(pairs[i]["prompt"] + pairs[i]["chosen"]
                                                              + pairs[i]["rejected"]))
    mine, per_rank = by_length[rank::world], math.ceil(len(pairs) / world)
    valid = torch.arange(per_rank, device=device) < len(mine)
    mine += [mine[0] if mine else 0] * (per_rank - len(mine))  # equal batch counts (FSDP's forward is collective)
    rewards, size = [], args.per_device_eval_batch_size or args.per_device_train_batch_size
    for i in range(0, per_rank, size):
        inputs = model_inputs([pairs[j] for j in mine[i:i + size]], pad_id, args, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            rewards.append(torch.stack(model(*inputs).chunk(2), 1))  # per pair (r_chosen, r_rejected)
    index, valid, rewards = (all_gather_cat(t) for t in (torch.tensor(mine, device=device), valid, torch.cat(rewards)))
    rewards = torch.empty(len(pairs), 2).index_copy_(0, index[valid].cpu(), rewards[valid].cpu())
    model.train(training)
    margin = torch.tensor([p["margin"] for p in pairs])
    metrics = pair_metrics(rewards[:, 0], rewards[:, 1], margin, pairs, args, "eval/")
    datasets = dict.fromkeys(p.get("dataset") for p in pairs)
    if len(datasets) > 1:  # a mixture: each dataset's own numbers as well
        for name in datasets:
            ours = torch.tensor([p.get("dataset") == name for p in pairs])
            metrics.update(pair_metrics(rewards[ours, 0], rewards[ours, 1], margin[ours],
                                        [p for p, o in zip(pairs, ours) if o], args, f"eval/{name}/"))
    return metrics, torch.cat([rewards, margin[:, None]], 1)


def pair_metrics(rc, rr, margin, pairs, args, prefix):
    """The evaluation metrics of pairs from their rewards, each key prefixed."""
    lengths = torch.tensor([len(p["chosen"]) for p in pairs] + [len(p["rejected"]) for p in pairs], dtype=torch.float)
    metrics = {
        "accuracy": (rc > rr).float().mean().item(),  # (a tie counts as an error)
        "loss": reward_model_loss(rc, rr, margin, args.loss_type, args.center_rewards_coefficient).item(),
        "preference_loss": preference_loss(rc, rr, margin, args.loss_type).mean().item(),  # (without the centering)
        "reward_gap": (rc - rr).mean().item(),
        "chosen_reward": rc.mean().item(),
        "rejected_reward": rr.mean().item(),
        "reward_mean": torch.cat([rc, rr]).mean().item(),
        "reward_std": torch.cat([rc, rr]).std().item(),
        "calibration_error": calibration_error(chosen_wins(rc, rr, margin, args.loss_type)),
        "length_correlation": pearson(torch.cat([rc, rr]), lengths),
    }
    known = torch.tensor([p["gold"] is not None for p in pairs])
    if known.any():  # embedded-task pairs (all, or some of a mixture): compare with the best possible accuracy
        gold, rc, rr = torch.tensor([p["gold"] for p in pairs if p["gold"] is not None]), rc[known], rr[known]
        p_gold = torch.sigmoid(common.PREFERENCE_BETA * (gold[:, 0] - gold[:, 1]))
        metrics["bayes_accuracy"] = torch.maximum(p_gold, 1 - p_gold).mean().item()
        metrics["accuracy_vs_bayes"] = (rc > rr).float().mean().item() / metrics["bayes_accuracy"]
        metrics["gold_correlation"] = pearson(torch.cat([rc, rr]), torch.cat([gold[:, 0], gold[:, 1]]))
    return {prefix + k: v for k, v in metrics.items()}


NORMALIZATION_PAIRS = 2048  # the mean's standard error is then under 1/45 of the rewards' std


def fit_normalization(model, train, args, pad_id, device, rank, world):
    """After training, --reward_normalization: reward_shift, the mean reward of NORMALIZATION_PAIRS training pairs drawn
    by seed (all, if fewer; never eval pairs, so that no held-out pair shapes the saved model), and with shift_scale
    reward_scale, their std. save_reward_model stores both in config.json; ppo.py's load_reward reads a reward as
    (score - reward_shift) / reward_scale."""
    if args.reward_normalization == "none":
        return {"reward_shift": 0.0, "reward_scale": 1.0, "reward_normalization_fitted_on": None}
    pairs = random.Random(common.seed_of(args.seed, "normalization")).sample(train, min(len(train),
                                                                                     NORMALIZATION_PAIRS))
    fitted = evaluate(model, pairs, args, pad_id, device, rank, world)[0]
    return {"reward_shift": fitted["eval/reward_mean"],
            "reward_scale": fitted["eval/reward_std"] if args.reward_normalization == "shift_scale" else 1.0,
            "reward_normalization_fitted_on": f"{len(pairs)} training pairs"}


def main(args):
    args, rank, world, device = start_up(args)  # arguments, models, datasets and output folder checked
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = micro * accumulation * world

    # 1. Model and data: preference pairs -> token ids (the same on every rank; each takes its slice of every batch).
    tokenizer = load_tokenizer(args.model_name_or_path)
    sharded = args.fsdp and world > 1  # then rank 0 loads the model, the others build it on the meta device
    # the backbone, float32 (dropout off) and a scalar head (reward_head: new, or the checkpoint's)
    hf_model, lora = load_reward_model(args, tokenizer, on_meta=sharded and rank != 0)
    args = resolve_lengths(args, hf_model, rank)
    # pairs past --max_length are cut (truncate_pair); eval: each dataset's --eval_split, else --eval_holdout of its
    # pairs, whole prompts held out of training (hold_out_by_prompt)
    train, evals, eval_sets = load_data(args, tokenizer, rank)
    # steps: --max_steps, else ceil(--num_train_epochs x (training pairs // global batch)), each epoch's leftover pairs
    # (fewer than a global batch) left out of it; evaluations after evals_at
    steps_per_epoch, total_steps, evals_at = schedule(args, len(train), global_batch, rank)
    if not args.eval_only and common.run_complete(args, total_steps, rank):
        return None

    # 2. Batch layout (model_inputs: packed, if the check on this model passes, else padded), optimizer, schedule.
    if not sharded:  # (sharded, every rank checks the layout on its shards: rank 0 may hold no weights)
        args, layout = choose_layout(RewardModel(hf_model.to(device)), args, len(tokenizer), rank)
    if args.gradient_checkpointing:
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model = parallelize(RewardModel(hf_model), args, device)
    if sharded:
        args, layout = choose_layout(model, args, len(tokenizer))
        model.reshard()  # (FSDP keeps the root's parameters gathered after a forward: the optimizer takes the shards)
    if args.eval_only:
        return evaluate_only(model, hf_model, evals, args, tokenizer, device, rank, world, layout, eval_sets)
    # AdamW (lr 1e-5; 1e-3 for the embedded models) with --weight_decay; --lr_scheduler_type after linear warm-up
    optimizer, scheduler = build_optimizer(model, args, total_steps)
    ckpt = common.resume_training(model, optimizer, scheduler, args.output_dir, args, world) if args.resume else None
    start_step = ckpt["step"] if ckpt else 0
    logger = common.Logger(args, args.wandb_project, start_step if args.resume else None) if rank == 0 else None
    if rank == 0:
        describe_run(args, hf_model, lora, train, layout, optimizer, world, device, steps_per_epoch, total_steps,
                     start_step)

    # 3. Training loop: per step, one fused forward per micro-batch, Bradley-Terry loss, one optimizer step.
    model.train()
    bar = tqdm(range(start_step, total_steps), disable=rank != 0, initial=start_step, total=total_steps, desc="rm")
    window, t_window, t_saved, ev = [], time.time(), time.time(), None
    common.stop_on_signals()
    for step in bar:
        epoch, offset = divmod(step, steps_per_epoch)
        if step == start_step or offset == 0:  # the epoch's order depends only on (seed, epoch): resumable anywhere
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(
                common.seed_of(args.seed, "epoch order", epoch))).tolist()
        batch = order[offset * global_batch:(offset + 1) * global_batch]
        mine = batch[rank * micro * accumulation:(rank + 1) * micro * accumulation]
        stats = train_step(model, [[train[i] for i in mine[m * micro:(m + 1) * micro]] for m in range(accumulation)],
                           args, tokenizer.pad_token_id, device)
        if not math.isfinite(stats["grad_norm"]):  # stop before the step: the last checkpoint stays the last good state
            raise common.UserError(f"step {step + 1}: the gradient norm is {stats['grad_norm']} (loss "
                                   f"{stats['loss']:.4g}); training diverged: lower --learning_rate; --resume "
                                   f"continues from the last checkpoint in {args.output_dir}")
        optimizer.step()
        lr = scheduler.get_last_lr()[0]  # (the rate this step used)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(stats)
        if step == start_step:  # what each rank held at most, in the first log
            memory = common.peak_memory(device)

        # 4. Log, evaluate, checkpoint (the speed logged is the training loop's: evaluations and saves are left out).
        done = step + 1
        if done % args.logging_steps == 0 or done == total_steps:
            log_train(logger, bar, window, done, steps_per_epoch, lr, global_batch,
                      time.time() - t_window, device, world, **memory)
            window, t_window, memory = [], time.time(), {}
        t_pause = time.time()
        if done in evals_at:
            ev, eval_rewards = evaluate(model, evals, args, tokenizer.pad_token_id, device, rank, world)
            ev = {"step": done, **ev, "perf/eval_pairs_per_s": len(evals) / (time.time() - t_pause)}
            if rank == 0:
                logger.log(ev)
                bar.write(common.format_metrics(ev))
        save, stop = common.step_end(done, args.save_steps, t_saved, device)
        if save and done < total_steps:
            common.save_training(model, optimizer, scheduler, done, rank, args.output_dir, global_batch=global_batch)
            t_saved = time.time()
        if stop and done < total_steps:
            common.exit_stopped(stop, done, args, rank, bar)
        t_window += time.time() - t_pause
    common.stop_on_signals(False)
    if ev is None:  # resumed at or past the total: no step ran, so its evaluation too
        ev, eval_rewards = evaluate(model, evals, args, tokenizer.pad_token_id, device, rank, world)

    # 5. Normalize (the training pairs' mean reward, in config.json: see fit_normalization) and save in HF format.
    normalization = fit_normalization(model, train, args, tokenizer.pad_token_id, device, rank, world)
    common.agreed(lambda: save_final(model, hf_model, lora, tokenizer, ev, eval_rewards, logger, args, rank,
                                     dict(normalization, eval_sets=eval_sets)))  # a failing save ends every rank
    common.leave_together()  # (under torchrun: every rank done)
    return ev


# ---------------------------------------------------------------------------------------------------------------------
# The systems. A first read can stop above: what follows makes the steps run on real data, at scale and fast,
# each piece behind one named function whose docstring states what it guarantees.
#
# Start-up checks, model and data.


def check_args(args):
    """Every size and range, and every model and dataset found, before anything is loaded or written; a bad one is
    named in one line."""
    for name in ("max_length", "max_prompt_length", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size", "logging_steps", "num_evals"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise common.UserError(f"--{name} {getattr(args, name)}: must be at least 1")
    for name in ("learning_rate", "weight_decay", "num_train_epochs", "warmup_steps", "warmup_ratio", "lr_end",
                 "max_grad_norm", "center_rewards_coefficient", "eval_steps", "save_steps", "head_init_std", "lora_r",
                 "lora_alpha"):
        value = getattr(args, name)
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise common.UserError(f"--{name} {value}: must be a finite number >= 0")
    if args.max_steps <= 0 and args.num_train_epochs is not None and not args.num_train_epochs > 0 and \
            not args.eval_only:
        raise common.UserError(f"--num_train_epochs {args.num_train_epochs}: must be above 0 (or set --max_steps)")
    if not 0 < args.eval_holdout < 1:
        raise common.UserError(f"--eval_holdout {args.eval_holdout}: must be a fraction within (0, 1)")
    if not args.warmup_ratio <= 1:
        raise common.UserError(f"--warmup_ratio {args.warmup_ratio}: must be within [0, 1]")
    common.check_source(args.model_name_or_path, "--model_name_or_path")
    for name, _ in mixture(args.dataset_mixer_list or [args.dataset_name, "1.0"]):
        common.check_source(name, "--dataset_mixer_list" if args.dataset_mixer_list else "--dataset_name", "dataset")


def start_up(args):
    """The checks before any weight is read, every one failing in one line: the arguments, the models and datasets
    found, and the output folder (one every rank sees, not another run's). Returns (args, rank, world, device)."""
    if args.eval_only and args.output_dir == Args.output_dir:  # never overwrite a trained model's own results
        args = dataclasses.replace(args, output_dir="runs/rm-eval")
    check_args(args)
    rank, world, device = setup_distributed()
    common.check_shared_output_dir(args.output_dir, rank)
    common.check_output_dir(args, rank)
    return args, rank, world, device


def load_tokenizer(name):
    if name.startswith("embedded-"):
        return common.embedded_tokenizer()
    from transformers import AutoTokenizer

    tok = common.load_pretrained(AutoTokenizer, name, "--model_name_or_path")
    if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:
        # A distinct pad id lets any loader (transformers pools at the last non-pad id) find a trailing EOS.
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    return tok


def load_reward_model(args, tokenizer, on_meta=False):
    """The reward model (a transformers sequence classifier) and, with --lora_r, the peft model holding its adapters.
    on_meta: built on the meta device, rank 0's weights broadcast into it when sharded (common.shard_from_rank0)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(args.seed)
    name = args.model_name_or_path
    # float32 whatever the stored dtype: AdamW's updates (lr x ~1e-3) would round away in bfloat16 weights; a frozen
    # LoRA base is only read, so it may be held in bfloat16
    dtype = torch.bfloat16 if args.lora_r and args.bf16 else torch.float32
    if name.startswith("embedded-"):
        config = common.embedded_model_config(name, len(tokenizer), num_labels=1)
        model, trained_head = AutoModelForSequenceClassification.from_config(config).to(dtype), False
    else:
        config = common.load_pretrained(AutoConfig, name, "--model_name_or_path")
        trained_head = any(a.endswith("ForSequenceClassification") for a in config.architectures or []) or \
            common.adapter_base(name) is not None and common.adapter_holds_head(name)
        config.num_labels = 1
        # dropout off, before the model is built: the two passes of a pair must see the same network
        plain = trained_head or on_meta or common.adapter_base(name)  # (an adapter's model is built by load_model)
        loader = AutoModelForSequenceClassification if plain else with_new_head(config)
        model = common.load_model(loader, name, "--model_name_or_path", on_meta, config=without_dropout(config),
                                  dtype=dtype)
    disable_dropout(model)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    model = reward_head(model, args, trained_head)
    return model, common.add_lora(model, args, "SEQ_CLS") if args.lora_r and not args.eval_only else None


def with_new_head(config):
    """A classifier class whose load report from a causal LM lists only the backbone's keys (the heads' expected)."""
    from transformers import AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification._model_mapping[type(config)]
    outside = [rf"^(?!{cls.base_model_prefix}\.)"]  # every key but the backbone's
    return type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_missing": outside,
                                       "_keys_to_ignore_on_load_unexpected": outside})


def resolve_lengths(args, model, rank):
    """--max_length and --max_prompt_length as given, or their defaults fitted to the model (common.length_default);
    a length the user gave that the model cannot read is refused here, before any pair is read."""
    max_length = common.length_default(args.max_length, 512, common.position_table(model), "--max_length", rank)
    common.check_position_table(model, max_length, f"--max_length {max_length}")
    max_prompt_length = args.max_prompt_length or min(256, max_length * 3 // 4)
    if max_length <= max_prompt_length:
        raise common.UserError(f"--max_prompt_length {max_prompt_length} must be below --max_length {max_length} to "
                               "leave room for the responses")
    return dataclasses.replace(args, max_length=max_length, max_prompt_length=max_prompt_length)


def load_data(args, tokenizer, rank):
    """Training and evaluation pairs of every dataset of the mixture, tokenized, each pair knowing its dataset, and
    what each dataset is evaluated on. A dataset with an eval split (--eval_split; by default validation, else test)
    is evaluated on the whole of it, its weight taking its share of the training pairs. The weighted training shares of
    the others are pooled, and --eval_holdout of the pool held out by prompt; a held-out prompt is then trained on in
    no dataset of the mixture (datasets may share pairs)."""
    mixer = mixture(args.dataset_mixer_list or [args.dataset_name, "1.0"])
    train_rows, eval_rows, pool, eval_sets = [], [], [], {}
    for name, weight in mixer:
        tried = [args.eval_split] if args.eval_split else ["validation", "test"]
        split, evals = next(((s, rows) for s in tried if (rows := common.load_rows(name, args.dataset_config, s))
                             is not None), (None, None))
        train = [] if args.eval_only and evals else common.load_rows(name, args.dataset_config, args.train_split)
        if not train and not (args.eval_only and evals):
            raise common.UserError(f"{name}: no rows in split '{args.train_split}'" + (
                f" nor {' or '.join(repr(s) for s in tried)}" if args.eval_only else "") + "; pass --train_split")
        if args.eval_only and evals is None:
            split, evals, train = args.train_split, train, []
        ours = lambda rows: [dict(r, _dataset=name) for r in rows]  # noqa: E731
        if evals is None:
            pool += ours(take_share(train, weight, args.seed))
            eval_sets[name] = f"{args.eval_holdout:g} of its training pairs, held out by prompt"
        else:
            train_rows += ours(take_share(train, weight, args.seed))
            eval_rows += ours(evals)
            eval_sets[name] = f"split {split!r}"
    if pool:
        train_rows, held = hold_out_by_prompt(pool, args.eval_holdout, args.seed, tokenizer, train_rows)
        eval_rows += held
    train, cut, dropped = tokenize_pairs(train_rows, tokenizer, args)
    common.check_vocabulary(tokenizer, [p["prompt"] + p["chosen"] + p["rejected"] for p in train],
                            " ".join(n for n, _ in mixer), args.model_name_or_path, "--model_name_or_path")
    if train_rows and not train:
        raise common.UserError(f"{' '.join(n for n, _ in mixer)}: all {len(train_rows)} training pairs were dropped: "
                               "chosen and rejected are identical (after truncation to --max_length); check the "
                               "data or raise --max_length")
    evals, cut_e, dropped_e = tokenize_pairs(eval_rows, tokenizer, args)
    if not evals:
        raise common.UserError(f"{' '.join(n for n, _ in mixer)}: no evaluation pairs left after tokenization")
    if rank == 0:
        count = collections.Counter(p["dataset"] for p in evals)
        for name, on in eval_sets.items():
            print(f"{name}: evaluating on {on} ({count[name]} pairs)")
        print(f"pairs: {len(train)} train, {len(evals)} eval; truncated {cut + cut_e}, dropped {dropped + dropped_e} "
              f"(identical after truncation); max_length {args.max_length}, max_prompt_length {args.max_prompt_length}")
    return train, evals, eval_sets


def mixture(mixer):
    """open-instruct's dataset mixer, [name, weight, ...], as (name, weight) pairs."""
    if len(mixer) % 2:
        raise common.UserError("--dataset_mixer_list: expected pairs of NAME WEIGHT, e.g. 'data.jsonl 1.0 other 500'")
    pairs = []
    for name, weight in zip(mixer[::2], mixer[1::2]):
        try:
            pairs.append((name, float(weight)))
        except ValueError:
            pairs.append((name, math.nan))
        if not 0 < pairs[-1][1] < math.inf:
            raise common.UserError(f"--dataset_mixer_list: weight {weight!r} of {name} must be a number above 0")
    return pairs


def take_share(rows, weight, seed):
    """A weight's share of the rows, drawn by seed: a fraction (<= 1) or a count (> 1)."""
    n = int(round(weight * len(rows))) if weight <= 1 else int(weight)
    if n < len(rows):
        rows = list(rows)
        random.Random(seed).shuffle(rows)
    return rows[:n]


def tokenize_pairs(rows, tokenizer, args):
    """Rows -> dicts of prompt/chosen/rejected token ids (+ margin), truncated by truncate_pair's policy.
    Pairs whose two sequences are identical after truncation carry no preference and are dropped."""
    in_file_order = sorted(range(len(rows)), key=lambda i: (str(rows[i]["_source"]), rows[i]["_row"]))
    texts, margins = [None] * len(rows), [None] * len(rows)
    for i in in_file_order:  # the first bad row of a file is the one reported, however the rows were shuffled
        texts[i] = common.split_pair(rows[i], tokenizer, common.where(rows[i]))
        margins[i] = margin_of(rows[i])
    prompts = common.tokenize_prompts(tokenizer, [t[0] for t in texts])
    chosen = common.tokenize_responses(tokenizer, [t[0] for t in texts], [t[1] for t in texts])
    rejected = common.tokenize_responses(tokenizer, [t[0] for t in texts], [t[2] for t in texts])
    bos_id, pairs, n_truncated = common.leading_id(tokenizer), [], 0
    for row, margin, p, c, r in zip(rows, margins, prompts, chosen, rejected):
        p, c, r, cut = truncate_pair(p, c, r, args.max_length, args.max_prompt_length, bos_id)
        n_truncated += cut
        if c != r:
            gold = (row["gold_chosen"], row["gold_rejected"]) if row.get("gold_chosen") is not None else None
            pairs.append({"prompt": p, "chosen": c, "rejected": r, "margin": float(margin),
                          "dataset": row.get("_dataset"), "gold": gold})
    return pairs, n_truncated, len(rows) - len(pairs)


def margin_of(row):
    """A row's margin: a number, or text that reads as one (CSV cells are text); absent or empty is 0."""
    margin = row.get("margin")
    try:
        value = 0.0 if margin is None or margin == "" else float(margin)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(margin, bool) or not math.isfinite(value):
        raise common.UserError(f"{common.where(row)}: field 'margin' is {margin!r}; expected a finite number")
    return value


def schedule(args, n_train, global_batch, rank):
    """(steps per epoch, total steps, the steps after which to evaluate: --eval_steps apart, else --num_evals spread
    evenly, the last one at the end)."""
    steps_per_epoch = n_train // global_batch
    if steps_per_epoch == 0 and not args.eval_only:
        raise common.UserError(f"{n_train} training pairs are fewer than one global batch of {global_batch}")
    epochs = args.num_train_epochs or (3 if args.model_name_or_path.startswith("embedded-") else 1)
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(epochs * max(steps_per_epoch, 1))
    evals_at = {*range(args.eval_steps, total_steps, args.eval_steps), total_steps} if args.eval_steps else \
        {math.ceil(k * total_steps / args.num_evals) for k in range(1, args.num_evals + 1)}
    if len(evals_at) < args.num_evals and not (args.eval_steps or args.eval_only) and rank == 0:
        print(f"--num_evals {args.num_evals}: {len(evals_at)}, one after each of the {total_steps} steps")
    return steps_per_epoch, total_steps, evals_at


def describe_run(args, hf_model, lora, train, layout, optimizer, world, device, steps_per_epoch, total_steps,
                 start_step):
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = micro * accumulation * world
    n_trained = sum(p.numel() for p in hf_model.parameters() if p.requires_grad)
    mean_len = sum(len(p["prompt"]) * 2 + len(p["chosen"]) + len(p["rejected"]) for p in train) / len(train)
    print(f"model {args.model_name_or_path}: {sum(p.numel() for p in hf_model.parameters()) / 1e6:.2f}M parameters"
          f", {n_trained / 1e6:.2f}M trained{f' (LoRA rank {args.lora_r})' if lora else ''}; world size {world} "
          f"({device.type}, {'FSDP2' if args.fsdp and world > 1 else 'DDP' if world > 1 else 'single process'})\n"
          f"batch layout: {layout}\nglobal batch {global_batch} pairs = {micro} x {accumulation} accumulation x "
          f"{world} ranks; ~{mean_len * global_batch:.0f} real tokens per step; {total_steps} steps "
          f"({total_steps / steps_per_epoch:.2f} epochs); lr {optimizer.param_groups[0]['initial_lr']:g}, "
          f"{args.lr_scheduler_type}, warmup {args.warmup_steps or int(args.warmup_ratio * total_steps)}"
          + (f"; resumed from step {start_step}" if start_step else "")
          + (" (at or past the total: the final evaluation and save remain)" if start_step >= total_steps else ""))


def build_optimizer(model, args, total_steps):
    """AdamW over the trainable parameters and transformers' learning-rate schedule, with warm-up."""
    from transformers import get_scheduler

    lr = args.learning_rate if args.learning_rate is not None else \
        1e-3 if args.model_name_or_path.startswith("embedded-") else 1e-5
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=args.weight_decay, fused=True)
    extra = {"polynomial": {"lr_end": args.lr_end}, "cosine_with_restarts": {"num_cycles": int(args.num_cycles)},
             "cosine": {"num_cycles": args.num_cycles / 2}}.get(args.lr_scheduler_type, {})
    return optimizer, get_scheduler(args.lr_scheduler_type, optimizer, scheduler_specific_kwargs=extra,
                                    num_warmup_steps=args.warmup_steps or int(args.warmup_ratio * total_steps),
                                    num_training_steps=total_steps)


# ---------------------------------------------------------------------------------------------------------------------
# The packed layout behind model_inputs (see there what guarantees its rewards): pairs end to end in one row.


# segment_attention makes one SDPA call per block of consecutive pairs of at most this many tokens (a longer pair is a
# block alone): short pairs share a call, long ones pay only for their own length, never for the row's
BLOCK_TOKENS = 256


def pack_segments(pairs, share_prompt=True):
    """A padding-free batch of one row: every pair's prompt + chosen + rejected (share_prompt: rejected's position ids
    continue from the prompt's end; Wang et al. 2024, arXiv 2410.20305) or its two sequences, end to end. Returns ids,
    None for the mask, position ids, the (row, column) read points (chosen ones, then rejected) and the Segments."""
    ids, seq, branch, positions, reads, blocks = [], [], [], [], [[], []], []

    def add(tokens, branches, pos):
        if not blocks or len(ids) + len(tokens) - blocks[-1][0] > BLOCK_TOKENS:
            blocks.append([len(ids), len(ids)])
        ids.extend(tokens), branch.extend(branches), positions.extend(pos)
        seq.extend([len(reads[0]) + len(reads[1])] * len(tokens))
        blocks[-1][1] = len(ids)

    for p in pairs:
        P, C, R = len(p["prompt"]), len(p["chosen"]), len(p["rejected"])
        if share_prompt:
            reads[0].append(len(ids) + P + C - 1), reads[1].append(len(ids) + P + C + R - 1)
            add(p["prompt"] + p["chosen"] + p["rejected"], [0] * P + [1] * C + [2] * R,
                list(range(P + C)) + list(range(P, P + R)))
        else:
            for side, response in enumerate((p["chosen"], p["rejected"])):
                reads[side].append(len(ids) + P + len(response) - 1)
                add(p["prompt"] + response, [0] * (P + len(response)), list(range(P + len(response))))
    cols = torch.tensor(reads[0] + reads[1])
    segments = Segments(torch.tensor(seq), torch.tensor(branch), torch.tensor(positions), [tuple(b) for b in blocks])
    return torch.tensor([ids]), None, torch.tensor([positions]), torch.stack([torch.zeros_like(cols), cols]), segments


class Segments:
    """A packed row as segment_attention reads it: each token's sequence, branch (0 prompt, 1 chosen, 2 rejected) and
    position, and the blocks (start, end) of whole sequences; a block's mask is built once per sliding window."""

    def __init__(self, sequence, branch, position, blocks):
        self.sequence, self.branch, self.position, self.blocks = sequence, branch, position, blocks
        self.masks, self.calls = {}, []

    def mask(self, b, window, device):
        if (b, window) not in self.masks:
            s, e = self.blocks[b]
            seq, branch, pos = (t[s:e].to(device) for t in (self.sequence, self.branch, self.position))
            # a token sees earlier tokens of its own sequence: the prompt, and its own branch (never the other one)
            m = (seq[:, None] == seq[None, :]) & ((branch[None, :] == 0) | (branch[:, None] == branch[None, :]))
            m &= pos[None, :] <= pos[:, None]
            if window:  # transformers' sliding window: query i sees key j when i - j < window
                m &= pos[:, None] - pos[None, :] < window
            self.masks[(b, window)] = m
        return self.masks[(b, window)]


def segment_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      sliding_window=None, rm_segments=None, **kwargs):
    """The attention of a packed row: per block of whole pairs, one SDPA call whose mask keeps each token inside its
    own sequence (a rejected token sees the prompt, never the chosen tokens) and this layer's sliding window; Gemma 2's
    softcapping in plain operations. Attention sinks are refused (choose_layout then keeps the padded batch)."""
    if rm_segments is None:
        raise ValueError("a model given the packed layout is called with a packed row only (see pack_segments)")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attention sinks")
    rm_segments.calls.append(sliding_window)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]  # query heads per key/value head (grouped-query attention)
    if groups > 1 and (softcap is not None or not sdpa_takes_groups_with_mask(query.device)):
        key, value = (t.repeat_interleave(groups, 1) for t in (key, value))
    out = None  # (1, heads, tokens, head dim), in the attention's dtype (autocast may differ from the query's)
    for b, (s, e) in enumerate(rm_segments.blocks):  # slices stay 4D: 3D inputs miss the fused kernel on CPU
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        mask = rm_segments.mask(b, sliding_window, query.device)
        if softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                               enable_gqa=q.shape[1] != k.shape[1])
        else:
            scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scaling / softcap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(v.dtype) @ v
        out = o.new_empty(query.shape) if out is None else out
        out[:, :, s:e] = o
    return out.transpose(1, 2).contiguous(), None


def sdpa_takes_groups_with_mask(device):
    """Whether SDPA gets grouped keys and values beside a boolean mask: not on CUDA, where that pair can fall back to
    the math kernel (whole attention matrices), so keys and values are repeated per query head there."""
    return device.type != "cuda"


def use_segment_attention(hf_model):
    """Give the model segment_attention, registered with transformers' attention interface as "rm_segments", and no
    mask of transformers' own (a dense N x N one over a packed row would never be read)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("rm_segments", segment_attention)
    AttentionMaskInterface.register("rm_segments", lambda *args, **kwargs: None)
    hf_model.config._attn_implementation = "rm_segments"


def declared_windows(config):
    """The sliding window of each layer, as the config declares it (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * \
        config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


@torch.no_grad()
def choose_layout(model, args, vocab_size, rank=0):
    """(args, layout): the packed layout if this model passes packed_layout_fault (run by rank 0, or under FSDP by
    every rank on its shards, on the run's device and precision; every rank takes rank 0's verdict), else the padded
    batch, and why."""
    padded = dataclasses.replace(args, padding_free=False)
    if not args.padding_free:
        return args, "padded (as asked)"
    if not hasattr(model.hf, "score"):
        return padded, "padded: an encoder reads its pooled [CLS] over the whole sequence"
    if "position_ids" not in inspect.signature(model.hf.base_model.forward).parameters:
        return padded, "padded: the model takes no position ids (ALiBi or recurrent)"
    why_not = [common.agreed(lambda: packed_layout_fault(model, args, vocab_size) if rank == 0 else None)]
    if dist.is_initialized():
        dist.broadcast_object_list(why_not, src=0)
    if why_not[0]:
        return padded, f"padded: {why_not[0]}"
    use_segment_attention(model.hf)
    name = "prefix-shared + packed" if args.prefix_sharing else "packed"
    return args, f"{name}: one row, attention per block of pairs (rewards checked equal to the padded batch's)"


def packed_layout_fault(model, args, vocab_size):
    """What is wrong with the packed layout for this model (None: nothing): on random pairs, 4 short ones and 2 long
    enough to fill more than one block and to pass the shortest sliding window (within --max_length), every layer must
    call segment_attention with the window its config declares, and the rewards must equal the padded batch's."""
    device, g = next(model.parameters()).device, torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(0, vocab_size, (k,), generator=g).tolist()  # noqa: E731
    pairs = [{"prompt": ids(3 + i), "chosen": ids(2 + i % 3), "rejected": ids(4 - i % 3), "margin": 0.0}
             for i in range(4)]
    limit = args.max_length or common.position_table(model.hf) or 2 * BLOCK_TOKENS
    long = min(limit, max([BLOCK_TOKENS] + [w + 8 for w in declared_windows(model.hf.config) if w])) - 8
    pairs += [{"prompt": ids(long // 2), "chosen": ids(long // 2 - i), "rejected": ids(long // 4), "margin": 0.0}
              for i in range(2 if long >= 16 else 0)]
    was_training, own, windows = model.training, model.hf.config._attn_implementation, declared_windows(model.hf.config)
    model.eval()
    low = args.bf16 or model.hf.dtype == torch.bfloat16  # a LoRA base held in bfloat16 runs under autocast too
    tol, why_not = 5e-2 if low else 1e-3, None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
        reference = model(*model_inputs(pairs, 0, dataclasses.replace(args, padding_free=False), device))
        use_segment_attention(model.hf)
        inputs = model_inputs(pairs, 0, args, device)
        try:
            rewards = model(*inputs)
        except NotImplementedError as e:
            why_not = f"its attention needs {e}"
    if why_not is None and inputs[-1].calls != windows:
        why_not = f"its layers called segment_attention with windows {inputs[-1].calls}, not the config's {windows}"
    elif why_not is None and not torch.allclose(rewards, reference, rtol=tol,
                                                atol=tol * reference.abs().max().item() + 1e-6):
        why_not = "its packed rewards differ from the padded batch's"
    model.train(was_training)
    model.hf.config._attn_implementation = own
    return why_not


# ---------------------------------------------------------------------------------------------------------------------
# Distributed set-up (torchrun's environment variables; a plain `python rm.py` is world size 1).


def setup_distributed():
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    common.attention_without_nan(device)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # an hour, not the default 10 minutes: the ranks wait in a collective while rank 0 writes the final model
        # (tens of GB at 7B); a rank that dies ends the job at once all the same (torchrun stops the others)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
    return rank, world, device


def parallelize(model, args, device):
    """DDP, or FSDP2 with one shard group per transformer block and one for the input embeddings (unless an output
    layer shares them), filled with rank 0's weights (common.shard_from_rank0)."""
    if not dist.is_initialized():
        return model.to(device)
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 is compute only: the sharded parameters, and so the optimizer's steps, stay in their own dtype
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else \
            MixedPrecisionPolicy()

        def shard(model):
            blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                          and len(m) == model.hf.config.num_hidden_layers)
            for block in blocks:
                fully_shard(block, mp_policy=mp)
            common.shard_input_embeddings(model, fully_shard, mp_policy=mp)
            if (head := common.scalar_head(model)) is not None:
                fully_shard(head, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
            fully_shard(model, mp_policy=mp)

        return common.shard_from_rank0(model, shard, device)
    model.to(device)
    # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, not a second copy of them
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else
                                                     None, broadcast_buffers=False, gradient_as_bucket_view=True)


def all_gather_cat(t):
    if not dist.is_initialized():
        return t
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------------------------------
# Logging, the final save, figures.


def log_train(logger, bar, window, step, steps_per_epoch, lr, global_batch, elapsed, device, world, **memory):
    """The training statistics of the steps since the last log, averaged over them and over ranks, and the speed (and
    in the first log, memory/*)."""
    keys = ("loss", "accuracy", "reward_gap", "grad_norm", "tokens")
    means = torch.tensor([sum(s[k] for s in window) / len(window) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(means)
    loss, accuracy, reward_gap, grad_norm, tokens = (means / world).tolist()
    tokens *= len(window) * world
    m = {"step": step, "epoch": step / steps_per_epoch, "train/loss": loss, "train/accuracy": accuracy,
         "train/reward_gap": reward_gap, "train/grad_norm": grad_norm, "lr": lr, "perf/tokens_per_s": tokens / elapsed,
         "perf/pairs_per_s": len(window) * global_batch / elapsed, **memory}
    if logger is not None:
        logger.log(m)
        bar.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}", tok_s=f"{tokens / elapsed:.0f}")
        bar.write(common.format_metrics(m))


def save_final(model, hf_model, lora, tokenizer, ev, eval_rewards, logger, args, rank, record):
    """The reward model in transformers' format with its normalization (record's reward_shift and reward_scale),
    eval_results.json (with record), the evaluation figure and a summary."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    shift, scale = record["reward_shift"], record["reward_scale"]
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    saved = save_reward_model(hf_model, lora, {k.removeprefix("hf."): v for k, v in model_sd.items()}, tokenizer,
                              args.output_dir, shift, scale)
    logger.close()
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        write_results(ev, eval_rewards, [json.loads(line) for line in f], args, **record)
    summary = f"final eval accuracy {ev['eval/accuracy']:.4f}"
    if "eval/bayes_accuracy" in ev:
        summary += f" (Bayes-optimal {ev['eval/bayes_accuracy']:.4f}, ratio {ev['eval/accuracy_vs_bayes']:.3f})"
    print(f"{summary}; saved to {args.output_dir}")
    if args.push_to_hub:
        repo = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
        saved.push_to_hub(repo)
        tokenizer.push_to_hub(repo)


def save_reward_model(hf_model, lora, state_dict, tokenizer, output_dir, shift, scale):
    """Weights in transformers' format (with LoRA: merged, and the adapter in output_dir/adapter). A linear head
    without a bias cannot hold a shift, so the normalization travels in config.json (beside an adapter, in
    reward_normalization.json): reward = (score - reward_shift) / reward_scale (ppo.py's load_reward applies it)."""
    normalization = {"reward_shift": shift, "reward_scale": scale}
    if lora is not None:
        hf_model = common.save_lora(hf_model, lora, state_dict, tokenizer, output_dir)
        state_dict = hf_model.state_dict()
        common.write_json_atomic(os.path.join(output_dir, "adapter", "reward_normalization.json"), normalization)
    hf_model.config.update(normalization)
    hf_model.config.architectures = [type(hf_model).__name__]
    common.save_pretrained_atomic(hf_model, tokenizer, output_dir, state_dict=state_dict)
    return hf_model


def evaluate_only(model, hf_model, evals, args, tokenizer, device, rank, world, layout, eval_sets):
    ev, rewards = evaluate(model, evals, args, tokenizer.pad_token_id, device, rank, world)
    if rank == 0:
        shift, scale = getattr(hf_model.config, "reward_shift", 0.0), getattr(hf_model.config, "reward_scale", 1.0)
        os.makedirs(args.output_dir, exist_ok=True)
        write_results(ev, rewards, [], args, num_pairs=len(evals), reward_shift=shift, reward_scale=scale,
                      normalized_reward_mean=(ev["eval/reward_mean"] - shift) / scale, batch_layout=layout,
                      eval_sets=eval_sets)
        print(common.format_metrics(ev))
        print(f"evaluated {args.model_name_or_path} on {len(evals)} pairs: accuracy {ev['eval/accuracy']:.4f}; "
              f"eval_results.json and eval.png in {args.output_dir}")
    common.leave_together()  # (under torchrun: every rank done)
    return ev


def write_results(ev, rewards, metrics, args, **extra):
    """eval_results.json (the evaluation's metrics, extra and the arguments) and eval.png."""
    common.write_json_atomic(os.path.join(args.output_dir, "eval_results.json"), {
        **{k.removeprefix("eval/"): v for k, v in ev.items()}, **extra, "args": dataclasses.asdict(args)})
    plot_eval(os.path.join(args.output_dir, "eval.png"), rewards, metrics, args.loss_type)


def plot_eval(path, rewards, metrics, loss_type="sigmoid"):
    """The reward model at a glance: chosen vs rejected reward histograms; a reliability diagram of P(chosen wins)
    (chosen_wins; each pair in both orders, as calibration_error counts it); accuracy and loss over steps. rewards: per
    pair (r_chosen, r_rejected, margin), as evaluate returns them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rc, rr = rewards[:, 0].numpy(), rewards[:, 1].numpy()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for r, color, name in ((rc, "tab:green", "chosen"), (rr, "tab:red", "rejected")):
        axes[0, 0].hist(r, bins=40, alpha=0.55, color=color, label=f"{name} (mean {r.mean():.3f})")
    axes[0, 0].set(title=f"Rewards on {len(rc)} eval pairs (accuracy {(rc > rr).mean():.3f})", xlabel="reward (logit)",
                   ylabel="pairs")
    p_chosen = chosen_wins(rewards[:, 0], rewards[:, 1], rewards[:, 2], loss_type)
    count, confidence, frequency = reliability(p_chosen)
    axes[0, 1].plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    axes[0, 1].plot(confidence[count > 0], frequency[count > 0], "o-", color="tab:blue", label="reward model")
    axes[0, 1].set(title=f"Reliability (ECE {calibration_error(p_chosen):.3f})", xlim=(0, 1), ylim=(0, 1),
                   xlabel="predicted P(this response wins)", ylabel="observed frequency")
    for ax, key in ((axes[1, 0], "accuracy"), (axes[1, 1], "loss")):
        for split, style, color, label in (("train", "-", "tab:blue", "train (logged window)"),
                                           ("eval", "o-", "tab:orange", "eval")):
            points = [(m["step"], m[f"{split}/{key}"]) for m in metrics if f"{split}/{key}" in m]
            if points:
                ax.plot(*zip(*points), style, color=color, alpha=0.8, label=label)
        ax.set(title=f"{key} over training" if ax.lines else f"{key}: evaluation only, no training curve",
               xlabel="optimizer step", ylabel=key)
    for ax in axes.flat:
        if ax.lines or ax.patches:
            ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    common.exit_on_user_error(main, common.cli(Args))
