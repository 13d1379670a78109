"""Every combination of options runs: each script over a pairwise covering array of its options (every pair of values
of every two options together in at least one short run), on the embedded task and on a model loaded from a folder
(stored in bfloat16, as hub checkpoints are). Each run must exit 0, log finite metrics and save a model that loads
and computes finite outputs. A new option gets a row in PPO_OPTIONS or RM_OPTIONS."""

import itertools
import json
import math
import os
from collections import OrderedDict

import pytest
import torch
from allpairspy import AllPairs
from test_families import preference_rows, write_jsonl
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common
import ppo
import rm
from conftest import read_metrics, run_main, run_ranks, save_checkpoint, without_inductor

TOK = common.embedded_tokenizer()

PPO_OPTIONS = OrderedDict(
    ranks=[1, 2],
    fsdp=[False, True],
    bf16=[False, True],
    lora_r=[0, 4],
    reward=["model", "function", "both"],
    critic_init=["auto", "policy", "reward"],
    ptx_coef=[0.0, 0.1],
    offload_inference_models=[False, True],
    kl_estimator=["k1", "k3"],
    target_kl=[None, 0.5],
    whiten_rewards=[False, True],
    stop_token=["eos", "none"],
    gradient_accumulation_steps=[1, 2],
    resume=[False, True],
    overwrite_output_dir=[False, True],
    policy=["embedded", "folder"],
    advantage_estimator=["gae", "rloo", "grpo", "dr_grpo", "reinforce_pp"],
    num_samples_per_prompt=[None, 2],
    kl_penalty=["reward", "loss"],
    loss_aggregation=["token_mean", "sequence_mean", "constant"],
    gradient_checkpointing=[False, True],
    group_by_length=[False, True],
    fused_logits=[False, True],
    lr_scheduler_type=["linear", "cosine_with_restarts", "polynomial"],
    compile=[False, True],
    num_evals=[0, 2],
    num_eval_prompts=[3, 7],
)

RM_OPTIONS = OrderedDict(
    ranks=[1, 2],
    fsdp=[False, True],
    bf16=[False, True],
    lora_r=[0, 4],
    padding_free=[False, True],
    lr_scheduler_type=["cosine", "polynomial", "warmup_stable_decay"],
    lr_end=[0.0, 1e-4],
    gradient_checkpointing=[False, True],
    center_rewards_coefficient=[0.0, 0.1],
    reward_normalization=["none", "shift", "shift_scale"],
    gradient_accumulation_steps=[1, 2],
    resume=[False, True],
    overwrite_output_dir=[False, True],
    model=["embedded", "folder"],
)


def ppo_refused(values):
    """The combinations ppo.py refuses by design: a critic initialised from a reward model that is not there (GAE's
    critic; the other estimators have none, and ignore the critic's options); frozen models held on the host without
    FSDP's shards to hold; a compiled decode of sharded weights (FSDP's, which offloading needs); reward whitening
    with an estimator that compares returns within a group."""
    estimator = values.get("advantage_estimator", "gae")
    return (
        (values.get("critic_init") == "reward" and values.get("reward") == "function" and estimator == "gae")
        or (values.get("whiten_rewards") and estimator not in ("gae", "reinforce_pp"))
        or (values.get("offload_inference_models") and not values.get("fsdp", True))
        or (values.get("compile") and (values.get("fsdp") or values.get("offload_inference_models")))
    )


