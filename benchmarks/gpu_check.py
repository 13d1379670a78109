"""What a GPU shows that a CPU cannot: attention kernels and NaN, both scripts end to end in bfloat16, packed vs padded
rewards, memory and speed at Llama-3-8B shapes, the decode step profiled (plain and --compile), an update with and
without --compile, sampling vs learning log-probs. Run it when a device is lent (results: benchmarks/README.md, GPU
check):

    python benchmarks/gpu_check.py --out gpu_report            # one CUDA device: 3 minutes on an H100 (2026-11-26)
    python benchmarks/gpu_check.py --quick --out /tmp/gpu       # tiny shapes, any device (a smoke run on a CPU)
    python benchmarks/gpu_check.py --sections decode --out gpu_decode  # the rollout, plain and --compile (< 4 min)

Writes report.json and report.md (device, torch / CUDA / cuDNN versions, every figure) to --out. Each section is
independent: one that fails is reported as such and the others still run. See ../shared/gpu-checks.md for what each
section must show.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import ppo  # noqa: E402
import rm  # noqa: E402


def sdpa_kernels(fn):
    """The SDPA kernels fn ran, from the profiler's event names (cuDNN, flash, memory-efficient, math)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as p:
        fn()
    names = {e.key for e in p.key_averages()}
    kinds = {
        "cudnn": "cudnn_attention",
        "flash": "flash_attention",
        "efficient": "efficient_attention",
        "math": "_scaled_dot_product_attention_math",
    }
    return sorted(k for k, marker in kinds.items() if any(marker in n for n in names))


def tiny_llama(width, layers, heads, kv_heads, vocab, device, dtype=torch.float32, seq_cls=False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    loader = AutoModelForSequenceClassification if seq_cls else AutoModelForCausalLM
    model = loader.from_config(config).to(device=device, dtype=dtype)
    return common.scalar_head_in_float32(model) if seq_cls else model


def check_attention(device, quick):
    """1. Kernels chosen and NaN: a fully masked query row (a left-padded prompt), and cuDNN's backward with a boolean
    mask at L % 128 == 64 with a row of very low log-sum-exp, with cuDNN on (the bug) and off (the fix)."""
    out = {}
    model = tiny_llama(128 if quick else 1024, 2, 8, 2, 1000, device)
    ids = torch.randint(3, 1000, (4, 96), device=device)
    mask = torch.ones_like(ids)
    mask[:2, :40] = 0  # two left-padded rows
    position = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out["ppo_left_padded_kernels"] = sdpa_kernels(
            lambda: model(input_ids=ids, attention_mask=mask, position_ids=position)
        )
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
    out["ppo_left_padded_nan"] = bool(torch.isnan(logits[mask.bool()]).any())
    rm_model = rm.RewardModel(tiny_llama(128 if quick else 512, 2, 8, 2, 1000, device, seq_cls=True))
    pairs = [
        {"prompt": list(range(3, 40 + i)), "chosen": list(range(5, 20)), "rejected": list(range(6, 30)), "margin": 0.0}
        for i in range(4)
    ]
    rm.use_segment_attention(rm_model.hf)
    inputs = rm.model_inputs(pairs, 0, rm.Args(padding_free=True), device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out["rm_packed_kernels"] = sdpa_kernels(lambda: rm_model(**inputs))
    # the raw kernel: a boolean mask, L % 128 == 64, one query row whose scores are all very low
    length = 192
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 8, length, 64, generator=g, device=device, dtype=torch.bfloat16) for _ in range(3))
    q[:, :, 5] = -200.0
    k[:, :, :6] = 10.0  # row 5 sees keys 0-5 only: log-sum-exp far below -88.7
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    for cudnn in (True, False):
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        qq = q.clone().requires_grad_(True)
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=causal)
        o.float().sum().backward()
        out[f"boolean_mask_backward_nan_cudnn_{'on' if cudnn else 'off'}"] = bool(torch.isnan(qq.grad).any())
    common.attention_without_nan(device)  # the scripts' setting: cuDNN off again
    return out


