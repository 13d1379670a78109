"""ppo.py's held-out evaluation: which prompts it reads, that it measures the policy alone (the same policy twice, and
--eval_only of the initial policy, give the same numbers), that a resumed run ends with the same evaluations, and that
bad evaluation options are refused in one line. 2 ranks against 1: test_ppo.py's split runs and test_lora.py."""

import json
import os
import sys

import pytest
import torch

import common
import ppo
from conftest import read_metrics, run_main, write_jsonl

TINY = dict(
    reward_fn="common:gold_rewards",
    total_episodes=32,
    per_device_train_batch_size=4,
    num_mini_batches=2,
    num_ppo_epochs=1,
    response_length=8,
    num_evals=2,
    num_eval_prompts=10,
)


def evaluations(output_dir):
    return [m for m in read_metrics(output_dir) if "eval/score" in m]


def repeated_prompt_rows(n=120, distinct=12):
    """Preference rows in which each of `distinct` prompts repeats in many rows, as in HH-RLHF."""
    rows = common.embedded_pairs(n, seed=7)
    prompts = sorted({r["prompt"] for r in rows})[:distinct]
    return [dict(r, prompt=prompts[i % len(prompts)]) for i, r in enumerate(rows)]


@pytest.mark.parametrize("data", ["embedded", "repeated"])
def test_no_eval_prompt_is_trained_on(data, tmp_path, monkeypatch):
    """Over a whole run, the prompts of every training episode and of every evaluation share no text: a prompt held
    out is held out in every row that repeats it."""
    dataset = "embedded" if data == "embedded" else write_jsonl(tmp_path / "pairs.jsonl", repeated_prompt_rows())
    seen = {"train": set(), "eval": set()}
    real_score, real_evaluate, phase = ppo.score, ppo.evaluate, ["train"]

    def spy_score(reward, batch, prompt_texts, *args, **kwargs):
        seen[phase[0]].update(prompt_texts[: len(batch.mask)])
        return real_score(reward, batch, prompt_texts, *args, **kwargs)

    def spy_evaluate(*args, **kwargs):
        phase[0] = "eval"
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            phase[0] = "train"

    monkeypatch.setattr(ppo, "score", spy_score)
    monkeypatch.setattr(ppo, "evaluate", spy_evaluate)
    args = dict(TINY, dataset_name=dataset, total_episodes=96, num_eval_prompts=40)
    ppo.main(ppo.Args(**args, output_dir=str(tmp_path / "out")))
    assert seen["train"] and seen["eval"] and not seen["train"] & seen["eval"]
    train, evals = ppo.train_and_eval_prompts(ppo.Args(**args, max_prompt_length=64), ppo.load_tokenizer(ppo.Args()))
    assert seen["eval"] == set(evals.texts) and not set(train.texts) & set(evals.texts)
    assert len(evaluations(tmp_path / "out")) == 3  # before the first update, then --num_evals 2


def test_the_first_evaluation_is_eval_only_of_the_initial_policy_and_the_same_policy_scores_the_same(
    tmp_path, reward_model_path
):
    """The evaluation before the first update equals --eval_only of the initial policy, number for number and row for
    row; --eval_only of the trained policy twice gives identical numbers, its KL read against the run's own initial
    policy (from its ppo_results.json), and it equals the run's last evaluation."""
    args = dict(TINY, reward_fn=None, reward_model_path=reward_model_path)
    ppo.main(ppo.Args(**args, output_dir=str(tmp_path / "run")))
    first, last = evaluations(tmp_path / "run")[0], evaluations(tmp_path / "run")[-1]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "eval_samples.jsonl")]
    ppo.main(ppo.Args(**args, eval_only=True, output_dir=str(tmp_path / "initial")))
    initial = json.load(open(tmp_path / "initial" / "eval_results.json"))
    assert {k: v for k, v in first.items() if k.startswith("eval/")} == {
        k: v for k, v in initial.items() if k.startswith("eval/")
    }
    assert [json.loads(line) for line in open(tmp_path / "initial" / "eval_samples.jsonl")] == [
        r for r in rows if r["step"] == 0
    ]
    trained = []
    for i in range(2):
        ppo.main(
            ppo.Args(
                **args, eval_only=True, sft_model_path=str(tmp_path / "run"), output_dir=str(tmp_path / f"trained{i}")
            )
        )
        trained.append(json.load(open(tmp_path / f"trained{i}" / "eval_results.json")))
    metrics = lambda r: {k: v for k, v in r.items() if k.startswith("eval/")}  # noqa: E731
    assert metrics(trained[0]) == metrics(trained[1]) and trained[0]["reference"] == "embedded-llama"
    measured = {k: v for k, v in last.items() if k.startswith("eval/") and "_change" not in k}  # not --eval_only's
    assert metrics(trained[0]) == pytest.approx(measured, abs=1e-4)
    assert last["eval/kl"] > 0 and first["eval/kl"] == 0.0
    results = json.load(open(tmp_path / "run" / "ppo_results.json"))
    assert results["eval_score"] == last["eval/score"] and results["eval_step"] == last["step"]