def covering_array(options, refused=lambda values: False):
    """allpairspy's pairwise rows (it hands the filter partial rows, in option order), then rows for the pairs of values
    of two options that its greedy search left out under the filter, each new row taking as many of them as it can
    hold: every pair the script does not refuse is in some row. (Options with more values first: fewer rows.)"""
    options = OrderedDict(sorted(options.items(), key=lambda item: -len(item[1])))
    rows = [
        OrderedDict(zip(options, values))
        for values in AllPairs(
            list(options.values()), filter_func=lambda values: not refused(dict(zip(options, values)))
        )
    ]
    missing = [
        (a, x, b, y)
        for (a, xs), (b, ys) in itertools.combinations(options.items(), 2)
        for x, y in itertools.product(xs, ys)
        if not refused({a: x, b: y}) and not any(r[a] == x and r[b] == y for r in rows)
    ]
    while missing:
        a, x, b, y = missing[0]
        row = next(r for r in (OrderedDict(base, **{a: x, b: y}) for base in rows) if not refused(r))
        fixed = {a, b}
        for c, u, d, v in missing[1:]:
            if (c in fixed and row[c] != u) or (d in fixed and row[d] != v):
                continue
            if not refused(candidate := OrderedDict(row, **{c: u, d: v})):
                row, fixed = candidate, fixed | {c, d}
        rows.append(row)
        missing = [(c, u, d, v) for c, u, d, v in missing if not (row[c] == u and row[d] == v)]
    return rows


PPO_ROWS, RM_ROWS = covering_array(PPO_OPTIONS, ppo_refused), covering_array(RM_OPTIONS)


def flags(args, defaults):
    """Command-line flags for these Args values (a False whose default is True as --no_<name>, as tyro spells it)."""
    out = []
    for k, v in args.items():
        if v is True:
            out.append(f"--{k}")
        elif v is False and getattr(defaults, k) is True:
            out.append(f"--no_{k}")
        elif isinstance(v, list):
            out += [f"--{k}", *map(str, v)]
        elif v is not False and v is not None:
            out += [f"--{k}", str(v)]
    return out


def runs(script, args, out, first=None):
    """The script's command lines for a row: twice with --resume where asked (the first run, to the shorter total
    `first`, leaves a checkpoint after its first update; the second resumes from it to the whole total). With
    --overwrite_output_dir the (first) run replaces an earlier finished run, of whose checkpoints none is left."""
    if args["overwrite_output_dir"]:
        save_checkpoint(out, 99, {"step": 99})
        write_jsonl(os.path.join(out, "metrics.jsonl"), [{"step": 99}])
    each = (
        [dict(args, resume=False, save_steps=1, **first), dict(args, resume=True, overwrite_output_dir=False)]
        if args.pop("resume")
        else [args]
    )
    return [[script, *flags(a, ppo.Args if script == "ppo.py" else rm.Args), "--output_dir", out] for a in each]


@pytest.fixture(scope="module")
def sft_folder(tmp_path_factory):
    """The embedded task's initial policy saved as a user's checkpoint: a folder, weights stored in bfloat16."""
    out = tmp_path_factory.mktemp("sft")
    ppo.embedded_sft_policy("embedded-llama", TOK, seed=3).to(torch.bfloat16).save_pretrained(out)
    TOK.save_pretrained(out)
    return str(out)


def ppo_row(row, reward_model_path, sft_folder):
    """A row of PPO_ROWS as (ranks, ppo.py's arguments, the first of two runs' if it resumes, its number of updates)."""
    row = dict(row)
    ranks, reward, policy = row.pop("ranks"), row.pop("reward"), row.pop("policy")
    if row["advantage_estimator"] == "dr_grpo":
        row.update(advantage_estimator="grpo", scale_rewards=False)
    micro, updates = 2, 3 if row["resume"] else 1
    batch = micro * row["gradient_accumulation_steps"] * 2 * ranks
    args = dict(
        row,
        total_episodes=batch * updates,
        per_device_train_batch_size=micro,
        num_mini_batches=2,
        num_ppo_epochs=2,
        response_length=6,
        sample_every=1,
        kl_horizon=100,
        sft_model_path=sft_folder if policy == "folder" else "embedded-llama",
        reward_model_path=None if reward == "function" else reward_model_path,
        reward_fn=None if reward == "model" else "common:gold_rewards",
        ptx_dataset_name="embedded" if row["ptx_coef"] else None,
    )
    if policy == "folder":
        args["learning_rate"] = 3e-4
    return ranks, args, dict(total_episodes=batch * 2), updates


