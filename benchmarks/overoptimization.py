"""Reward-model overoptimization (Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model Overoptimization") on
the embedded task, whose gold reward is known exactly.

    python benchmarks/overoptimization.py            # the sweep; benchmarks/results/overoptimization.{json,png}
    python benchmarks/overoptimization.py --quick    # the smallest setting (tests/test_overoptimization.py runs it)
    python benchmarks/overoptimization.py --plot_only   # the figure and table again from the JSON

What it measures, per seed (the seed of the reward model's initialisation, its share of the 40,000 training pairs and
their order; of the initial policy and of every sample):
  1. Reward models of several strengths: `rm.py` on 125, 500, 2,000 and 8,000 preference pairs, each with its
     held-out accuracy (4,000 pairs) beside the Bayes-optimal accuracy the task knows exactly.
  2. Best-of-n: one pool of N responses per prompt from the initial policy (ppo.py's, seeded as a run with that seed),
     scored by every reward model and by the gold reward. The gold (and proxy) score of the response the proxy ranks
     first among n drawn without replacement from the pool, in expectation over the draws: sorting a prompt's pool by
     proxy score, the i-th lowest (1-based) is the best of n with probability C(i-1, n-1) / C(N, n) (the paper's
     unbiased estimator). Its KL to the initial policy is log n - (n-1)/n.
  3. RL: `ppo.py` against each reward model, and against the gold reward itself (the ceiling), with no KL penalty
     (as the paper's main runs: the KL travelled is the x axis). Every 4 updates (128 episodes), ppo.py's held-out
     evaluation gives one point, as Gao et al. measure it: on prompts never trained on, the mean gold score, the mean
     proxy score and d = sqrt(mean KL to the initial policy), from the same responses. ppo.py's defaults otherwise (a
     smaller learning rate spread the rise over more points but fitted the RL form worse: benchmarks/README.md).
     The KL penalty (the paper's sec. 3.6): the same runs against one reward model with --kl_coef above 0, their gold
     against d beside the run with no penalty (overoptimization_kl.png).
  4. Fits, per reward model, of the gold score relative to the initial policy's: R_bon(d) = d (alpha - beta d) and
     R_RL(d) = d (alpha - beta log d), least squares through the origin on the mean curve over seeds (the mean d and
     score at each n, or after each update), with R^2 and the peak (d* = alpha / 2 beta, height alpha^2 / 4 beta;
     d* = exp(alpha / beta - 1), height beta d*); each seed's own fit gives the spread.
The proxy score is drawn divided by PREFERENCE_BETA: labels are sigmoid(beta (gold_a - gold_b)), so a reward model
learns beta x gold, and proxy / beta is on the gold's scale. Everything runs in this one process, one run after another.
"""

import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

# kl_coefs: the KL-penalty runs, against the reward model of kl_pairs pairs, beside its run with no penalty.
FULL = dict(
    sizes=[125, 500, 2000, 8000],
    seeds=[1, 2, 3, 4],
    pool=512,
    max_n=256,
    episodes=4096,
    eval_prompts=128,
    kl_coefs=[0.03, 0.1],
    kl_pairs=2000,
)
QUICK = dict(
    sizes=[125, 2000], seeds=[1], pool=64, max_n=32, episodes=2048, eval_prompts=64, kl_coefs=[0.1], kl_pairs=2000
)
UPDATES_PER_POINT = 4
COLORS = ["tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple"]


def train_reward_model(size, seed, out):
    import rm

    args = rm.Args(
        dataset_mixer_list=["embedded", str(size)], seed=seed, num_evals=1, output_dir=out, overwrite_output_dir=True
    )  # the sweep's own scratch folder: a second sweep replaces the first
    common.exit_on_user_error(rm.main, args)
    ev = json.load(open(os.path.join(out, "eval_results.json")))
    return {"accuracy": ev["accuracy"], "bayes_accuracy": ev["bayes_accuracy"]}


