"""The memory plan: will a ppo.py or rm.py run fit its GPUs? Per rank, each model's states (weights, gradients, AdamW),
what each phase holds beside them (the rollout's gathered policy and KV cache, a micro-batch's activations), and the
host memory loading takes, from the models' config.json alone (models built on the meta device: no weight, no
tokenizer, no GPU). A plan whose peak passes 90% of the GPU's memory exits 2 naming the first flags that fit.

    python benchmarks/memory_plan.py ppo --world_size 8 --gpu_memory_gb 80 --sft_model_path M --reward_model_path R \\
        --per_device_train_batch_size 16 --response_length 512 --max_prompt_length 256 --fsdp --bf16
    python benchmarks/memory_plan.py rm --world_size 8 --gpu_memory_gb 80 --model_name_or_path M --fsdp --bf16

SCRIPT is ppo or rm; --world_size (default 8) and --gpu_memory_gb (default 80, in GB of 10^9 bytes) describe the
GPUs; every other flag is the script's own. Exit 0: every phase fits; 2: one does not, or bad input (one line on
stderr). The activations rows were checked against an H100 at Llama-3-8B shapes (benchmarks/README.md, GPU check),
the states against what 2 ranks hold (tests/test_memory.py).
"""

import argparse
import copy
import dataclasses
import functools
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import UserError, embedded_model_config, embedded_tokenizer  # noqa: E402

FRACTION = 0.9
"""A plan fits where every phase's peak is within this share of the GPU's memory; the rest is for what no row counts
(the CUDA context, the allocator's fragmentation, FSDP's gathered blocks, the optimizer step's temporaries)."""


@dataclasses.dataclass
class Planned:
    """One model as a script holds it: its parameters, those trained (float32, with a float32 gradient and AdamW's
    two float32 moments each), the bytes of a frozen parameter (4 or 2), and the ranks its states are split over
    (FSDP: the world size; DDP: 1, a replica each)."""

    name: str
    parameters: int
    trained: int
    frozen_bytes: int
    shards: int
    frozen_in_float32: int = 0
    """Frozen parameters held in float32 whatever frozen_bytes says (ppo.py's sharded output layers)."""
    on_host: bool = False
    """Its shards in pinned host memory (--offload_inference_models under FSDP): gathered unit by unit as it computes,
    as every sharded model is, so it takes no GPU memory between uses."""
    loaded: int = 1
    """Whole models of its size rank 0 holds while loading it (2: a LoRA critic copied from the reward model, which
    then lives on as the critic with its adapter off)."""

    def bytes(self):
        """{"weights", "gradients", "AdamW"}: the bytes of each on one rank."""
        frozen = self.parameters - self.trained - self.frozen_in_float32
        return {
            "weights": (frozen * self.frozen_bytes + (self.frozen_in_float32 + self.trained) * 4) / self.shards,
            "gradients": self.trained * 4 / self.shards,
            "AdamW": self.trained * 8 / self.shards,
        }


@dataclasses.dataclass
class Transient:
    """What one phase ("rollout" or "learning") holds on each rank's GPU beside the models' states."""

    name: str
    phase: str
    size: float


# --- the models' shapes, from their configs ---------------------------------------------------------------------------


@functools.cache
def config(path, vocab_size=None):
    """The transformers config of a model folder or hub name (of a peft adapter folder: its base's); of an embedded
    model, its config for a tokenizer of vocab_size tokens (the embedded tokenizer's by default). None read: UserError.
    """
    from transformers import AutoConfig

    if path.startswith("embedded-"):
        return embedded_model_config(path, vocab_size or len(embedded_tokenizer()))
    adapter = os.path.join(path, "adapter_config.json")
    if os.path.exists(adapter) and not os.path.exists(os.path.join(path, "config.json")):
        with open(adapter) as f:
            return config(json.load(f).get("base_model_name_or_path") or path, vocab_size)
    local = os.path.exists(path) or path.startswith((".", "/"))
    if local and not os.path.exists(os.path.join(path, "config.json")):
        raise UserError(f"{path}: no config.json there")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        why = (str(e).strip() or type(e).__name__).splitlines()[0][:200]
        raise UserError(f"{path}: no model config read there ({why})") from None


