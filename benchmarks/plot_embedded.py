"""The embedded task's PPO runs on one figure: gold score against sqrt(KL) for a policy trained on the learned reward
model (kl_coef 0.1 and 0.05) and one trained on the gold reward itself (--reward_fn common:gold_rewards), the
comparison of Gao et al. 2022; the held-out evaluations as markers. Run after:

    python rm.py && python ppo.py && python ppo.py --kl_coef 0.05 --output_dir runs/ppo-kl0.05 \
        && python ppo.py --reward_fn common:gold_rewards --output_dir runs/ppo-gold
    python benchmarks/plot_embedded.py      # writes benchmarks/results/embedded_gold_vs_kl.png
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

RUNS = {
    "runs/ppo": "reward model, kl_coef 0.1 (default)",
    "runs/ppo-kl0.05": "reward model, kl_coef 0.05",
    "runs/ppo-gold": "gold reward itself (--reward_fn)",
}


def smooth(x, k=9):
    return np.convolve(np.pad(x, (k // 2, k // 2), mode="edge"), np.ones(k) / k, mode="valid")


def main(out="benchmarks/results/embedded_gold_vs_kl.png"):
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (path, label), color in zip(RUNS.items(), ["tab:red", "tab:purple", "tab:gray"]):
        with open(os.path.join(path, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        ms, evals = [m for m in lines if "objective/kl" in m], [m for m in lines if "eval/gold" in m]
        episodes = np.array([m["episodes"] for m in ms])
        gold, proxy = np.array([m["gold/mean"] for m in ms]), np.array([m["objective/scores"] for m in ms])
        kl = np.sqrt(np.maximum([m["objective/kl"] for m in ms], 0))
        left.plot(smooth(kl), smooth(gold), color=color, label=f"gold score; policy trained on the {label}")
        if path != "runs/ppo-gold":
            left.plot(smooth(kl), smooth(proxy), "--", color=color, alpha=0.6, label=f"proxy score ({label})")
        right.plot(episodes, smooth(gold), color=color, label=label)
        if evals:  # held-out prompts, never trained on
            left.plot(
                [max(m["eval/kl"], 0) ** 0.5 for m in evals],
                [m["eval/gold"] for m in evals],
                "o",
                color=color,
                mec="black",
                label=f"held-out gold ({label})",
            )
            right.errorbar(
                [m["episodes"] for m in evals],
                [m["eval/gold"] for m in evals],
                [m["eval/gold_se"] for m in evals],
                fmt="o",
                color=color,
                mec="black",
                capsize=2,
            )
    left.set(
        title="Score against sqrt(KL to the reference), 9-update moving average",
        xlabel="sqrt(KL)",
        ylabel="mean score per episode",
    )
    left.legend(fontsize=7)
    right.set(
        title="Gold score during training (dots: held-out prompts, +- s.e.)",
        xlabel="episodes",
        ylabel="mean gold score",
    )
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")
    summary()


def summary(n=5):
    """Prints rm.py's held-out accuracy against Bayes and each PPO run's means over its first and last n updates."""
    if os.path.exists("runs/rm/eval_results.json"):
        with open("runs/rm/eval_results.json") as f:
            ev = json.load(f)
        print(
            "rm: "
            + ", ".join(
                f"{k} {ev[k]:.4f}" for k in ("accuracy", "bayes_accuracy", "accuracy_vs_bayes", "calibration_error")
            )
        )
    for path in RUNS:
        with open(os.path.join(path, "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        ms, evals = [m for m in lines if "objective/kl" in m], [m for m in lines if "eval/gold" in m]
        first, last = ms[:n], ms[-n:]
        mean = lambda rows, k: np.mean([m[k] for m in rows])  # noqa: E731
        print(
            f"{path}: {len(ms)} updates of {ms[0]['episodes']} episodes; gold {mean(first, 'gold/mean'):.3f} -> "
            f"{mean(last, 'gold/mean'):.3f} (initial std {mean(first, 'gold/std'):.3f}: "
            f"{(mean(last, 'gold/mean') - mean(first, 'gold/mean')) / mean(first, 'gold/std'):+.1f} std); proxy "
            f"{mean(first, 'objective/scores'):.2f} -> {mean(last, 'objective/scores'):.2f}; KL "
            f"{mean(last, 'objective/kl'):.1f}; EOS rate {mean(last, 'response/eos_rate'):.2f}"
            + (
                f"; held-out gold {evals[0]['eval/gold']:.3f} +- {evals[0]['eval/gold_se']:.3f} -> "
                f"{evals[-1]['eval/gold']:.3f} +- {evals[-1]['eval/gold_se']:.3f}, KL {evals[-1]['eval/kl']:.1f}"
                if evals
                else ""
            )
        )


if __name__ == "__main__":
    main()
