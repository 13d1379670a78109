"""GAE against the critic-free estimators (RLOO, GRPO, Dr. GRPO, REINFORCE++) on the embedded task, at equal episodes:
gold score against episodes and against wall time, the KL reached, time per update and peak memory, over seeds.

    python rm.py                                   # the reward model of the proxy rows (runs/rm)
    python benchmarks/bench_estimators.py          # ~20 minutes on 2 CPU cores; benchmarks/results/estimators.json
    python benchmarks/bench_estimators.py --plot_only   # the figure and table again from the JSON

Rows: gae (ppo.py's defaults: a critic initialised from the reward model, 1 response per prompt); rloo, grpo, dr_grpo
(grpo --no_scale_rewards --loss_aggregation constant) and reinforce_pp, each with 4 responses per prompt and no
critic. Each row trains on the reward model (`proxy`: the gold score is then what the proxy is meant to measure) and
on the gold reward itself as a rule (`--reward_fn common:gold_rewards`). Everything else is gae's default (KL in the
reward, k1, token_mean, kl_coef 0.1, rollout batch 32, 4 PPO epochs), so the rows differ in the estimator alone (and
Dr. GRPO's average). grpo's own defaults (KL in the loss, k3, sequence_mean) are pinned to gae's here. Every run is
its own process, one after the other, on an otherwise idle machine; peak memory is its peak
resident set (VmHWM).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ESTIMATORS = {
    "gae": {},
    "rloo": dict(advantage_estimator="rloo", num_samples_per_prompt=4),
    "grpo": dict(
        advantage_estimator="grpo", num_samples_per_prompt=4, kl_penalty="reward", loss_aggregation="token_mean"
    ),
    "dr_grpo": dict(
        advantage_estimator="grpo",
        num_samples_per_prompt=4,
        scale_rewards=False,
        kl_penalty="reward",
        loss_aggregation="constant",
    ),
    "reinforce_pp": dict(advantage_estimator="reinforce_pp", num_samples_per_prompt=4),
}
REWARDS = {"proxy": dict(reward_model_path="runs/rm"), "gold": dict(reward_fn="common:gold_rewards")}
COLORS = {"gae": "black", "rloo": "tab:blue", "grpo": "tab:orange", "dr_grpo": "tab:green", "reinforce_pp": "tab:red"}


def run_row(spec):
    """One run in this process: ppo.main on the row's flags; prints its history, wall time and peak memory as JSON."""
    import ppo

    args = ppo.Args(**{"num_evals": 0, **spec}, sample_every=10**9)  # training alone, unless a row evaluates
    t = time.time()
    history = ppo.main(args)
    wall = time.time() - t
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f if "perf/time_rollout" in line]
    with open("/proc/self/status") as f:  # this process's own peak resident set
        peak_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    keep = ("step", "episodes", "gold/mean", "objective/kl", "objective/scores")
    print(
        "RESULT "
        + json.dumps(
            {
                "wall_s": wall,
                "peak_rss_mb": peak_kb / 1024,
                "history": [
                    {k: round(v, 5) if isinstance(v, float) else v for k, v in h.items() if k in keep} for h in history
                ],
                "update_s": [
                    round(m["perf/time_rollout"] + m["perf/time_score"] + m["perf/time_learn"], 5) for m in metrics
                ],
            }
        )
    )


def smooth(xs, window=10):
    return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def summarize(runs):
    """Per estimator and reward: the mean and spread (min, max) over seeds of each row's numbers."""

    def mean_of(h, key, part):
        xs = [x[key] for x in (h[:5] if part == "first" else h[-5:])]
        return sum(xs) / len(xs)

    table = {}
    for r in runs:
        h = r["history"]
        row = {
            "gold_first": mean_of(h, "gold/mean", "first"),
            "gold_last": mean_of(h, "gold/mean", "last"),
            "kl_last": mean_of(h, "objective/kl", "last"),
            "update_s": sum(r["update_s"]) / len(r["update_s"]),
            "peak_rss_mb": r["peak_rss_mb"],
            "wall_s": r["wall_s"],
        }
        for k, v in row.items():
            table.setdefault((r["estimator"], r["reward"]), {}).setdefault(k, []).append(v)
    return table