def best_of_n_pool(seed, pool, rm_dirs):
    """A pool of `pool` responses to each of 48 validation prompts from ppo.py's initial policy of this seed, with
    each response's gold score and every reward model's (normalized, as ppo.py scores it): arrays (48, pool)."""
    import ppo

    args = ppo.Args(seed=seed, reward_model_path=rm_dirs[0])
    tokenizer = ppo.load_tokenizer(args)
    stop_id = ppo.stop_token_id(args, tokenizer)
    policy = ppo.load_policy(args, tokenizer)
    rng, prompts = random.Random(0), []
    while len(prompts) < 48:  # 48 distinct validation prompts, never trained on
        prompts += [p] if (p := common.embedded_prompt(rng, "validation")) not in prompts else []
    ids = common.tokenize_prompts(tokenizer, prompts)
    rewards = [ppo.load_reward(ppo.Args(seed=seed, reward_model_path=d), tokenizer) for d in rm_dirs]
    gold, proxy = np.zeros((len(prompts), pool)), np.zeros((len(rm_dirs), len(prompts), pool))
    for i, (p, p_ids) in enumerate(zip(prompts, ids)):
        episodes = range(10**9 + i * pool, 10**9 + (i + 1) * pool)  # sampling streams no PPO run of 4,096 uses
        seeds = [common.seed_of(seed, "sampling", e) for e in episodes]
        batch = ppo.rollout(policy, [p_ids] * pool, seeds, args, stop_id, tokenizer.pad_token_id)
        for j, reward in enumerate(rewards):
            texts = ppo.score(reward, batch, [p] * pool, tokenizer, stop_id, args)
            proxy[j, i] = batch.scores.numpy()
        gold[i] = common.gold_rewards([p] * pool, texts)
    return gold, proxy


def best_of_n(proxy, values, n):
    """The unbiased estimate of E[values of the response ranked first by proxy among n drawn without replacement],
    from each row's pool of N: the i-th lowest proxy score (1-based) is the best of n with probability
    C(i-1, n-1) / C(N, n). Averaged over rows (prompts)."""
    N = proxy.shape[1]
    i = np.arange(1, N + 1)
    log_c = lambda a, b: math.lgamma(a + 1) - math.lgamma(b + 1) - math.lgamma(a - b + 1)  # noqa: E731
    weight = np.array([math.exp(log_c(k - 1, n - 1) - log_c(N, n)) if k >= n else 0.0 for k in i])
    order = np.argsort(proxy, axis=1, kind="stable")
    return float((np.take_along_axis(values, order, 1) @ weight).mean())


def rl_run(seed, episodes, out, rm_dir=None, kl_coef=0.0, eval_prompts=256):
    """ppo.py against a reward model (or the gold reward, rm_dir None): one point per UPDATES_PER_POINT updates, and
    one before the first, from its held-out evaluations: (d, mean gold score, mean proxy score)."""
    import ppo

    reward = dict(reward_model_path=rm_dir) if rm_dir else dict(reward_fn="common:gold_rewards")
    updates = episodes // (ppo.Args.per_device_train_batch_size * ppo.Args.num_mini_batches)
    args = ppo.Args(
        **reward,
        seed=seed,
        kl_coef=kl_coef,
        total_episodes=episodes,
        output_dir=out,
        sample_every=10**9,
        overwrite_output_dir=True,
        num_evals=updates // UPDATES_PER_POINT,
        num_eval_prompts=eval_prompts,
    )
    history = common.exit_on_user_error(ppo.main, args)
    return [
        {"d": math.sqrt(max(h["eval/kl"], 0.0)), "gold": h["eval/gold"], "proxy": h["eval/score"]}
        for h in history
        if "eval/score" in h
    ]