@functools.cache
def meta_model(path, kind, vocab_size=None):
    """The model at path on the meta device (no memory): a causal LM (kind "causal") or a one-label sequence classifier
    ("reward"), its embeddings grown to vocab_size rows where the tokenizer has more. Shared: do not change it."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    c = copy.deepcopy(config(path, vocab_size))
    c.num_labels, c.vocab_size = 1, max(c.vocab_size, vocab_size or 0)
    loader = AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return loader.from_config(c)


def lora_of(args):
    """The LoRA settings (rank, alpha, target modules), hashable, or None without LoRA."""
    return (args.lora_r, args.lora_alpha, tuple(args.lora_target_modules)) if args.lora_r else None


@functools.cache
def shape(path, kind, vocab_size=None, lora=None):
    """(all, trained) parameters of meta_model(path, kind, vocab_size); with lora (lora_of), of that model with peft's
    adapters added as the scripts add them (a classifier's head trained beside them, and counted twice, as peft keeps
    the original beside the trained copy)."""
    from peft import LoraConfig, get_peft_model

    model = meta_model(path, kind, vocab_size)
    if lora is None:
        return (n := sum(p.numel() for p in model.parameters())), n
    model, (r, alpha, targets) = copy.deepcopy(model), lora
    task = "CAUSAL_LM" if kind == "causal" else "SEQ_CLS"
    settings = LoraConfig(
        task_type=task,
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules="all-linear" if targets == ("all-linear",) else list(targets),
    )
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            get_peft_model(model, settings)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise UserError(
            f"--lora_target_modules {' '.join(targets)}: peft cannot put LoRA adapters on "
            f"{type(model).__name__} ({str(e).splitlines()[0][:200]})"
        ) from None
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


def output_layer(path, vocab_size=None):
    """Parameters of the causal LM's output layer where it is an nn.Linear of its own (not tied to the input
    embeddings), else 0: the part ppo.py holds in float32 under FSDP."""
    model = meta_model(path, "causal", vocab_size)
    head = model.get_output_embeddings()
    untied = type(head) is torch.nn.Linear and head.weight is not model.get_input_embeddings().weight
    return sum(p.numel() for p in head.parameters()) if untied else 0


def block_shape(path, kind, vocab_size=None):
    """(blocks, hidden size, values per token and block a training forward keeps for its backward at the compute dtype,
    and at the residual stream's): the attention's query, keys and values (one head per query head), its output and
    the output projection's input (SDPA's fused kernels keep no attention matrix); the MLP's up-projections, twice
    (their outputs and the activation's); each norm's output at the compute dtype, its input (and an RMSNorm's
    normalised input) at the residual stream's."""
    model = meta_model(path, kind, vocab_size)
    c, h = model.config, model.config.hidden_size
    heads = c.num_attention_heads
    kv, d = getattr(c, "num_key_value_heads", None) or heads, getattr(c, "head_dim", None) or h // heads
    blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == c.num_hidden_layers)
    outputs = sum(getattr(m, "out_features", 0) or getattr(m, "nf", 0) for m in blocks[0].modules())
    up = outputs - (heads + 2 * kv) * d - 2 * h  # all but q, k, v and the two projections back to the hidden size
    norms = [
        type(m).__name__.lower()
        for m in blocks[0].modules()
        if "norm" in type(m).__name__.lower() and getattr(m, "weight", None) is not None and m.weight.numel() == h
    ]  # (not per-head q/k norms)
    return len(blocks), h, 5 * heads * d + 2 * up + len(norms) * h, sum(2 if "rms" in n else 1 for n in norms) * h


def activation_bytes(path, kind, vocab_size, tokens, compute_bytes, residual_bytes, checkpointing):
    """The bytes a training forward over `tokens` tokens keeps for its backward (block_shape); with activation
    checkpointing, each block's input, plus one block's activations and as much again for their gradients while it is
    recomputed and goes backward."""
    blocks, h, compute, residual = block_shape(path, kind, vocab_size)
    block = compute * compute_bytes + residual * residual_bytes
    return tokens * (blocks * h * residual_bytes + 2 * block if checkpointing else blocks * block)


def kv_cache_bytes(path, sequences, length, dtype_bytes, vocab_size=None):
    """A KV cache of `sequences` x `length` tokens: keys and values of every layer's key/value heads."""
    c = config(path, vocab_size)
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * kv * d * sequences * length * dtype_bytes


# --- the scripts' plans -----------------------------------------------------------------------------------------------


