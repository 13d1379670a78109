"""Memory that falls with the number of ranks: peak memory of the largest process, one process against 2 ranks with
--fsdp (torchrun, gloo on the CPU), for rm.py and ppo.py, loading included.

    python benchmarks/bench_memory.py          # CPU; writes benchmarks/results/memory_cpu.json
    python benchmarks/bench_memory.py --plan   # only the memory plan of Pythia 6.9B PPO on 8 ranks (no weights;
                                               # benchmarks/memory_plan.py)

Two models, initialised at random and stored in bfloat16 as released checkpoints are, big enough that their states
(float32 weights, gradients, AdamW's two moments: 16 bytes a trained parameter) dominate a process: Pythia-160M's
shape (GPT-NeoX, 12 layers of width 768, vocabulary 50,304; 162M parameters), and bench_lora.py's Llama shape with
Qwen2's vocabulary of 151,936 rows (180M parameters, 87% of them in the embedding and output layers). ppo.py holds
four models (policy and critic trained, reference and reward model frozen), rm.py one. Each row runs in its own
process tree, one after the other, repeated; the peak is the largest ru_maxrss of the tree (the launcher's and each
rank's). Every row runs with MALLOC_MMAP_THRESHOLD_=1048576: glibc otherwise raises its threshold after the first
large free and keeps later freed buffers (FSDP's per-block gathers) in its heap, so that RSS measures the allocator's
retention instead of the memory the process uses. Both splits see the same global batch, so they train the same run
(the last logged loss of each is printed beside the peak). First, the peak of a process that only imports each
script: memory every process holds whatever the number of ranks. Beside each ratio, "at best": what 2 ranks could
do, the one-process peak with its models' states (from the memory plan) halved and all else the same (states_mb).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def run(argv, nproc):
    """One row in its own process tree: (its metrics.jsonl rows, the peak RSS of its largest process in MB)."""
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    )
    env = dict(
        os.environ,
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        MALLOC_MMAP_THRESHOLD_="1048576",
    )
    proc = subprocess.Popen(
        launcher + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the maximum over the tree: the launcher and every rank it waited for
    if status != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{out[-3000:]}")
    with open(os.path.join(argv[argv.index("--output_dir") + 1], "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], usage.ru_maxrss / 1024


PYTHIA_6_9B = dict(
    model_type="gpt_neox",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    intermediate_size=16384,
    vocab_size=50432,
    rotary_pct=0.25,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def plan_7b():
    """ppo.py's memory plan (memory_plan.py) for Pythia 6.9B PPO, full fine-tuning, on one node of 8 GPUs, from config
    files alone."""
    import memory_plan
    from transformers import AutoConfig

    import ppo

    work = tempfile.mkdtemp(prefix="plan_7b_")
    fields = dict(PYTHIA_6_9B)
    model_type = fields.pop("model_type")
    for name, arch in (("policy", "GPTNeoXForCausalLM"), ("reward", "GPTNeoXForSequenceClassification")):
        AutoConfig.for_model(model_type, **fields, architectures=[arch], num_labels=1).save_pretrained(
            os.path.join(work, name)
        )
    tables = {}
    for flags in (["--fsdp", "--bf16"], ["--fsdp"], ["--bf16"]):
        args = ppo.Args(
            sft_model_path=os.path.join(work, "policy"),
            reward_model_path=os.path.join(work, "reward"),
            fsdp="--fsdp" in flags,
            bf16="--bf16" in flags,
        )
        models = memory_plan.plan("ppo", args, 8)
        tables[" ".join(flags)] = {
            m.name: {k: v / 1e9 for k, v in m.bytes().items()} for m in models if isinstance(m, memory_plan.Planned)
        }
        print(" ".join(flags) + ": " + memory_plan.table(models, 8))
    return tables


def pythia_160m(work):
    """Pythia-160M's shape, at random, stored in bfloat16, with the embedded task's tokenizer and pairs."""
    from bench_lora import build_assets
    from transformers import GPTNeoXConfig

    return build_assets(
        work,
        GPTNeoXConfig,
        vocab_size=50304,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    )


def main():
    from bench_lora import build_assets

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--plan", action="store_true", help="only the 7B memory plan")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "memory_cpu.json"))
    args = p.parse_args()
    plan = plan_7b()
    if args.plan:
        return
    report = {"device": "cpu", "repeats": args.repeats, "models": {}, "pythia_6.9b_ppo_plan_gb_per_gpu_8_ranks": plan}
    report["import_only_mb"] = {script: imported(script) for script in ("rm", "ppo")}
    print(
        "a process that only imports the script: "
        + ", ".join(f"{k}.py {v:.0f} MB" for k, v in report["import_only_mb"].items())
    )
    for shape, build in (("pythia-160m", pythia_160m), ("152k-vocabulary", build_assets)):
        work = tempfile.mkdtemp(prefix="bench_memory_")
        n_params = build(work)
        rows = measure(work, args.repeats)
        states = states_mb(work)
        report["models"][shape] = {"parameters": n_params, "rows": rows, "states_mb_one_process": states}
        print(f"\n{shape}: {n_params / 1e6:.1f}M parameters (stored in bfloat16); {args.repeats} repeats")
        print(f"{'row':<24} {'peak MB (min-max)':>20} {'vs 1 process':>13} {'at best':>14} {'last loss':>12}")
        for name, row in rows.items():
            script = name.split()[0]
            base = min(rows[script + " 1 process"]["peak_mb"])
            mb = row["peak_mb"]
            print(
                f"{name:<24} {min(mb):>9.0f}-{max(mb):<10.0f} {min(mb) / base:>12.2f}x "
                f"{(base - states[script] / 2) / base:>13.2f}x {row['last_loss'][-1]:>12.5f}",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


def imported(script):
    """Peak memory (MB) of a process that only imports the script (torch, transformers and the rest): a part of every
    process's peak that no number of ranks divides."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576")
    proc = subprocess.Popen([sys.executable, "-c", f"import {script}"], cwd=ROOT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"import {script} failed")
    return usage.ru_maxrss / 1024


