"""Reward modeling (Bradley-Terry) in one file.

    python rm.py                                   # embedded task, tiny model, CPU, a few minutes
    torchrun --nproc_per_node 2 rm.py              # the same on 2 processes (gloo on CPU, nccl on GPU)
    torchrun --nproc_per_node 8 rm.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --dataset_name Anthropic/hh-rlhf --bf16 --learning_rate 1e-5 --per_device_train_batch_size 8
    python rm.py --help                            # every option, documented

A reward model is a language model with a scalar head read at the last real token of prompt + response. It is trained
so that r(prompt, chosen) - r(prompt, rejected) is large: loss = -log sigmoid(r_c - r_r - margin) (Bradley & Terry
1952; Ouyang et al. 2022, eq. 1; the margin of Touvron et al. 2023), plus optional centering. The whole method reads
from here to the end of `main` (load model and pairs; train; evaluate; fit the reward normalization; save), where the
FENCE stands; below it, what a run calls but a reader may trust by its docstring (loading, distributed set-up, I/O,
logging), then the opt-in packed layout (--padding_free). Left out (README): equal loss variants, figures, upload.
"""

import collections
import dataclasses
import datetime
import inspect
import math
import os
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from tqdm import tqdm

import common


@dataclass
class Args:
    """rm.py's options (help: the comment after each field; the why of a default: above it). Each default is the value
    a run uses, but None where it depends on the model: fill_defaults (below) fills those, and the run records them."""
    # --- reward model
    center_rewards_coefficient: float = 0.0  # Weight of mean((r_c + r_r)^2), keeping rewards near 0 (Eisenstein 2023)
    head_init_std: float | None = None  # Std of a new head's weights (None: 1/sqrt(hidden_size + 1), rewards ~1)
    # fitted after training on 2048 training pairs (never eval ones); config.json: (logit - shift) / scale, as ppo.py
    reward_normalization: Literal["none", "shift", "shift_scale"] = "shift"  # Saved rewards' mean 0 (and std 1)
    # --- model and data
    model_name_or_path: str = "embedded-llama"  # HF model, path or peft adapter folder; or embedded-llama/-neox
    dataset_name: str = "embedded"  # Hub dataset, local .jsonl/.json/.parquet/.csv (gzip too), or `embedded`
    dataset_config: str | None = None  # Hub dataset configuration name
    dataset_mixer_list: list[str] = field(default_factory=list)  # NAME WEIGHT ... (weight <= 1: fraction, > 1: count)
    train_split: str = "train"  # Split to train on
    eval_split: str | None = None  # Split evaluated on, refused if absent (None: validation, else test, else held out)
    eval_holdout: float = 0.1  # Without an eval split: this fraction held out, by whole prompts never trained on
    max_length: int | None = None  # Max tokens of prompt + response (None: 512, or the model's position table if less)
    max_prompt_length: int | None = None  # Prompt tokens kept at least if a pair is cut (None: min(256, 3/4 max))
    output_dir: str = "runs/rm"  # The model, tokenizer, metrics.jsonl, eval_results.json and checkpoints
    # --- optimisation
    learning_rate: float | None = None  # AdamW learning rate (None: 1e-5; 1e-3 for the embedded models)
    weight_decay: float = 0.0  # AdamW weight decay
    num_train_epochs: float | None = None  # Passes over the pairs (None: 1; 3 for the embedded models)
    max_steps: int = -1  # Total optimizer steps; overrides --num_train_epochs when > 0
    per_device_train_batch_size: int = 32  # Pairs per device per micro-step (chosen and rejected in one forward)
    gradient_accumulation_steps: int = 1  # Micro-steps per optimizer step (global batch: per-device x this x ranks)
    per_device_eval_batch_size: int = 32  # Pairs per device per evaluation forward
    lr_scheduler_type: Literal["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "inverse_sqrt",
                               "constant_with_warmup", "reduce_lr_on_plateau", "cosine_with_min_lr", "greedy",
                               "cosine_warmup_with_min_lr", "warmup_stable_decay"] = "cosine"  # LR after warm-up
    lr_end: float = 0.0  # End LR of polynomial (a linear decay to it), cosine_*min_lr and warmup_stable_decay
    warmup_steps: int = 0  # Linear warm-up steps (overrides --warmup_ratio when > 0)
    warmup_ratio: float = 0.05  # Warm-up as a fraction of the total steps
    max_grad_norm: float = 1.0  # Gradient clipping norm (0 disables)
    seed: int = 1  # Seed of the head, data order, hold-out, mixture shares and the normalization sample
    # --- LoRA (through peft)
    lora_r: int = 0  # LoRA rank on the backbone's linear layers (Hu et al. 2021), head trained in full; 0: off
    lora_alpha: float = 16.0  # LoRA scale numerator: an adapter adds (lora_alpha / lora_r) * B A to its layer
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # Layers (or suffixes) adapted
    # --- evaluation, logging, checkpoints
    num_evals: int = 5  # Evaluations evenly spread over training, the last at its end
    logging_steps: int = 50  # Log train metrics every this many steps
    save_steps: int | None = None  # Checkpoint every this many steps (None: every 30 minutes; 0: none)
    resume: bool = False  # Continue from the latest checkpoint in --output_dir, on any number of ranks
    overwrite_output_dir: bool = False  # Train afresh where a run or checkpoints are (refused without this or --resume)
    track: bool = False  # Log to Weights & Biases (works with WANDB_MODE=offline)
    tensorboard: bool = False  # Also write every logged metric as TensorBoard events to --output_dir/tensorboard
    wandb_project: str = "rlhf-rm"  # Weights & Biases project
    run_name: str | None = None  # Run name for Weights & Biases (None: its own)
    eval_only: bool = False  # No training: evaluate --model_name_or_path on the eval split (or every pair)
    # --- systems
    # opt-in speed path (below the fence), used if its rewards equal the padded ones on this model (said at start-up)
    padding_free: bool = False  # Pack each pair in one row, its prompt once, no padding (default: 2B padded rows)
    fsdp: bool = False  # Shard parameters, gradients and optimizer state per block with FSDP2 (default: DDP)
    bf16: bool = False  # bfloat16 autocast (weights, optimizer state float32; a frozen LoRA base in bfloat16)
    gradient_checkpointing: bool = False  # Recompute activations in the backward pass to save memory


