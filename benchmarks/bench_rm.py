"""Reward-model training speed: TRL's RewardTrainer vs rm.py's batch layouts (padded: the default; prefix-shared +
packed: --padding_free).

    pip install -r benchmarks/requirements.txt
    python benchmarks/bench_rm.py                       # CPU: HH-RLHF (BPE, 512), HH-RLHF (bytes, 1024), embedded
    python benchmarks/bench_rm.py --device cuda --shape pythia-160m --bf16 --pairs 2048 --batch 16

Every row trains the same randomly initialised model (saved once), on the same token sequences (tokenized and
truncated once, by rm.py's policy: over-long pairs dropped, and handed to TRL pre-tokenized), with the same global
batch, max length, number of pairs, optimizer and schedule, one epoch. Each row runs in its own process, so its peak
memory is its own. Two speeds: the training loop alone, and the whole process (start-up, data, training, every
evaluation, saving) over the pairs trained; rm.py rows evaluate at rm.py's defaults (--num_evals, the last one at the
end; the eval batch as the training one), TRL evaluates once, after training. Writes the table to stdout and to --out
(JSON).
"""

import argparse
import gzip
import json
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HH = os.path.join(ROOT, "..", "shared", "data", "hh-rlhf-harmless-base", "test.jsonl.gz")
SHAPES = {  # "big enough that compute dominates" on each device
    "small-llama": dict(
        arch="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4
    ),
    "pythia-160m": dict(
        arch="neox", hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
    ),
}
TASKS = {  # name: (training pairs, held-out pairs, max length, tokenizer vocabulary; 258 = one token per byte)
    "hh-rlhf": (512, 512, 512, 8000),
    "hh-bytes": (256, 128, 1024, 258),
    "embedded": (512, 512, 512, None),
    "hh-rlhf-152k": (256, 128, 512, 8000),
}
MODEL_VOCAB = {"hh-rlhf-152k": 151_936}  # a real-sized embedding (Qwen2's vocabulary), for the memory row
MODES = {
    "rm.py padded (default)": ["--no_padding_free"],  # (the flag spelled out: --before runs it on older code too)
    "rm.py prefix-shared + packed (--padding_free)": ["--padding_free"],
}


