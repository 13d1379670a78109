"""README's embedded table: the default pipeline and its variants on the embedded task, each command timed, then the
reward model's accuracy against Bayes on the validation and out-of-distribution splits, and each PPO run's gold on
training batches, validation prompts and out-of-distribution prompts, before and after.

    python benchmarks/bench_embedded.py                      # runs every command in runs/; embedded.json, the table
    python benchmarks/bench_embedded.py --before CHECKOUT    # also times `python rm.py && python ppo.py` there first
    python benchmarks/bench_embedded.py --table_only         # the table again from benchmarks/results/embedded.json
    python benchmarks/bench_embedded.py --collect_only       # the figures again from runs/, keeping the timings

Every command runs in its own process, one after another, with a fresh SFT cache (the first `python ppo.py` trains the
initial policy, as on a new machine). Nothing else should run: the wall times are the figures of README.
Validation figures come from each run's own evaluations (256 distinct prompts before the first update and after the
last); out-of-distribution ones from `ppo.py --eval_only --eval_split ood` of the initial and the trained policy.
A standard error is over distinct prompts. The paired one is that of the per-prompt difference between the first and
the last evaluation, which read the same prompts with the same random streams.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "benchmarks", "results", "embedded.json")
PPO_RUNS = {
    "runs/ppo": [],
    "runs/ppo-kl0.05": ["--kl_coef", "0.05"],
    "runs/ppo-gold": ["--reward_fn", "common:gold_rewards"],
}


def timed(cmd, cwd, env):
    """Runs one command and returns its wall time in seconds; stops the benchmark if it fails."""
    start = time.time()
    proc = subprocess.run([sys.executable, *cmd], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stderr[-3000:]}")
    return time.time() - start


def mean_se(values):
    n = len(values)
    mean = sum(values) / n
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def ppo_row(path, ood_before, ood_after, n=5):
    """One PPO run's figures: training batches' gold (first and last n updates), validation gold before and after with
    the paired standard error of the change, out-of-distribution gold before and after, KL and distinct-2."""
    metrics = read_jsonl(os.path.join(path, "metrics.jsonl"))
    updates, evals = [m for m in metrics if "objective/kl" in m], [m for m in metrics if "eval/gold" in m]
    samples = read_jsonl(os.path.join(path, "eval_samples.jsonl"))
    first = {s["prompt"]: s["gold"] for s in samples if s["step"] == evals[0]["step"]}
    last = {s["prompt"]: s["gold"] for s in samples if s["step"] == evals[-1]["step"]}
    change, change_se = mean_se([last[p] - first[p] for p in first])
    mean = lambda rows, k: sum(m[k] for m in rows) / len(rows)  # noqa: E731
    return {
        "train_gold": [mean(updates[:n], "gold/mean"), mean(updates[-n:], "gold/mean")],
        "train_proxy": [mean(updates[:n], "objective/scores"), mean(updates[-n:], "objective/scores")],
        "validation_gold": [
            [evals[0]["eval/gold"], evals[0]["eval/gold_se"]],
            [evals[-1]["eval/gold"], evals[-1]["eval/gold_se"]],
        ],
        "validation_change": [change, change_se, change / change_se],
        "validation_prompts": len(first),
        "ood_gold": [[r["eval/gold"], r["eval/gold_se"]] for r in (ood_before, ood_after)],
        "kl": [evals[-1]["eval/kl"], ood_after["eval/kl"]],
        "distinct_1": [evals[0]["eval/distinct_1"], evals[-1]["eval/distinct_1"], ood_after["eval/distinct_1"]],
        "distinct_2": [evals[0]["eval/distinct_2"], evals[-1]["eval/distinct_2"], ood_after["eval/distinct_2"]],
        "updates": len(updates),
    }


def bayes_accuracy_of_splits():
    """Each embedded split's Bayes-optimal accuracy, mean of max(p, 1 - p) with p the gold's P(chosen wins)."""
    sys.path.insert(0, ROOT)
    import common

    out = {}
    for split in common.EMBEDDED_SPLITS:
        rows = common.load_rows("embedded", split=split)
        p = [1 / (1 + math.exp(-common.PREFERENCE_BETA * (r["gold_chosen"] - r["gold_rejected"]))) for r in rows]
        out[split] = {
            "bayes_accuracy": sum(max(q, 1 - q) for q in p) / len(p),
            "pairs": len(rows),
            "prompts": len({r["prompt"] for r in rows}),
        }
    return out


def run(before):
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", XDG_CACHE_HOME=tempfile.mkdtemp())
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
    }
    if before:  # the same two commands in another checkout, first, with its own fresh cache
        old_env = dict(env, XDG_CACHE_HOME=tempfile.mkdtemp())
        result["before"] = {
            "checkout": subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=before, capture_output=True, text=True
            ).stdout.strip(),
            "rm_s": timed(["rm.py", "--overwrite_output_dir"], before, old_env),
            "ppo_s": timed(["ppo.py", "--overwrite_output_dir"], before, old_env),
        }
        print(f"before: {result['before']}", flush=True)
    result["rm_s"] = timed(["rm.py", "--overwrite_output_dir"], ROOT, env)
    timed(
        [
            "rm.py",
            "--eval_only",
            "--eval_split",
            "ood",
            "--model_name_or_path",
            "runs/rm",
            "--output_dir",
            "runs/rm-ood",
            "--overwrite_output_dir",
        ],
        ROOT,
        env,
    )
    result["ppo_s"] = {
        path: timed(["ppo.py", *flags, "--output_dir", path, "--overwrite_output_dir"], ROOT, env)
        for path, flags in PPO_RUNS.items()
    }
    for name, model in [("initial", "embedded-llama"), *[(p, p) for p in PPO_RUNS]]:
        out = f"runs/ood-{os.path.basename(name)}"
        timed(
            [
                "ppo.py",
                "--eval_only",
                "--eval_split",
                "ood",
                "--sft_model_path",
                model,
                "--output_dir",
                out,
                "--overwrite_output_dir",
            ],
            ROOT,
            env,
        )
    return collect(result)


def collect(result):
    """Adds the figures of the runs' files in runs/ to result and writes benchmarks/results/embedded.json."""

    def ood(name):
        with open(os.path.join(ROOT, f"runs/ood-{os.path.basename(name)}", "eval_results.json")) as f:
            return json.load(f)

    rm_eval = {
        split: json.load(open(os.path.join(ROOT, path, "eval_results.json")))
        for split, path in (("validation", "runs/rm"), ("ood", "runs/rm-ood"))
    }
    result["rm"] = {
        split: {k: ev[k] for k in ("accuracy", "bayes_accuracy", "accuracy_vs_bayes", "num_pairs") if k in ev}
        for split, ev in rm_eval.items()
    }
    result["ppo"] = {path: ppo_row(os.path.join(ROOT, path), ood("initial"), ood(path)) for path in PPO_RUNS}
    result["bayes_accuracy"] = bayes_accuracy_of_splits()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    return result