def fill_defaults(args, model, rank=0):
    """The defaults that depend on the model, the only ones not written in Args; printed, and saved with the results."""
    # pretrained models: 1 epoch, as InstructGPT and Llama 2 (they overfit after one); tiny models from scratch: more
    embedded = args.model_name_or_path.startswith("embedded-")
    max_length = args.max_length or min(512, common.position_table(model) or 512)  # (GPT-2: 1024, BERT: 512, ...)
    head = getattr(model, "score", None)  # a new head's std: first rewards of order 1 (as Ziegler et al. 2019's code)
    filled = {"learning_rate": 1e-3 if embedded else 1e-5, "num_train_epochs": 3.0 if embedded else 1.0,
              "max_length": max_length, "max_prompt_length": min(256, max_length * 3 // 4),
              "head_init_std": 1 / math.sqrt(head.in_features + 1) if head is not None else None}
    filled = {k: v for k, v in filled.items() if getattr(args, k) is None and v is not None}
    if filled and rank == 0:
        print("defaults for this model: " + ", ".join(f"--{k} {v:.4g}" for k, v in filled.items()))
    return dataclasses.replace(args, **filled)


# --- The math. -------------------------------------------------------------------------------------------------------
def preference_loss(r_chosen, r_rejected, margin):
    """Per-pair Bradley-Terry negative log-likelihood with the Llama 2 margin (Touvron et al. 2023, eq. 2), stable at
    any gap; another pair loss goes here (training and evaluation read it through reward_model_loss)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)


def reward_model_loss(r_chosen, r_rejected, margin, center_coefficient=0.0):
    """The objective train_step minimises and evaluate reports: the mean over pairs of the preference loss, plus
    center_coefficient * mean((r_c + r_r)^2) (Eisenstein et al. 2023)."""
    return preference_loss(r_chosen, r_rejected, margin).mean() + \
        center_coefficient * ((r_chosen + r_rejected) ** 2).mean()


# --- The method's conventions, the same as ppo.py's (tests/test_rm.py checks that they agree). -----------------------
def truncate_prompt(ids, max_prompt_length, bos_id=None):
    """A prompt longer than max_prompt_length keeps its END (the turn being answered) and its leading BOS/[CLS]."""
    if len(ids) <= max_prompt_length:
        return ids
    keep = 1 if bos_id is not None and ids and ids[0] == bos_id else 0
    return ids[:keep] + ids[len(ids) - max_prompt_length + keep:]


def truncate_pair(prompt, chosen, rejected, max_length, max_prompt_length, bos_id=None):
    """(prompt ids, None), or (None, why the pair is dropped). Responses are never cut: a cut response loses its EOS,
    and its reward would be read at a token never trained on (TRL's RewardTrainer and open-instruct drop such pairs).
    A pair past max_length has its prompt cut (truncate_prompt) to what the longer response leaves, but not below
    max_prompt_length; if the pair still does not fit it is dropped ("too long": over half of the training pairs
    stops the run). Responses of the same tokens carry no preference ("identical")."""
    if chosen == rejected:
        return None, "identical"
    longest = max(len(chosen), len(rejected))
    if min(len(prompt), max_prompt_length) + longest > max_length:
        return None, "too long"
    return truncate_prompt(prompt, max_length - longest, bos_id), None


def last_token_index(mask):
    """Where a reward is read, in every layout: the last token of each row of the mask (a sequence's EOS: a response
    is never cut), read from the mask (a pad id may equal EOS), right or left padded."""
    return (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(1)


def sequence_reward(model, ids, mask):
    """A padded batch's rewards: a decoder's scalar head at each row's last real token; an encoder's pooled head."""
    if not hasattr(model, "score"):  # BERT, RoBERTa, DeBERTa: a pooled `classifier`
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    hidden = model.base_model(input_ids=ids, attention_mask=mask, use_cache=False,
                              position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state  # ALiBi: ignored
    return model.score(hidden[torch.arange(len(ids), device=ids.device), last_token_index(mask)]).squeeze(-1).float()


def without_dropout(config):
    """Dropout off, so that a pair's two passes see one network: every dropout probability of the config 0 (some
    models, OPT, call F.dropout with it), and other training-mode randomness: layer drop, MoE routers' jitter."""
    for key, value in list(vars(config).items()):
        if any(s in key for s in ("dropout", "pdrop", "layerdrop", "jitter")) and isinstance(value, float):
            setattr(config, key, 0.0)
    return config


def disable_dropout(model):
    without_dropout(model.config)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def new_head(model, std):
    """A new head `score` drawn N(0, std^2) (fill_defaults: 1/sqrt(hidden + 1)); encoders keep their pooled head's.
    Every head computes in float32 (load_reward_model): a bfloat16 reward moves in steps of 1/128 of its size."""
    if hasattr(model, "score"):
        torch.nn.init.normal_(model.score.weight, std=std)


def load_reward_model(args, tokenizer, rank=0, on_meta=False):
    """(the sequence classifier, its peft model with --lora_r, args with the model's defaults filled): the backbone
    float32 (a frozen LoRA base may be bfloat16), dropout off, an adapter folder merged in (load_backbone); a new head
    where the start has no trained one (a causal LM, an SFT model); --lora_r's adapters, the head trained in full."""
    hf_model, needs_head = load_backbone(args, tokenizer, on_meta)
    args = fill_defaults(args, hf_model, rank)
    if needs_head:
        new_head(hf_model, args.head_init_std)
    hf_model = common.scalar_head_in_float32(hf_model)
    return hf_model, common.add_lora(hf_model, args, "SEQ_CLS") if args.lora_r and not args.eval_only else None, args


# --- The batch, the model, one training step, evaluation. ------------------------------------------------------------
def collate(pairs, pad_id):
    """The padded batch (the default layout): 2B rows, the chosen sequences then the rejected ones, right-padded
    (rewards.chunk(2) splits them); one pass equals two, as rows never attend to each other and dropout is off."""
    seqs = [p["prompt"] + p["chosen"] for p in pairs] + [p["prompt"] + p["rejected"] for p in pairs]
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return ids, mask


def model_inputs(pairs, pad_id, args, device="cpu"):
    """The model's inputs for B pairs, by name; it returns the B chosen rewards, then the B rejected ones. Padded, or
    with --padding_free a packed row (pack_segments, below the fence; choose_layout checked it on this model)."""
    if args.padding_free:
        ids, segments = pack_segments(pairs, device)
        return {"input_ids": ids.to(device), "packed": segments}
    ids, mask = collate(pairs, pad_id)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


class RewardModel(torch.nn.Module):
    """The module DDP and FSDP wrap: a padded batch's rewards (sequence_reward), or a packed row's (packed_rewards)."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, attention_mask=None, packed=None):
        return sequence_reward(self.hf, input_ids, attention_mask) if packed is None else \
            packed_rewards(self.hf, input_ids, packed)


def train_step(model, micro_batches, args, pad_id, device):
    """The forward and backward passes of one optimizer step, the gradients clipped to --max_grad_norm. Returns the
    step's mean loss, accuracy, reward gap and the gradient norm before clipping."""
    stats = dict.fromkeys(("loss", "accuracy", "reward_gap"), 0.0)
    for m, pairs in enumerate(micro_batches):
        inputs = model_inputs(pairs, pad_id, args, device)
        margin = torch.tensor([p["margin"] for p in pairs], device=device)
        if hasattr(model, "require_backward_grad_sync"):  # DDP all-reduces the gradients on the last micro-batch only
            model.require_backward_grad_sync = m == len(micro_batches) - 1  # (FSDP reduce-scatters every one's)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            r_chosen, r_rejected = model(**inputs).chunk(2)
        loss = reward_model_loss(r_chosen, r_rejected, margin, args.center_rewards_coefficient)
        # / accumulation: the summed gradients are the mean over this rank's pairs, and DDP/FSDP average the ranks',
        # so the step's gradient is that of the mean loss over the global batch (equal micro-batches)
        (loss / len(micro_batches)).backward()
        stats["loss"] += loss.item() / len(micro_batches)
        stats["accuracy"] += (r_chosen > r_rejected).float().mean().item() / len(micro_batches)
        stats["reward_gap"] += (r_chosen - r_rejected).mean().item() / len(micro_batches)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
    stats["grad_norm"] = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
    return stats


@torch.no_grad()
def evaluate(model, pairs, args, pad_id, device, rank, world):
    """(metrics (pair_metrics: of all pairs, and of each dataset of a mixture), per pair (r_chosen, r_rejected)), the
    pairs shared by the ranks; the model in evaluation mode (dropout is off anyway)."""
    training = model.training
    model.eval()
    rewards = all_pair_rewards(model, pairs, args, pad_id, device, rank, world)
    model.train(training)
    margin = torch.tensor([p["margin"] for p in pairs])
    return pair_metrics(rewards[:, 0], rewards[:, 1], margin, pairs, args, "eval/"), rewards


def fit_normalization(model, train, args, pad_id, device, rank, world):
    """--reward_normalization: reward_shift, the mean reward of 2048 training pairs drawn by seed (never eval pairs; its
    standard error under 1/45 of the rewards' std), with shift_scale reward_scale, their std; ppo.py reads (score -
    reward_shift) / reward_scale."""
    if args.reward_normalization == "none":
        return {"reward_shift": 0.0, "reward_scale": 1.0, "reward_normalization_fitted_on": None}
    rng = random.Random(common.seed_of(args.seed, "normalization"))
    pairs = rng.sample(train, min(2048, len(train)))
    fitted = evaluate(model, pairs, args, pad_id, device, rank, world)[0]
    return {"reward_shift": fitted["eval/reward_mean"],
            "reward_scale": fitted["eval/reward_std"] if args.reward_normalization == "shift_scale" else 1.0,
            "reward_normalization_fitted_on": f"{len(pairs)} training pairs"}


def schedule(args, n_train, global_batch, rank):
    """(steps per epoch, total steps, the steps after which to evaluate): --max_steps, else ceil(--num_train_epochs x
    (training pairs // global batch)), each epoch's leftover pairs (fewer than a global batch) left out of it."""
    steps_per_epoch = n_train // global_batch
    if steps_per_epoch == 0 and not args.eval_only:
        raise common.UserError(f"{n_train} training pairs are fewer than one global batch of {global_batch}")
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * max(steps_per_epoch, 1))
    evals_at = {math.ceil(k * total_steps / args.num_evals) for k in range(1, args.num_evals + 1)}
    if len(evals_at) < args.num_evals and not args.eval_only and rank == 0:
        print(f"--num_evals {args.num_evals}: {len(evals_at)}, one after each of the {total_steps} steps")
    return steps_per_epoch, total_steps, evals_at