def fit(d, r, form):
    """Least squares through the origin of r = d (alpha - beta d) (bon) or d (alpha - beta log d) (rl): alpha, beta,
    R^2, and the peak's d and height (inf where beta <= 0: no peak)."""
    d, r = np.asarray(d, float), np.asarray(r, float)
    keep = d > 0
    d, r = d[keep], r[keep]
    x = np.stack([d, -d * d if form == "bon" else -d * np.log(d)], 1)
    (alpha, beta), *_ = np.linalg.lstsq(x, r, rcond=None)
    r2 = 1 - ((r - x @ [alpha, beta]) ** 2).sum() / ((r - r.mean()) ** 2).sum()
    if beta <= 0:
        peak_d = peak = math.inf
    elif form == "bon":
        peak_d, peak = alpha / (2 * beta), alpha**2 / (4 * beta)
    else:
        peak_d = math.exp(alpha / beta - 1)
        peak = beta * peak_d
    return {"alpha": float(alpha), "beta": float(beta), "r2": float(r2), "peak_d": peak_d, "peak": peak}


def curve(form, f, d):
    return d * (f["alpha"] - f["beta"] * (d if form == "bon" else np.log(np.maximum(d, 1e-9))))


def measure(setting, scratch, out):
    """Every seed's runs, written to `out` as each seed ends (a cut-short sweep keeps its finished seeds)."""
    runs, start = [], time.time()
    ns = [2**k for k in range(int(math.log2(setting["max_n"])) + 1)]
    for seed in setting["seeds"]:
        t = time.time()
        rm_dirs = [os.path.join(scratch, f"rm-{size}-{seed}") for size in setting["sizes"]]
        rms = [train_reward_model(size, seed, d) for size, d in zip(setting["sizes"], rm_dirs)]
        gold, proxy = best_of_n_pool(seed, setting["pool"], rm_dirs)
        for size, rm_result, rm_dir, p in zip(setting["sizes"], rms, rm_dirs, proxy):
            bon = [
                {
                    "n": n,
                    "d": math.sqrt(math.log(n) - (n - 1) / n),
                    "gold": best_of_n(p, gold, n),
                    "proxy": best_of_n(p, p, n),
                }
                for n in ns
            ]
            for kl_coef in [0.0] + (setting["kl_coefs"] if size == setting["kl_pairs"] else []):
                rl = rl_run(
                    seed,
                    setting["episodes"],
                    os.path.join(scratch, f"ppo-{size}-{seed}-kl{kl_coef}"),
                    rm_dir,
                    kl_coef,
                    setting["eval_prompts"],
                )
                runs.append(
                    dict(
                        rm_result,
                        pairs=size,
                        seed=seed,
                        kl_coef=kl_coef,
                        gold_init=float(gold.mean()),
                        proxy_init=float(p.mean()),
                        bon=bon,
                        rl=rl,
                    )
                )
        rl = rl_run(
            seed, setting["episodes"], os.path.join(scratch, f"ppo-gold-{seed}"), eval_prompts=setting["eval_prompts"]
        )
        runs.append(dict(pairs=None, seed=seed, kl_coef=0.0, gold_init=float(gold.mean()), rl=rl))
        print(f"seed {seed}: {time.time() - t:.0f} s", flush=True)
        common.write_json_atomic(
            out, {"date": time.strftime("%Y-%m-%d"), "setting": setting, "wall_s": time.time() - start, "runs": runs}
        )


def relative(run, points, key):
    """A curve's (d, score relative to the initial policy's); proxy scores divided by PREFERENCE_BETA. The initial
    policy's score is the curve's own first point where it is at d = 0 (n = 1; RL's evaluation before the first
    update, on its held-out prompts), else the pool's mean."""
    base, scale = (run["gold_init"], 1.0) if key == "gold" else (run["proxy_init"], common.PREFERENCE_BETA)
    base = points[0][key] if points[0]["d"] == 0 else base
    return [p["d"] for p in points], [(p[key] - base) / scale for p in points]


def mean_curve(group, form, key="gold"):
    """The curve of the mean over seeds at matched point (the same n, or the same update): (d, relative score)."""
    xy = np.array([relative(r, r[form], key) for r in group])  # (seeds, 2, points)
    return list(xy[:, 0].mean(0)), list(xy[:, 1].mean(0))