def build_tokenizer(texts, vocab_size, out_dir):
    """A byte-level BPE tokenizer trained locally on the task's own text (no download); with vocab_size 258, no merges:
    one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|pad|>", "<|eos|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|eos|>")
    fast.save_pretrained(out_dir)
    return fast


def build_model(shape, vocab_size, pad_id, eos_id, out_dir, max_length):
    import torch
    from transformers import AutoModelForSequenceClassification, GPTNeoXConfig, LlamaConfig

    s = dict(SHAPES[shape])
    arch = s.pop("arch")
    common = dict(
        vocab_size=vocab_size,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        max_position_embeddings=2 * max_length,
        num_labels=1,
        **s,
    )
    cfg = (
        LlamaConfig(num_key_value_heads=s["num_attention_heads"], **common)
        if arch == "llama"
        else GPTNeoXConfig(**common)
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg)
    torch.nn.init.normal_(model.score.weight, std=1 / (cfg.hidden_size + 1) ** 0.5)
    model.save_pretrained(out_dir)
    return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n), cfg


def prepare_task(task, args, work):
    """Writes DIR/train.jsonl and DIR/test.jsonl (explicit prompt format, for rm.py), the same pairs as token ids (for
    TRL), a tokenizer and the model. Returns the description of the task."""
    import common
    import rm

    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "settings.json"), "w") as f:
        json.dump(vars(args), f)
    if task.startswith("hh-"):
        with gzip.open(HH, "rt") as f:
            rows = [json.loads(line) for line in f]
        tok = build_tokenizer([r["chosen"] for r in rows] + [r["rejected"] for r in rows], args.vocab_size, work)
        rows = [
            dict(zip(("prompt", "chosen", "rejected"), common.shared_prefix_split(r["chosen"], r["rejected"])))
            for r in rows
        ]
    else:
        tok = common.embedded_tokenizer()
        tok.save_pretrained(work)
        rows = common.embedded_pairs(args.pairs + args.eval_pairs, seed=7)
    splits = {"train": rows[: args.pairs], "test": rows[args.pairs : args.pairs + args.eval_pairs]}
    targs = rm.Args(max_length=args.max_length, min_prompt_length=args.max_length * 3 // 4)
    ids = {}
    for split, part in splits.items():
        with open(os.path.join(work, f"{split}.jsonl"), "w") as f:
            for r in part:
                f.write(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n")
        ids[split], _ = rm.tokenize_pairs([dict(r, _source=task, _row=i) for i, r in enumerate(part)], tok, targs)
    with open(os.path.join(work, "ids.json"), "w") as f:
        json.dump(ids, f)
    n_params, cfg = build_model(
        args.shape,
        MODEL_VOCAB.get(task, len(tok)),
        tok.pad_token_id,
        tok.eos_token_id,
        os.path.join(work, "model"),
        args.max_length,
    )
    train = ids["train"]
    pair_tokens = sum(2 * len(p["prompt"]) + len(p["chosen"]) + len(p["rejected"]) for p in train) / len(train)
    unique = sum(len(p["prompt"]) + len(p["chosen"]) + len(p["rejected"]) for p in train) / len(train)
    # Model FLOPs per pair (PaLM appendix B: 6N per token + 12 * layers * width * sequence length for attention),
    # counted on the two sequences prompt + chosen and prompt + rejected: the work every trainer is asked to do.
    seq_flops = lambda n: n * (6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * n)  # noqa: E731
    flops = sum(
        seq_flops(len(p["prompt"]) + len(p["chosen"])) + seq_flops(len(p["prompt"]) + len(p["rejected"])) for p in train
    ) / len(train)
    return {
        "task": task,
        "train_pairs": len(train),
        "eval_pairs": len(ids["test"]),
        "max_length": args.max_length,
        "tokenizer": (
            f"UTF-8 bytes ({len(tok)} tokens)"
            if args.vocab_size == 258
            else f"byte-level BPE, {len(tok)} tokens, trained on the HH-RLHF text"
            if task.startswith("hh-")
            else f"embedded word-level, {len(tok)} tokens"
        ),
        "model": f"{args.shape} ({n_params / 1e6:.1f}M non-embedding parameters, vocabulary {cfg.vocab_size})",
        "tokens_per_pair": pair_tokens,
        "unique_tokens_per_pair": unique,
        "flops_per_pair": flops,
    }


def warmup_steps(args):
    return max(1, int(0.05 * (args.pairs // args.batch)))


def child_trl(work, args):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    ids = json.load(open(os.path.join(work, "ids.json")))
    model = AutoModelForSequenceClassification.from_pretrained(os.path.join(work, "model"))
    tok = AutoTokenizer.from_pretrained(work)
    train = Dataset.from_list(
        [{"chosen_ids": p["prompt"] + p["chosen"], "rejected_ids": p["prompt"] + p["rejected"]} for p in ids["train"]]
    )
    cfg = RewardConfig(
        output_dir=os.path.join(work, "trl"),
        per_device_train_batch_size=args.batch,
        num_train_epochs=1,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=warmup_steps(args),
        max_grad_norm=1.0,
        logging_steps=10,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        bf16=args.bf16,
        gradient_checkpointing=False,
        max_length=None,
        seed=1,
        dataloader_drop_last=True,
        use_cpu=args.device == "cpu",
        disable_dropout=True,
    )
    trainer = RewardTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok)
    start = time.time()
    trainer.train()
    seconds = time.time() - start
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(ids["test"]), 32):
            part = ids["test"][i : i + 32]
            seqs = [p["prompt"] + p["chosen"] for p in part] + [p["prompt"] + p["rejected"] for p in part]
            batch = tok.pad({"input_ids": seqs}, return_tensors="pt")
            r = model(**{k: v.to(model.device) for k, v in batch.items()}).logits.squeeze(-1).float()
            correct += (r[: len(part)] > r[len(part) :]).sum().item()
    steps = len(ids["train"]) // args.batch
    return {"train_seconds": seconds, "pairs_trained": steps * args.batch, "accuracy": correct / len(ids["test"])}


def child_rm(work, args, flags, code_root=ROOT):
    out = os.path.join(work, "rm-" + "-".join(f.strip("-") for f in flags))
    # The prompt's floor, under the name the rm.py at code_root gives it (--max_prompt_length before issue 67)
    floor = (
        "--min_prompt_length"
        if "min_prompt_length" in open(os.path.join(code_root, "rm.py")).read()
        else "--max_prompt_length"
    )
    sys.argv = [
        "rm.py",
        "--model_name_or_path",
        os.path.join(work, "model"),
        "--dataset_name",
        work,
        "--output_dir",
        out,
        "--overwrite_output_dir",
        "--learning_rate",
        str(args.lr),
        "--num_train_epochs",
        "1",
        "--per_device_train_batch_size",
        str(args.batch),
        "--per_device_eval_batch_size",
        str(args.batch),
        "--max_length",
        str(args.max_length),
        floor,
        str(args.max_length * 3 // 4),
        "--logging_steps",
        "10",
        "--warmup_steps",
        str(warmup_steps(args)),
        "--reward_normalization",
        "none",
        *(["--bf16"] if args.bf16 else []),
        *flags,
    ]
    # rm.py tokenizes the text itself; the saved model's tokenizer is the benchmark's (saved beside the data)
    import shutil

    for f in os.listdir(work):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(work, f), os.path.join(work, "model", f))
    sys.path.insert(0, code_root)  # its common.py too
    runpy.run_path(os.path.join(code_root, "rm.py"), run_name="__main__")
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    windows = [m for m in metrics if "perf/pairs_per_s" in m]
    pairs, seconds, last = 0, 0.0, 0
    for m in windows:
        n = (m["step"] - last) * args.batch
        pairs, seconds, last = pairs + n, seconds + n / m["perf/pairs_per_s"], m["step"]
    return {
        "train_seconds": seconds,
        "pairs_trained": pairs,
        "accuracy": json.load(open(os.path.join(out, "eval_results.json")))["accuracy"],
    }


def matmul_peak(device, bf16, n=2048, reps=10):
    import torch

    dtype = torch.bfloat16 if bf16 else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.time()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.time() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="hh-rlhf,hh-bytes,embedded", help="comma-separated: " + ", ".join(TASKS))
    p.add_argument("--rows", default="trl," + ",".join(MODES), help="comma-separated: trl and/or rm.py modes")
    p.add_argument("--pairs", type=int, default=None, help="training pairs, one epoch (default: the task's)")
    p.add_argument("--eval_pairs", type=int, default=None, help="held-out pairs (default: the task's)")
    p.add_argument("--batch", type=int, default=8, help="pairs per step (global batch; one process)")
    p.add_argument("--max_length", type=int, default=None, help="default: the task's")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--shape", default="small-llama", choices=list(SHAPES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--repeats", type=int, default=1, help="run every row this many times, one after the other")
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "rm_cpu.json"))
    p.add_argument(
        "--before",
        default=None,
        help="a checkout of an earlier commit of this project: each rm.py row "
        "also runs from there, as ROW@before (before/after comparisons of one change)",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    assert all("," not in row for row in MODES), "--rows is comma-separated: a row's name cannot hold a comma"

    if args.child:  # one row, in its own process
        work, row = args.child.split("::")
        task_args = argparse.Namespace(**json.load(open(os.path.join(work, "settings.json"))))
        mode, before = row.removesuffix("@before"), row.endswith("@before")
        result = (
            child_trl(work, task_args)
            if row == "trl"
            else child_rm(work, task_args, MODES[mode], os.path.abspath(args.before) if before else ROOT)
        )
        import torch

        result["peak_memory_mb"] = (
            torch.cuda.max_memory_allocated() / 2**20
            if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        with open(os.path.join(work, "result.json"), "w") as f:
            json.dump(result, f)
        return

    if any(t.startswith("hh-") for t in args.tasks.split(",")) and not os.path.exists(HH):
        sys.exit(f"HH-RLHF pairs not found at {HH}; run with --tasks embedded")
    work_root = args.work or tempfile.mkdtemp(prefix="bench_rm_")
    peak = matmul_peak(args.device, args.bf16)
    report = {
        "device": args.device,
        "bf16": args.bf16,
        "matmul_peak_gflops": peak / 1e9,
        "batch": args.batch,
        "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d"),
        "tasks": [],
    }
    for task in args.tasks.split(","):
        pairs, eval_pairs, max_length, vocab_size = TASKS[task]
        task_args = argparse.Namespace(
            **{
                **vars(args),
                "pairs": args.pairs or pairs,
                "vocab_size": vocab_size,
                "eval_pairs": args.eval_pairs or eval_pairs,
                "max_length": args.max_length or max_length,
            }
        )
        work = os.path.join(work_root, task)
        info = prepare_task(task, task_args, work)
        runs = {
            row: []
            for r in args.rows.split(",")
            for row in ([r + "@before"] if args.before and r != "trl" else []) + [r]
        }
        for _ in range(args.repeats):  # rows interleaved, so that a slow spell of the machine hits every row
            for row in runs:
                env = dict(os.environ, TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
                start = time.time()
                proc = subprocess.run(
                    [sys.executable, __file__, "--child", f"{work}::{row}", *sys.argv[1:]],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                wall = time.time() - start
                if proc.returncode != 0:
                    sys.exit(f"{row} on {task} failed:\n{proc.stderr[-3000:]}")
                r = json.load(open(os.path.join(work, "result.json")))
                runs[row].append(
                    {
                        **r,
                        "process_seconds": wall,
                        "pairs_per_s": r["pairs_trained"] / r["train_seconds"],
                        "process_pairs_per_s": r["pairs_trained"] / wall,
                    }
                )
        rows = []
        for row, rs in runs.items():
            best = lambda k: max(x[k] for x in rs)  # noqa: E731, B023 - used within this iteration
            rows.append(
                {
                    "row": row,
                    "runs": rs,
                    "pairs_trained": rs[0]["pairs_trained"],
                    "pairs_per_s": best("pairs_per_s"),
                    "process_pairs_per_s": best("process_pairs_per_s"),
                    "pairs_per_s_range": [min(x["pairs_per_s"] for x in rs), best("pairs_per_s")],
                    "process_pairs_per_s_range": [
                        min(x["process_pairs_per_s"] for x in rs),
                        best("process_pairs_per_s"),
                    ],
                    "tokens_per_s": best("pairs_per_s") * info["tokens_per_pair"],
                    "process_tokens_per_s": best("process_pairs_per_s") * info["tokens_per_pair"],
                    "peak_memory_mb": max(x["peak_memory_mb"] for x in rs),
                    "accuracy": rs[0]["accuracy"],
                    "mfu": best("pairs_per_s") * info["flops_per_pair"] / peak,
                }
            )
        trl = next((r for r in rows if r["row"] == "trl"), None)
        for r in rows:
            r["speed_vs_trl"] = r["pairs_per_s"] / trl["pairs_per_s"] if trl else None
            r["process_speed_vs_trl"] = r["process_pairs_per_s"] / trl["process_pairs_per_s"] if trl else None
        report["tasks"].append({**info, "rows": rows})
        print(format_table(info, rows, report), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


def format_table(info, rows, report):
    lines = [
        f"\n{info['task']}: {info['train_pairs']} train / {info['eval_pairs']} held-out pairs, {info['tokenizer']}, "
        f"{info['model']}, {info['tokens_per_pair']:.0f} tokens per pair ({info['unique_tokens_per_pair']:.0f} "
        f"without the repeated prompt); {report['device']}, batch {report['batch']}, max_length "
        f"{info['max_length']}, matmul peak {report['matmul_peak_gflops']:.0f} GFLOP/s, best of "
        f"{report['repeats']} (range in brackets)",
        "| row | pairs trained | pairs/s (loop) | pairs/s (process) | tokens/s (process) | peak memory (MB) | "
        "held-out accuracy | MFU (loop) | vs TRL (loop) | vs TRL (process) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = f"{r['speed_vs_trl']:.2f}x" if r["speed_vs_trl"] else "-"
        vs_p = f"{r['process_speed_vs_trl']:.2f}x" if r["process_speed_vs_trl"] else "-"
        lo, hi = r["pairs_per_s_range"]
        plo, phi = r["process_pairs_per_s_range"]
        lines.append(
            f"| {r['row']} | {r['pairs_trained']} | {hi:.2f} [{lo:.2f}] | {phi:.2f} [{plo:.2f}] | "
            f"{r['process_tokens_per_s']:.0f} | {r['peak_memory_mb']:.0f} | {r['accuracy']:.3f} | "
            f"{r['mfu']:.1%} | {vs} | {vs_p} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