def build_optimizer(model, args, total_steps):
    """AdamW on the trained parameters; transformers' --lr_scheduler_type after linear warm-up, to --lr_end where the
    schedule has an end rate."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=args.weight_decay, fused=True)
    end = {"polynomial": {"lr_end": args.lr_end, "power": 1.0},  # power 1: a linear decay to --lr_end
           "cosine_with_min_lr": {"min_lr": args.lr_end}, "cosine_warmup_with_min_lr": {"min_lr": args.lr_end},
           # the last fifth of the steps cools down (Hagele et al. 2024: a 20% cool-down matches cosine)
           "warmup_stable_decay": {"num_decay_steps": total_steps // 5,
                                   "min_lr_ratio": args.lr_end / args.learning_rate if args.learning_rate else 0.0}}
    try:
        scheduler = transformers.get_scheduler(
            args.lr_scheduler_type, optimizer, num_training_steps=total_steps,
            num_warmup_steps=args.warmup_steps or int(args.warmup_ratio * total_steps),
            scheduler_specific_kwargs=end.get(args.lr_scheduler_type))
    except (ValueError, TypeError) as e:  # e.g. polynomial's --lr_end not below --learning_rate
        raise common.UserError(f"--lr_scheduler_type {args.lr_scheduler_type}: {common.first_line(e)}") from None
    return optimizer, scheduler


def main(args):
    args, rank, world, device = start_up(args)  # arguments, sources and output folder checked, before any weight
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = micro * accumulation * world

    # 1. Model and data: preference pairs -> token ids (the same on every rank; each takes its slice of every batch).
    tokenizer = load_tokenizer(args.model_name_or_path)
    sharded = args.fsdp and world > 1  # then rank 0 loads the model, the others build it on the meta device
    hf_model, lora, args = load_reward_model(args, tokenizer, rank, on_meta=sharded and rank != 0)
    # pairs through truncate_pair; eval pairs: each dataset's eval split, else --eval_holdout of it by prompt (Args)
    train, evals, eval_sets = load_data(args, tokenizer, rank)
    steps_per_epoch, total_steps, evals_at = schedule(args, len(train), global_batch, rank)
    if not args.eval_only and common.run_complete(args, total_steps, rank):
        return None

    # 2. DDP or FSDP2; the batch layout: padded, or with --padding_free packed if checked equal on this model.
    model, layout = parallelize(RewardModel(hf_model), args, device), "padded (the default)"
    if args.padding_free:
        args, layout = choose_layout(model, args, len(tokenizer), rank)
    if args.eval_only:
        return evaluate_only(model, hf_model, evals, args, tokenizer, device, rank, world, layout, eval_sets)
    optimizer, scheduler = build_optimizer(model, args, total_steps)
    ckpt = common.resume_training(model, optimizer, scheduler, args.output_dir, args, world) if args.resume else None
    start_step = ckpt["step"] if ckpt else 0
    logger = common.Logger(args, args.wandb_project, start_step if args.resume else None) if rank == 0 else None
    describe_run(args, hf_model, lora, layout, optimizer, world, device, steps_per_epoch, total_steps, start_step, rank)

    # 3. Training loop: per step, one forward per micro-batch (chosen and rejected rows together), one optimizer step.
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
            ev = evaluate(model, evals, args, tokenizer.pad_token_id, device, rank, world)[0]
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
        ev = evaluate(model, evals, args, tokenizer.pad_token_id, device, rank, world)[0]

    # 5. Normalize (the training pairs' mean reward, in config.json: see fit_normalization) and save in HF format.
    normalization = fit_normalization(model, train, args, tokenizer.pad_token_id, device, rank, world)
    common.agreed(lambda: save_final(model, hf_model, lora, tokenizer, ev, logger, args, rank,
                                     dict(normalization, eval_sets=eval_sets)))  # a failing save ends every rank
    common.leave_together()  # (under torchrun: every rank done)
    return ev


# ===================================================== FENCE ========================================================
# The method ends here. Below: what a run calls, each piece trusted by its docstring, then the opt-in packed layout.


# --- Start-up checks, loading the model and the data. ----------------------------------------------------------------
def start_up(args):
    """Each check that can fail before a weight is read, in one line (arguments, sources, output folder); (rank, world
    size, device) from torchrun's variables, the ranks joined."""
    if args.eval_only and args.output_dir == Args.output_dir:  # never overwrite a trained model's own results
        args = dataclasses.replace(args, output_dir="runs/rm-eval")
    for name in ("max_length", "max_prompt_length", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "per_device_eval_batch_size", "logging_steps", "num_evals"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise common.UserError(f"--{name} {value}: must be at least 1")
    for name in ("learning_rate", "weight_decay", "num_train_epochs", "warmup_steps", "warmup_ratio", "lr_end",
                 "max_grad_norm", "center_rewards_coefficient", "save_steps", "head_init_std", "lora_r", "lora_alpha"):
        if (value := getattr(args, name)) is not None and not (value >= 0 and math.isfinite(value)):
            raise common.UserError(f"--{name} {value}: must be a finite number >= 0")
    if args.num_train_epochs == 0 and args.max_steps <= 0 and not args.eval_only:  # (below 0 or NaN: refused above)
        raise common.UserError(f"--num_train_epochs {args.num_train_epochs}: must be above 0 (or set --max_steps)")
    if not 0 < args.eval_holdout < 1:
        raise common.UserError(f"--eval_holdout {args.eval_holdout}: must be a fraction within (0, 1)")
    if args.eval_split == args.train_split and not args.eval_only:
        raise common.UserError(f"--eval_split {args.eval_split} is the --train_split: the evaluation would read the "
                               "pairs trained on; pass another split, or none to hold out --eval_holdout of them")
    if not args.warmup_ratio <= 1:
        raise common.UserError(f"--warmup_ratio {args.warmup_ratio}: must be within [0, 1]")
    if args.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy"):  # stepped with a metric, not by step count
        raise common.UserError(f"--lr_scheduler_type {args.lr_scheduler_type}: sets the rate from a metric, which "
                               "rm.py's loop, scheduled by steps, does not pass; pick one by steps (e.g. cosine)")
    common.check_source(args.model_name_or_path, "--model_name_or_path")
    for name, _ in common.mixture(args.dataset_mixer_list or [args.dataset_name, "1.0"]):
        common.check_source(name, "--dataset_mixer_list" if args.dataset_mixer_list else "--dataset_name", "dataset")
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    common.attention_without_nan(device)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # an hour, not 10 minutes: the ranks wait while rank 0 writes the final model (tens of GB at 7B)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
    common.check_shared_output_dir(args.output_dir, rank)
    common.check_output_dir(args, rank)
    return args, rank, world, device


def load_tokenizer(name):
    if name.startswith("embedded-"):
        return common.embedded_tokenizer()
    tok = common.load_pretrained(transformers.AutoTokenizer, name, "--model_name_or_path")
    if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:  # transformers pools at the last non-pad id
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    return tok


def load_backbone(args, tokenizer, on_meta=False):
    """(the sequence classifier, whether its head is new): float32 (bfloat16 would round AdamW's updates away; a frozen
    LoRA base: bfloat16 with --bf16), dropout off, an adapter folder merged in; on_meta: no weight read."""
    torch.manual_seed(args.seed)
    name, loader = args.model_name_or_path, transformers.AutoModelForSequenceClassification
    dtype = torch.bfloat16 if args.lora_r and args.bf16 else torch.float32
    if name.startswith("embedded-"):
        config = common.embedded_model_config(name, len(tokenizer), num_labels=1)
        model, needs_head = loader.from_config(config).to(dtype), True
    else:
        config = without_dropout(common.load_pretrained(transformers.AutoConfig, name, "--model_name_or_path"))
        # the head is the checkpoint's if it is a classifier, or an adapter folder holding the head (as rm.py saves)
        adapter = common.adapter_base(name) is not None
        needs_head = not (any(a.endswith("ForSequenceClassification") for a in config.architectures or []) or
                          adapter and common.adapter_holds_head(name))
        if needs_head and not (adapter or on_meta):  # (common.load_model builds those itself)
            cls = loader._model_mapping[type(config)]
            outside = [rf"^(?!{cls.base_model_prefix}\.)"]  # load report: a missing head is expected, not reported
            loader = type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_missing": outside,
                                                 "_keys_to_ignore_on_load_unexpected": outside})
        config.num_labels = 1
        model = common.load_model(loader, name, "--model_name_or_path", on_meta, config=config, dtype=dtype)
    if args.max_length:  # (the default is within the table: fill_defaults)
        common.check_position_table(model, args.max_length, f"--max_length {args.max_length}")
    disable_dropout(model)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    if needs_head and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"{name}: a new reward head (score, {model.config.hidden_size} -> 1) on its backbone")
    return model, needs_head