def report(runs, out_png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import common

    table = summarize(runs)
    lines = [
        "| reward | estimator | gold score, first → last 5 updates | KL at the end | time per update (s) | "
        "peak memory (MB) |",
        "|---|---|---|---|---|---|",
    ]
    fmt = lambda xs, p=2: f"{sum(xs) / len(xs):.{p}f} ({min(xs):.{p}f}–{max(xs):.{p}f})"  # noqa: E731
    for (estimator, reward), row in table.items():
        lines.append(
            f"| {reward} | {estimator} | {fmt(row['gold_first'])} → **{fmt(row['gold_last'])}** | "
            f"{fmt(row['kl_last'], 1)} | {fmt(row['update_s'], 3)} | {fmt(row['peak_rss_mb'], 0)} |"
        )
    print("\n".join(lines))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for i, reward in enumerate(REWARDS):
        for estimator in ESTIMATORS:
            rows = [r for r in runs if r["estimator"] == estimator and r["reward"] == reward]
            if not rows:
                continue
            n = min(len(r["history"]) for r in rows)
            curves = [smooth([h["gold/mean"] for h in r["history"][:n]]) for r in rows]
            mean = [sum(c[j] for c in curves) / len(curves) for j in range(n)]
            low, high = ([f(c[j] for c in curves) for j in range(n)] for f in (min, max))
            episodes = [h["episodes"] for h in rows[0]["history"][:n]]
            seconds = [sum(sum(r["update_s"][: j + 1]) for r in rows) / len(rows) for j in range(n)]
            for ax, x in ((axes[i, 0], episodes), (axes[i, 1], seconds)):
                ax.plot(x, mean, color=COLORS[estimator], label=f"{estimator} ({len(rows)} seeds)")
                ax.fill_between(x, low, high, color=COLORS[estimator], alpha=0.15)
        what = "the reward model (proxy)" if reward == "proxy" else "the gold reward"
        axes[i, 0].set(title=f"Trained on {what}", xlabel="episodes", ylabel="gold score (10-update mean)")
        axes[i, 1].set(
            title=f"Trained on {what}", xlabel="seconds of training (2 CPU cores)", ylabel="gold score (10-update mean)"
        )
        axes[i, 0].legend(fontsize=8)
    common.save_figure(fig, out_png)
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=list(ESTIMATORS))
    parser.add_argument("--rewards", nargs="+", default=list(REWARDS), choices=list(REWARDS))
    parser.add_argument("--total_episodes", type=int, default=6144)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "estimators.json"))
    parser.add_argument("--plot_only", action="store_true")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        return run_row(json.loads(args.row))
    if not args.plot_only:
        if "proxy" in args.rewards and not os.path.exists(os.path.join(ROOT, "runs", "rm", "config.json")):
            sys.exit("no reward model at runs/rm: run `python rm.py` first")
        runs, scratch = [], os.path.join(ROOT, "runs", "bench-estimators")
        for seed in args.seeds:  # seeds outermost: a cut-short benchmark still has every row at some seeds
            for reward in args.rewards:
                for estimator in args.estimators:
                    spec = dict(
                        ESTIMATORS[estimator],
                        **REWARDS[reward],
                        seed=seed,
                        total_episodes=args.total_episodes,
                        overwrite_output_dir=True,
                        output_dir=os.path.join(scratch, f"{estimator}-{reward}-{seed}"),
                    )
                    proc = subprocess.run(
                        [sys.executable, __file__, "--row", json.dumps(spec)],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        env=dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1"),
                    )
                    if proc.returncode:
                        sys.exit(f"{estimator} {reward} seed {seed} failed:\n{proc.stderr[-3000:]}")
                    result = json.loads(
                        next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:]
                    )
                    runs.append(dict(result, estimator=estimator, reward=reward, seed=seed))
                    h = result["history"]
                    print(
                        f"{estimator:>12} {reward:>5} seed {seed}: gold {h[0]['gold/mean']:.3f} -> "
                        f"{h[-1]['gold/mean']:.3f}, KL {h[-1]['objective/kl']:.2f}, {result['wall_s']:.0f} s, "
                        f"peak {result['peak_rss_mb']:.0f} MB",
                        flush=True,
                    )
                    with open(args.out, "w") as f:
                        json.dump(
                            {"date": time.strftime("%Y-%m-%d"), "total_episodes": args.total_episodes, "runs": runs}, f
                        )
    runs = json.load(open(args.out))["runs"]
    report(runs, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