def ppo_plan(args, world, vocab_size=None):
    """ppo.py's rows for ppo.Args on `world` ranks. Models: policy and critic trained, reference and reward model
    frozen; under --fsdp (several ranks) each sharded, the frozen ones in bfloat16 under --bf16 but for the reference's
    output layer, and in host memory with --offload_inference_models; under DDP replicas. With LoRA the reference is
    the policy with its adapters off (frozen bases in bfloat16 under --bf16), and a reward model the critic starts
    from is the critic with its adapter off. Then the rollout's rows (the policy in the compute dtype: gathered under
    FSDP, its output layer in float32; autocast's copy under DDP --bf16; the KV cache) and the learning phase's (one
    micro-batch's activations, of the policy or the critic, whichever is larger; autocast's copies under DDP)."""
    from ppo import FUSED_BLOCK

    shards = world if args.fsdp and world > 1 else 1
    frozen_bytes, host = 2 if args.bf16 and (args.lora_r or shards > 1) else 4, args.offload_inference_models
    lora, sft = lora_of(args), args.sft_model_path
    policy = shape(sft, "causal", vocab_size, lora)
    rows = [Planned("policy", *policy, frozen_bytes, shards)]
    head = output_layer(sft, vocab_size) if shards > 1 and not lora else 0  # (in float32 under FSDP)
    if not lora:
        rows.append(Planned("reference policy", policy[0], 0, frozen_bytes, shards, head, host and shards > 1))
    reward = args.reward_model_path if args.reward_model_path is not None else None if args.reward_fn else "runs/rm"
    if reward == "runs/rm" and not os.path.exists(reward):  # (ppo.py's default: rm.py's default output folder)
        raise UserError("--reward_model_path runs/rm: no reward model there; pass --reward_model_path or --reward_fn")
    gae = args.advantage_estimator == "gae"
    if gae:
        same_tokens = reward and config(reward).vocab_size == config(sft, vocab_size).vocab_size
        from_reward = args.critic_init == "reward" or args.critic_init == "auto" and same_tokens
        critic_source = (reward, "reward", None) if from_reward else (sft, "reward", vocab_size)
        critic = shape(*critic_source, lora)
        rows.append(Planned("critic", *critic, frozen_bytes, shards, loaded=2 if lora and from_reward else 1))
    if reward and not (lora and gae and from_reward):
        rows.append(
            Planned("reward model", shape(reward, "reward")[0], 0, frozen_bytes, shards, on_host=host and shards > 1)
        )
    compute, residual = (2, 2 if lora else 4) if args.bf16 else (4, 4)  # (a LoRA base held in bfloat16 computes so)
    micro, width = args.per_device_train_batch_size, (args.max_prompt_length or 256) + args.response_length
    sequences = micro * args.gradient_accumulation_steps * args.num_mini_batches
    if shards > 1 or args.bf16 and not lora:
        rows.append(
            Transient(
                "policy gathered" if shards > 1 else "policy, autocast's copy",
                "rollout",
                (policy[0] - head) * compute + head * 4,
            )
        )
    rows.append(
        Transient(
            f"KV cache ({sequences} x {width} tokens)",
            "rollout",
            kv_cache_bytes(sft, sequences, width, compute, vocab_size),
        )
    )
    vocab = max(config(sft, vocab_size).vocab_size, vocab_size or 0)
    logits = 4 * micro * args.response_length * vocab  # the log-softmax response_logprobs keeps (float32) ...
    logits = 4 * 4 * FUSED_BLOCK[0] * FUSED_BLOCK[1] if args.fused_logits else logits  # ... or a block's few
    learners = [((sft, "causal", vocab_size), logits, policy[0])] + ([(critic_source, 0, critic[0])] if gae else [])
    rows.append(
        Transient(
            f"activations ({micro} x {width} tokens)",
            "learning",
            max(
                activation_bytes(*source, micro * width, compute, residual, args.gradient_checkpointing) + extra
                for source, extra, _ in learners
            ),
        )
    )
    if shards == 1 and args.bf16 and not lora:
        rows.append(Transient("autocast's bfloat16 weights", "learning", 2 * max(n for *_, n in learners)))
    return rows