def load_data(args, tokenizer, rank):
    """(train pairs, eval pairs, what each dataset is evaluated on): its eval split whole (--eval_split, else
    validation, else test), else --eval_holdout of the pooled shares of the others, by prompt (hold_out_by_prompt)."""
    if args.max_length <= args.max_prompt_length:
        raise common.UserError(f"--max_prompt_length {args.max_prompt_length} must be below --max_length "
                               f"{args.max_length} to leave room for the responses")
    mixer = common.mixture(args.dataset_mixer_list or [args.dataset_name, "1.0"])
    names = " ".join(n for n, _ in mixer)
    fit = f"--max_length {args.max_length} with the prompt cut to --max_prompt_length {args.max_prompt_length}"
    train_rows, eval_rows, pool, eval_sets = [], [], [], {}
    for name, weight in mixer:
        tried = [args.eval_split] if args.eval_split else [s for s in ("validation", "test") if s != args.train_split]
        split, evals = next(((s, rows) for s in tried if (rows := common.load_rows(name, args.dataset_config, s))
                             is not None), (None, None))
        if args.eval_split and evals is None:
            raise common.UserError(f"{name}: no split {args.eval_split!r} (--eval_split); it has "
                                   f"{', '.join(map(repr, common.split_names(name, args.dataset_config)))}: pass one "
                                   "of them, or no --eval_split to hold out --eval_holdout of the training pairs")
        train = [] if args.eval_only and evals else common.load_rows(name, args.dataset_config, args.train_split)
        if not train and not (args.eval_only and evals):
            raise common.UserError(f"{name}: no rows in split '{args.train_split}'" + (
                f" nor {' or '.join(repr(s) for s in tried)}" if args.eval_only else "") + "; pass --train_split")
        if args.eval_only and evals is None:
            split, evals, train = args.train_split, train, []
        share = [dict(r, _dataset=name) for r in take_share(train, weight, args.seed)]
        (pool if evals is None else train_rows).extend(share)
        eval_rows += [dict(r, _dataset=name) for r in evals or []]
        eval_sets[name] = f"{args.eval_holdout:g} of its training pairs, held out by prompt" if evals is None else \
            f"split {split!r}"
    if pool:
        train_rows, held = hold_out_by_prompt(pool, args.eval_holdout, args.seed, tokenizer, train_rows)
        eval_rows += held
    train, dropped = tokenize_pairs(train_rows, tokenizer, args)
    if train_rows and dropped["too long"] > len(train_rows) / 2:
        raise common.UserError(f"{names}: {dropped['too long']} of {len(train_rows)} training pairs do not fit {fit}: "
                               "raise --max_length (or lower --max_prompt_length)")
    if train_rows and not train:
        raise common.UserError(f"{names}: all {len(train_rows)} training pairs were dropped: chosen and rejected are "
                               "identical token for token; check the data")
    evals, dropped_e = tokenize_pairs(eval_rows, tokenizer, args)
    if not evals:
        raise common.UserError(f"{names}: no evaluation pairs left after tokenization (--max_length "
                               f"{args.max_length}: {dropped_e['too long']} too long)")
    if rank == 0:
        count = collections.Counter(p["dataset"] for p in evals)
        for name, on in eval_sets.items():
            print(f"{name}: evaluating on {on} ({count[name]} pairs)")
        n = dropped + dropped_e
        print(f"pairs: {len(train)} train, {len(evals)} eval; prompts cut {n['prompt cut']}; dropped {n['too long']} "
              f"too long (past {fit}), {n['identical']} identical")
    return train, evals, eval_sets