def test_a_run_stopped_during_or_after_an_evaluation_resumes_to_the_same_evaluations(tmp_path, monkeypatch):
    """A run killed right after the checkpoint that follows an evaluation, one killed inside an evaluation, and one
    killed in its first update (the first evaluation logged, no checkpoint yet), each resumed, end with the
    uninterrupted run's metrics, evaluations and eval_samples.jsonl."""
    args = dict(TINY, total_episodes=64, num_evals=4, save_steps=2)  # 8 updates: evaluations after 0, 2, 4, 6, 8
    ppo.main(ppo.Args(**args, output_dir=str(tmp_path / "full")))
    real_save, real_evaluate, calls = common.commit_checkpoint, ppo.evaluate, []

    def save_then_crash(root, name, state, keep=2):
        real_save(root, name, state, keep)
        if state["step"] == 4:
            raise KeyboardInterrupt

    def evaluate_then_crash(*a, **k):
        calls.append(1)
        if len(calls) == 4:  # the evaluation after update 6, after the checkpoint of update 6
            raise KeyboardInterrupt
        return real_evaluate(*a, **k)

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    cuts = {
        "after": (common, "commit_checkpoint", save_then_crash),
        "during": (ppo, "evaluate", evaluate_then_crash),
        "first update": (ppo, "learn", interrupt),
    }
    for cut, (owner, name, crash) in cuts.items():
        with monkeypatch.context() as patch:
            patch.setattr(owner, name, crash)
            with pytest.raises(KeyboardInterrupt):
                ppo.main(ppo.Args(**args, output_dir=str(tmp_path / cut)))
        ppo.main(ppo.Args(**args, resume=True, output_dir=str(tmp_path / cut)))

    def strip(ms):
        return [{k: v for k, v in m.items() if not k.startswith(("perf/", "memory/"))} for m in ms]

    full = strip(read_metrics(tmp_path / "full"))
    assert [m["step"] for m in full if "eval/score" in m] == [0, 2, 4, 6, 8]
    for cut in cuts:
        assert strip(read_metrics(tmp_path / cut)) == full, cut
        for name in ("eval_samples.jsonl", "samples.jsonl"):
            assert open(tmp_path / cut / name).read() == open(tmp_path / "full" / name).read(), (cut, name)


def test_a_run_without_evaluations_trains_as_one_with_them(tmp_path):
    """Evaluation reads the policy and changes nothing of training: --num_evals 0 and 2 log the same updates."""
    for n in (0, 2):
        ppo.main(ppo.Args(**dict(TINY, num_evals=n), output_dir=str(tmp_path / str(n))))
    runs = [
        [
            {k: v for k, v in m.items() if not k.startswith(("perf/", "memory/"))}
            for m in read_metrics(tmp_path / n)
            if "eval/score" not in m
        ]
        for n in ("0", "2")
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 4


@pytest.mark.parametrize(
    "data,flags,expected",
    [
        (
            "pairs",
            ["--eval_split", "validation"],
            "pairs.jsonl: no split 'validation' (--eval_split); its splits: train",
        ),
        ("pairs", ["--eval_split", "train"], "--eval_split train is the training split"),
        ("pairs", ["--eval_holdout", "0"], "--eval_holdout 0.0: must be a fraction within (0, 1)"),
        ("pairs", ["--eval_holdout", "1.5"], "--eval_holdout 1.5: must be a fraction within (0, 1)"),
        ("pairs", ["--num_eval_prompts", "0"], "--num_eval_prompts 0: must be at least 1"),
        ("pairs", ["--num_evals", "-1"], "--num_evals -1: must be a finite number >= 0"),
        ("one prompt", [], "every training prompt is an eval prompt"),
        ("empty eval split", ["--eval_split", "validation"], "split 'validation' has no prompt to evaluate on"),
    ],
)
def test_bad_evaluation_options_are_one_line_errors_with_nothing_written(tmp_path, data, flags, expected):
    rows = repeated_prompt_rows(40, distinct=1 if data == "one prompt" else 8)
    if data == "empty eval split":
        path = tmp_path / "data"
        os.makedirs(path)
        write_jsonl(path / "train.jsonl", rows)
        (path / "validation.jsonl").write_text("")
    else:
        path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "out"
    proc = run_main(
        ["ppo.py", "--reward_fn", "common:gold_rewards", "--dataset_name", str(path), "--output_dir", str(out), *flags],
        check=False,
    )
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_eval_prompts_are_distinct_and_their_standard_errors_are_over_distinct_prompts(tmp_path, capsys):
    """A validation split of 30 rows over 6 prompt texts: each text is evaluated once, the run says there are only 6,
    eval/prompts counts 6, each standard error is the std over those 6 rows over sqrt(6), and distinct-n is that of
    the logged responses."""
    data = tmp_path / "data"
    os.makedirs(data)
    write_jsonl(data / "train.jsonl", repeated_prompt_rows(60, distinct=12))
    validation = common.embedded_pairs(40, seed=11)
    texts = sorted({r["prompt"] for r in validation})[:6]
    write_jsonl(data / "validation.jsonl", [dict(r, prompt=texts[i % 6]) for i, r in enumerate(validation[:30])])
    ppo.main(
        ppo.Args(
            **dict(TINY, num_eval_prompts=20, num_evals=1), dataset_name=str(data), output_dir=str(tmp_path / "out")
        )
    )
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("prompts:"))
    assert "6 distinct eval prompts" in line and "only 6 distinct, each evaluated once" in line, line
    samples = [json.loads(x) for x in open(tmp_path / "out" / "eval_samples.jsonl")]
    for record in evaluations(tmp_path / "out"):
        rows = [s for s in samples if s["step"] == record["step"]]
        assert sorted(s["prompt"] for s in rows) == texts and record["eval/prompts"] == 6
        score = torch.tensor([s["score"] for s in rows], dtype=torch.float64)
        assert record["eval/score_se"] == pytest.approx((score.std() / 6**0.5).item(), rel=1e-9)
        assert record["eval/distinct_1"] == ppo.distinct_ngrams([s["response"] for s in rows], 1)


