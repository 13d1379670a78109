"""Bradley-Terry reward modeling in one file.

    python rm.py                                   # embedded task, tiny model, CPU, a few minutes
    torchrun --nproc_per_node 2 rm.py              # the same on 2 processes (gloo on CPU, nccl on GPU)
    torchrun --nproc_per_node 8 rm.py --model_name_or_path EleutherAI/pythia-1b-deduped \
        --dataset_name Anthropic/hh-rlhf --bf16 --learning_rate 1e-5 --per_device_train_batch_size 8
    python rm.py --help                            # every option, documented

A reward model is a language model with a scalar head, read at the last real token of prompt + response. It learns to
make r(prompt, chosen) - r(prompt, rejected) large. The loss is -log sigmoid(r_c - r_r - margin), Bradley and Terry's
(1952) model as in Ouyang et al. (2022, eq. 1), with Touvron et al.'s (2023) margin and an optional centering term.
The method reads from here to the end of `main`. Below the FENCE are the parts a reader may trust by their docstrings,
then the opt-in packed layout of --padding_free. The README lists what is left out, such as other forms of this loss.
"""

import collections
import contextlib
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
    """Train a reward model on preference pairs (Bradley-Terry), or evaluate one with --eval_only."""

    # --- reward model
    center_rewards_coefficient: float = 0.0  # Weight of mean((r_c + r_r)^2), keeping rewards near 0 (Eisenstein 2023)
    head_init_std: float | None = None  # Std of a new head's weights (default: 1/sqrt(hidden_size + 1))
    # The normalization fitted on training pairs, saved beside the weights, which do not apply it: config.json's
    # reward_shift (the mean; none: 0) and reward_scale (shift_scale: the std; else 1), with LoRA also in
    # adapter/reward_normalization.json. A user of the model computes (score - reward_shift) / reward_scale, as ppo.py
    # does
    reward_normalization: Literal["none", "shift", "shift_scale"] = "shift"
    # --- model and data
    model_name_or_path: str = "embedded-llama"  # Hub model, local or peft adapter folder, or embedded-llama/-neox
    dataset_name: str = "embedded"  # Hub dataset, local .jsonl/.json/.parquet/.csv, gzipped or not, or `embedded`
    dataset_config: str | None = None  # Hub dataset configuration name
    dataset_mixer_list: list[str] = field(default_factory=list)  # NAME WEIGHT ...; weight <= 1: fraction, > 1: count
    train_split: str = "train"  # Split to train on
    eval_split: str | None = None  # Split to evaluate on (default: validation, else test, else held-out pairs)
    eval_holdout: float = 0.1  # Without an eval split, this fraction held out, by whole prompts never trained on
    max_length: int | None = None  # Max prompt + response tokens (default: min(512, the positions the model declares))
    # A floor, not a cap: a pair past --max_length has its prompt cut to what its longer response leaves, but not below
    # this, else the pair is dropped; a prompt is never cut otherwise (default: min(256, 3/4 of --max_length))
    min_prompt_length: int | None = None
    output_dir: str = "runs/rm"  # Folder of the model, tokenizer, metrics.jsonl, eval_results.json and checkpoints
    # --- optimisation
    learning_rate: float | None = None  # AdamW learning rate (default: 1e-5; 1e-3 for the embedded models)
    weight_decay: float = 0.0  # AdamW weight decay
    num_train_epochs: float | None = None  # Passes over the pairs (default: 1; 3 for the embedded models)
    max_steps: int = -1  # Total optimizer steps, overriding --num_train_epochs when above 0
    per_device_train_batch_size: int = 32  # Pairs per device per micro-step
    gradient_accumulation_steps: int = 1  # Micro-steps per optimizer step; global batch = per-device x this x ranks
    per_device_eval_batch_size: int = 32  # Pairs per device per evaluation forward
    # Learning rate schedule after warm-up; constant takes no warm-up, constant_with_warmup does
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "inverse_sqrt",
        "constant_with_warmup",
        "cosine_with_min_lr",
        "cosine_warmup_with_min_lr",
        "warmup_stable_decay",
    ] = "cosine"
    lr_end: float = 0.0  # Final learning rate of polynomial, cosine_*min_lr and warmup_stable_decay
    warmup_steps: int = 0  # Linear warm-up steps, overriding --warmup_ratio when above 0
    warmup_ratio: float = 0.05  # Warm-up as a fraction of the total steps
    max_grad_norm: float = 1.0  # Gradient clipping norm; 0 disables clipping
    seed: int = 1  # Seed of the head, data order, hold-out, mixture shares and the normalization sample
    # --- LoRA, through peft
    lora_r: int = 0  # LoRA rank on the backbone's linear layers, 0 for none (Hu et al. 2021)
    lora_alpha: float = 16.0  # LoRA scale: an adapter adds (lora_alpha / lora_r) * B A to its layer
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # Names or suffixes of layers
    # --- evaluation, logging, checkpoints
    num_evals: int = 5  # Evaluations evenly spread over training, the last at its end
    logging_steps: int = 50  # Log train metrics every this many steps
    save_steps: int | None = None  # Checkpoint every this many steps, 0 for never (default: every 30 minutes)
    resume: bool = False  # Continue from the latest checkpoint in --output_dir, on any number of ranks
    overwrite_output_dir: bool = False  # Allow training afresh in an --output_dir that holds a run or checkpoints
    track: bool = False  # Log to Weights & Biases, also with WANDB_MODE=offline
    tensorboard: bool = False  # Also write every logged metric as TensorBoard events to --output_dir/tensorboard
    wandb_project: str = "rlhf-rm"  # Weights & Biases project
    run_name: str | None = None  # Run name for Weights & Biases (default: its own)
    eval_only: bool = False  # Evaluate --model_name_or_path on the eval split, or every pair if none, without training
    # --- systems
    padding_free: bool = False  # Pack pairs into one row, each prompt once, if this model passes the check at start-up
    fsdp: bool = False  # Shard parameters, gradients and optimizer state per block with FSDP2, not DDP
    bf16: bool = False  # bfloat16 autocast; weights and optimizer state stay float32, a frozen LoRA base bfloat16
    gradient_checkpointing: bool = False  # Recompute activations in the backward pass to save memory