def rm_plan(args, world, vocab_size=None):
    """rm.py's rows for rm.Args on `world` ranks: the reward model trained in full, or its adapters and head (LoRA;
    the frozen base in bfloat16 under --bf16), or only read (--eval_only); sharded under --fsdp (several ranks), else
    a replica. Training holds beside it a micro-batch's activations (its pairs, both sequences at --max_length), and
    under DDP --bf16 autocast's bfloat16 copy of the weights."""
    path = args.model_name_or_path
    total, trained = shape(path, "reward", vocab_size, lora_of(args))
    shards, low = world if args.fsdp and world > 1 else 1, bool(args.lora_r and args.bf16)
    rows = [Planned("reward model", total, 0 if args.eval_only else trained, 2 if low else 4, shards)]
    if not args.eval_only:
        tokens = 2 * args.per_device_train_batch_size * (args.max_length or 512)
        rows.append(
            Transient(
                f"activations ({tokens} tokens)",
                "learning",
                activation_bytes(
                    path,
                    "reward",
                    vocab_size,
                    tokens,
                    2 if args.bf16 else 4,
                    2 if low else 4,
                    args.gradient_checkpointing,
                ),
            )
        )
        if shards == 1 and args.bf16 and not args.lora_r:
            rows.append(Transient("autocast's bfloat16 weights", "learning", 2 * total))
    return rows


def plan(script, args, world, vocab_size=None):
    """The rows (Planned, then Transient) of script ("ppo" or "rm") for its Args on `world` ranks; vocab_size: the
    tokenizer's length where it has more tokens than the config's embeddings (None: the config's)."""
    return (ppo_plan if script == "ppo" else rm_plan)(args, world, vocab_size)


# --- reading a plan ---------------------------------------------------------------------------------------------------


def states_bytes(rows):
    """The bytes the models' states take on each rank's GPU (those offloaded to the host take none)."""
    return sum(sum(m.bytes().values()) for m in rows if isinstance(m, Planned) and not m.on_host)


def peaks(rows):
    """{phase: its peak per rank}: the states, and what the phase holds beside them."""
    phases = dict.fromkeys(r.phase for r in rows if isinstance(r, Transient)) or {"learning": 0}
    return {
        p: states_bytes(rows) + sum(r.size for r in rows if isinstance(r, Transient) and r.phase == p) for p in phases
    }


def rank0_host_bytes(models):
    """Rank 0's host memory while an FSDP run loads: each model whole, in float32 (bfloat16: a LoRA base under --bf16),
    three at most at once (ppo.build_models: reward model, policy and critic; then policy, critic and the reference
    copied from the policy, the reward model sharded and freed)."""
    low = any(0 < m.trained < m.parameters and m.frozen_bytes == 2 for m in models)  # (a LoRA base held in bfloat16)
    return sum(sorted(m.parameters for m in models for _ in range(m.loaded))[-3:]) * (2 if low else 4)


def table(rows, world, capacity=None):
    """The plan as a small table, GB per rank: each model's weights, gradients and AdamW state; each phase's rows and
    peak; the host memory loading takes (FSDP on several ranks: rank0_host_bytes; else every rank its replicas); with
    capacity (bytes), whether it fits."""
    models = [m for m in rows if isinstance(m, Planned)]
    lines = [
        f"memory plan per rank ({world} rank{'s' if world > 1 else ''}; GB):",
        f"  {'model':<18}{'params':>9}{'weights':>9}{'grads':>9}{'AdamW':>9}{'total':>9}",
    ]
    for m in models:
        b = m.bytes()
        lines.append(
            f"  {m.name:<18}{m.parameters / 1e6:>8.1f}M"
            + "".join(f"{v / 1e9:>9.2f}" for v in b.values())
            + f"{sum(b.values()) / 1e9:>9.2f}"
            + (" (host memory)" if m.on_host else "")
        )
    row = lambda label, size: f"  {label:<54}{size / 1e9:>9.2f}"  # noqa: E731
    lines.append(row("states on the device", states_bytes(rows)))
    for phase, peak in peaks(rows).items():
        lines += [row(f"{phase}: {r.name}", r.size) for r in rows if isinstance(r, Transient) and r.phase == phase]
        lines.append(row(f"{phase} peak", peak))
    if any(m.shards > 1 for m in models):
        lines.append(
            f"  host memory while loading: {rank0_host_bytes(models) / 1e9:.1f} GB on rank 0, at most three "
            "models whole at once (each freed after its broadcast into the shards; the other ranks build on "
            "the meta device)"
        )
    else:
        lines.append(
            f"  host memory while loading: up to {sum(m.parameters for m in models) * 4 / 1e9:.1f} GB on "
            "each rank, its replicas built in float32"
        )
    if capacity:
        fits = max(peaks(rows).values()) <= FRACTION * capacity
        lines.append(
            f"  {'fits' if fits else 'does not fit'}: {FRACTION:.0%} of a {capacity / 1e9:.1f} GB GPU is "
            f"{FRACTION * capacity / 1e9:.1f} GB"
        )
    return "\n".join(lines)