def take_share(rows, weight, seed):  # a fraction (weight <= 1) or a count of the rows, drawn by seed
    n = int(round(weight * len(rows))) if weight <= 1 else int(weight)
    if n < len(rows):
        rows = list(rows)
        random.Random(seed).shuffle(rows)
    return rows[:n]


def hold_out_by_prompt(rows, fraction, seed, tokenizer, also_trained=()):
    """(train, eval): whole prompts drawn by seed go to eval until they hold `fraction` of the rows (common.hold_out).
    Their pairs in also_trained, other datasets' rows, leave training too. With one prompt in all, rows are drawn."""
    prompt = lambda row: common.split_pair(row, tokenizer, common.where(row))[0]  # noqa: E731
    keys = [prompt(r) for r in rows]
    keys = keys if len(set(keys)) > 1 else list(range(len(rows)))
    held = common.hold_out(keys, fraction, seed)
    train = [r for r, k in zip(rows, keys) if k not in held] + [r for r in also_trained if prompt(r) not in held]
    return train, [r for r, k in zip(rows, keys) if k in held]


def tokenize_pairs(rows, tokenizer, args):
    """(pairs: prompt/chosen/rejected ids, margin, dataset, gold rewards; counts of the prompts cut and of the pairs
    dropped, by reason), each through truncate_pair; the tokenizer's coverage checked first, on every row as read."""
    in_file_order = sorted(range(len(rows)), key=lambda i: (str(rows[i]["_source"]), rows[i]["_row"]))
    texts, margins = [None] * len(rows), [None] * len(rows)
    for i in in_file_order:  # the first bad row of a file is the one reported, however the rows were shuffled
        texts[i] = common.split_pair(rows[i], tokenizer, common.where(rows[i]))
        margin = rows[i].get("margin")  # a number, or text that reads as one (CSV cells); absent or empty: 0
        margins[i] = 0.0 if margin is None or margin == "" else common.as_number(margin)
        if isinstance(margin, bool) or not math.isfinite(margins[i]):
            raise common.UserError(f"{common.where(rows[i])}: field 'margin' is {margin!r}; expected a finite number")
    prompts = common.tokenize_prompts(tokenizer, [t[0] for t in texts])
    chosen = common.tokenize_responses(tokenizer, [t[0] for t in texts], [t[1] for t in texts])
    rejected = common.tokenize_responses(tokenizer, [t[0] for t in texts], [t[2] for t in texts])
    common.check_vocabulary(tokenizer, [p + c + r for p, c, r in zip(prompts, chosen, rejected)],
                            " ".join(dict.fromkeys(str(r.get("_dataset") or r["_source"]) for r in rows)),
                            args.model_name_or_path, "--model_name_or_path")
    bos_id, pairs, counts = common.leading_id(tokenizer), [], collections.Counter()
    for row, margin, p, c, r in zip(rows, margins, prompts, chosen, rejected):
        kept, why = truncate_pair(p, c, r, args.max_length, args.max_prompt_length, bos_id)
        if why or kept != p:
            counts[why or "prompt cut"] += 1
        if kept is not None:
            gold = (row["gold_chosen"], row["gold_rejected"]) if row.get("gold_chosen") is not None else None
            pairs.append({"prompt": kept, "chosen": c, "rejected": r, "margin": margin,
                          "dataset": row.get("_dataset"), "gold": gold})
    return pairs, counts