def states_mb(work):
    """The bytes (MB) of every model's states in one process of each script, from its memory plan (memory_plan.py; the
    plan is what the scripts hold: tests/test_memory.py). Were they alone to halve on 2 ranks and the rest of the peak
    stay, the ratio would be (peak - states / 2) / peak: the "at best" column, the best 2 ranks can do."""
    import memory_plan

    import ppo
    import rm

    model = os.path.join(work, "model")
    return {
        "rm.py": memory_plan.states_bytes(memory_plan.plan("rm", rm.Args(model_name_or_path=model), 1)) / 2**20,
        "ppo.py": memory_plan.states_bytes(
            memory_plan.plan("ppo", ppo.Args(sft_model_path=model, reward_model_path=os.path.join(work, "rm-0-1")), 1)
        )
        / 2**20,
    }


def measure(work, repeats):
    """Each row's peak (MB) and last loss, per repeat."""
    model, pairs = os.path.join(work, "model"), os.path.join(work, "pairs.jsonl")
    # the same global batch both ways: 8 x 2 accumulation in one process, 8 x 2 ranks
    splits = {"1 process": (1, ["--gradient_accumulation_steps", "2"]), "2 ranks --fsdp": (2, ["--fsdp"])}
    rows = {f"{script} {split}": {"peak_mb": [], "last_loss": []} for script in ("rm.py", "ppo.py") for split in splits}
    for r in range(repeats):
        for split, (nproc, flags) in splits.items():
            out = os.path.join(work, f"rm-{r}-{nproc}")
            metrics, peak = run(
                [
                    "rm.py",
                    "--model_name_or_path",
                    model,
                    "--dataset_name",
                    pairs,
                    "--max_steps",
                    "4",
                    "--logging_steps",
                    "1",
                    "--num_evals",
                    "1",
                    "--per_device_train_batch_size",
                    "8",
                    "--learning_rate",
                    "1e-4",
                    "--eval_holdout",
                    "0.02",
                    "--output_dir",
                    out,
                    *flags,
                ],
                nproc,
            )
            rows[f"rm.py {split}"]["peak_mb"].append(peak)
            rows[f"rm.py {split}"]["last_loss"].append([m["train/loss"] for m in metrics if "train/loss" in m][-1])
            print(f"repeat {r} rm.py {split}: {peak:.0f} MB", flush=True)
        reward = os.path.join(work, f"rm-{r}-1")
        for split, (nproc, flags) in splits.items():
            out = os.path.join(work, f"ppo-{r}-{nproc}")
            metrics, peak = run(
                [
                    "ppo.py",
                    "--sft_model_path",
                    model,
                    "--reward_model_path",
                    reward,
                    "--total_episodes",
                    "32",
                    "--per_device_train_batch_size",
                    "8",
                    "--num_mini_batches",
                    "1",
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
                nproc,
            )
            rows[f"ppo.py {split}"]["peak_mb"].append(peak)
            rows[f"ppo.py {split}"]["last_loss"].append(metrics[-1]["loss/policy"])
            print(f"repeat {r} ppo.py {split}: {peak:.0f} MB", flush=True)
    return rows


if __name__ == "__main__":
    main()