# --- The math. -------------------------------------------------------------------------------------------------------
def preference_loss(r_chosen, r_rejected, margin):
    """Returns each pair's Bradley-Terry negative log-likelihood with Llama 2's margin (Touvron et al. 2023, eq. 2).
    logsigmoid keeps it exact at any gap. Another pair loss would go here."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)


def reward_model_loss(r_chosen, r_rejected, margin, center_coefficient=0.0):
    """Returns the mean preference loss plus center_coefficient * mean((r_c + r_r)^2) (Eisenstein et al. 2023)."""
    return (
        preference_loss(r_chosen, r_rejected, margin).mean()
        + center_coefficient * ((r_chosen + r_rejected) ** 2).mean()
    )


# --- Conventions shared with ppo.py; tests/test_rm.py checks that they agree. ----------------------------------------
# The reward's token is decided by common.tokenize_responses' final EOS, load_tokenizer's pad and last_token_index.
def truncate_prompt(ids, max_prompt_length, bos_id=None):
    """Cuts a prompt past max_prompt_length to its end, the turn being answered, keeping a leading BOS or [CLS]."""
    if len(ids) <= max_prompt_length:
        return ids
    keep = 1 if bos_id is not None and ids and ids[0] == bos_id else 0
    return ids[:keep] + ids[len(ids) - max_prompt_length + keep :]


def truncate_pair(prompt, chosen, rejected, max_length, min_prompt_length, bos_id=None):
    """Returns (prompt ids, None), or (None, why the pair is dropped). Responses are never cut, even at an inner EOS.
    A cut one would lose its EOS, and its reward would be read at a token never trained on; TRL and open-instruct drop
    such pairs too. A pair past max_length has its prompt cut to fit, keeping at least min_prompt_length tokens of it.
    A pair that cannot fit is dropped as "too long", and load_data stops the run if over half the training pairs are.
    A pair whose responses are the same tokens states no preference, and is dropped as "identical"."""
    if chosen == rejected:
        return None, "identical"
    longest = max(len(chosen), len(rejected))
    if min(len(prompt), min_prompt_length) + longest > max_length:
        return None, "too long"
    return truncate_prompt(prompt, max_length - longest, bos_id), None


def last_token_index(mask):
    """Returns the index of each row's last real token, where its reward is read, in every layout. It is the EOS that
    ends the response, after any EOS inside it. The index comes from the mask, not the ids, as a pad id may equal the
    EOS id. transformers' own classifiers look in the ids for the last token that is not a pad. So load_tokenizer gives
    such a tokenizer a pad token of its own. The saved model then reads the same token when transformers runs it."""
    return (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(1)


def sequence_reward(model, ids, mask):
    """Returns a padded batch's rewards: a decoder's scalar head at each row's last real token, or an encoder's pooled
    head. Position ids count real tokens only. So a row's reward is the same right padded, as rm.py pads, or left
    padded, as ppo.py's prompts are."""
    if not hasattr(model, "score"):  # BERT, RoBERTa and DeBERTa have a pooled `classifier`
        return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    hidden = model.base_model(
        input_ids=ids, attention_mask=mask, use_cache=False, position_ids=(mask.cumsum(1) - 1).clamp(min=0)
    ).last_hidden_state  # ALiBi ignores them
    return model.score(hidden[torch.arange(len(ids), device=ids.device), last_token_index(mask)]).squeeze(-1).float()


def without_dropout(config):
    """Returns the config with dropout off, so that a pair's two passes see one network. Every dropout probability
    becomes 0, since some models, such as OPT, call F.dropout with it. So do layer drop and MoE routers' jitter."""
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
    """Draws a new head's weights from N(0, std^2); encoders keep their pooled head. The default std,
    1/sqrt(hidden_size + 1), makes the first rewards of order 1, as in Ziegler et al. (2019)'s code. Every head
    computes in float32, since a bfloat16 reward moves in steps of 1/128 of its size."""
    if hasattr(model, "score"):
        torch.nn.init.normal_(model.score.weight, std=std)


def load_reward_model(args, tokenizer, rank=0, on_meta=False):
    """Returns (the sequence classifier, its peft model with --lora_r, args with the model's defaults filled). It gets a
    new head if the start has no trained one, like a causal LM or an SFT model. LoRA adapts the backbone, and the head
    is trained in full."""
    hf_model, needs_head = load_backbone(args, tokenizer, on_meta)
    args = fill_defaults(args, hf_model, rank)
    if needs_head:
        new_head(hf_model, args.head_init_std)
    hf_model = common.scalar_head_in_float32(hf_model)
    return hf_model, common.add_lora(hf_model, args, "SEQ_CLS") if args.lora_r and not args.eval_only else None, args


# --- The batch, the model, one training step, evaluation. ------------------------------------------------------------
def collate(pairs, pad_id):
    """Returns the padded batch: 2B right-padded rows, the chosen sequences then the rejected ones. One pass over them
    equals two, because rows never attend to each other and dropout is off."""
    seqs = [p["prompt"] + p["chosen"] for p in pairs] + [p["prompt"] + p["rejected"] for p in pairs]
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


def model_inputs(pairs, pad_id, args, device="cpu"):
    """Returns the model's inputs for B pairs, by name; the model returns the B chosen rewards, then the B rejected.
    The batch is padded, or with --padding_free a packed row that choose_layout checked."""
    if args.padding_free:
        ids, segments = pack_segments(pairs, device)
        return {"input_ids": ids.to(device), "packed": segments}
    ids, mask = collate(pairs, pad_id)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