# --- Distributed: DDP or FSDP2, and evaluation shared by the ranks. --------------------------------------------------
def parallelize(model, args, device):
    """DDP, or FSDP2 per transformer block and input embeddings, filled with rank 0's weights; activations recomputed
    in the backward pass with --gradient_checkpointing."""
    if args.gradient_checkpointing:
        model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if not dist.is_initialized():
        return model.to(device)
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 is compute only: the sharded parameters, and so the optimizer's steps, stay in their own dtype
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else \
            MixedPrecisionPolicy()

        def shard(model):
            for block in next(m for m in model.modules()
                              if isinstance(m, torch.nn.ModuleList) and len(m) == model.hf.config.num_hidden_layers):
                fully_shard(block, mp_policy=mp)
            common.shard_input_embeddings(model, fully_shard, mp_policy=mp)
            if hasattr(model.hf, "score"):  # gathered in float32, not bfloat16: the head computes from float32 weights
                fully_shard(model.hf.score, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
            fully_shard(model, mp_policy=mp)

        return common.shard_from_rank0(model, shard, device)
    # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, not a second copy of them
    return torch.nn.parallel.DistributedDataParallel(
        model.to(device), device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
        gradient_as_bucket_view=True)


def all_pair_rewards(model, pairs, args, pad_id, device, rank, world):
    """Per pair (r_chosen, r_rejected), on CPU, in the pairs' order; each rank computes a slice, longest pairs first
    (a batch holds pairs of similar length, little padding; the peak memory comes first)."""
    order = sorted(range(len(pairs)), key=lambda i: -sum(len(pairs[i][k]) for k in ("prompt", "chosen", "rejected")))
    mine, per_rank = order[rank::world], math.ceil(len(pairs) / world)
    valid = torch.arange(per_rank, device=device) < len(mine)
    mine += [mine[0] if mine else 0] * (per_rank - len(mine))  # equal batch counts (FSDP's forward is collective)
    rewards, size = [], args.per_device_eval_batch_size
    for i in range(0, per_rank, size):
        inputs = model_inputs([pairs[j] for j in mine[i:i + size]], pad_id, args, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            rewards.append(torch.stack(model(**inputs).chunk(2), 1))
    index, rewards = torch.tensor(mine, device=device), torch.cat(rewards)
    if dist.is_initialized():  # every rank's slice
        index, valid, rewards = (torch.cat(dist.nn.functional.all_gather(t)) for t in (index, valid, rewards))
    return torch.empty(len(pairs), 2).index_copy_(0, index[valid].cpu(), rewards[valid].cpu())


# --- Evaluation metrics, logging and the final save. -----------------------------------------------------------------
def calibration_error(p_chosen, n_bins=10):
    """Expected calibration error of P(chosen wins): over bins of predictions, sum of (bin size / N) * |mean
    prediction - frequency it came true|; each pair counted in both orders, (p, won) and (1 - p, lost)."""
    p = torch.cat([p_chosen, 1 - p_chosen]).double()
    won = torch.cat([torch.ones_like(p_chosen), torch.zeros_like(p_chosen)]).double()
    bins = (p * n_bins).long().clamp(max=n_bins - 1)
    total = lambda x: torch.bincount(bins, weights=x, minlength=n_bins)  # noqa: E731
    return ((total(p) - total(won)).abs().sum() / len(p)).item()


def pearson(x, y):
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return (x * y).sum().item() / max(math.sqrt((x * x).sum().item() * (y * y).sum().item()), 1e-12)


def pair_metrics(rc, rr, margin, pairs, args, prefix):
    """The evaluation metrics of pairs from their rewards, each key prefixed; of a mixture's, each dataset's too."""
    lengths = torch.tensor([len(p["chosen"]) for p in pairs] + [len(p["rejected"]) for p in pairs], dtype=torch.float)
    loss = preference_loss(rc, rr, margin)
    metrics = {
        "accuracy": (rc > rr).float().mean().item(),  # (a tie counts as an error)
        "loss": reward_model_loss(rc, rr, margin, args.center_rewards_coefficient).item(),
        "preference_loss": loss.mean().item(),  # (without the centering)
        "reward_gap": (rc - rr).mean().item(), "chosen_reward": rc.mean().item(), "rejected_reward": rr.mean().item(),
        "reward_mean": torch.cat([rc, rr]).mean().item(), "reward_std": torch.cat([rc, rr]).std().item(),
        "calibration_error": calibration_error(torch.exp(-loss)),  # P(chosen wins) as the loss models it
        "length_correlation": pearson(torch.cat([rc, rr]), lengths),
    }
    known = torch.tensor([p["gold"] is not None for p in pairs])
    if known.any():  # embedded-task pairs (all, or some of a mixture): compare with the best possible accuracy
        gold, c, r = torch.tensor([p["gold"] for p in pairs if p["gold"] is not None]), rc[known], rr[known]
        p_gold = torch.sigmoid(common.PREFERENCE_BETA * (gold[:, 0] - gold[:, 1]))
        metrics["bayes_accuracy"] = torch.maximum(p_gold, 1 - p_gold).mean().item()
        metrics["accuracy_vs_bayes"] = (c > r).float().mean().item() / metrics["bayes_accuracy"]
        metrics["gold_correlation"] = pearson(torch.cat([c, r]), torch.cat([gold[:, 0], gold[:, 1]]))
    metrics = {prefix + k: v for k, v in metrics.items()}
    datasets = dict.fromkeys(p.get("dataset") for p in pairs)
    for name in datasets if len(datasets) > 1 else ():  # a mixture: each dataset's metrics too, PREFIX + NAME/...
        ours = torch.tensor([p.get("dataset") == name for p in pairs])
        metrics.update(pair_metrics(rc[ours], rr[ours], margin[ours], [p for p, o in zip(pairs, ours) if o], args,
                                    f"{prefix}{name}/"))
    return metrics


def describe_run(args, model, lora, layout, optimizer, world, device, steps_per_epoch, total_steps, start_step, rank):
    if rank != 0:
        return
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"model {args.model_name_or_path}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"{trained / 1e6:.2f}M trained{f' (LoRA rank {args.lora_r})' if lora else ''}; world size {world} "
          f"({device.type}, {'FSDP2' if args.fsdp and world > 1 else 'DDP' if world > 1 else 'single process'})\n"
          f"batch layout: {layout}\n{total_steps} steps ({total_steps / steps_per_epoch:.2f} epochs), lr "
          f"{optimizer.param_groups[0]['initial_lr']:g} ({args.lr_scheduler_type})" +
          (f"; resumed from step {start_step}" if start_step else "") +
          (" (at or past the total: the final evaluation and save remain)" if start_step >= total_steps else ""))


def log_train(logger, bar, window, step, steps_per_epoch, lr, global_batch, elapsed, device, world, **memory):
    """The statistics of the steps since the last log, averaged over them and over ranks, and the speed."""
    keys = ("loss", "accuracy", "reward_gap", "grad_norm")
    means = torch.tensor([sum(s[k] for s in window) / len(window) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(means)
    means /= world
    m = {"step": step, "epoch": step / steps_per_epoch, **{f"train/{k}": v for k, v in zip(keys, means.tolist())},
         "lr": lr, "perf/pairs_per_s": len(window) * global_batch / elapsed, **memory}
    if logger is not None:
        logger.log(m)
        bar.set_postfix(loss=f"{m['train/loss']:.4f}", acc=f"{m['train/accuracy']:.3f}")
        bar.write(common.format_metrics(m))


def save_final(model, hf_model, lora, tokenizer, ev, logger, args, rank, record):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    save_reward_model(hf_model, lora, {k.removeprefix("hf."): v for k, v in model_sd.items()}, tokenizer,
                      args.output_dir, record["reward_shift"], record["reward_scale"])
    logger.close()
    common.write_json_atomic(os.path.join(args.output_dir, "eval_results.json"), {
        **{k.removeprefix("eval/"): v for k, v in ev.items()}, **record, "args": dataclasses.asdict(args)})
    bayes = f" (Bayes-optimal {ev['eval/bayes_accuracy']:.4f}, ratio {ev['eval/accuracy_vs_bayes']:.3f})" \
        if "eval/bayes_accuracy" in ev else ""
    print(f"final eval accuracy {ev['eval/accuracy']:.4f}{bayes}; saved to {args.output_dir}")


def save_reward_model(hf_model, lora, state_dict, tokenizer, output_dir, shift, scale):
    """transformers' format (LoRA: merged, adapter in output_dir/adapter); a head without a bias cannot hold a shift, so
    config.json (and reward_normalization.json) holds it: reward = (score - reward_shift) / reward_scale, as ppo.py."""
    normalization = {"reward_shift": shift, "reward_scale": scale}
    if lora is not None:
        hf_model = common.save_lora(hf_model, lora, state_dict, tokenizer, output_dir)
        state_dict = hf_model.state_dict()
        common.write_json_atomic(os.path.join(output_dir, "adapter", "reward_normalization.json"), normalization)
    hf_model.config.update(normalization)
    hf_model.config.architectures = [type(hf_model).__name__]
    common.save_pretrained_atomic(hf_model, tokenizer, output_dir, state_dict=state_dict)


def evaluate_only(model, hf_model, evals, args, tokenizer, device, rank, world, layout, eval_sets):
    ev = evaluate(model, evals, args, tokenizer.pad_token_id, device, rank, world)[0]
    if rank == 0:
        shift, scale = getattr(hf_model.config, "reward_shift", 0.0), getattr(hf_model.config, "reward_scale", 1.0)
        os.makedirs(args.output_dir, exist_ok=True)
        common.write_json_atomic(os.path.join(args.output_dir, "eval_results.json"), {
            **{k.removeprefix("eval/"): v for k, v in ev.items()}, "num_pairs": len(evals), "reward_shift": shift,
            "reward_scale": scale, "normalized_reward_mean": (ev["eval/reward_mean"] - shift) / scale,
            "batch_layout": layout, "eval_sets": eval_sets, "args": dataclasses.asdict(args)})
        print(f"{common.format_metrics(ev)}\nevaluated {args.model_name_or_path} on {len(evals)} pairs; "
              f"eval_results.json in {args.output_dir}")
    common.leave_together()  # (under torchrun: every rank done)
    return ev


# === The opt-in packed layout (--padding_free): pairs end to end in one row, each prompt once, no padding. ==========
# segment_attention makes one SDPA call per block of consecutive pairs of at most this many tokens (a longer pair is a
# block alone): short pairs share a call, long ones pay only for their own length, never for the row's
BLOCK_TOKENS = 256


def pack_segments(pairs, device="cpu"):
    """(ids of one row, its segments): per pair prompt + chosen + rejected, end to end, rejected's positions continuing
    from the prompt's end (Wang et al. 2024, arXiv 2410.20305). `member` marks each sequence's tokens (chosen, then
    rejected), `read` its last (where its reward is read: last_token_index, as in the padded batch), `blocks` (start,
    end) whole pairs; segment_attention fills `masks` (each block's by window, built once) and `calls` (its windows)."""
    ids, positions, blocks = [], [], []
    member = torch.zeros(2 * len(pairs), sum(len(p["prompt"] + p["chosen"] + p["rejected"]) for p in pairs), dtype=bool)
    for i, p in enumerate(pairs):
        s, P, C, R = len(ids), len(p["prompt"]), len(p["chosen"]), len(p["rejected"])
        if not blocks or s + P + C + R - blocks[-1][0] > BLOCK_TOKENS:
            blocks.append([s, s])
        ids += p["prompt"] + p["chosen"] + p["rejected"]
        positions += list(range(P + C)) + list(range(P, P + R))
        blocks[-1][1] = len(ids)
        member[i, s:s + P + C] = member[len(pairs) + i, s:s + P] = member[len(pairs) + i, s + P + C:len(ids)] = True
    # a namespace, not a tuple or a dataclass: DDP and FSDP pass on copies of those, `masks` and `calls` with them
    return torch.tensor([ids]), SimpleNamespace(
        member=member, position=torch.tensor(positions, device=device), blocks=[tuple(b) for b in blocks],
        read=last_token_index(member).to(device), masks={}, calls=[])


def packed_rewards(hf_model, input_ids, segments):
    """A packed row's rewards (chosen, then rejected): the scalar head at each sequence's last token, under
    segment_attention (use_segment_attention, which choose_layout sets once checked)."""
    if hf_model.config._attn_implementation != "rm_segments":  # the model's own attention would cross pairs
        raise ValueError("a packed row needs the model's attention set by choose_layout")
    hidden = hf_model.base_model(input_ids=input_ids, position_ids=segments.position[None], use_cache=False,
                                 rm_segments=segments).last_hidden_state
    return hf_model.score(hidden[0, segments.read]).squeeze(-1).float()


def segment_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                      sliding_window=None, rm_segments=None, **kwargs):
    """Per block of whole pairs (pack_segments), one SDPA call under its mask: a token sees the earlier tokens of its
    own sequences (a rejected token the prompt, never a chosen one) within this layer's window; Gemma 2's softcap."""
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attention sinks")
    rm_segments.calls.append(sliding_window)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]  # query heads per key/value head (grouped-query attention)
    if groups > 1 and (softcap is not None or not sdpa_takes_groups_with_mask(query.device)):
        key, value = (t.repeat_interleave(groups, 1) for t in (key, value))
    out = []  # per block (1, heads, tokens, head dim), in the attention's dtype (autocast's, not the query's)
    for b, (s, e) in enumerate(rm_segments.blocks):  # slices stay 4D: 3D inputs miss the fused kernel on CPU
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        if (slot := (b, sliding_window)) not in rm_segments.masks:
            member, pos = rm_segments.member[:, s:e].to(query.device, torch.float32), rm_segments.position[s:e]
            behind = pos[:, None] - pos[None, :]  # transformers' sliding window: query i sees key j if i - j < window
            rm_segments.masks[slot] = (member.T @ member > 0) & (behind >= 0) & (behind < (sliding_window or math.inf))
        mask = rm_segments.masks[slot]
        if softcap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                               enable_gqa=q.shape[1] != k.shape[1])
        else:
            scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scaling / softcap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(v.dtype) @ v
        out.append(o)
    return torch.cat(out, 2).transpose(1, 2).contiguous(), None