def summarize(runs):
    """Per reward model (and the gold run): accuracy, and the fits of both forms on the gold score's mean curve over
    seeds; each seed's own fit gives the spread. A run's collapse onto repeated words comes at a different update in
    each seed, so one fit through every seed's raw points mixes curves of different shapes, while the mean curve is
    the expected gold score after k updates, the quantity the paper's forms describe."""
    rows, runs = [], [r for r in runs if not r.get("kl_coef")]  # the KL-penalty runs: kl_report
    for pairs in dict.fromkeys(r["pairs"] for r in runs):
        group = [r for r in runs if r["pairs"] == pairs]
        row = {"pairs": pairs, "seeds": [r["seed"] for r in group]}
        for form in ("bon", "rl") if pairs else ("rl",):
            xy = [relative(r, r[form], "gold") for r in group]
            row[form] = fit(*mean_curve(group, form), form)
            row[form]["seed_fits"] = [fit(x, y, form) for x, y in xy]
            row[form]["max_gold"] = [max(y) for _, y in xy]  # the highest gold point of each seed
            row[form]["last_gold"] = [y[-1] for _, y in xy]
            row[form]["last_proxy"] = [relative(r, r[form], "proxy")[1][-1] for r in group] if pairs else None
        if pairs:
            row["accuracy"] = [r["accuracy"] for r in group]
            row["bayes_accuracy"] = group[0]["bayes_accuracy"]
        rows.append(row)
    return rows