def rm_row(row, folder, small_pairs_file, family_dir):
    """A row of RM_ROWS as (ranks, rm.py's arguments, the first of two runs' if it resumes)."""
    row = dict(row)
    ranks, model = row.pop("ranks"), row.pop("model")
    args = dict(
        row,
        max_steps=4 if row["resume"] else 2,
        per_device_train_batch_size=4,
        num_evals=1,
        logging_steps=1,
        max_length=64,
        min_prompt_length=32,
    )
    if model == "folder":  # a tiny Llama stored in bfloat16, with its own tokenizer and chat-formatted pairs
        args.update(
            model_name_or_path=family_dir("llama"),
            learning_rate=1e-3,
            dataset_name=write_jsonl(folder / "pairs.jsonl", preference_rows("llama", 80)),
        )
    else:
        args.update(dataset_name=small_pairs_file)
    return ranks, args, dict(max_steps=2)


@pytest.fixture(scope="module")
def ran(tmp_path_factory, reward_model_path, sft_folder, small_pairs_file, family_dir):
    """Every row's runs: 1 rank in this process (a process costs seconds of imports), 2 ranks under torchrun.
    {(script, row index): (output_dir, the first error of its runs or None)}."""
    with pytest.MonkeyPatch.context() as patch:
        without_inductor(patch)
        return run_rows(tmp_path_factory, reward_model_path, sft_folder, small_pairs_file, family_dir)


def run_rows(tmp_path_factory, reward_model_path, sft_folder, small_pairs_file, family_dir):
    jobs, errors = {}, {}
    for script, rows in (("ppo.py", PPO_ROWS), ("rm.py", RM_ROWS)):
        for i, row in enumerate(rows):
            out = tmp_path_factory.mktemp(f"{script[:-3]}{i}-")
            _, args, first, *_ = (
                ppo_row(row, reward_model_path, sft_folder)
                if script == "ppo.py"
                else rm_row(row, out, small_pairs_file, family_dir)
            )
            jobs[script, i] = row["ranks"], str(out / "out"), runs(script, args, str(out / "out"), first)
    for key, (ranks, _, each) in jobs.items():
        try:
            [run_main(argv) for argv in each if ranks == 1]
        except Exception as e:  # (this row fails; the others still run)
            errors[key] = repr(e)
    two = [key for key, (ranks, _, _) in jobs.items() if ranks == 2]
    failed = iter(
        run_ranks([argv for key in two for argv in jobs[key][2]], str(tmp_path_factory.mktemp("jobs")), check=False)[1]
    )
    errors.update({key: next((e for e in [next(failed) for _ in jobs[key][2]] if e), None) for key in two})
    return {key: (out, errors.get(key)) for key, (_, out, _) in jobs.items()}


@pytest.mark.parametrize(
    "key",
    [("ppo.py", i) for i in range(len(PPO_ROWS))] + [("rm.py", i) for i in range(len(RM_ROWS))],
    ids=[f"ppo{i}" for i in range(len(PPO_ROWS))] + [f"rm{i}" for i in range(len(RM_ROWS))],
)
def test_every_pair_of_options_runs(key, ran, reward_model_path, sft_folder):
    out, error = ran[key]
    assert error is None, error
    assert not os.path.exists(os.path.join(out, "checkpoints", "step_00000099"))  # (--overwrite_output_dir's)
    metrics = read_metrics(out)
    assert metrics and all(math.isfinite(v) for m in metrics for v in m.values() if isinstance(v, float)), metrics
    if key[0] == "ppo.py":
        evals, row = [m for m in metrics if "eval/score" in m], PPO_ROWS[key[1]]
        assert len(metrics) - len(evals) == ppo_row(row, reward_model_path, sft_folder)[3]
        assert bool(evals) == bool(row["num_evals"])
        assert all(m["eval/prompts"] == row["num_eval_prompts"] for m in evals)
        model = AutoModelForCausalLM.from_pretrained(out)
    else:
        results = json.load(open(os.path.join(out, "eval_results.json")))
        assert 0 <= results["accuracy"] <= 1 and math.isfinite(results["loss"])
        model = AutoModelForSequenceClassification.from_pretrained(out)
    assert torch.isfinite(model(input_ids=torch.tensor([[2, 4, 5, 6, 3]])).logits).all()