class RewardModel(torch.nn.Module):
    """The module DDP and FSDP wrap. It returns the rewards of a padded batch or of a packed row."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, attention_mask=None, packed=None):
        return (
            sequence_reward(self.hf, input_ids, attention_mask)
            if packed is None
            else packed_rewards(self.hf, input_ids, packed)
        )


def train_step(model, micro_batches, args, pad_id, device):
    """Runs the forward and backward passes of one optimizer step and clips the gradients to --max_grad_norm. Returns
    the step's mean loss, accuracy and reward gap, and the gradient norm before clipping. Dividing each loss by the
    number of micro-batches gives the gradient of the mean loss, which DDP and FSDP average over the ranks."""
    stats = dict.fromkeys(("loss", "accuracy", "reward_gap"), 0.0)
    for m, pairs in enumerate(micro_batches):
        inputs = model_inputs(pairs, pad_id, args, device)
        margin = torch.tensor([p["margin"] for p in pairs], device=device)
        # DDP all-reduces the summed gradients in the last backward only. FSDP2 reduce-scatters each backward's:
        # skipping it (set_requires_gradient_sync) would keep whole unsharded gradients on every rank.
        sync = m == len(micro_batches) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                r_chosen, r_rejected = model(**inputs).chunk(2)
            loss = reward_model_loss(r_chosen, r_rejected, margin, args.center_rewards_coefficient)
            (loss / len(micro_batches)).backward()
        stats["loss"] += loss.item() / len(micro_batches)
        stats["accuracy"] += (r_chosen > r_rejected).float().mean().item() / len(micro_batches)
        stats["reward_gap"] += (r_chosen - r_rejected).mean().item() / len(micro_batches)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
    stats["grad_norm"] = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
    return stats


@torch.no_grad()
def evaluate(model, pairs, args, pad_id, device, rank, world):
    """Returns the pairs' metrics and each pair's (r_chosen, r_rejected). The ranks divide the pairs between them, and
    each rank returns all of them. The model runs in evaluation mode, though dropout is off anyway."""
    training = model.training
    model.eval()
    rewards = all_pair_rewards(model, pairs, args, pad_id, device, rank, world)
    model.train(training)
    margin = torch.tensor([p["margin"] for p in pairs])
    return pair_metrics(rewards[:, 0], rewards[:, 1], margin, pairs, args, "eval/"), rewards


def pair_metrics(rc, rr, margin, pairs, args, prefix):
    """Returns the evaluation metrics of pairs from their rewards, each key prefixed, and of each dataset of a mixture.
    A tie counts as an error. The calibration is that of the model's P(chosen wins) = sigmoid(r_c - r_r), without the
    margin. Embedded-task pairs know their gold rewards, so they are also compared with the best possible accuracy."""
    lengths = torch.tensor([len(p["chosen"]) for p in pairs] + [len(p["rejected"]) for p in pairs], dtype=torch.float)
    metrics = {
        "accuracy": (rc > rr).float().mean().item(),
        "loss": reward_model_loss(rc, rr, margin, args.center_rewards_coefficient).item(),
        "preference_loss": preference_loss(rc, rr, margin).mean().item(),  # without the centering
        "reward_gap": (rc - rr).mean().item(),
        "chosen_reward": rc.mean().item(),
        "rejected_reward": rr.mean().item(),
        "reward_mean": torch.cat([rc, rr]).mean().item(),
        "reward_std": torch.cat([rc, rr]).std().item(),
        "calibration_error": calibration_error(torch.sigmoid(rc - rr)),
        "length_correlation": pearson(torch.cat([rc, rr]), lengths),
    }
    known = torch.tensor([p["gold"] is not None for p in pairs])
    if known.any():
        gold, c, r = torch.tensor([p["gold"] for p in pairs if p["gold"] is not None]), rc[known], rr[known]
        p_gold = torch.sigmoid(common.PREFERENCE_BETA * (gold[:, 0] - gold[:, 1]))
        metrics["bayes_accuracy"] = torch.maximum(p_gold, 1 - p_gold).mean().item()
        metrics["accuracy_vs_bayes"] = (c > r).float().mean().item() / metrics["bayes_accuracy"]
        metrics["gold_correlation"] = pearson(torch.cat([c, r]), torch.cat([gold[:, 0], gold[:, 1]]))
    metrics = {prefix + k: v for k, v in metrics.items()}
    datasets = dict.fromkeys(p.get("dataset") for p in pairs)
    for name in datasets if len(datasets) > 1 else ():  # keys PREFIX + NAME/...
        ours = torch.tensor([p.get("dataset") == name for p in pairs])
        metrics.update(
            pair_metrics(
                rc[ours], rr[ours], margin[ours], [p for p, o in zip(pairs, ours) if o], args, f"{prefix}{name}/"
            )
        )
    return metrics


def calibration_error(p_chosen, n_bins=10):
    """Returns the expected calibration error of P(chosen wins): over bins of predictions, the sum of (bin size / N) *
    |mean prediction - frequency it came true|. Each pair counts in both orders, as (p, won) and (1 - p, lost)."""
    p = torch.cat([p_chosen, 1 - p_chosen]).double()
    won = torch.cat([torch.ones_like(p_chosen), torch.zeros_like(p_chosen)]).double()
    bins = (p * n_bins).long().clamp(max=n_bins - 1)
    total = lambda x: torch.bincount(bins, weights=x, minlength=n_bins)  # noqa: E731
    return ((total(p) - total(won)).abs().sum() / len(p)).item()


def pearson(x, y):
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return (x * y).sum().item() / max(math.sqrt((x * x).sum().item() * (y * y).sum().item()), 1e-12)


def fit_normalization(model, train, args, pad_id, device, rank, world):
    """Returns the reward normalization that ppo.py applies as (score - reward_shift) / reward_scale, and its count.
    reward_shift is the mean reward of 2048 training pairs drawn by seed, or of all if fewer, never eval pairs. Its
    standard error is under std/sqrt(n) on n pairs, 1/45 of the std at 2048. shift_scale makes reward_scale the std."""
    if args.reward_normalization == "none":
        return {"reward_shift": 0.0, "reward_scale": 1.0, "reward_normalization_fitted_on": None}
    rng = random.Random(common.seed_of(args.seed, "normalization"))
    pairs = rng.sample(train, min(2048, len(train)))
    fitted = evaluate(model, pairs, args, pad_id, device, rank, world)[0]
    return {
        "reward_shift": fitted["eval/reward_mean"],
        "reward_scale": fitted["eval/reward_std"] if args.reward_normalization == "shift_scale" else 1.0,
        "reward_normalization_fitted_on": f"{len(pairs)} training pairs",
    }


def main(args):
    args, rank, world, device = start_up(args)
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    global_batch = micro * accumulation * world

    # 1. The model and the pairs. A dataset is evaluated on its eval split, else on --eval_holdout held out by prompt.
    tokenizer = load_tokenizer(args.model_name_or_path)
    sharded = args.fsdp and world > 1  # then only rank 0 reads the weights; the others use the meta device
    hf_model, lora, args = load_reward_model(args, tokenizer, rank, on_meta=sharded and rank != 0)
    train, evals, eval_sets = load_data(args, tokenizer, rank)
    steps_per_epoch, total_steps, evals_at = schedule(args, len(train), global_batch, rank)
    if not args.eval_only and common.run_complete(args, total_steps, rank):
        return None

    # 2. DDP or FSDP2. With --padding_free, the batch is packed if this model's rewards match the padded ones.
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

    # 3. Training: per step, one forward per micro-batch, chosen and rejected rows together, then an optimizer step.
    model.train()
    bar = tqdm(range(start_step, total_steps), disable=rank != 0, initial=start_step, total=total_steps, desc="rm")
    window, t_window, t_saved, ev = [], time.time(), time.time(), None
    common.stop_on_signals()
    for step in bar:
        epoch, offset = divmod(step, steps_per_epoch)
        if step == start_step or offset == 0:  # the order depends on seed and epoch only, so a run resumes anywhere
            order = torch.randperm(
                len(train), generator=torch.Generator().manual_seed(common.seed_of(args.seed, "epoch order", epoch))
            ).tolist()
        batch = order[offset * global_batch : (offset + 1) * global_batch]
        mine = batch[rank * micro * accumulation : (rank + 1) * micro * accumulation]  # this rank's slice
        stats = train_step(
            model,
            [[train[i] for i in mine[m * micro : (m + 1) * micro]] for m in range(accumulation)],
            args,
            tokenizer.pad_token_id,
            device,
        )
        if not math.isfinite(stats["grad_norm"]):  # stopping before the step keeps the last checkpoint good
            raise common.UserError(
                f"step {step + 1}: the gradient norm is {stats['grad_norm']} (loss "
                f"{stats['loss']:.4g}); training diverged: lower --learning_rate; --resume "
                f"continues from the last checkpoint in {args.output_dir}"
            )
        optimizer.step()
        lr = scheduler.get_last_lr()[0]  # the rate this step used
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(stats)
        if step == start_step:  # each rank's peak memory goes in the first log
            memory = common.peak_memory(device)

        # 4. Log, evaluate and checkpoint. The logged speed leaves out evaluations and saves.
        done = step + 1
        if done % args.logging_steps == 0 or done == total_steps:
            log_train(
                logger,
                bar,
                window,
                done,
                steps_per_epoch,
                lr,
                global_batch,
                time.time() - t_window,
                device,
                world,
                **memory,
            )
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
    if ev is None:  # a run resumed at its end ran no step, so no evaluation either
        ev = evaluate(model, evals, args, tokenizer.pad_token_id, device, rank, world)[0]

    # 5. Fit the reward normalization and save in transformers' format.
    normalization = fit_normalization(model, train, args, tokenizer.pad_token_id, device, rank, world)
    common.agreed(
        lambda: save_final(
            model, hf_model, lora, tokenizer, ev, logger, args, rank, dict(normalization, eval_sets=eval_sets)
        )
    )  # a failing save ends every rank
    common.leave_together()
    return ev


# ===================================================== FENCE ========================================================
# The method ends here. Below are the parts a run calls, each trusted by its docstring, then the opt-in packed layout.


# --- Start-up checks, loading the model and the data. ----------------------------------------------------------------
def start_up(args):
    """Returns (args, rank, world size, device) from torchrun's variables, the ranks joined. Every check that can fail
    before a weight is read comes first, each in one line: arguments, sources and the output folder."""
    if args.eval_only and args.output_dir == Args.output_dir:  # never overwrite a trained model's results
        args = dataclasses.replace(args, output_dir="runs/rm-eval")
    for name in (
        "max_length",
        "min_prompt_length",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "per_device_eval_batch_size",
        "logging_steps",
        "num_evals",
    ):
        if (value := getattr(args, name)) is not None and value < 1:
            raise common.UserError(f"--{name} {value}: must be at least 1")
    for name in (
        "learning_rate",
        "weight_decay",
        "num_train_epochs",
        "warmup_steps",
        "warmup_ratio",
        "lr_end",
        "max_grad_norm",
        "center_rewards_coefficient",
        "save_steps",
        "head_init_std",
        "lora_r",
        "lora_alpha",
    ):
        if (value := getattr(args, name)) is not None and not (value >= 0 and math.isfinite(value)):
            raise common.UserError(f"--{name} {value}: must be a finite number >= 0")
    if args.num_train_epochs == 0 and args.max_steps <= 0 and not args.eval_only:  # below 0 or NaN was refused above
        raise common.UserError(f"--num_train_epochs {args.num_train_epochs}: must be above 0 (or set --max_steps)")
    if not 0 < args.eval_holdout < 1:
        raise common.UserError(f"--eval_holdout {args.eval_holdout}: must be a fraction within (0, 1)")
    if args.eval_split == args.train_split and not args.eval_only:
        raise common.UserError(
            f"--eval_split {args.eval_split} is the --train_split: the evaluation would read the "
            "pairs trained on; pass another split, or none to hold out --eval_holdout of them"
        )
    if not args.warmup_ratio <= 1:
        raise common.UserError(f"--warmup_ratio {args.warmup_ratio}: must be within [0, 1]")
    common.check_source(args.model_name_or_path, "--model_name_or_path")
    for name, _ in common.mixture(args.dataset_mixer_list or [args.dataset_name, "1.0"]):
        common.check_source(name, "--dataset_mixer_list" if args.dataset_mixer_list else "--dataset_name", "dataset")
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    common.attention_without_nan(device)
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # An hour, not 10 minutes: the ranks wait while rank 0 writes the final model, tens of GB at 7B.
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(hours=1))
    common.check_shared_output_dir(args.output_dir, rank)
    common.check_output_dir(args, rank)
    return args, rank, world, device


def load_tokenizer(name):
    if name.startswith("embedded-"):
        return common.embedded_tokenizer()
    tok = common.load_pretrained(transformers.AutoTokenizer, name, "--model_name_or_path")
    if tok.pad_token is None or tok.pad_token_id == tok.eos_token_id:  # see last_token_index
        tok.add_special_tokens({"pad_token": "<|pad|>"})
    return tok


def load_backbone(args, tokenizer, on_meta=False):
    """Returns (the sequence classifier, whether its head is new), dropout off and an adapter folder merged in. Weights
    are float32, since bfloat16 would round AdamW's updates away; a frozen LoRA base is bfloat16 with --bf16."""
    torch.manual_seed(args.seed)
    name, loader = args.model_name_or_path, transformers.AutoModelForSequenceClassification
    dtype = torch.bfloat16 if args.lora_r and args.bf16 else torch.float32
    if name.startswith("embedded-"):
        config = common.embedded_model_config(name, len(tokenizer), num_labels=1)
        model, needs_head = loader.from_config(config).to(dtype), True
    else:
        config = without_dropout(common.load_pretrained(transformers.AutoConfig, name, "--model_name_or_path"))
        # The head comes from the checkpoint if it is a classifier, or an adapter folder that holds one, as rm.py saves.
        adapter = common.adapter_base(name) is not None
        needs_head = not (
            any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
            or adapter
            and common.adapter_holds_head(name)
        )
        if needs_head and not (adapter or on_meta):  # common.load_model builds those itself
            cls = loader._model_mapping[type(config)]
            outside = [rf"^(?!{cls.base_model_prefix}\.)"]  # the load report leaves out the new head
            loader = type(
                cls.__name__,
                (cls,),
                {"_keys_to_ignore_on_load_missing": outside, "_keys_to_ignore_on_load_unexpected": outside},
            )
        config.num_labels = 1
        model = common.load_model(loader, name, "--model_name_or_path", on_meta, config=config, dtype=dtype)
    if args.max_length:  # a default is fitted to the positions instead, in fill_defaults
        common.check_position_table(model, args.max_length, f"--max_length {args.max_length}")
    disable_dropout(model)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.pad_token_id = tokenizer.pad_token_id
    if needs_head and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"{name}: a new reward head (score, {model.config.hidden_size} -> 1) on its backbone")
    return model, needs_head


