"""Reward-model overoptimization (Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model Overoptimization") on
the embedded task, whose gold reward is known exactly.

    python benchmarks/overoptimization.py            # the sweep; benchmarks/results/overoptimization.{json,png}
    python benchmarks/overoptimization.py --quick    # the smallest setting (tests/test_overoptimization.py runs it)
    python benchmarks/overoptimization.py --plot_only   # the figure and table again from the JSON

What it measures, per seed (the seed of the reward model's initialisation, its share of the 40,000 training pairs and
their order, and of every sample; the initial policy is ppo.py's one embedded checkpoint, whatever the seed):
  1. Reward models of several strengths: `rm.py` on 125, 500, 2,000 and 8,000 preference pairs, each with its
     held-out accuracy (4,000 pairs) beside the Bayes-optimal accuracy the task knows exactly.
  2. Best-of-n: one pool of 256 responses to each of 256 distinct validation prompts and 256 distinct `ood` prompts
     (ppo.py's eval prompts of each split, never trained on) from the initial policy, scored by every reward model and
     by the gold reward. The gold (and proxy) score of the response the proxy ranks first among n drawn without
     replacement from the pool, in expectation over the draws: sorting a prompt's pool by proxy score, the i-th lowest
     (1-based) is the best of n with probability C(i-1, n-1) / C(N, n) (the paper's unbiased estimator). Its KL to
     the initial policy is log n - (n-1)/n.
  3. RL: `ppo.py` against each reward model, and against the gold reward itself (the ceiling), with no KL penalty
     (as the paper's main runs: the KL travelled is the x axis), at a learning rate of 1e-4, a third of ppo.py's
     default. At the default the KL reaches d = 2-3 within 3 points and the policy's gold turns down by the 4th. The
     smaller rate spreads the rise over 8-10 points of 32 and leaves 20 for the fall. Every 4 updates (128 episodes),
     ppo.py's held-out evaluation gives one point, as Gao et al. measure it: on prompts never trained on, the mean gold
     score, the mean proxy score and d = sqrt(mean KL to the initial policy), from the same responses. The same policy
     is evaluated on `ood` prompts beside each point, so each method's generalization gap is read at matched KL.
     The KL penalty (the paper's sec. 3.6): the same runs against one reward model with --kl_coef above 0, their gold
     against d beside the run with no penalty (overoptimization_kl.png).
  4. Fits, per reward model, of the gold score relative to the initial policy's: R_bon(d) = d (alpha - beta d) and
     R_RL(d) = d (alpha - beta log d), least squares through the origin on the mean curve over seeds (the mean d and
     score at each n, or after each update), with R^2 and the peak (d* = alpha / 2 beta, height alpha^2 / 4 beta;
     d* = exp(alpha / beta - 1), height beta d*); each seed's own fit gives the spread. RL's mean curve's peak, each
     seed's fall from it to the last point, and the peak's rise with the data, in standard errors over seeds.
The proxy score is drawn divided by PREFERENCE_BETA: labels are sigmoid(beta (gold_a - gold_b)), so a reward model
learns beta x gold, and proxy / beta is on the gold's scale. Two seeds run at once, each in its own process on one
thread (`jobs`): the tiny models gain little from a second thread, and the sweep then uses both cores.
"""

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import random
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402

# kl_coefs: the KL-penalty runs, against the reward model of kl_pairs pairs, beside its run with no penalty.
# pool: responses per best-of-n prompt; bon_prompts: distinct prompts of each split in the pool; learning_rate: RL's.
# jobs: seeds measured at once, each in its own process on one thread.
FULL = dict(
    sizes=[125, 500, 2000, 8000],
    seeds=[1, 2, 3, 4],
    pool=256,
    max_n=256,
    bon_prompts=256,
    episodes=4096,
    learning_rate=1e-4,
    eval_prompts=128,
    kl_coefs=[0.03, 0.1],
    kl_pairs=2000,
    jobs=2,
)
QUICK = dict(
    sizes=[125, 2000],
    seeds=[1],
    pool=64,
    max_n=32,
    bon_prompts=16,
    episodes=2048,
    learning_rate=1e-4,
    eval_prompts=64,
    kl_coefs=[0.1],
    kl_pairs=2000,
    jobs=1,
)
SPLITS = ("validation", "ood")  # every point is read on both: its keys for ood end in _ood
UPDATES_PER_POINT = 4
COLORS = ["tab:red", "tab:orange", "tab:green", "tab:blue", "tab:purple"]