def report(runs, out_png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl_table = kl_report(runs, out_png.replace(".png", "_kl.png"))
    rows, runs = summarize(runs), [r for r in runs if not r.get("kl_coef")]

    def span(xs, p):  # (min–max) over seeds where there are several
        return f" ({min(xs):.{p}f}–{max(xs):.{p}f})" if len(xs) > 1 else ""

    def spread(xs, p=2):  # the mean over seeds, and its span
        return f"{np.mean(xs):.{p}f}" + span(xs, p)

    num = lambda x: "none" if math.isinf(x) else f"{x:.2f}"  # noqa: E731
    lines = [
        "| reward model | held-out accuracy (Bayes-optimal) | method | alpha | beta (per seed) | R^2 (per seed) | "
        "peak d (KL) | peak gold (fit) | highest gold point | last point: gold / proxy |",
        "|---" * 10 + "|",
    ]
    for row in rows:
        name = f"{row['pairs']:,} pairs" if row["pairs"] else "gold reward (ceiling)"
        acc = f"{spread(row['accuracy'], 3)} ({row['bayes_accuracy']:.3f})" if row["pairs"] else "–"
        for form in ("bon", "rl"):
            if form in row:
                f = row[form]
                kl = "" if math.isinf(f["peak_d"]) else f" ({f['peak_d'] ** 2:.1f})"
                last = spread(f["last_gold"]) + (f" / {spread(f['last_proxy'])}" if f["last_proxy"] else "")
                per_seed = lambda key, p: span([x[key] for x in f["seed_fits"]], p)  # noqa: E731, B023 - used at once
                lines.append(
                    f"| {name} | {acc} | {'best-of-n' if form == 'bon' else 'RL'} | {f['alpha']:.3f} | "
                    f"{f['beta']:.3f}{per_seed('beta', 3)} | {f['r2']:.2f}{per_seed('r2', 2)} | "
                    f"{num(f['peak_d'])}{kl} | {num(f['peak'])} | "
                    f"{spread(f['max_gold'])} | {last} |"
                )
    print("\n".join(lines))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for color, pairs in zip(COLORS, dict.fromkeys(r["pairs"] for r in runs)):
        group = [r for r in runs if r["pairs"] == pairs]
        row = next(x for x in rows if x["pairs"] == pairs)
        label = f"{pairs:,} pairs" if pairs else "gold reward (ceiling)"
        for ax, form in zip(axes, ("bon", "rl")):
            if form not in row:
                continue
            for r in group:  # each seed's gold points, faint; the mean curves over seeds drawn over them
                ax.plot(*relative(r, r[form], "gold"), ".", color=color, ms=2, alpha=0.25)
            for key, style in (("gold", "o-"), ("proxy", "x--")) if pairs else (("gold", "o-"),):
                ax.plot(*mean_curve(group, form, key), style, color=color, ms=3, lw=0.8, label=f"{label}: {key}")
            d = np.linspace(0, max(p["d"] for r in group for p in r[form]), 100)
            ax.plot(d, curve(form, row[form], d), color=color, lw=2.5, alpha=0.6)
    for ax, title in zip(axes, ("Best-of-n (n = 1 ... {})".format(runs[0]["bon"][-1]["n"]), "RL (PPO, no KL penalty)")):
        ax.axhline(0, color="gray", lw=0.5)
        ax.set(
            title=title,
            xlabel="d = sqrt(KL to the initial policy)",
            ylabel="score - initial policy's (gold: solid; proxy / beta: dashed)",
        )
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.suptitle(
        "Reward-model overoptimization on the embedded task: means over seeds (dots: each seed's gold); "
        "thick lines: the fitted forms"
    )
    common.save_figure(fig, out_png)
    return rows, "\n".join(lines) + "\n\n" + kl_table


def kl_report(runs, out_png):
    """Gold against d for the reward model of the KL-penalty runs, one curve per --kl_coef (means over seeds), and a
    table: where each run ends and its highest gold point. Curves that coincide make the penalty a stopping point."""
    import matplotlib.pyplot as plt

    coefs = sorted({r.get("kl_coef", 0.0) for r in runs if r.get("kl_coef")})
    if not coefs:
        return ""
    pairs = next(r["pairs"] for r in runs if r.get("kl_coef"))
    lines = [
        f"| {pairs:,} pairs, --kl_coef | last point: d (KL) | last point: gold | highest gold point (its d) | "
        "gold at the penalised run's last d on the unpenalised curve |",
        "|---" * 5 + "|",
    ]
    fig, ax = plt.subplots(figsize=(7, 5))
    free = mean_curve([r for r in runs if r["pairs"] == pairs and not r.get("kl_coef")], "rl")
    for color, coef in zip(COLORS, [0.0] + coefs):
        d, gold = mean_curve([r for r in runs if r["pairs"] == pairs and r.get("kl_coef", 0.0) == coef], "rl")
        ax.plot(d, gold, "o-", color=color, ms=3, lw=0.8, label=f"--kl_coef {coef:g}")
        best = int(np.argmax(gold))
        on_free = np.interp(d[-1], free[0], free[1]) if coef else gold[-1]
        lines.append(
            f"| {coef:g} | {d[-1]:.2f} ({d[-1] ** 2:.1f}) | {gold[-1]:+.3f} | {gold[best]:+.3f} "
            f"({d[best]:.2f}) | {on_free:+.3f} |"
        )
    ax.axhline(0, color="gray", lw=0.5)
    ax.set(
        title=f"KL penalty, the {pairs:,}-pair reward model: held-out gold (mean of seeds)",
        xlabel="d = sqrt(KL to the initial policy)",
        ylabel="gold score - initial policy's",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    common.save_figure(fig, out_png)
    print("\n".join(lines))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the smallest setting (the test suite's)")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "overoptimization.json"))
    parser.add_argument("--scratch", default=os.path.join(ROOT, "runs", "overoptimization"))
    parser.add_argument("--plot_only", action="store_true")
    args = parser.parse_args()
    setting = dict(QUICK if args.quick else FULL, **({"seeds": args.seeds} if args.seeds else {}))
    if not args.plot_only:
        measure(setting, args.scratch, args.out)
    report(json.load(open(args.out))["runs"], os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