def fill_defaults(args, model, rank=0):
    """Returns args with the defaults that depend on the model, and prints them. Pretrained models train 1 epoch, as
    InstructGPT and Llama 2 do, since they overfit after one. The embedded models start from scratch and need more."""
    embedded = args.model_name_or_path.startswith("embedded-")
    positions, key = common.declared_positions(model.config)
    max_length = args.max_length or min(512, positions or 512)
    if max_length < 512 and not args.max_length and rank == 0:
        print(f"--max_length {max_length}: the positions the model declares ({key}), fewer than the default 512")
    head = getattr(model, "score", None)
    filled = {
        "learning_rate": 1e-3 if embedded else 1e-5,
        "num_train_epochs": 3.0 if embedded else 1.0,
        "max_length": max_length,
        "min_prompt_length": min(256, max_length * 3 // 4),
        "head_init_std": 1 / math.sqrt(head.in_features + 1) if head is not None else None,
    }
    filled = {k: v for k, v in filled.items() if getattr(args, k) is None and v is not None}
    if filled and rank == 0:
        print("defaults for this model: " + ", ".join(f"--{k} {v:.4g}" for k, v in filled.items()))
    return dataclasses.replace(args, **filled)


def load_data(args, tokenizer, rank):
    """Returns (train pairs, eval pairs, what each dataset is evaluated on). A dataset is evaluated on its eval split:
    --eval_split, else validation, else test. The rest hold out --eval_holdout of their pooled shares, by prompt."""
    if args.max_length <= args.min_prompt_length:
        raise common.UserError(
            f"--min_prompt_length {args.min_prompt_length} must be below --max_length "
            f"{args.max_length} to leave room for the responses"
        )
    mixer = common.mixture(args.dataset_mixer_list or [args.dataset_name, "1.0"])
    names = " ".join(n for n, _ in mixer)
    fit = f"--max_length {args.max_length} with the prompt cut to --min_prompt_length {args.min_prompt_length} tokens"
    train_rows, eval_rows, pool, eval_sets = [], [], [], {}
    for name, weight in mixer:
        tried = [args.eval_split] if args.eval_split else [s for s in ("validation", "test") if s != args.train_split]
        split, evals = next(
            ((s, rows) for s in tried if (rows := common.load_rows(name, args.dataset_config, s)) is not None),
            (None, None),
        )
        if args.eval_split and evals is None:
            raise common.UserError(
                f"{name}: no split {args.eval_split!r} (--eval_split); it has "
                f"{', '.join(map(repr, common.split_names(name, args.dataset_config)))}: pass one "
                "of them, or no --eval_split to hold out --eval_holdout of the training pairs"
            )
        train = [] if args.eval_only and evals else common.load_rows(name, args.dataset_config, args.train_split)
        if not train and not (args.eval_only and evals):
            raise common.UserError(
                f"{name}: no rows in split '{args.train_split}'"
                + (f" nor {' or '.join(repr(s) for s in tried)}" if args.eval_only else "")
                + "; pass --train_split"
            )
        if args.eval_only and evals is None:
            split, evals, train = args.train_split, train, []
        share = [dict(r, _dataset=name) for r in take_share(train, weight, args.seed, name)]
        (pool if evals is None else train_rows).extend(share)
        eval_rows += [dict(r, _dataset=name) for r in evals or []]
        eval_sets[name] = (
            f"{args.eval_holdout:g} of its training pairs, held out by prompt" if evals is None else f"split {split!r}"
        )
    if pool:
        train_rows, held = hold_out_by_prompt(pool, args.eval_holdout, args.seed, tokenizer, train_rows)
        eval_rows += held
    train, dropped = tokenize_pairs(train_rows, tokenizer, args)
    if train_rows and dropped["too long"] > len(train_rows) / 2:
        raise common.UserError(
            f"{names}: {dropped['too long']} of {len(train_rows)} training pairs do not fit {fit}: "
            "raise --max_length (or lower --min_prompt_length)"
        )
    if train_rows and not train:
        raise common.UserError(
            f"{names}: all {len(train_rows)} training pairs were dropped: chosen and rejected are "
            "identical token for token; check the data"
        )
    evals, dropped_e = tokenize_pairs(eval_rows, tokenizer, args)
    if not evals:
        raise common.UserError(
            f"{names}: no evaluation pairs left after tokenization (--max_length "
            f"{args.max_length}: {dropped_e['too long']} too long)"
        )
    if rank == 0:
        count = collections.Counter(p["dataset"] for p in evals)
        for name, on in eval_sets.items():
            print(f"{name}: evaluating on {on} ({count[name]} pairs)")
        n = dropped + dropped_e
        print(
            f"pairs: {len(train)} train, {len(evals)} eval; prompts cut {n['prompt cut']}; dropped {n['too long']} "
            f"too long (past {fit}), {n['identical']} identical; kept whole with an EOS inside a response "
            f"{n['inner EOS']}"
        )
    return train, evals, eval_sets


def take_share(rows, weight, seed, name="the dataset"):  # a fraction of the rows if weight <= 1, else a count
    n = int(round(weight * len(rows))) if weight <= 1 else int(weight)
    if 0 < len(rows) < n:  # --eval_only may pass no rows
        raise common.UserError(
            f"--dataset_mixer_list asks for {n} rows of {name}, but its training split has "
            f"{len(rows)}; ask for at most {len(rows)}, or 1.0 for all of them"
        )
    if n < len(rows):
        rows = list(rows)
        random.Random(seed).shuffle(rows)
    return rows[:n]


def hold_out_by_prompt(rows, fraction, seed, tokenizer, also_trained=()):
    """Returns (train, eval). Whole prompts drawn by seed are held out until they hold `fraction` of the rows. Their
    pairs in also_trained, other datasets' rows, leave training too. If all rows share one prompt, rows are drawn."""
    prompt = lambda row: common.split_pair(row, tokenizer, common.where(row))[0]  # noqa: E731
    keys = [prompt(r) for r in rows]
    keys = keys if len(set(keys)) > 1 else list(range(len(rows)))
    held = common.hold_out(keys, fraction, seed)
    train = [r for r, k in zip(rows, keys) if k not in held] + [r for r in also_trained if prompt(r) not in held]
    return train, [r for r, k in zip(rows, keys) if k in held]


def tokenize_pairs(rows, tokenizer, args):
    """Returns the pairs, each through truncate_pair, and the counts of prompts cut and of pairs dropped by reason. It
    also counts kept pairs with an EOS inside a response. The tokenizer's coverage is checked first, on every row."""
    in_file_order = sorted(range(len(rows)), key=lambda i: (str(rows[i]["_source"]), rows[i]["_row"]))
    texts, margins = [None] * len(rows), [None] * len(rows)
    for i in in_file_order:  # the first bad row of a file is the one reported, however the rows were shuffled
        texts[i] = common.split_pair(rows[i], tokenizer, common.where(rows[i]))
        margin = rows[i].get("margin")  # a number or text that reads as one, as in CSV; absent or empty means 0
        margins[i] = 0.0 if margin is None or margin == "" else common.as_number(margin)
        if isinstance(margin, bool) or not math.isfinite(margins[i]):
            raise common.UserError(f"{common.where(rows[i])}: field 'margin' is {margin!r}; expected a finite number")
    prompts = common.tokenize_prompts(tokenizer, [t[0] for t in texts])
    chosen = common.tokenize_responses(tokenizer, [t[0] for t in texts], [t[1] for t in texts])
    rejected = common.tokenize_responses(tokenizer, [t[0] for t in texts], [t[2] for t in texts])
    common.check_vocabulary(
        tokenizer,
        [p + c + r for p, c, r in zip(prompts, chosen, rejected)],
        " ".join(dict.fromkeys(str(r.get("_dataset") or r["_source"]) for r in rows)),
        args.model_name_or_path,
        "--model_name_or_path",
    )
    bos_id, end, pairs, counts = common.leading_id(tokenizer), common.end_id(tokenizer), [], collections.Counter()
    for row, margin, p, c, r in zip(rows, margins, prompts, chosen, rejected):
        kept, why = truncate_pair(p, c, r, args.max_length, args.min_prompt_length, bos_id)
        if why or kept != p:
            counts[why or "prompt cut"] += 1
        if kept is not None and (end in c[:-1] or end in r[:-1]):
            counts["inner EOS"] += 1
        if kept is not None:
            gold = (row["gold_chosen"], row["gold_rejected"]) if row.get("gold_chosen") is not None else None
            pairs.append(
                {
                    "prompt": kept,
                    "chosen": c,
                    "rejected": r,
                    "margin": margin,
                    "dataset": row.get("_dataset"),
                    "gold": gold,
                }
            )
    return pairs, counts


# --- Distributed: DDP or FSDP2, and evaluation shared by the ranks. --------------------------------------------------
def parallelize(model, args, device):
    """Returns the model under DDP, or under FSDP2 per transformer block and input embeddings, with rank 0's weights.
    With --gradient_checkpointing, activations are recomputed in the backward pass."""
    if args.gradient_checkpointing:
        model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if not dist.is_initialized():
        return model.to(device)
    if args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16 is for compute only, so the sharded parameters and the optimizer's steps keep their own dtype
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if args.bf16
            else MixedPrecisionPolicy()
        )

        def shard(model):
            for block in next(
                m
                for m in model.modules()
                if isinstance(m, torch.nn.ModuleList) and len(m) == model.hf.config.num_hidden_layers
            ):
                fully_shard(block, mp_policy=mp)
            common.shard_input_embeddings(model, fully_shard, mp_policy=mp)
            if hasattr(model.hf, "score"):  # the head gathers its weights in float32
                fully_shard(model.hf.score, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
            fully_shard(model, mp_policy=mp)

        return common.shard_from_rank0(model, shard, device)
    # gradient_as_bucket_view makes the gradients views into DDP's all-reduce buckets, not a second copy
    return torch.nn.parallel.DistributedDataParallel(
        model.to(device),
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )


def all_pair_rewards(model, pairs, args, pad_id, device, rank, world):
    """Returns each pair's (r_chosen, r_rejected) on CPU, in the pairs' order. Each rank computes a slice, longest pairs
    first, so that a batch holds pairs of similar length and the peak memory comes first."""
    order = sorted(range(len(pairs)), key=lambda i: -sum(len(pairs[i][k]) for k in ("prompt", "chosen", "rejected")))
    mine, per_rank = order[rank::world], math.ceil(len(pairs) / world)
    valid = torch.arange(per_rank, device=device) < len(mine)
    mine += [mine[0] if mine else 0] * (per_rank - len(mine))  # equal batch counts: FSDP's forward is collective
    rewards, size = [], args.per_device_eval_batch_size
    for i in range(0, per_rank, size):
        inputs = model_inputs([pairs[j] for j in mine[i : i + size]], pad_id, args, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            rewards.append(torch.stack(model(**inputs).chunk(2), 1))
    index, rewards = torch.tensor(mine, device=device), torch.cat(rewards)
    if dist.is_initialized():
        index, valid, rewards = (torch.cat(dist.nn.functional.all_gather(t)) for t in (index, valid, rewards))
    return torch.empty(len(pairs), 2).index_copy_(0, index[valid].cpu(), rewards[valid].cpu())


# --- The schedule, the optimizer, logging and the final save. ---------------------------------------------------------
def schedule(args, n_train, global_batch, rank):
    """Returns (steps per epoch, total steps, the steps after which to evaluate). The total is --max_steps, else
    ceil(--num_train_epochs x steps per epoch). An epoch leaves out the pairs left over after its last global batch."""
    steps_per_epoch = n_train // global_batch
    if steps_per_epoch == 0 and not args.eval_only:
        raise common.UserError(f"{n_train} training pairs are fewer than one global batch of {global_batch}")
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * max(steps_per_epoch, 1))
    evals_at = {math.ceil(k * total_steps / args.num_evals) for k in range(1, args.num_evals + 1)}
    if len(evals_at) < args.num_evals and not args.eval_only and rank == 0:
        print(f"--num_evals {args.num_evals}: {len(evals_at)}, one after each of the {total_steps} steps")
    return steps_per_epoch, total_steps, evals_at


def build_optimizer(model, args, total_steps):
    """Returns AdamW on the trained parameters and transformers' --lr_scheduler_type, after a linear warm-up where the
    schedule takes one (constant takes none). A schedule with an end rate ends at --lr_end; polynomial decays to it
    linearly."""
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        fused=True,
    )
    end = {
        "polynomial": {"lr_end": args.lr_end, "power": 1.0},
        "cosine_with_min_lr": {"min_lr": args.lr_end},
        "cosine_warmup_with_min_lr": {"min_lr": args.lr_end},
        # the last fifth of the steps cools down; Hagele et al. (2024) find that a 20% cool-down matches cosine
        "warmup_stable_decay": {
            "num_decay_steps": total_steps // 5,
            "min_lr_ratio": args.lr_end / args.learning_rate if args.learning_rate else 0.0,
        },
    }
    try:
        scheduler = transformers.get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_training_steps=total_steps,
            num_warmup_steps=args.warmup_steps or int(args.warmup_ratio * total_steps),
            scheduler_specific_kwargs=end.get(args.lr_scheduler_type),
        )
    except (ValueError, TypeError) as e:  # such as polynomial's --lr_end not below --learning_rate
        raise common.UserError(f"--lr_scheduler_type {args.lr_scheduler_type}: {common.first_line(e)}") from None
    return optimizer, scheduler