def train_reward_model(size, seed, out):
    import rm

    args = rm.Args(
        dataset_mixer_list=["embedded", str(size)], seed=seed, num_evals=1, output_dir=out, overwrite_output_dir=True
    )  # the sweep's own scratch folder: a second sweep replaces the first
    common.exit_on_user_error(rm.main, args)
    ev = json.load(open(os.path.join(out, "eval_results.json")))
    return {"accuracy": ev["accuracy"], "bayes_accuracy": ev["bayes_accuracy"], **repeat_probe(out)}


def repeat_probe(rm_dir, n=512):
    """How much of the exploit a reward model sees. For n validation prompts, a response of 4 distinct words of the
    non-avoided topics is extended by a fresh word or by its first word said again. repeat_accuracy: how often the
    model ranks the two as the gold does; word_accuracy: the same for two fresh words, the values it must know. Each
    response is scored with the EOS rm.py appends, where the reward is read."""
    import torch
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(rm_dir)
    rng, agree = random.Random(0), {"repeat_accuracy": 0, "word_accuracy": 0}
    prompts = sorted({r["prompt"] for r in common.embedded_split("validation")})
    for prompt in rng.sample(prompts, n):
        avoided = common.prompt_parts(prompt)[1]
        words = rng.sample([w for w in common.WORDS if common.TOPIC_OF[w] != avoided], 6)
        base = " " + " ".join(words[:4])
        responses = [base + " " + words[4], base + " " + words[0], base + " " + words[5]]
        ids = [tokenizer(prompt + r)["input_ids"] + [tokenizer.eos_token_id] for r in responses]
        with torch.no_grad():
            score = [model(input_ids=torch.tensor([x])).logits[0, 0].item() for x in ids]
        gold = common.gold_rewards([prompt] * 3, responses)
        agree["repeat_accuracy"] += (score[0] > score[1]) == (gold[0] > gold[1])
        agree["word_accuracy"] += (score[0] > score[2]) == (gold[0] > gold[2])
    return {k: v / n for k, v in agree.items()}


def best_of_n_pool(seed, setting, rm_dirs, split):
    """A pool of `pool` responses to each of `bon_prompts` distinct prompts of the split from ppo.py's initial policy,
    with each response's gold score and every reward model's (normalized, as ppo.py scores it): arrays (prompts, pool)
    and (reward models, prompts, pool). The prompts are those ppo.py would evaluate on: never trained on."""
    import ppo

    args = ppo.Args(seed=seed, reward_model_path=rm_dirs[0], eval_split=split, num_eval_prompts=setting["bon_prompts"])
    tokenizer = ppo.load_tokenizer(args)
    ppo.fill_defaults(args, ppo.position_limit(args), rank=1)
    stop_id = ppo.stop_token_id(args, tokenizer)
    policy = ppo.load_policy(args, tokenizer)
    prompts = ppo.train_and_eval_prompts(args, tokenizer)[1]
    rewards = [ppo.load_reward(ppo.Args(seed=seed, reward_model_path=d), tokenizer) for d in rm_dirs]
    pool, offset = setting["pool"], 10**9 + SPLITS.index(split) * 10**8  # sampling streams no PPO run uses
    gold, proxy = np.zeros((len(prompts.ids), pool)), np.zeros((len(rm_dirs), len(prompts.ids), pool))
    for i, (p, p_ids) in enumerate(zip(prompts.texts, prompts.ids)):
        seeds = [common.seed_of(seed, "sampling", offset + i * pool + j) for j in range(pool)]
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