def sdpa_takes_groups_with_mask(device):  # not on CUDA: with a boolean mask, grouped keys can fall to the math kernel
    return device.type != "cuda"


def use_segment_attention(hf_model):  # and no mask of transformers' own (a dense N x N one would go unread)
    transformers.AttentionInterface.register("rm_segments", segment_attention)
    transformers.AttentionMaskInterface.register("rm_segments", lambda *args, **kwargs: None)
    hf_model.config._attn_implementation = "rm_segments"


def declared_windows(config):  # each layer's sliding window (None: full attention)
    window = getattr(config, "sliding_window", None)  # (no layer_types: every layer its window, if any)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


@torch.no_grad()
def choose_layout(model, args, vocab_size, rank=0):
    """(args, layout) under --padding_free: packed if this model passes packed_layout_fault, else padded, and why. DDP:
    rank 0 checks its copy; FSDP: every rank its shards (the forward is collective), rank 0's verdict for all."""
    sharded, model = hasattr(model, "reshard"), getattr(model, "module", model)  # (DDP's module; FSDP is in place)
    why_not = [common.agreed(lambda: packed_layout_fault(model, args, vocab_size) if rank == 0 or sharded else None)]
    if sharded:
        model.reshard()  # (FSDP keeps the root's parameters gathered after a forward: the optimizer takes the shards)
    if dist.is_initialized():
        dist.broadcast_object_list(why_not, src=0)
    if why_not[0]:
        return dataclasses.replace(args, padding_free=False), f"padded: {why_not[0]}"
    use_segment_attention(model.hf)
    return dataclasses.replace(args, padding_free=True), "prefix-shared + packed: one row, attention per block of " \
        "pairs (--padding_free; rewards checked equal to padded ones)"