def describe_run(args, model, lora, layout, optimizer, world, device, steps_per_epoch, total_steps, start_step, rank):
    if rank != 0:
        return
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"model {args.model_name_or_path}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
        f"{trained / 1e6:.2f}M trained{f' (LoRA rank {args.lora_r})' if lora else ''}; world size {world} "
        f"({device.type}, {'FSDP2' if args.fsdp and world > 1 else 'DDP' if world > 1 else 'single process'})\n"
        f"batch layout: {layout}\n{total_steps} steps ({total_steps / steps_per_epoch:.2f} epochs), lr "
        f"{optimizer.param_groups[0]['initial_lr']:g} ({args.lr_scheduler_type})"
        + (f"; resumed from step {start_step}" if start_step else "")
        + (" (at or past the total: the final evaluation and save remain)" if start_step >= total_steps else "")
    )


def log_train(logger, bar, window, step, steps_per_epoch, lr, global_batch, elapsed, device, world, **memory):
    """Logs the speed and the statistics of the steps since the last log, averaged over them and over the ranks."""
    keys = ("loss", "accuracy", "reward_gap", "grad_norm")
    means = torch.tensor([sum(s[k] for s in window) / len(window) for k in keys], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(means)
    means /= world
    m = {
        "step": step,
        "epoch": step / steps_per_epoch,
        **{f"train/{k}": v for k, v in zip(keys, means.tolist())},
        "lr": lr,
        "perf/pairs_per_s": len(window) * global_batch / elapsed,
        **memory,
    }
    if logger is not None:
        logger.log(m)
        bar.set_postfix(loss=f"{m['train/loss']:.4f}", acc=f"{m['train/accuracy']:.3f}")
        bar.write(common.format_metrics(m))


def save_final(model, hf_model, lora, tokenizer, ev, logger, args, rank, record):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    save_reward_model(
        hf_model,
        lora,
        {k.removeprefix("hf."): v for k, v in model_sd.items()},
        tokenizer,
        args.output_dir,
        record["reward_shift"],
        record["reward_scale"],
    )
    logger.close()
    common.write_json_atomic(
        os.path.join(args.output_dir, "eval_results.json"),
        {**{k.removeprefix("eval/"): v for k, v in ev.items()}, **record, "args": dataclasses.asdict(args)},
    )
    bayes = (
        f" (Bayes-optimal {ev['eval/bayes_accuracy']:.4f}, ratio {ev['eval/accuracy_vs_bayes']:.3f})"
        if "eval/bayes_accuracy" in ev
        else ""
    )
    print(f"final eval accuracy {ev['eval/accuracy']:.4f}{bayes}; saved to {args.output_dir}")


def save_reward_model(hf_model, lora, state_dict, tokenizer, output_dir, shift, scale):
    """Saves the model in transformers' format, LoRA merged and its adapter in output_dir/adapter. A head without a
    bias cannot hold the shift, so config.json holds the normalization, as does adapter/reward_normalization.json; a
    user applies it as (score - reward_shift) / reward_scale. The score is read at the EOS that ends every response
    here. A text scored without it is read at a position the model never trained on."""
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
        common.write_json_atomic(
            os.path.join(args.output_dir, "eval_results.json"),
            {
                **{k.removeprefix("eval/"): v for k, v in ev.items()},
                "num_pairs": len(evals),
                "reward_shift": shift,
                "reward_scale": scale,
                "normalized_reward_mean": (ev["eval/reward_mean"] - shift) / scale,
                "batch_layout": layout,
                "eval_sets": eval_sets,
                "args": dataclasses.asdict(args),
            },
        )
        print(
            f"{common.format_metrics(ev)}\nevaluated {args.model_name_or_path} on {len(evals)} pairs; "
            f"eval_results.json in {args.output_dir}"
        )
    common.leave_together()
    return ev


# === The opt-in packed layout of --padding_free: pairs end to end in one row, each prompt once, no padding. =========
# segment_attention makes one SDPA call per block of consecutive pairs of at most this many tokens. A longer pair is a
# block alone. Short pairs share a call, and a long one pays only for its own length, never for the row's.
BLOCK_TOKENS = 256


def pack_segments(pairs, device="cpu"):
    """Returns one row's ids and its segments: each pair's prompt + chosen + rejected, end to end. Rejected's positions
    continue from the prompt's end (Wang et al. 2024, arXiv 2410.20305). `member` marks each sequence's tokens, chosen
    ones first, and `read` its last token, where its reward is read. `blocks` holds each block's (start, end). Later,
    segment_attention fills `masks`, each block's per window, and `calls`, the windows it was called with."""
    ids, positions, blocks = [], [], []
    member = torch.zeros(2 * len(pairs), sum(len(p["prompt"] + p["chosen"] + p["rejected"]) for p in pairs), dtype=bool)
    for i, p in enumerate(pairs):
        s, P, C, R = len(ids), len(p["prompt"]), len(p["chosen"]), len(p["rejected"])
        if not blocks or s + P + C + R - blocks[-1][0] > BLOCK_TOKENS:
            blocks.append([s, s])
        ids += p["prompt"] + p["chosen"] + p["rejected"]
        positions += list(range(P + C)) + list(range(P, P + R))
        blocks[-1][1] = len(ids)
        member[i, s : s + P + C] = member[len(pairs) + i, s : s + P] = member[len(pairs) + i, s + P + C : len(ids)] = (
            True
        )
    # A namespace: DDP and FSDP pass on copies of a tuple or a dataclass, and the copies' masks and calls would be lost.
    return torch.tensor([ids]), SimpleNamespace(
        member=member,
        position=torch.tensor(positions, device=device),
        blocks=[tuple(b) for b in blocks],
        read=last_token_index(member).to(device),
        masks={},
        calls=[],
    )


def packed_rewards(hf_model, input_ids, segments):
    """Returns a packed row's rewards, chosen then rejected: the scalar head at each sequence's last token. It needs
    segment_attention, which choose_layout sets once it is checked."""
    if hf_model.config._attn_implementation != "rm_segments":  # the model's own attention would cross pairs
        raise ValueError("a packed row needs the model's attention set by choose_layout")
    hidden = hf_model.base_model(
        input_ids=input_ids, position_ids=segments.position[None], use_cache=False, rm_segments=segments
    ).last_hidden_state
    return hf_model.score(hidden[0, segments.read]).squeeze(-1).float()


def segment_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    softcap=None,
    sliding_window=None,
    rm_segments=None,
    **kwargs,
):
    """Runs one SDPA call per block of whole pairs, under its mask. A token sees the earlier tokens of its own sequences
    within this layer's window. So a rejected token sees the prompt but no chosen one. It applies Gemma 2's softcap."""
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attention sinks")
    rm_segments.calls.append(sliding_window)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]  # query heads per key/value head, as in grouped-query attention
    if groups > 1 and (softcap is not None or not sdpa_takes_groups_with_mask(query.device)):
        key, value = (t.repeat_interleave(groups, 1) for t in (key, value))
    out = []  # per block (1, heads, tokens, head dim), in autocast's dtype, not the query's
    for b, (s, e) in enumerate(rm_segments.blocks):  # slices stay 4D: 3D inputs miss the fused kernel on CPU
        q, k, v = query[:, :, s:e], key[:, :, s:e], value[:, :, s:e]
        if (slot := (b, sliding_window)) not in rm_segments.masks:
            member, pos = rm_segments.member[:, s:e].to(query.device, torch.float32), rm_segments.position[s:e]
            behind = pos[:, None] - pos[None, :]  # transformers' sliding window: query i sees key j if i - j < window
            rm_segments.masks[slot] = (member.T @ member > 0) & (behind >= 0) & (behind < (sliding_window or math.inf))
        mask = rm_segments.masks[slot]
        if softcap is None:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
            )
        else:
            scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scaling / softcap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(v.dtype) @ v
        out.append(o)
    return torch.cat(out, 2).transpose(1, 2).contiguous(), None