def rl_run(seed, setting, out, rm_dir=None, kl_coef=0.0):
    """ppo.py against a reward model (or the gold reward, rm_dir None) at the sweep's learning rate: one point per
    UPDATES_PER_POINT updates, and one before the first, from its held-out evaluation on validation prompts, each with
    the same policy's evaluation on `ood` prompts beside it: (d, mean gold score, mean proxy score) on each split."""
    import ppo

    reward = dict(reward_model_path=rm_dir) if rm_dir else dict(reward_fn="common:gold_rewards")
    updates = setting["episodes"] // (ppo.Args.per_device_train_batch_size * ppo.Args.num_mini_batches)
    args = ppo.Args(
        **reward,
        seed=seed,
        kl_coef=kl_coef,
        learning_rate=setting["learning_rate"],
        total_episodes=setting["episodes"],
        output_dir=out,
        sample_every=10**9,
        overwrite_output_dir=True,
        num_evals=updates // UPDATES_PER_POINT,
        num_eval_prompts=setting["eval_prompts"],
    )
    real_evaluate, ood, ood_prompts = ppo.evaluate, [], []

    def evaluate_both(models, prompts, args, tokenizer, stop_id, baseline=None):
        """ppo.py's evaluation, then the same policy's on the `ood` split's prompts, kept in `ood`."""
        if not ood_prompts:
            ood_prompts.append(ppo.train_and_eval_prompts(dataclasses.replace(args, eval_split="ood"), tokenizer)[1])
        ood.append(real_evaluate(models, ood_prompts[0], args, tokenizer, stop_id)[0])
        return real_evaluate(models, prompts, args, tokenizer, stop_id, baseline)

    ppo.evaluate = evaluate_both
    try:
        history = common.exit_on_user_error(ppo.main, args)
    finally:
        ppo.evaluate = real_evaluate
    points = [h for h in history if "eval/score" in h]
    return {
        "rl": [point(h) for h in points],
        "rl_ood": [point(h) for h in ood],
    }


def point(h):
    """An evaluation's point: d = sqrt(its mean KL to the initial policy), its mean gold and proxy scores."""
    return {"d": math.sqrt(max(h["eval/kl"], 0.0)), "gold": h["eval/gold"], "proxy": h["eval/score"]}


def fit(d, r, form):
    """Least squares through the origin of r = d (alpha - beta d) (bon) or d (alpha - beta log d) (rl): alpha, beta,
    R^2, and the peak's d and height (inf where beta <= 0: no peak)."""
    form = form.split("_")[0]  # bon_ood and rl_ood fit as bon and rl
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
    form = form.split("_")[0]
    return d * (f["alpha"] - f["beta"] * (d if form == "bon" else np.log(np.maximum(d, 1e-9))))


def measure_seed(setting, seed, scratch):
    """One seed's reward models, best-of-n pools and RL runs; returns its runs."""
    torch_threads(setting)
    runs, t = [], time.time()
    ns = [2**k for k in range(int(math.log2(setting["max_n"])) + 1)]
    rm_dirs = [os.path.join(scratch, f"rm-{size}-{seed}") for size in setting["sizes"]]
    rms = [train_reward_model(size, seed, d) for size, d in zip(setting["sizes"], rm_dirs)]
    pools = {split: best_of_n_pool(seed, setting, rm_dirs, split) for split in SPLITS}
    for k, (size, rm_result, rm_dir) in enumerate(zip(setting["sizes"], rms, rm_dirs)):
        bon = {}
        for split, (gold, proxy) in pools.items():
            bon["bon" + ("_ood" if split == "ood" else "")] = [
                {
                    "n": n,
                    "d": math.sqrt(math.log(n) - (n - 1) / n),
                    "gold": best_of_n(proxy[k], gold, n),
                    "proxy": best_of_n(proxy[k], proxy[k], n),
                }
                for n in ns
            ]
        gold, proxy = pools["validation"]
        for kl_coef in [0.0] + (setting["kl_coefs"] if size == setting["kl_pairs"] else []):
            rl = rl_run(seed, setting, os.path.join(scratch, f"ppo-{size}-{seed}-kl{kl_coef}"), rm_dir, kl_coef)
            init = dict(gold_init=float(gold.mean()), proxy_init=float(proxy[k].mean()))
            runs.append(dict(rm_result, pairs=size, seed=seed, kl_coef=kl_coef, **init, **bon, **rl))
    rl = rl_run(seed, setting, os.path.join(scratch, f"ppo-gold-{seed}"))
    runs.append(dict(pairs=None, seed=seed, kl_coef=0.0, gold_init=float(pools["validation"][0].mean()), **rl))
    print(f"seed {seed}: {time.time() - t:.0f} s", flush=True)
    return runs