def table(r):
    """README's rows, from the benchmark's JSON."""
    v, o = r["rm"]["validation"], r["rm"]["ood"]
    lines = [
        f"| `python rm.py` | validation: accuracy {v['accuracy']:.4f} vs Bayes {v['bayes_accuracy']:.4f}, **"
        f"{v['accuracy_vs_bayes']:.3f} of Bayes**; ood: {o['accuracy']:.4f} vs {o['bayes_accuracy']:.4f}, **"
        f"{o['accuracy_vs_bayes']:.3f}** | | | {r['rm_s']:.0f} s |"
    ]
    commands = {
        "runs/ppo": "`python ppo.py`",
        "runs/ppo-kl0.05": "`python ppo.py --kl_coef 0.05`",
        "runs/ppo-gold": "`python ppo.py --reward_fn common:gold_rewards`",
    }
    for path, p in r["ppo"].items():
        (v0, s0), (v1, s1) = p["validation_gold"]
        (o0, t0), (o1, t1) = p["ood_gold"]
        change, se, z = p["validation_change"]
        lines.append(
            f"| {commands[path]} | {p['train_gold'][0]:.3f} → **{p['train_gold'][1]:.3f}** "
            f"({p['train_proxy'][0]:.2f} → {p['train_proxy'][1]:.2f}) | {v0:.3f} ± {s0:.3f} → **{v1:.3f} ± "
            f"{s1:.3f}** ({change:+.3f} ± {se:.3f} paired: {z:.0f} s.e.) | {o0:.3f} ± {t0:.3f} → **{o1:.3f} ± "
            f"{t1:.3f}** | {p['kl'][0]:.1f} / {p['kl'][1]:.1f} | {p['distinct_1'][0]:.3f} → "
            f"{p['distinct_1'][1]:.3f} | {r['ppo_s'][path]:.0f} s |"
        )
    lines.append(
        "\n"
        + ", ".join(
            f"{s} {v['bayes_accuracy']:.4f} ({v['pairs']:,} pairs, {v['prompts']:,} prompts)"
            for s, v in r["bayes_accuracy"].items()
        )
    )
    if "before" in r:
        b = r["before"]
        now = r["rm_s"] + r["ppo_s"]["runs/ppo"]
        lines.append(
            f"\n`python rm.py && python ppo.py`: {now:.0f} s ({r['rm_s']:.0f} + {r['ppo_s']['runs/ppo']:.0f}) "
            f"against {b['rm_s'] + b['ppo_s']:.0f} s ({b['rm_s']:.0f} + {b['ppo_s']:.0f}) at {b['checkout']}: "
            f"{now / (b['rm_s'] + b['ppo_s']):.2f}x"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="a checkout whose `python rm.py && python ppo.py` is timed first")
    parser.add_argument("--table_only", action="store_true")
    parser.add_argument("--collect_only", action="store_true", help="read runs/ again, keeping the JSON's timings")
    args = parser.parse_args()
    if args.table_only or args.collect_only:
        with open(OUT) as f:
            result = json.load(f)
        result = collect(result) if args.collect_only else result
    else:
        result = run(args.before)
    print(table(result))


if __name__ == "__main__":
    main()