def sdpa_takes_groups_with_mask(device):  # on CUDA, grouped keys with a boolean mask can fall to the math kernel
    return device.type != "cuda"


def use_segment_attention(hf_model):  # no mask of transformers' own: a dense N x N one would go unread
    transformers.AttentionInterface.register("rm_segments", segment_attention)
    transformers.AttentionMaskInterface.register("rm_segments", lambda *args, **kwargs: None)
    hf_model.config._attn_implementation = "rm_segments"


def declared_windows(config):  # each layer's sliding window, None for full attention
    window = getattr(config, "sliding_window", None)  # without layer_types, every layer has the window, if any
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


@torch.no_grad()
def choose_layout(model, args, vocab_size, rank=0):
    """Returns (args, layout): packed if this model passes packed_layout_fault, else padded with the reason. Under DDP
    rank 0 checks its copy. Under FSDP every rank checks its shards, as the forward is collective; rank 0 decides."""
    sharded, model = hasattr(model, "reshard"), getattr(model, "module", model)  # DDP wraps; FSDP shards in place
    why_not = [common.agreed(lambda: packed_layout_fault(model, args, vocab_size) if rank == 0 or sharded else None)]
    if sharded:
        model.reshard()  # FSDP keeps the root's parameters gathered after a forward; the optimizer needs the shards
    if dist.is_initialized():
        dist.broadcast_object_list(why_not, src=0)
    if why_not[0]:
        return dataclasses.replace(args, padding_free=False), f"padded: {why_not[0]}"
    use_segment_attention(model.hf)
    return (
        dataclasses.replace(args, padding_free=True),
        "prefix-shared + packed: one row, attention per block of "
        "pairs (--padding_free; rewards checked equal to padded ones)",
    )