def packed_layout_fault(model, args, vocab_size):
    """Why the packed layout fails this model (None: it does not), on random pairs, 4 short and 2 longer than a block
    and the shortest sliding window: each layer must call segment_attention with its declared window, and the rewards
    must equal the padded batch's on the run's device and precision. Any error of the packed forward is a fault."""
    if not hasattr(model.hf, "score"):
        return "an encoder reads its pooled [CLS] over the whole sequence"
    if "position_ids" not in inspect.signature(model.hf.base_model.forward).parameters:
        return "the model takes no position ids (ALiBi or recurrent)"
    device, g = next(model.parameters()).device, torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(0, vocab_size, (k,), generator=g).tolist()  # noqa: E731
    windows, own, was_training = declared_windows(model.hf.config), model.hf.config._attn_implementation, model.training
    long = min(args.max_length or common.position_table(model.hf) or 2 * BLOCK_TOKENS,
               max([BLOCK_TOKENS] + [w + 8 for w in windows if w])) - 8
    sizes = [(3 + i, 2 + i % 3, 4 - i % 3) for i in range(4)] + [(long // 2, long // 2 - i, long // 4) for i in
                                                                 range(2 if long >= 16 else 0)]
    pairs = [{"prompt": ids(p), "chosen": ids(c), "rejected": ids(r), "margin": 0.0} for p, c, r in sizes]
    model.eval()
    low = args.bf16 or model.hf.dtype == torch.bfloat16  # a LoRA base held in bfloat16 runs under autocast too
    tol, why_not = 5e-2 if low else 1e-3, None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
        reference = model(**model_inputs(pairs, 0, dataclasses.replace(args, padding_free=False), device))
        try:  # whatever fails (a base model without the keyword, layers that drop it, odd head sizes): padded
            use_segment_attention(model.hf)
            inputs = model_inputs(pairs, 0, dataclasses.replace(args, padding_free=True), device)
            rewards = model(**inputs)
            if inputs["packed"].calls != windows:
                why_not = f"its layers called segment_attention with windows {inputs['packed'].calls}, not {windows}"
            elif not torch.allclose(rewards, reference, rtol=tol, atol=tol * reference.abs().max().item() + 1e-6):
                why_not = "its packed rewards differ from the padded batch's"
        except Exception as e:
            why_not = f"its forward fails on a packed row ({type(e).__name__}: {common.first_line(e)[:200]})"
    model.train(was_training)
    model.hf.config._attn_implementation = own
    return why_not


if __name__ == "__main__":
    common.exit_on_user_error(main, common.cli(Args))