def check_scripts(device, quick, scratch):
    """2. Both scripts end to end in bf16: rm.py, then ppo.py full fine-tuning, with LoRA, and on prompts of very
    different lengths (heavy left padding). Finite metrics and the last samples."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    steps, episodes = ("20", "64") if quick else ("60", "1024")

    def run(*argv, threads=None):
        t = time.time()
        out = argv[argv.index("--output_dir") + 1]
        try:
            proc = subprocess.run(
                [sys.executable, *argv, "--overwrite_output_dir"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env=env | ({"OMP_NUM_THREADS": str(threads)} if threads else {}),
                timeout=150,
            )
        except subprocess.TimeoutExpired as e:  # where it was: the log's tail and how many updates it logged
            tail = lambda b: (b.decode(errors="replace") if isinstance(b, bytes) else b or "")[-1200:]  # noqa: E731
            logged = os.path.join(out, "metrics.jsonl")
            return {
                "timeout_s": 150,
                "stderr": tail(e.stderr),
                "stdout": tail(e.stdout),
                "metrics_lines": sum(1 for _ in open(logged)) if os.path.exists(logged) else 0,
            }
        if proc.returncode:
            return {"exit": proc.returncode, "stderr": proc.stderr[-1500:]}
        metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        finite = all(v == v and abs(v) != float("inf") for m in metrics for v in m.values() if isinstance(v, float))
        result = {
            "exit": 0,
            "seconds": round(time.time() - t, 1),
            "all_finite": finite,
            "first": metrics[0],
            "last": metrics[-1],
        }
        if os.path.exists(os.path.join(out, "samples.jsonl")):
            result["last_samples"] = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))][-3:]
        return result

    os.makedirs(scratch, exist_ok=True)
    rm_dir = os.path.join(scratch, "rm")
    prompts = os.path.join(scratch, "prompts.jsonl")
    with open(prompts, "w") as f:
        for i in range(256):
            f.write(
                json.dumps({"prompt": "User: tell me about animals such as" + " cat" * (i % 60) + " Assistant:"}) + "\n"
            )
    ppo_base = ["ppo.py", "--bf16", "--reward_model_path", rm_dir, "--total_episodes", episodes]
    out = {"rm": run("rm.py", "--bf16", "--max_steps", steps, "--output_dir", rm_dir)}
    runs = {
        "ppo": [*ppo_base, "--output_dir", os.path.join(scratch, "ppo")],
        "ppo_lora": [
            *ppo_base,
            "--lora_r",
            "8",
            "--learning_rate",
            "1e-3",
            "--output_dir",
            os.path.join(scratch, "ppo_lora"),
        ],
        "ppo_left_padded": [
            *ppo_base,
            "--dataset_name",
            prompts,
            "--max_prompt_length",
            "128",
            "--output_dir",
            os.path.join(scratch, "ppo_pad"),
        ],
    }
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:  # side by side: tiny models leave the GPU idle
        # (each process's CPU threads a share of the cores: three of all of them each oversubscribe them)
        futures = {
            name: pool.submit(run, *argv, threads=max(1, os.cpu_count() // len(runs))) for name, argv in runs.items()
        }
    return out | {name: f.result() for name, f in futures.items()}


def check_packed_vs_padded(device, quick):
    """3. A GQA Llama (width 512, 4 layers, 8 heads, 2 KV heads), 8 pairs of 300-600 tokens: packed rewards and
    gradients against the padded batch's, in fp32 and bf16 autocast, cuDNN on and off."""
    out = {}
    n, lo, hi = (4, 30, 60) if quick else (8, 300, 600)
    g = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(n):
        p, c, r = (int(torch.randint(lo // 2, hi // 2, (1,), generator=g)) for _ in range(3))  # 300-600 a side
        pairs.append(
            {
                k: torch.randint(3, 1000, (m,), generator=g).tolist()
                for k, m in (("prompt", p), ("chosen", c), ("rejected", r))
            }
            | {"margin": 0.0}
        )
    for precision in ("fp32", "bf16"):
        for cudnn in (True, False) if device.type == "cuda" else (False,):
            if device.type == "cuda":
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
            results = []
            for packed in (False, True):
                model = rm.RewardModel(tiny_llama(128 if quick else 512, 4, 8, 2, 1000, device, seq_cls=True))
                if packed:
                    rm.use_segment_attention(model.hf)
                inputs = rm.model_inputs(pairs, 0, rm.Args(padding_free=packed), device)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    rewards = model(**inputs)
                rewards.sum().backward()
                results.append((rewards.detach().float(), torch.cat([p.grad.flatten() for p in model.parameters()])))
            (r0, g0), (r1, g1) = results
            out[f"{precision}_cudnn_{'on' if cudnn else 'off'}"] = {
                "max_reward_diff": (r0 - r1).abs().max().item(),
                "max_reward": r0.abs().max().item(),
                "grad_rel_diff": ((g0 - g1).norm() / g0.norm()).item(),
                "nan": bool(torch.isnan(g1).any()),
            }
    common.attention_without_nan(device)
    return out


def check_8b_shapes(device, quick):
    """4. Llama-3-8B shapes from a config, random bf16 weights: the learning forward + backward of ppo.py's
    response_logprobs (the plain path, and --fused_logits: `_fused`) at micro-batches of 768 tokens (peak memory,
    time, OOM), with and without activation checkpointing; the rollout of 64 prompts x 256 new tokens. The second of
    two timings."""
    from transformers import AutoModelForCausalLM

    config, shape = llama_8b_config(quick)
    result = {}
    with torch.device(device):
        policy = ppo.output_layer_in_float32(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
    length = 96 if quick else 768
    for micro, checkpointing, fused in itertools.product((2, 4) if quick else (4, 8, 16), (False, True), (False, True)):
        if checkpointing:
            policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            policy.activation_checkpointing_disable()
        ids = torch.randint(3, shape["vocab_size"], (micro, length), device=device)
        mask = torch.ones_like(ids)

        def step():
            logprobs, _ = ppo.response_logprobs(policy, ids, mask, length // 2, 1.0, entropy=True, fused=fused)  # noqa: B023, timed within this iteration
            logprobs.sum().backward()
            policy.zero_grad(set_to_none=True)

        result[f"learn_micro{micro}_ckpt{int(checkpointing)}{'_fused' * fused}"] = timed(step, device, policy)
    policy.activation_checkpointing_disable()
    n_prompts, new = (8, 16) if quick else (64, 256)
    args = ppo.Args(response_length=new)
    query = torch.randint(3, shape["vocab_size"], (n_prompts, 128), device=device)
    qmask = torch.ones_like(query, dtype=torch.bool)
    seeds = torch.arange(n_prompts, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        rollout = timed(lambda: ppo.generate(policy, query, qmask, seeds, args, None, 0), device)
    logits = torch.randn(n_prompts, shape["vocab_size"], device=device)
    noise = timed(lambda: [ppo.sample_tokens(logits, seeds, t) for t in range(new)], device)
    if "seconds" in rollout:
        rollout["ms_per_token"] = round(rollout["seconds"] / new * 1000, 2)
        rollout["sampler_share"] = round(noise.get("seconds", 0) / rollout["seconds"], 3)
    result["rollout"] = rollout
    return result


def check_decode_profile(device, quick):
    """4 (the rollout's cost), the plain decode and --compile's in the same call. The Llama-3-8B-shaped policy (random
    bf16 weights), 64 prompts of 128 tokens, 256 new tokens, bf16 autocast, no stop token. For each path: the wall time
    per token of a whole rollout (--compile: its second; compile_s, the first's extra time), peak memory (--compile:
    the CUDA graph's pool included); the decode alone under the profiler (32 new tokens less 1: the prefill taken
    away), the GPU's busy time per token (its kernels' time summed) and the kernels per token; wall - busy is host time
    (Python, launches, syncs), which CUDA graphs remove. Then the two rollouts compared (bf16 rounds the two paths'
    logits differently, so samples may part): the share of tokens and rows alike, and the mean log-prob of each one's
    tokens under the learning forward."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    config, shape = llama_8b_config(quick)
    with torch.device(device):
        policy = ppo.output_layer_in_float32(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)).eval()
    rows, prompt, new, profiled = (8, 16, 24, 8) if quick else (64, 128, 256, 32)
    query = torch.randint(
        3, shape["vocab_size"], (rows, prompt), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    qmask = torch.ones_like(query, dtype=torch.bool)
    seeds = torch.tensor([common.seed_of(1, "sampling", e) for e in range(rows)], device=device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def rollout(n, compiled):  # (--max_prompt_length: the same static cache, so one compilation, for every n)
        args = ppo.Args(response_length=n, max_prompt_length=prompt + new - n, compile=compiled)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return ppo.generate(policy, query, qmask, seeds, args, None, 0)

    def clock(fn):
        sync()
        t = time.time()
        out = fn()
        sync()
        return time.time() - t, out

    def profiled_run(n, compiled):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
            rollout(n, compiled)
            sync()
        events = p.key_averages()
        kernels = [e for e in events if getattr(e, "self_device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
        return {
            "busy_ms": sum(e.self_device_time_total for e in kernels) / 1000,
            "kernels": sum(e.count for e in kernels),
            "graph_launches": sum(e.count for e in events if e.key == "cudaGraphLaunch"),
            "host_top_ops": sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:6],
        }

    result, tokens = {}, {}
    for name, compiled in (("plain", False), ("compile", True)):
        out = {}
        if compiled:
            counters.clear()
            first, _ = clock(lambda: rollout(new, True))
        else:
            rollout(profiled, False)  # (a warm-up: kernels' first launches)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        seconds, tokens[name] = clock(lambda: rollout(new, compiled))  # noqa: B023, called at once
        prefill, _ = clock(lambda: rollout(1, compiled))  # noqa: B023, called at once
        out["wall_ms_per_token"] = round(seconds / new * 1000, 2)
        out["decode_wall_ms_per_token"] = round((seconds - prefill) / (new - 1) * 1000, 2)
        if cuda:
            out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if compiled:
            out["compile_s"] = round(first - seconds, 1)
            out["graph_breaks"] = sum(counters["graph_break"].values())
            out["cudagraph_skips"] = sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "skip" in k)
            out["graphs_compiled"] = counters["stats"].get("unique_graphs", 0)
        one, many = profiled_run(1, compiled), profiled_run(profiled, compiled)
        busy = (many["busy_ms"] - one["busy_ms"]) / (profiled - 1)
        out["gpu_busy_ms_per_token"] = round(busy, 2)
        out["gpu_busy_share"] = round(busy / max(out["decode_wall_ms_per_token"], 1e-9), 3)
        out["kernels_per_token"] = round((many["kernels"] - one["kernels"]) / (profiled - 1))
        out["graph_launches_per_token"] = round((many["graph_launches"] - one["graph_launches"]) / (profiled - 1), 2)
        out["host_top_ops_ms_per_token"] = {
            e.key: round(e.self_cpu_time_total / 1000 / profiled, 2) for e in many["host_top_ops"]
        }
        result[name] = out
    a, b = tokens["plain"], tokens["compile"]
    parted = (a != b).int().cumsum(1).gt(0)  # from the first token where a row's two samples differ
    mask = torch.ones_like(a, dtype=torch.long)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        logprob = {
            k: ppo.response_logprobs(policy, torch.cat([query, t], 1), torch.cat([qmask.long(), mask], 1), prompt, 1.0)[
                0
            ]
            .mean()
            .item()
            for k, t in tokens.items()
        }
    result["same_samples"] = {
        "tokens_equal": round((a == b).float().mean().item(), 4),
        "rows_equal": round((~parted[:, -1]).float().mean().item(), 4),
        "tokens_before_rows_part": round((~parted).float().sum(1).mean().item(), 1),
        "mean_logprob_plain": round(logprob["plain"], 4),
        "mean_logprob_compile": round(logprob["compile"], 4),
    }
    result["speedup"] = round(result["plain"]["wall_ms_per_token"] / result["compile"]["wall_ms_per_token"], 2)
    return result


def check_ppo_update(device, quick, scratch):
    """4 (a whole update). The embedded task's PPO (--bf16, the gold reward as a function: no reward model), three
    updates of 32 episodes, plain and with --compile: each update's time and its rollout's (the first --compile
    update compiles), the last update's gold score."""
    out = {}
    for compiled in (False, True):
        args = ppo.Args(
            bf16=True,
            compile=compiled,
            reward_fn="common:gold_rewards",
            total_episodes=96,
            sample_every=1000,
            save_steps=0,
            overwrite_output_dir=True,
            num_evals=0,
            output_dir=os.path.join(scratch, f"ppo_update_compile{int(compiled)}"),
        )
        if quick:
            args = dataclasses.replace(args, per_device_train_batch_size=4, total_episodes=24)
        ppo.main(args)
        metrics = [json.loads(line) for line in open(os.path.join(args.output_dir, "metrics.jsonl"))]
        batch = metrics[0]["episodes"]
        out["compile" if compiled else "plain"] = {
            "update_s": [round(batch / m["perf/episodes_per_s"], 3) for m in metrics],
            "rollout_s": [round(m["perf/time_rollout"], 3) for m in metrics],
            "gold_last": metrics[-1].get("gold/mean"),
        }
    return out


def check_8b_reward(device, quick):
    """4 (rm.py). The reward model at Llama-3-8B shapes: the packed forward + backward of 8 pairs of ~1,000 tokens,
    with and without activation checkpointing, and its forward alone with the SDPA kernels it ran (grouped-query:
    never the math kernel)."""
    from transformers import AutoModelForSequenceClassification

    config, _ = llama_8b_config(quick)
    with torch.device(device):
        reward_model = rm.RewardModel(
            common.scalar_head_in_float32(AutoModelForSequenceClassification.from_config(config, dtype=torch.bfloat16))
        )
    rm.use_segment_attention(reward_model.hf)
    k = 100 if quick else 1000
    pairs = [
        {
            "prompt": list(range(3, 3 + k // 2)),
            "chosen": list(range(5, 5 + k // 2)),
            "rejected": list(range(7, 7 + k // 2)),
            "margin": 0.0,
        }
        for _ in range(8)
    ]
    inputs = rm.model_inputs(pairs, 0, rm.Args(padding_free=True), device)

    def rm_step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            reward_model(**inputs).sum().backward()
        reward_model.zero_grad(set_to_none=True)

    result = {}
    for checkpointing in (False, True):
        if checkpointing:
            reward_model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        result[f"rm_packed_8_pairs_ckpt{int(checkpointing)}"] = timed(rm_step, device, reward_model)
    reward_model.hf.activation_checkpointing_disable()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):  # 32 query heads on 8 key/value heads
        forward = lambda: reward_model(**inputs)  # noqa: E731
        result["rm_packed_forward_gqa"] = timed(forward, device) | {"kernels": sdpa_kernels(forward)}
    return result


def llama_8b_config(quick):
    from transformers import LlamaConfig

    shape = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    if quick:
        shape = dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    return LlamaConfig(**shape, max_position_embeddings=8192, num_labels=1, pad_token_id=0), shape


def timed(fn, device, model=None):
    """The second of two timings (peak memory on a GPU), or oom."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    try:
        for _ in range(2):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.time()
            fn()
            sync()
            out = {"seconds": round(time.time() - t, 3)}
        if cuda:
            out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    except torch.OutOfMemoryError:
        out = {"oom": True}
    if model is not None:  # an OOM mid-backward leaves gradients behind: free them for the next shape
        model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def check_logprobs(device, quick):
    """5. Old vs learning log-probs at initialisation, on a policy trained first (random weights hide rounding
    effects): |new - old| over the response tokens (old: ppo.logprobs_and_values; new: learn()'s first forwards), the
    fraction of ratios outside 1 +- 0.2 and the KL per sequence at initialisation, for bf16 weights and for fp32
    weights under bf16 autocast."""
    import random

    from transformers import AutoModelForCausalLM

    tok = common.embedded_tokenizer()
    out = {}
    # the embedded policy (width 64) and a wider one (512, 4 layers) trained the same way on the device; prompts of
    # up to ~250 tokens, so that attention spans several key blocks (a short one fits one block, where a one-token
    # decode and a whole-sequence forward may round alike)
    for width in (64, 128 if quick else 512):
        config = common.embedded_model_config("embedded-llama", len(tok))
        if width != 64:
            config.update(
                dict(
                    hidden_size=width,
                    intermediate_size=4 * width,
                    num_hidden_layers=4,
                    num_attention_heads=8,
                    num_key_value_heads=8,
                )
            )
        config.max_position_embeddings = 512
        torch.manual_seed(0)
        policy = AutoModelForCausalLM.from_config(config).to(device)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        rng = random.Random(0)
        for _ in range(50 if quick else 300):  # as ppo.embedded_sft_policy, on the device
            texts = [common.embedded_prompt(rng) for _ in range(64)]
            prompts = common.tokenize_prompts(tok, texts)
            responses = common.tokenize_responses(tok, texts, [common.embedded_response(rng) for _ in texts])
            batch = tok.pad(
                {"input_ids": [q + r for q, r in zip(prompts, responses)]}, padding_side="right", return_tensors="pt"
            ).to(device)
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            for i, q in enumerate(prompts):
                labels[i, : len(q)] = -100
            policy(**batch, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
        policy.eval()
        out[f"width{width}"] = logprob_gaps(ppo.output_layer_in_float32(policy), tok, device)
    return out


def logprob_gaps(policy, tok, device):
    import random

    args = ppo.Args(response_length=16, per_device_train_batch_size=32, num_mini_batches=2, bf16=True)
    rng = random.Random(0)
    prompts = common.tokenize_prompts(
        tok,
        [
            common.embedded_prompt(rng).replace(" Assistant:", "") + " cat" * rng.randint(0, 230) + " Assistant:"
            for _ in range(64)
        ],
    )
    out = {"prompt_tokens_max": max(map(len, prompts))}
    for name, dtype in (("bf16_weights", torch.bfloat16), ("fp32_weights_autocast", torch.float32)):
        model = policy.to(dtype)
        seeds = [common.seed_of(args.seed, "sampling", e) for e in range(64)]
        batch = ppo.rollout(model, prompts, seeds, args, tok.eos_token_id, tok.pad_token_id)
        ppo.logprobs_and_values(model, model, None, batch, args, 0, contextlib.nullcontext)
        new = torch.zeros_like(batch.logprobs)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):  # learn()'s first forwards
            for f in (f for step in ppo.epoch_plan(batch, args, 0, 0) for f in step.forwards):
                new[f.rows, : f.kept] = ppo.response_logprobs(
                    model, f.ids, f.attention_mask, f.context, args.temperature
                )[0]
        real = batch.mask
        diff = (new - batch.logprobs)[real]
        ratio = diff.exp()
        out[name] = {
            "mean_abs_diff": diff.abs().mean().item(),
            "max_abs_diff": diff.abs().max().item(),
            "ratio_outside_0.2": ((ratio - 1).abs() > 0.2).float().mean().item(),
            "kl_per_sequence_at_initialisation": ((batch.logprobs - batch.ref_logprobs) * real).sum(1).mean().item(),
        }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_report")
    parser.add_argument("--scratch", default=None, help="where the scripts' runs go (default: OUT/runs)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run, on any device")
    parser.add_argument(
        "--sections",
        nargs="*",
        default=["attention", "packed", "logprobs", "scripts", "shapes", "rm_shapes", "decode_profile", "ppo_update"],
        help="sections to run, in this order (decode: decode_profile and ppo_update)",
    )
    a = parser.parse_args()
    a.sections = [n for name in a.sections for n in ({"decode": ["decode_profile", "ppo_update"]}.get(name, [name]))]
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    common.attention_without_nan(device)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "quick": a.quick,
        "date": time.strftime("%Y-%m-%d"),
    }
    checks = {
        "attention": lambda: check_attention(device, a.quick),
        "scripts": lambda: check_scripts(device, a.quick, a.scratch or os.path.join(a.out, "runs")),
        "packed": lambda: check_packed_vs_padded(device, a.quick),
        "shapes": lambda: check_8b_shapes(device, a.quick),
        "rm_shapes": lambda: check_8b_reward(device, a.quick),
        "decode_profile": lambda: check_decode_profile(device, a.quick),
        "ppo_update": lambda: check_ppo_update(device, a.quick, a.scratch or os.path.join(a.out, "runs")),
        "logprobs": lambda: check_logprobs(device, a.quick),
    }
    for name in a.sections:
        t = time.time()
        try:
            report[name] = checks[name]()
        except Exception:
            report[name] = {"error": traceback.format_exc()[-2000:]}
        report[name + "_seconds"] = round(time.time() - t, 1)
        print(name, json.dumps(report[name])[:400], flush=True)
        common.write_json_atomic(os.path.join(a.out, "report.json"), report)  # after each: a cut-off run keeps some
        with open(os.path.join(a.out, "report.md"), "w") as f:
            f.write(
                f"# GPU check: {report['device']} (torch {report['torch']}, CUDA {report['cuda']}, cuDNN "
                f"{report['cudnn']}), {report['date']}\n\n"
            )
            for done in a.sections[: a.sections.index(name) + 1]:
                f.write(
                    f"## {done} ({report[done + '_seconds']} s)\n\n```json\n"
                    f"{json.dumps(report[done], indent=1)}\n```\n\n"
                )


if __name__ == "__main__":
    main()
