"""Compares two ppo.py runs prompt by prompt, from their eval_samples.jsonl.

    python benchmarks/compare_runs.py runs/ppo-a runs/ppo-b               # each run's last evaluation
    python benchmarks/compare_runs.py runs/ppo runs/ppo --step_a 0        # one run's first evaluation against its last

A run is a folder holding eval_samples.jsonl (ppo.py's, or --eval_only's), or the file itself. Each evaluation's rows
hold one response to each eval prompt and its measures. The two evaluations must be of the same prompts: ppo.py draws
them and their random streams by --eval_seed, not --seed, so runs of any seed or setting pair. For each measure both
hold, the table gives both means, the mean of the per-prompt differences B - A, and its paired standard error: the
sample std of the differences over sqrt(n). Pairing removes the prompts' own spread from the comparison, so a change
far smaller than either mean's standard error can still be resolved. Works for any dataset. Two runs of different
prompts are refused in one line, exit code 2.
"""

import argparse
import json
import math
import os
import sys


class Refused(Exception):
    """A comparison that cannot be made, said in one line."""


def read_evaluation(run, step):
    """Returns one evaluation's rows of a run, by prompt text, and its step: the step asked, else the last."""
    path = os.path.join(run, "eval_samples.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise Refused(f"{run}: no eval_samples.jsonl; pass a ppo.py output folder or the file")
    by_step = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                row = json.loads(line)
                step_of_row, _ = int(row["step"]), str(row["prompt"])
                by_step.setdefault(step_of_row, []).append(row)
            except (ValueError, KeyError, TypeError):
                raise Refused(
                    f"{path}, line {n}: not a row of ppo.py's eval_samples.jsonl (step, prompt, measures)"
                ) from None
    if not by_step:
        raise Refused(f"{path}: no evaluation in it")
    chosen = max(by_step) if step is None else step
    if chosen not in by_step:
        raise Refused(f"{path}: no evaluation at step {step}; its steps: {', '.join(map(str, sorted(by_step)))}")
    rows = {}
    for row in by_step[chosen]:
        if row["prompt"] in rows:
            raise Refused(f"{path}: the evaluation at step {chosen} holds one prompt twice; rows must be distinct")
        rows[row["prompt"]] = row
    return rows, chosen


def paired(a, b):
    """Returns, for each numeric measure both evaluations hold, (mean A, mean B, mean of B - A, paired standard error,
    n). The evaluations must be of the same prompts."""
    if a.keys() != b.keys():
        only_a, only_b = len(a.keys() - b.keys()), len(b.keys() - a.keys())
        raise Refused(
            f"the runs evaluated different prompts ({only_a} only in A, {only_b} only in B, {len(a.keys() & b.keys())} "
            "in both); evaluate both with one --eval_seed, --num_eval_prompts and eval split"
        )
    first = next(iter(a.values()))
    names = [
        k
        for k, v in first.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and k in next(iter(b.values()))
    ]
    out = {}
    for name in names:
        keys = [p for p in a if name in a[p] and name in b[p]]
        diffs = [b[p][name] - a[p][name] for p in keys]
        n = len(diffs)
        mean = sum(diffs) / n
        se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else 0.0
        out[name] = (sum(a[p][name] for p in keys) / n, sum(b[p][name] for p in keys) / n, mean, se, n)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_a", help="a ppo.py output folder, or its eval_samples.jsonl")
    parser.add_argument("run_b", help="the other run")
    parser.add_argument("--step_a", type=int, default=None, help="A's evaluation at this step (default: its last)")
    parser.add_argument("--step_b", type=int, default=None, help="B's evaluation at this step (default: its last)")
    parser.add_argument("--json", default=None, help="also write the comparison to this file")
    args = parser.parse_args(argv)
    try:
        a, step_a = read_evaluation(args.run_a, args.step_a)
        b, step_b = read_evaluation(args.run_b, args.step_b)
        table = paired(a, b)
    except Refused as e:
        print(f"compare_runs.py: {e}", file=sys.stderr)
        return 2
    print(f"A: {args.run_a} at step {step_a}; B: {args.run_b} at step {step_b}; {len(a)} prompts, paired")
    print("| measure | A | B | B - A | paired s.e. | (B - A) / s.e. |\n|---|---|---|---|---|---|")
    for name, (mean_a, mean_b, diff, se, _) in table.items():
        z = f"{diff / se:+.1f}" if se > 0 else "–"
        print(f"| {name} | {mean_a:.4f} | {mean_b:.4f} | {diff:+.4f} | {se:.4f} | {z} |")
    if args.json:
        keys = ("mean_a", "mean_b", "difference", "paired_se", "prompts")
        with open(args.json, "w") as f:
            json.dump({name: dict(zip(keys, v)) for name, v in table.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