def test_distinct_n_counts_distinct_word_n_grams_over_all():
    assert ppo.distinct_ngrams(["a b c", "a b d"], 1) == 4 / 6
    assert ppo.distinct_ngrams(["a b c", "a b d"], 2) == 3 / 4  # a b, b c, a b, b d
    assert ppo.distinct_ngrams(["horse horse horse"] * 3, 1) == 1 / 9
    assert ppo.distinct_ngrams(["horse horse horse"] * 3, 2) == 1 / 6
    assert ppo.distinct_ngrams(["", "a"], 2) == 0.0 and ppo.distinct_ngrams([], 1) == 0.0


@pytest.mark.parametrize("grouped", [False, True])
def test_runs_of_two_seeds_are_evaluated_on_the_same_prompts_and_streams_and_compare_prompt_by_prompt(
    tmp_path, capsys, grouped
):
    """--seed 1 and 2 share the eval prompts, their streams and the initial policy: their first evaluations are row
    for row the same. Each later evaluation logs its change from the first with the paired standard error, equal to
    the formula over eval_samples.jsonl's rows. benchmarks/compare_runs.py computes the same from the files, and
    refuses, in one line, a run of another --eval_seed, whose prompts differ. Under --group_by_length too, whose
    micro-batches of the evaluation follow --eval_seed."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import compare_runs

    for seed in (1, 2):
        ppo.main(ppo.Args(**TINY, seed=seed, group_by_length=grouped, output_dir=str(tmp_path / f"seed{seed}")))
    rows = {s: [json.loads(line) for line in open(tmp_path / f"seed{s}" / "eval_samples.jsonl")] for s in (1, 2)}
    first = {s: [r for r in rows[s] if r["step"] == 0] for s in (1, 2)}
    assert first[1] == first[2] and len(first[1]) == 10
    last = {s: [r for r in rows[s] if r["step"] == max(x["step"] for x in rows[s])] for s in (1, 2)}
    assert last[1] != last[2]  # The seeds' training differs.
    logged = evaluations(tmp_path / "seed1")
    assert "eval/gold_change" not in logged[0]
    for name in ("gold", "score", "length", "kl"):
        diffs = torch.tensor([b[name] - a[name] for a, b in zip(first[1], last[1])], dtype=torch.float64)
        assert logged[-1][f"eval/{name}_change"] == pytest.approx(diffs.mean().item(), abs=1e-9)
        se = (((diffs - diffs.mean()) ** 2).sum() / (len(diffs) - 1) / len(diffs)).sqrt().item()
        assert logged[-1][f"eval/{name}_change_se"] == pytest.approx(se, abs=1e-9)
    assert (
        compare_runs.main(
            [str(tmp_path / "seed1"), str(tmp_path / "seed1"), "--step_a", "0", "--json", str(tmp_path / "c.json")]
        )
        == 0
    )
    same = json.load(open(tmp_path / "c.json"))
    assert same["gold"]["difference"] == pytest.approx(logged[-1]["eval/gold_change"], abs=1e-9)
    assert same["gold"]["paired_se"] == pytest.approx(logged[-1]["eval/gold_change_se"], abs=1e-9)
    assert (
        compare_runs.main([str(tmp_path / "seed1"), str(tmp_path / "seed2"), "--json", str(tmp_path / "c.json")]) == 0
    )
    between = json.load(open(tmp_path / "c.json"))["gold"]
    assert between["difference"] == pytest.approx(
        sum(b["gold"] - a["gold"] for a, b in zip(last[1], last[2])) / 10, abs=1e-9
    )
    other = dict(TINY, eval_seed=5, eval_only=True, output_dir=str(tmp_path / "other"))
    ppo.main(ppo.Args(**other))
    capsys.readouterr()
    assert compare_runs.main([str(tmp_path / "seed1"), str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "different prompts" in err and "--eval_seed" in err, err
