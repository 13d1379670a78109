"""LoRA against full fine-tuning: peak memory and time per step of rm.py and ppo.py on one model.

    python benchmarks/bench_lora.py                      # CPU; writes benchmarks/results/lora_cpu.json
    python benchmarks/bench_lora.py --device cuda --out benchmarks/results/lora_gpu.json

The model is Llama-shaped (8 layers of width 512, grouped-query attention) with Qwen2's vocabulary of 151,936 rows,
so that the embedding and output layers weigh what they weigh in the small released models; it is initialised at
random and stored in bfloat16, as released checkpoints are. Prompts and pairs are the embedded task's (its
word-level tokenizer is saved with the model). Rows, each in its own process, one after the other, repeated:
full fine-tuning, LoRA (rank 16 on every linear layer of the backbone), and on a GPU, LoRA with --bf16 (the frozen
base held in bfloat16; a CPU without bfloat16 instructions emulates them, many times slower). ppo.py's reward model
is the full fine-tuning rm.py row's output, the same for every ppo.py row.
Peak memory is the process's peak RSS on CPU (torch.cuda.max_memory_allocated on a GPU); time per step is the
training loop's: rm.py's optimizer steps per second from its logged pairs/s, ppo.py's seconds per update (rollout,
score, learn), the first update left out.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODES = {"full fine-tuning": [], "LoRA r=16": ["--lora_r", "16", "--lora_alpha", "32"]}
BF16_MODE = {"LoRA r=16, bf16 base": ["--lora_r", "16", "--lora_alpha", "32", "--bf16"]}  # GPU only: see below
GPU_PEAK = (
    "import atexit, torch; atexit.register(lambda: print('PEAK_GPU_MB', torch.cuda.max_memory_allocated() / 2**20))"
)


def build_assets(work, config_class=None, **shape):
    """The model (by default the Llama shape above; else config_class(**shape)), at random, stored in bfloat16, with
    the embedded task's tokenizer, and 2,000 of its pairs, in work/model and work/pairs.jsonl."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import common

    tokenizer = common.embedded_tokenizer()
    if config_class is None:
        config_class, shape = (
            LlamaConfig,
            dict(
                vocab_size=151_936,
                hidden_size=512,
                intermediate_size=1536,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=2,
                max_position_embeddings=512,
            ),
        )
    config = config_class(
        **shape,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(os.path.join(work, "model"))
    tokenizer.save_pretrained(os.path.join(work, "model"))
    with open(os.path.join(work, "pairs.jsonl"), "w") as f:
        for row in common.embedded_pairs(2000, seed=5):
            f.write(json.dumps(row) + "\n")
    return sum(p.numel() for p in model.parameters())


def run(argv, device):
    """One row in its own process: (its metrics.jsonl rows, its peak memory in MB)."""
    code = (
        GPU_PEAK + "; " if device == "cuda" else ""
    ) + f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({argv[0]!r}, run_name='__main__')"
    env = dict(os.environ, WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out[-3000:]}")
    peak = usage.ru_maxrss / 1024
    if device == "cuda":
        peak = float(next(line.split()[1] for line in out.splitlines() if line.startswith("PEAK_GPU_MB")))
    trained = next(
        line for line in out.splitlines() if "trained" in line and ("parameters" in line or "policy" in line)
    )
    out_dir = argv[argv.index("--output_dir") + 1]
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], peak, trained


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rm_steps", type=int, default=20)
    p.add_argument("--ppo_episodes", type=int, default=64)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lora_cpu.json"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench_lora_")
    n_params = build_assets(work)
    model, pairs = os.path.join(work, "model"), os.path.join(work, "pairs.jsonl")
    modes = {**MODES, **(BF16_MODE if args.device == "cuda" else {})}
    rows = {f"{script} {mode}": {"peak_mb": [], "s_per_step": []} for script in ("rm.py", "ppo.py") for mode in modes}
    for r in range(args.repeats):
        for mode, flags in modes.items():
            out = os.path.join(work, f"rm-{r}-{len(flags)}")
            batch = 16
            metrics, peak, trained = run(
                [
                    "rm.py",
                    "--model_name_or_path",
                    model,
                    "--dataset_name",
                    pairs,
                    "--max_steps",
                    str(args.rm_steps),
                    "--logging_steps",
                    str(args.rm_steps),
                    "--num_evals",
                    "1",
                    "--per_device_train_batch_size",
                    str(batch),
                    "--learning_rate",
                    "1e-4",
                    "--eval_holdout",
                    "0.02",
                    "--output_dir",
                    out,
                    *flags,
                ],
                args.device,
            )
            pairs_per_s = next(m["perf/pairs_per_s"] for m in metrics if "perf/pairs_per_s" in m)
            rows[f"rm.py {mode}"]["peak_mb"].append(peak)
            rows[f"rm.py {mode}"]["s_per_step"].append(batch / pairs_per_s)
            rows[f"rm.py {mode}"]["trained"] = trained
            print(f"repeat {r} rm.py {mode}: {peak:.0f} MB, {batch / pairs_per_s:.3f} s/step", flush=True)
        reward = os.path.join(work, f"rm-{r}-0")
        for mode, flags in modes.items():
            out = os.path.join(work, f"ppo-{r}-{len(flags)}")
            metrics, peak, trained = run(
                [
                    "ppo.py",
                    "--sft_model_path",
                    model,
                    "--reward_model_path",
                    reward,
                    "--total_episodes",
                    str(args.ppo_episodes),
                    "--per_device_train_batch_size",
                    "8",
                    "--num_mini_batches",
                    "2",
                    "--response_length",
                    "16",
                    "--sample_every",
                    "1000",
                    "--learning_rate",
                    "1e-5",
                    "--output_dir",
                    out,
                    *flags,
                ],
                args.device,
            )
            per_update = [m["perf/time_rollout"] + m["perf/time_score"] + m["perf/time_learn"] for m in metrics[1:]]
            rows[f"ppo.py {mode}"]["peak_mb"].append(peak)
            rows[f"ppo.py {mode}"]["s_per_step"].append(sum(per_update) / len(per_update))
            rows[f"ppo.py {mode}"]["trained"] = trained
            print(
                f"repeat {r} ppo.py {mode}: {peak:.0f} MB, {sum(per_update) / len(per_update):.3f} s/update", flush=True
            )
    report = {
        "device": args.device,
        "model_parameters": n_params,
        "rm_steps": args.rm_steps,
        "ppo_episodes": args.ppo_episodes,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nmodel: {n_params / 1e6:.1f}M parameters (Llama-shaped, vocabulary 151,936); {args.repeats} repeats")
    print(f"{'row':<34} {'peak MB (min-max)':>20} {'s/step (min-max)':>20}")
    for name, row in rows.items():
        mb, s = row["peak_mb"], row["s_per_step"]
        print(f"{name:<34} {min(mb):>9.0f}-{max(mb):<10.0f} {min(s):>9.3f}-{max(s):<10.3f}")


if __name__ == "__main__":
    main()