def torch_threads(setting):
    """One thread per process where several measure seeds at once: tiny models gain little from a second thread."""
    if setting["jobs"] > 1:
        import torch

        torch.set_num_threads(1)


def measure(setting, scratch, out):
    """Every seed's runs, `jobs` seeds at once, written to `out` as each seed ends (a cut-short sweep keeps its
    finished seeds)."""
    runs, start = [], time.time()

    def save(seed_runs):
        runs.extend(seed_runs)
        runs.sort(key=lambda r: r["seed"])  # each seed's runs in their order
        common.write_json_atomic(
            out, {"date": time.strftime("%Y-%m-%d"), "setting": setting, "wall_s": time.time() - start, "runs": runs}
        )

    if setting["jobs"] == 1:
        for seed in setting["seeds"]:
            save(measure_seed(setting, seed, scratch))
        return
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(setting["jobs"], mp_context=context) as pool:
        futures = [pool.submit(measure_seed, setting, seed, scratch) for seed in setting["seeds"]]
        for future in concurrent.futures.as_completed(futures):
            save(future.result())


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


FORMS = ("bon", "rl", "bon_ood", "rl_ood")  # each method's curve on validation prompts, then on ood prompts


def mean_and_se(xs):
    """The mean over seeds and its standard error (0 for one seed)."""
    xs = np.asarray(xs, float)
    return float(xs.mean()), float(xs.std(ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else 0.0


def summarize(runs):
    """Per reward model (and the gold run): accuracy, and the fits of both forms on the gold score's mean curve over
    seeds; each seed's own fit gives the spread. A run's collapse onto repeated words comes at a different update in
    each seed, so one fit through every seed's raw points mixes curves of different shapes, while the mean curve is
    the expected gold score after k updates, the quantity the paper's forms describe."""
    rows, runs = [], [r for r in runs if not r.get("kl_coef")]  # the KL-penalty runs: kl_report
    for pairs in dict.fromkeys(r["pairs"] for r in runs):
        group = [r for r in runs if r["pairs"] == pairs]
        row = {"pairs": pairs, "seeds": [r["seed"] for r in group]}
        for form in [f for f in FORMS if f in group[0]]:
            xy = [relative(r, r[form], "gold") for r in group]
            d, mean = mean_curve(group, form)
            row[form] = fit(d, mean, form)
            row[form]["seed_fits"] = [fit(x, y, form) for x, y in xy]
            row[form]["max_gold"] = [max(y) for _, y in xy]  # the highest gold point of each seed
            row[form]["last_gold"] = [y[-1] for _, y in xy]
            row[form]["last_proxy"] = [relative(r, r[form], "proxy")[1][-1] for r in group] if pairs else None
            # The mean curve's peak: its point, each seed's gold there, and each seed's fall from it to the last point.
            top = int(np.argmax(mean))
            row[form]["peak_point"], row[form]["peak_d_point"] = top, d[top]
            row[form]["gold_at_peak"] = [y[top] for _, y in xy]
            row[form]["fall"] = [y[top] - y[-1] for _, y in xy]
        if pairs:
            row["probe"] = {k: [r[k] for r in group] for k in ("repeat_accuracy", "word_accuracy") if k in group[0]}
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
    forms = [f for f in FORMS if f in runs[0]]
    fig, axes = plt.subplots(len(forms) // 2, 2, figsize=(13, 5 * (len(forms) // 2)), squeeze=False)
    axes = axes.ravel()
    for color, pairs in zip(COLORS, dict.fromkeys(r["pairs"] for r in runs)):
        group = [r for r in runs if r["pairs"] == pairs]
        row = next(x for x in rows if x["pairs"] == pairs)
        label = f"{pairs:,} pairs" if pairs else "gold reward (ceiling)"
        for ax, form in zip(axes, forms):
            if form not in row:
                continue
            for r in group:  # each seed's gold points, faint; the mean curves over seeds drawn over them
                ax.plot(*relative(r, r[form], "gold"), ".", color=color, ms=2, alpha=0.25)
            for key, style in (("gold", "o-"), ("proxy", "x--")) if pairs else (("gold", "o-"),):
                ax.plot(*mean_curve(group, form, key), style, color=color, ms=3, lw=0.8, label=f"{label}: {key}")
            d = np.linspace(0, max(p["d"] for r in group for p in r[form]), 100)
            ax.plot(d, curve(form, row[form], d), color=color, lw=2.5, alpha=0.6)
    bon_title = f"Best-of-n (n = 1 ... {runs[0]['bon'][-1]['n']})"
    titles = [
        (bon_title if f.startswith("bon") else "RL (PPO, no KL penalty)")
        + (", ood prompts" if f.endswith("_ood") else ", validation prompts")
        for f in forms
    ]
    for ax, title in zip(axes, titles):
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
    tables = [lines, generalization_table(runs), targets_table(rows), probe_table(rows), blind_bound_table()]
    text = "\n\n".join("\n".join(t) for t in tables if t) + "\n\n" + kl_table
    print("\n\n".join("\n".join(t) for t in tables[1:] if t))
    return rows, text


def probe_table(rows):
    """Each reward model's repeat and word probes (repeat_probe): mean (min-max) over seeds."""
    rows = [r for r in rows if r.get("probe")]
    if not rows:
        return []
    lines = [
        "| reward model | ranks a word said again below a fresh one, as the gold does | "
        "ranks two fresh words as the gold does |",
        "|---|---|---|",
    ]
    for r in rows:
        cells = [
            f"{np.mean(r['probe'][k]):.3f} ({min(r['probe'][k]):.3f}–{max(r['probe'][k]):.3f})" for k in r["probe"]
        ]
        lines.append(f"| {r['pairs']:,} pairs | " + " | ".join(cells) + " |")
    return lines


def blind_bound_table(values=(0.0, -1.0, -2.0, -3.0)):
    """What a reward model blind to repeats can reach, for each value of a word said again: on the validation pairs,
    the Bayes accuracy (ranking by the gold) and a blind model's (ranking by the gold with each repeat valued as its
    word), both in expectation over the Bradley-Terry labels the gold would draw."""
    lines = [
        "| a repeat's value | Bayes accuracy | blind to repeats | blind / Bayes |",
        "|---" * 4 + "|",
    ]
    pairs, saved = common.embedded_split("validation"), common.REPEAT_VALUE
    try:
        for value in values:
            bayes = blind = 0.0
            for row in pairs:
                common.REPEAT_VALUE = value
                gap = common.gold_reward(row["prompt"], row["chosen"]) - common.gold_reward(
                    row["prompt"], row["rejected"]
                )
                first = 1 / (1 + math.exp(-common.PREFERENCE_BETA * gap))  # the chance the first is labelled chosen
                seen = [blind_gold(row["prompt"], row[k]) for k in ("chosen", "rejected")]
                bayes += max(first, 1 - first)
                blind += first if seen[0] > seen[1] else 1 - first if seen[0] < seen[1] else 0.5
            n = len(pairs)
            lines.append(f"| {value:g} | {bayes / n:.4f} | {blind / n:.4f} | {blind / bayes:.3f} |")
    finally:
        common.REPEAT_VALUE = saved
    return lines


def blind_gold(prompt, response):
    """The gold as a model blind to repeats sees it: each word said again valued as its first saying."""
    asked, avoided = common.prompt_parts(prompt)
    words = response.split()
    values = [
        common.NON_WORD_VALUE
        if w not in common.WORD_VALUE or common.TOPIC_OF[w] == avoided
        else common.WORD_VALUE[w] + common.TOPIC_BONUS * (common.TOPIC_OF[w] == asked)
        for w in words
    ]
    return sum(values) / len(values) if values else common.NON_WORD_VALUE


def generalization_table(runs, at=(1.0, 2.0)):
    """Each method's gold gain over the initial policy on validation and on ood prompts at matched KL: the mean curves
    over seeds read at d in `at`, by linear interpolation along the curve up to its first point at that d. The
    generalization gap is the validation gain minus the ood gain (Kirk et al. 2024 compare best-of-n and RL so)."""
    if "rl_ood" not in runs[0]:
        return []
    lines = [
        "| reward model | method | d (KL) | gold gain, validation | gold gain, ood | gap (validation - ood) |",
        "|---" * 6 + "|",
    ]
    for pairs in dict.fromkeys(r["pairs"] for r in runs if r["pairs"]):
        group = [r for r in runs if r["pairs"] == pairs]
        for method in ("bon", "rl"):
            for d in at:
                val, ood = (reach(*mean_curve(group, f), d) for f in (method, method + "_ood"))
                if val is None or ood is None:
                    continue
                name = "best-of-n" if method == "bon" else "RL"
                lines.append(
                    f"| {pairs:,} pairs | {name} | {d:.1f} ({d * d:.1f}) | {val:+.3f} | {ood:+.3f} | {val - ood:+.3f} |"
                )
    return lines


def reach(d, y, at):
    """The curve's value where its d first reaches `at`, interpolated between the points around it; None if never."""
    for k in range(1, len(d)):
        if d[k] >= at:
            return float(np.interp(at, [d[k - 1], d[k]], [y[k - 1], y[k]])) if d[k] > d[k - 1] else float(y[k])
    return None


def targets_table(rows):
    """RL's overoptimization per reward model: the mean curve's peak, the points before it, each seed's fall from it
    to the last point in standard errors over seeds, the RL form's R^2; and the peak's rise with the data."""
    proxies = [r for r in rows if r["pairs"] and "rl" in r]
    if not proxies:
        return []
    lines = [
        "| reward model | RL peak: gold gain (s.e. over seeds) | its d | points before it | last point's fall from it "
        "(s.e.; in s.e.) | RL form R^2 | best-of-n R^2 | best-of-n gold at the largest n |",
        "|---" * 8 + "|",
    ]
    for r in proxies:
        f = r["rl"]
        peak, peak_se = mean_and_se(f["gold_at_peak"])
        fall, fall_se = mean_and_se(f["fall"])
        sigmas = f"{fall / fall_se:.1f}" if fall_se > 0 else "–"
        lines.append(
            f"| {r['pairs']:,} pairs | {peak:+.3f} ({peak_se:.3f}) | {f['peak_d_point']:.2f} | {f['peak_point']} | "
            f"{fall:+.3f} ({fall_se:.3f}; {sigmas}) | {f['r2']:.2f} | {r['bon']['r2']:.2f} | "
            f"{np.mean(r['bon']['last_gold']):+.3f} |"
        )
    (lo, lo_se), (hi, hi_se) = (mean_and_se(proxies[i]["rl"]["gold_at_peak"]) for i in (0, -1))
    se = math.hypot(lo_se, hi_se)
    lines.append(
        f"\nRL peak, {proxies[-1]['pairs']:,} pairs minus {proxies[0]['pairs']:,} pairs: {hi - lo:+.3f} "
        f"(s.e. {se:.3f}; {(hi - lo) / se if se else float('nan'):.1f} s.e.)"
    )
    return lines


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