def packed_layout_fault(model, args, vocab_size):
    """Returns why the packed layout fails this model, or None. It runs 4 short random pairs and 2 longer than a block
    and the shortest sliding window. Each layer must call segment_attention with its declared window. The rewards must
    equal the padded batch's on the run's device and precision. Any error of the packed forward is a fault."""
    if not hasattr(model.hf, "score"):
        return "an encoder reads its pooled [CLS] over the whole sequence"
    if "position_ids" not in inspect.signature(model.hf.base_model.forward).parameters:
        return "the model takes no position ids (ALiBi or recurrent)"
    device, g = next(model.parameters()).device, torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(0, vocab_size, (k,), generator=g).tolist()  # noqa: E731
    windows, own, was_training = declared_windows(model.hf.config), model.hf.config._attn_implementation, model.training
    long = (
        min(
            args.max_length or common.position_table(model.hf) or 2 * BLOCK_TOKENS,
            max([BLOCK_TOKENS] + [w + 8 for w in windows if w]),
        )
        - 8
    )
    sizes = [(3 + i, 2 + i % 3, 4 - i % 3) for i in range(4)] + [
        (long // 2, long // 2 - i, long // 4) for i in range(2 if long >= 16 else 0)
    ]
    pairs = [{"prompt": ids(p), "chosen": ids(c), "rejected": ids(r), "margin": 0.0} for p, c, r in sizes]
    model.eval()
    low = args.bf16 or model.hf.dtype == torch.bfloat16  # a LoRA base held in bfloat16 runs under autocast too
    tol, why_not = 5e-2 if low else 1e-3, None
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
        reference = model(**model_inputs(pairs, 0, dataclasses.replace(args, padding_free=False), device))
        try:  # any failure means padded: a model without the keyword, layers that drop it, odd head sizes
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
