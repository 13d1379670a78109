"""benchmarks/overoptimization.py: its best-of-n estimator and fits against direct computations, its --quick trends."""

import itertools
import json
import math
import os
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import overoptimization  # noqa: E402


def test_best_of_n_estimator_is_the_mean_over_every_subset():
    rng = np.random.default_rng(0)
    proxy, gold = rng.normal(size=(3, 7)), rng.normal(size=(3, 7))
    for n in range(1, 8):
        direct = np.mean(
            [
                np.mean([g[list(s)][np.argmax(p[list(s)])] for s in itertools.combinations(range(7), n)])
                for p, g in zip(proxy, gold)
            ]
        )
        assert overoptimization.best_of_n(proxy, gold, n) == pytest.approx(direct, abs=1e-12), n


@pytest.mark.parametrize("form", ["bon", "rl"])
def test_fits_recover_a_known_curve_and_its_peak(form):
    d = np.linspace(0.1, 6, 40)
    truth = {"alpha": 0.8, "beta": 0.3}
    f = overoptimization.fit(d, overoptimization.curve(form, truth, d), form)
    assert f["alpha"] == pytest.approx(0.8) and f["beta"] == pytest.approx(0.3) and f["r2"] == pytest.approx(1.0)
    grid = np.linspace(1e-3, 20, 200001)
    r = overoptimization.curve(form, truth, grid)
    assert f["peak_d"] == pytest.approx(grid[r.argmax()], abs=1e-3) and f["peak"] == pytest.approx(r.max())


def test_fits_are_on_the_mean_curve_over_seeds():
    """Two seeds whose gold points straddle a known curve by opposite noise: the fit of the mean curve recovers the
    curve exactly, each seed's own fit (the spread) does not."""
    d = np.linspace(0.2, 6, 20)
    truth = {"alpha": 0.5, "beta": 0.2}
    noise = 0.05 * np.sin(3 * d)
    runs = [
        {
            "pairs": 500,
            "seed": seed,
            "gold_init": 0.4,
            "proxy_init": 0.0,
            "accuracy": 0.6,
            "bayes_accuracy": 0.7,
            "bon": [
                {"d": x, "gold": 0.4 + overoptimization.curve("bon", truth, x) + sign * e, "proxy": 0.0}
                for x, e in zip(d, noise)
            ],
            "rl": [
                {"d": x, "gold": 0.4 + overoptimization.curve("rl", truth, x) + sign * e, "proxy": 0.0}
                for x, e in zip(d, noise)
            ],
        }
        for seed, sign in ((1, 1), (2, -1))
    ]
    (row,) = overoptimization.summarize(runs)
    for form in ("bon", "rl"):
        assert row[form]["alpha"] == pytest.approx(0.5) and row[form]["beta"] == pytest.approx(0.2), form
        assert row[form]["r2"] == pytest.approx(1.0), form
        assert all(abs(f["alpha"] - 0.5) > 1e-3 and f["r2"] < 1 - 1e-4 for f in row[form]["seed_fits"]), form


def test_quick_sweep_shows_overoptimization(tmp_path, monkeypatch):
    """The smallest setting: two reward models (125 and 2,000 pairs), one seed. Each claim holds with a margin, so
    that another machine's arithmetic, which moves a run's trajectory, does not move the verdict. The larger model is
    more accurate, and its best-of-n reaches a higher gold score; best-of-n's proxy rises with n; under RL against
    either, the proxy promises far more than the gold gives, and against the larger the gold rises and falls back; a
    KL penalty, and PPO on the gold reward itself, stop at a much smaller KL than PPO against a proxy with none. Every
    point is read on ood prompts too."""
    out = tmp_path / "quick.json"
    monkeypatch.setattr(sys, "argv", ["overoptimization.py", "--quick", "--out", str(out), "--scratch", str(tmp_path)])
    overoptimization.main()  # (in this process: it runs rm.py and ppo.py in its own)
    runs = json.load(open(out))["runs"]
    small, large, penalised, ceiling = runs
    assert (small["pairs"], large["pairs"], penalised["pairs"], ceiling["pairs"]) == (125, 2000, 2000, None)
    assert [r["kl_coef"] for r in runs] == [0.0, 0.0, 0.1, 0.0]
    # RL's points come from the held-out evaluations, the first before any update
    assert all(r["rl"][0]["d"] == 0 and len(r["rl"]) == 17 for r in (small, large, penalised, ceiling))
    # Every point is read on ood prompts too, the same number of points, the first at d = 0
    assert all(len(r["rl_ood"]) == 17 and r["rl_ood"][0]["d"] == 0 for r in runs)
    assert all(len(r["bon_ood"]) == len(r["bon"]) for r in (small, large, penalised))
    assert small["accuracy"] + 0.03 < large["accuracy"] < large["bayes_accuracy"]
    assert large["word_accuracy"] > small["word_accuracy"] + 0.05  # the probe: more data, the words' values known
    for r in (small, large):
        assert all(a["proxy"] <= b["proxy"] + 1e-12 for a, b in zip(r["bon"], r["bon"][1:]))
        assert all(a["d"] < b["d"] for a, b in zip(r["bon"], r["bon"][1:]))
        d, gold = overoptimization.relative(r, r["rl"], "gold")
        _, proxy = overoptimization.relative(r, r["rl"], "proxy")
        assert proxy[-1] > gold[-1] + 0.5, (proxy, gold)  # Goodhart: the proxy's gain overstates the gold's
    assert large["bon"][-1]["gold"] > small["bon"][-1]["gold"] + 0.1 and small["bon"][-1]["gold"] > small["gold_init"]
    free = min(r["rl"][-1]["d"] for r in (small, large))
    assert penalised["rl"][-1]["d"] < 0.75 * large["rl"][-1]["d"] and ceiling["rl"][-1]["d"] < 0.75 * free
    assert overoptimization.relative(ceiling, ceiling["rl"], "gold")[1][-1] > 0.1  # PPO on the gold raises it
    gold = overoptimization.relative(large, large["rl"], "gold")[1]
    assert max(gold) > gold[-1] + 0.05 and max(gold) > 0.1, gold  # The gold rises, then the exploit costs it.
    assert os.path.getsize(tmp_path / "quick.png") > 1000 and os.path.getsize(tmp_path / "quick_kl.png") > 1000
    assert not math.isnan(overoptimization.summarize(runs)[0]["rl"]["r2"])