def refusal(script, args, world, capacity, vocab_size=None):
    """None where every phase's peak fits FRACTION of capacity (bytes per GPU); else one line: the phase that does not,
    and the first of these whose peaks fit: --gradient_checkpointing, --fsdp, --fsdp --bf16, LoRA (each without, then
    with --gradient_checkpointing), then --fsdp --bf16 --gradient_checkpointing on more ranks."""
    phase, peak = max(peaks(plan(script, args, world, vocab_size)).items(), key=lambda kv: kv[1])
    if peak <= FRACTION * capacity:
        return None
    r, lora, ckpt = dataclasses.replace, args.lora_r or 16, "--gradient_checkpointing"
    bases = [
        ("", {}),
        ("--fsdp", dict(fsdp=True)),
        ("--fsdp --bf16", dict(fsdp=True, bf16=True)),
        (f"--lora_r {lora} --bf16", dict(lora_r=lora, bf16=True)),
        (f"--lora_r {lora} --fsdp --bf16", dict(lora_r=lora, fsdp=True, bf16=True)),
    ]
    tries = [
        (
            f"{flags} {ckpt}".strip() if c else flags,
            r(args, **kw, gradient_checkpointing=c or args.gradient_checkpointing),
            world,
        )
        for flags, kw in bases
        for c in (False, True)
        if flags or c
    ]
    tries += [
        (f"--fsdp --bf16 {ckpt} on {n} ranks", r(args, fsdp=True, bf16=True, gradient_checkpointing=True), n)
        for n in (8, 16, 32, 64)
        if n > world
    ]
    fit = next(
        (flags for flags, a, w in tries if max(peaks(plan(script, a, w, vocab_size)).values()) <= FRACTION * capacity),
        None,
    )
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    return (
        f"the {phase} phase needs {peak / 1e9:.1f} GB per GPU ({ranks}; the plan above), more than {FRACTION:.0%} "
        f"of the GPU's {capacity / 1e9:.1f} GB: "
        + (
            f"pass {fit}"
            if fit
            else "use LoRA (--lora_r 16), --fsdp --bf16, --gradient_checkpointing, a smaller micro-batch and more ranks"
        )
    )


def held_bytes(model, optimizer=None):
    """{"weights", "gradients", "AdamW"}: the bytes this rank really holds in the model's parameters (its shards under
    FSDP; a tied parameter once), their gradients, and the optimizer's state for them: what Planned.bytes predicts."""

    def size(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list({id(p): p for p in model.parameters()}.values())
    ids = {id(p) for p in params}
    return {
        "weights": sum(size(p) for p in params),
        "gradients": sum(size(p.grad) for p in params if p.grad is not None),
        "AdamW": 0
        if optimizer is None
        else sum(
            size(v)
            for p, s in optimizer.state.items()
            if id(p) in ids
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ),
    }


def main(argv=None):
    """The command line (module docstring): prints the table; returns 0 if it fits, 2 if not or on bad input."""
    import tyro

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("script", nargs="?")
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--gpu_memory_gb", type=float, default=80.0)
    known, rest = parser.parse_known_args(argv)
    if known.script is None and {"-h", "--help"} & set(rest):  # (after a script: tyro prints the script's flags)
        print(__doc__.split("\n\n")[1])
        return 0
    script = os.path.basename(known.script or "").removesuffix(".py")
    if script not in ("ppo", "rm"):
        print(
            f"error: {f'{known.script}: no such script; name' if known.script else 'name a script:'} ppo or rm, then "
            "its flags",
            file=sys.stderr,
        )
        return 2
    if known.world_size < 1 or known.gpu_memory_gb <= 0:
        print("error: --world_size and --gpu_memory_gb must be positive", file=sys.stderr)
        return 2
    import ppo
    import rm

    args = tyro.cli(ppo.Args if script == "ppo" else rm.Args, args=rest, prog=f"memory_plan.py {script}")
    capacity = known.gpu_memory_gb * 1e9
    try:
        print(table(plan(script, args, known.world_size), known.world_size, capacity))
        message = refusal(script, args, known.world_size, capacity)
    except UserError as e:
        message = str(e)
    if message:
        print(f"error: {message}", file=sys.stderr)
    return 2 if message else 0


if __name__ == "__main__":
    sys.exit(main())
