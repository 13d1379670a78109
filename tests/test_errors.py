"""Bad input never costs a user their work: every mistake is one line (exit code 2, no traceback) naming the flag, or
the file, line and field, and an --output_dir holding an earlier run is left byte for byte as it was."""

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time

import huggingface_hub
import pytest
import torch
import tyro
from safetensors.torch import load_file, save_file
from test_families import write_jsonl
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

import common
import ppo
import rm
from conftest import ROOT, read_checkpoint, run_main, run_script, save_checkpoint
from families import build_tokenizer


@pytest.fixture(scope="session")
def saved_run(tmp_path_factory, small_pairs_file):
    out = tmp_path_factory.mktemp("saved") / "run"
    run_main(
        [
            "rm.py",
            "--dataset_name",
            small_pairs_file,
            "--max_steps",
            "2",
            "--num_evals",
            "1",
            "--save_steps",
            "1",
            "--output_dir",
            str(out),
        ]
    )
    return out


def snapshot(path):
    return {
        os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
        for d, _, files in os.walk(path)
        for f in files
    }


GOOD = '{"prompt": "User: tell me about animals Assistant:", "chosen": " cat dog", "rejected": " red"}'
CASES = {  # name: (flags, files {name: text or bytes} written to the data folder, expected text of the one line)
    "zero batch": (["--per_device_train_batch_size", "0"], {}, "--per_device_train_batch_size 0: must be at least 1"),
    "zero accumulation": (["--gradient_accumulation_steps", "0"], {}, "--gradient_accumulation_steps 0: must be"),
    "zero eval batch": (["--per_device_eval_batch_size", "0"], {}, "--per_device_eval_batch_size 0: must be"),
    "zero logging": (["--logging_steps", "0"], {}, "--logging_steps 0: must be at least 1"),
    "negative lr": (["--learning_rate", "-1"], {}, "--learning_rate -1.0: must be a finite number >= 0"),
    "holdout": (["--eval_holdout", "1.5"], {}, "--eval_holdout 1.5: must be a fraction within (0, 1)"),
    "zero epochs": (["--num_train_epochs", "0"], {}, "--num_train_epochs 0.0: must be above 0"),
    "negative prompt length": (["--min_prompt_length", "-1"], {}, "--min_prompt_length -1: must be at least 1"),
    "no room for responses": (["--min_prompt_length", "600"], {}, "--min_prompt_length 600 must be below --max_length"),
    "missing model": (["--model_name_or_path", "./no_such_model"], {}, "--model_name_or_path ./no_such_model: no such"),
    "lora target": (
        ["--lora_r", "4", "--lora_target_modules", "no_such_layer"],
        {},
        "--lora_target_modules no_such_layer: peft cannot put LoRA adapters on LlamaForSequence",
    ),
    "message without role": (
        [],
        {"d.jsonl": GOOD + '\n{"chosen": [{"content": "x"}], "rejected": [{"role": "assistant", "content": "y"}]}\n'},
        "d.jsonl: line 2: field 'chosen', message 0: expected {'role': text",
    ),
    "nan margin": (
        [],
        {"d.jsonl": GOOD + "\n" + GOOD[:-1] + ', "margin": NaN}\n'},
        "d.jsonl: line 2: field 'margin' is nan; expected a finite number",
    ),
    "blank lines count": (
        [],
        {"d.jsonl": GOOD + "\n\n" + '{"chosen": " a"}\n'},
        "d.jsonl: line 3: field 'rejected' is missing",
    ),
    "csv row": (
        [],
        {"d.csv": "prompt,chosen,rejected\nUser:, cat, dog\nUser:, cat,\n"},
        "d.csv: line 3: field 'rejected' is missing",
    ),
    "file in a folder": (
        [],
        {"dir/train.jsonl": GOOD + "\n", "dir/test.jsonl": '{"chosen": " a"}\n'},
        "dir/test.jsonl: line 1: field 'rejected' is missing",
    ),
    "undecodable bytes": (
        [],
        {"d.jsonl": (GOOD + "\n").encode() + b'{"chosen": " caf\xe9", "rejected": " x"}\n'},
        "d.jsonl: line 2: not UTF-8 text",
    ),
    "all pairs identical": (
        [],
        {"d.jsonl": '{"prompt": "User:", "chosen": " cat", "rejected": " cat"}\n' * 5},
        "d.jsonl: all 4 training pairs were dropped: chosen and rejected are identical",
    ),
    "eval split missing from a file": (
        ["--eval_split", "validation_typo"],
        {"d.jsonl": (GOOD + "\n") * 5},
        "d.jsonl: no split 'validation_typo' (--eval_split); it has 'train'",
    ),
    "eval split missing from a folder": (
        ["--eval_split", "validation"],
        {"dir/train.jsonl": (GOOD + "\n") * 5, "dir/test.jsonl": GOOD + "\n"},
        "dir: no split 'validation' (--eval_split); it has 'test', 'train'",
    ),
    "eval split the train split": (
        ["--eval_split", "train"],
        {"d.jsonl": (GOOD + "\n") * 5},
        "--eval_split train is the --train_split: the evaluation would read the pairs",
    ),
    "text the tokenizer cannot read": (
        [],
        {
            "d.jsonl": '{"prompt": "Human: How do I bake bread? Assistant:", "chosen": '
            '" Preheat the oven first.", "rejected": " Buy it instead please."}\n' * 5
        },
        "% of its tokens are <unk> to embedded-llama's tokenizer",
    ),
    "pairs past max_length": (
        ["--max_length", "8", "--min_prompt_length", "4"],
        {"d.jsonl": '{"prompt": "User:", "chosen": " cat dog red cat dog red cat dog red", "rejected": " a"}\n' * 5},
        "training pairs do not fit --max_length 8 with the prompt cut to",
    ),
    "array row": ([], {"d.jsonl": GOOD + "\n[1, 2]\n"}, "d.jsonl: line 2: a JSON list is not a row"),
    "string row": ([], {"d.jsonl": '"just text"\n'}, "d.jsonl: line 1: a JSON str is not a row"),
    "text margin": (
        [],
        {"d.jsonl": GOOD + "\n" + GOOD[:-1] + ', "margin": "high"}\n'},
        "d.jsonl: line 2: field 'margin' is 'high'; expected a finite number",
    ),
    "int field": ([], {"d.jsonl": '{"chosen": " cat", "rejected": 5}\n'}, "d.jsonl: line 1: field 'rejected' is int"),
    "invalid JSON, gzipped": (
        [],
        {"bad.jsonl.gz": gzip.compress(b'{"chosen": " a", "rejected": " b"}\n{not json\n')},
        "bad.jsonl.gz: line 2: not valid JSON",
    ),
    "unknown role": (
        [],
        {
            "d.jsonl": '{"chosen": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": '
            '"a"}], "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": '
            '"b"}]}\n'
        },
        "d.jsonl: line 1: field 'chosen', message 1: role 'wizard' is not one of",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_leaves_earlier_work_intact(case, tmp_path, saved_run, small_pairs_file):
    flags, files, expected = CASES[case]
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    data = (
        str(tmp_path / "dir")
        if "dir/train.jsonl" in files
        else str(tmp_path / next(iter(files)))
        if files
        else small_pairs_file
    )
    out = tmp_path / "out"
    shutil.copytree(saved_run, out)
    before = snapshot(out)
    # --overwrite_output_dir: the earlier run is replaced only once training starts, never by a run that stops before
    argv = ["--dataset_name", data, "--output_dir", str(out), "--overwrite_output_dir", *flags]
    # one case as a user runs it, a process of its own; the others through the same entry point in this process
    proc = (run_script if case == "zero batch" else run_main)(["rm.py", *argv], check=False)
    stderr = proc.stderr
    lines = stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert snapshot(out) == before


def test_bad_ppo_flag_leaves_earlier_run_intact(tmp_path, saved_run):
    out = tmp_path / "out"
    shutil.copytree(saved_run, out)
    before = snapshot(out)
    proc = run_script(["ppo.py", "--num_mini_batches", "0", "--output_dir", str(out)], check=False)
    assert proc.returncode == 2 and "--num_mini_batches 0: must be at least 1" in proc.stderr
    assert snapshot(out) == before


@pytest.mark.parametrize("compressed", [False, True])
def test_byte_order_mark_is_accepted(tmp_path, compressed):
    rows = [json.dumps(r) for r in common.embedded_pairs(64, seed=2)]
    text = ("\ufeff" + "\n".join(rows) + "\n").encode("utf-8")
    path = tmp_path / ("bom.jsonl.gz" if compressed else "bom.jsonl")
    path.write_bytes(gzip.compress(text) if compressed else text)
    loaded = common.load_rows(str(path))
    assert len(loaded) == 64 and loaded[0]["chosen"] == json.loads(rows[0])["chosen"]
    rm.main(
        rm.Args(
            dataset_name=str(path),
            max_steps=2,
            num_evals=1,
            per_device_train_batch_size=8,
            output_dir=str(tmp_path / "out"),
        )
    )
    assert os.path.exists(tmp_path / "out" / "model.safetensors")


def poison_loss(monkeypatch, call):
    """rm.py's preference loss made NaN at its `call`-th call."""
    calls, real_loss = [], rm.preference_loss

    def poisoned(*a, **k):
        calls.append(1)
        return real_loss(*a, **k) * (float("nan") if len(calls) == call else 1.0)

    monkeypatch.setattr(rm, "preference_loss", poisoned)


def test_non_finite_gradient_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path, small_pairs_file, reward_model_path, monkeypatch
):
    """rm.py and ppo.py: a NaN or infinite gradient stops the run in one line, no final model saved."""
    real_loss = ppo.policy_loss
    monkeypatch.setattr(
        ppo, "policy_loss", lambda *a, **k: (lambda loss, stats: (loss * float("inf"), stats))(*real_loss(*a, **k))
    )
    with pytest.raises(common.UserError, match=r"update 1: the gradient norm is (nan|inf) .*lower --learning_rate"):
        ppo.main(ppo.Args(reward_model_path=reward_model_path, total_episodes=32, output_dir=str(tmp_path / "ppo")))
    assert not os.path.exists(tmp_path / "ppo" / "model.safetensors")
    poison_loss(monkeypatch, 5)
    with pytest.raises(common.UserError, match=r"step 5: the gradient norm is nan .*--resume continues"):
        rm.main(
            rm.Args(
                dataset_name=small_pairs_file,
                max_steps=8,
                save_steps=2,
                num_evals=1,
                per_device_train_batch_size=8,
                output_dir=str(tmp_path / "rm"),
            )
        )
    assert open(tmp_path / "rm" / "checkpoints" / "latest").read() == "step_00000004"
    state = common.load_latest_checkpoint(str(tmp_path / "rm"))
    weights = read_checkpoint(common.latest_checkpoint(str(tmp_path / "rm")))["model"]
    assert state["step"] == 4 and all(torch.isfinite(v).all() for v in weights.values())
    assert not os.path.exists(tmp_path / "rm" / "model.safetensors")  # no final model from a diverged run


def test_a_new_run_that_stops_leaves_the_earlier_runs_files_whole(tmp_path, saved_run, small_pairs_file, monkeypatch):
    """A new run stopped half-way into a finished run's folder: the earlier model and results stay byte for byte, its
    checkpoints are gone (--resume must not continue it)."""
    out = tmp_path / "out"
    shutil.copytree(saved_run, out)
    before = snapshot(out)
    poison_loss(monkeypatch, 3)
    with pytest.raises(common.UserError, match="step 3: the gradient norm is nan"):
        rm.main(
            rm.Args(
                dataset_name=small_pairs_file,
                max_steps=4,
                logging_steps=1,
                num_evals=1,
                per_device_train_batch_size=8,
                output_dir=str(out),
                overwrite_output_dir=True,
            )
        )
    after = snapshot(out)
    before = {k: v for k, v in before.items() if not k.startswith("checkpoints") and k != "metrics.jsonl"}
    assert {k: v for k, v in after.items() if k != "metrics.jsonl"} == before and not (out / "checkpoints").exists()
    assert [json.loads(line)["step"] for line in after["metrics.jsonl"].splitlines()] == [1, 2]


def test_checkpoints_are_atomic_never_an_earlier_runs_latest_never_run_code_and_a_full_disk_is_one_line(
    tmp_path, monkeypatch
):
    save_checkpoint(str(tmp_path / "a"), 1, {"step": 1})
    os.makedirs(tmp_path / "a" / "checkpoints" / "step_00000002.tmp")  # a crash mid-write leaves only a .tmp directory
    assert common.load_latest_checkpoint(str(tmp_path / "a"))["step"] == 1
    save_checkpoint(str(tmp_path / "a"), 2, {"step": 2})
    save_checkpoint(str(tmp_path / "a"), 3, {"step": 3})
    assert common.load_latest_checkpoint(str(tmp_path / "a"))["step"] == 3
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == ["latest", "step_00000002", "step_00000003"]
    for step in (7, 8):  # an earlier run into the same folder reached step 8
        save_checkpoint(str(tmp_path), step, {"step": step, "run": "old"})
    for step in (2, 4, 6, 8):
        save_checkpoint(str(tmp_path), step, {"step": step, "run": "new"})
        latest = common.load_latest_checkpoint(str(tmp_path))
        assert latest == {"step": step, "run": "new"}
    assert len([d for d in os.listdir(tmp_path / "checkpoints") if d.startswith("step_")]) == 2
    shutil.rmtree("/tmp/rlhf-crafted-checkpoint-ran", ignore_errors=True)
    save_checkpoint(str(tmp_path / "code"), 2, {"step": 2, "payload": _RunsCode()})
    with pytest.raises(Exception, match="Weights only load failed"):
        common.load_latest_checkpoint(str(tmp_path / "code"))
    assert not os.path.exists("/tmp/rlhf-crafted-checkpoint-ran")
    disk = tmp_path / "disk"  # a full disk: one line, no partial files
    save_checkpoint(str(disk), 2, {"step": 2, "w": torch.zeros(4)})
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("unexpected pos 64")))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(
        common.UserError,
        match=r"checkpoints: no room to save \(0 MB needed, 0 MB free\); the "
        r"partial files were removed",
    ):
        save_checkpoint(str(disk), 4, {"step": 4, "w": torch.zeros(10**4)})
    assert sorted(os.listdir(disk / "checkpoints")) == ["latest", "step_00000002"]  # no step_00000004.tmp
    monkeypatch.undo()
    assert common.load_latest_checkpoint(str(disk))["step"] == 2


def test_numbers_in_text_cells_are_numbers_and_sharegpt_roles_are_mapped(tmp_path):
    """Margins in text cells are numbers; ShareGPT roles are mapped; a role the chat template drops is named."""
    (tmp_path / "d.csv").write_text('prompt,chosen,rejected,margin\nUser:, cat, dog,"0.5"\nUser:, red, owl,\n')
    (tmp_path / "d.jsonl").write_text(GOOD[:-1] + ', "margin": " 2.5 "}\n')
    args = rm.Args(max_length=64, min_prompt_length=32)
    csv_pairs = rm.tokenize_pairs(common.load_rows(str(tmp_path / "d.csv")), common.embedded_tokenizer(), args)[0]
    json_pairs = rm.tokenize_pairs(common.load_rows(str(tmp_path / "d.jsonl")), common.embedded_tokenizer(), args)[0]
    assert [p["margin"] for p in csv_pairs] == [0.5, 0.0] and json_pairs[0]["margin"] == 2.5
    row = {
        "chosen": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "cat"}],
        "rejected": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "dog"}],
    }
    mapped = {k: [dict(m, role={"human": "user", "gpt": "assistant"}[m["role"]]) for m in v] for k, v in row.items()}
    tok = common.embedded_tokenizer()
    assert common.split_pair(row, tok, "x") == common.split_pair(mapped, tok, "x")
    tokenizer = build_tokenizer("llama")  # a role the chat template drops (Llama 2's: user and assistant turns only)
    row = {
        "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}],
        "rejected": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "b"}],
    }
    with pytest.raises(common.UserError, match="d.jsonl: line 2: field 'rejected', message 1: role 'narrator' is not"):
        common.split_pair(row, tokenizer, "d.jsonl: line 2")
    row["rejected"][1]["role"] = "assistant"
    assert common.split_pair(row, tokenizer, "d.jsonl: line 2")[1:] == (" a </s>", " b </s>")


class _RunsCode:
    def __reduce__(self):
        return (os.mkdir, ("/tmp/rlhf-crafted-checkpoint-ran",))


def test_a_new_save_leaves_no_weight_file_of_an_older_one(tmp_path):
    tok = common.embedded_tokenizer()
    model = AutoModelForSequenceClassification.from_config(common.embedded_model_config("embedded-llama", len(tok), 1))
    common.save_pretrained_atomic(model, tok, str(tmp_path))  # one file
    assert os.path.exists(tmp_path / "model.safetensors")
    common.save_pretrained_atomic(model, tok, str(tmp_path), max_shard_size="100KB")  # sharded, with an index
    assert not os.path.exists(tmp_path / "model.safetensors")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in reloaded.state_dict().items())


def test_eval_only_reads_a_folder_with_a_test_split_alone_and_mixtures_with_some_gold(tmp_path, saved_run):
    (tmp_path / "data").mkdir()
    write_jsonl(
        tmp_path / "data" / "test.jsonl",
        [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in common.embedded_pairs(40, seed=9)],
    )
    ev = rm.main(
        rm.Args(
            model_name_or_path=str(saved_run),
            dataset_name=str(tmp_path / "data"),
            eval_only=True,
            output_dir=str(tmp_path / "eval"),
        )
    )
    assert json.load(open(tmp_path / "eval" / "eval_results.json"))["num_pairs"] == 40 and "eval/accuracy" in ev
    ev = rm.main(
        rm.Args(
            dataset_mixer_list=["embedded", "300", str(tmp_path / "data" / "test.jsonl"), "1.0"],
            max_steps=2,
            per_device_train_batch_size=8,
            num_evals=1,
            output_dir=str(tmp_path / "mix"),
        )
    )
    assert 0.5 < ev["eval/bayes_accuracy"] < 1  # from the embedded pairs, the only ones with gold values
    results = json.load(open(tmp_path / "mix" / "eval_results.json"))  # each dataset's numbers and eval set, recorded
    test_file = str(tmp_path / "data" / "test.jsonl")
    assert "embedded/bayes_accuracy" in results and f"{test_file}/accuracy" in results
    assert results["eval_sets"] == {
        "embedded": "split 'validation'",
        test_file: "0.1 of its training pairs, held out by prompt",
    }


def test_a_tokenizer_loaded_as_the_wrong_class_is_named_before_any_pair_is_dropped(tmp_path):
    """A tokenizer AutoTokenizer loads as the wrong class (no tokens for any text) is named before every pair drops."""
    common.embedded_tokenizer().save_pretrained(tmp_path)
    Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert common.tokenize_prompts(common.embedded_tokenizer(), ["User: tell"]) != [[]]  # the right class works
    with pytest.raises(common.UserError, match=r"gives no tokens for the text 'a b': it is loaded as the wrong class"):
        common.tokenize_prompts(tokenizer, ["User: tell me about animals Assistant:"])


def test_data_the_tokenizer_does_not_cover_stops_both_scripts_before_training(hh_path, tmp_path):
    """Data 95% <unk> (chance accuracy, exit 0) stops both scripts; a tokenizer 4% unknown is not stopped."""
    unknown = (
        r"test.jsonl.gz: 9\d% of its tokens are <unk> to embedded-llama's tokenizer, which does not cover this "
        r"data; pass {} a model whose tokenizer does"
    )
    with pytest.raises(common.UserError, match=unknown.format("--model_name_or_path")):
        rm.main(rm.Args(dataset_name=hh_path, max_steps=2, num_evals=1, output_dir=str(tmp_path / "rm")))
    with pytest.raises(common.UserError, match=unknown.format("--sft_model_path")):
        ppo.main(
            ppo.Args(
                dataset_name=hh_path,
                reward_fn="common:gold_rewards",
                total_episodes=32,
                output_dir=str(tmp_path / "ppo"),
            )
        )
    assert not os.path.exists(tmp_path / "rm" / "model.safetensors") and not os.path.exists(tmp_path / "ppo")
    rows = common.load_rows(hh_path)
    tokenizer = build_tokenizer("bert")
    common.check_vocabulary(tokenizer, tokenizer([r["chosen"] for r in rows])["input_ids"], "hh", "bert", "--flag")


@pytest.mark.parametrize(
    "script, flags, named",
    [
        ("ppo", ["--reward_model_path", "runs/rm-missing"], "--reward_model_path runs/rm-missing"),
        ("ppo", ["--sft_model_path", "someone/no-such-model"], "--sft_model_path someone/no-such-model"),
        ("ppo", ["--dataset_name", "someone/no-such-prompts"], "--dataset_name someone/no-such-prompts"),
        ("ppo", ["--dataset_name", "no_such_prompts.jsonl"], "--dataset_name no_such_prompts.jsonl"),
        ("ppo", ["--ptx_coef", "0.1", "--ptx_dataset_name", "someone/no-such-text"], "--ptx_dataset_name someone/"),
        ("rm", ["--model_name_or_path", "someone/no-such-model"], "--model_name_or_path someone/no-such-model"),
        ("rm", ["--dataset_name", "nope.jsonl"], "--dataset_name nope.jsonl"),
        ("rm", ["--dataset_mixer_list", "embedded", "100", "someone/no-such-pairs", "1.0"], "someone/no-such-pairs"),
    ],
)
def test_every_model_and_dataset_is_found_before_any_model_loads(script, flags, named, tmp_path, monkeypatch):
    """Offline, a name neither a local path nor in the hub cache is one line naming it once, before any model loads."""
    module = {"ppo": ppo, "rm": rm}[script]
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    monkeypatch.setattr(
        module,
        "build_models" if script == "ppo" else "load_reward_model",
        lambda *a, **k: pytest.fail("a model was loaded before the names were found"),
    )
    flags = flags + (
        ["--reward_fn", "common:gold_rewards"] if script == "ppo" and "runs/rm-missing" not in flags else []
    )
    proc = run_main([f"{script}.py", *flags, "--output_dir", str(tmp_path)], check=False)
    stderr = proc.stderr
    assert proc.returncode == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert named in stderr and stderr.count(named.split()[-1]) == 1 and "no such file or folder" in stderr, stderr


def test_help_is_printed_once_under_torchrun_the_methods_options_first():
    """tyro's own help, from each field's docstring: once under torchrun, the method's options first."""
    proc = run_script(["rm.py", "--help"], nproc=2, env={"COLUMNS": "200"})
    assert proc.stdout.count("usage: rm.py") == 1, proc.stdout[-2000:]
    assert re.findall(r"│ (--\w+)", proc.stdout)[:2] == ["--center_rewards_coefficient", "--head_init_std"]
    assert "Weight of mean((r_c + r_r)^2)" in proc.stdout and "--lr_end" in proc.stdout
    assert "this fraction held out, by whole prompts" in proc.stdout
    assert "warmup_stable_decay" in proc.stdout  # every schedule transformers has
    proc = run_script(["ppo.py", "--help"], env={"COLUMNS": "80"})
    assert re.findall(r"│ (--\w+)", proc.stdout)[:2] == ["--advantage_estimator", "--num_samples_per_prompt"]


def test_help_shows_no_default_none_after_a_default_the_help_states(monkeypatch, capsys):
    """A field whose default is None shows its help's own default, not tyro's "(default: None)". Others keep tyro's."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["ppo.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        common.cli(ppo.Args)
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "--num_samples_per_prompt" in out and "(default: None)" not in out, out
    assert re.search(r"--kl_coef FLOAT\W*\n\W*[^\n]*\(default: 0\.1\)", out), out
    flags = ["--num_samples_per_prompt", "2", "--kl_coef", "0.2"]
    monkeypatch.setattr(sys, "argv", ["ppo.py", *flags])
    assert common.cli(ppo.Args) == tyro.cli(ppo.Args, args=flags, use_underscores=True)


def test_the_new_reward_head_is_said_once_and_only_really_unexpected_keys_are_reported(
    family_dir, tmp_path, small_pairs_file
):
    """A causal LM as rm.py's start: its new head and unused LM head in one line; a missing backbone weight reported."""
    source = tmp_path / "lm"
    shutil.copytree(family_dir("llama"), source)
    weights = load_file(source / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    proc = run_script(
        [
            "rm.py",
            "--model_name_or_path",
            str(source),
            "--dataset_name",
            small_pairs_file,
            "--max_steps",
            "1",
            "--num_evals",
            "1",
            "--output_dir",
            str(tmp_path / "out"),
        ]
    )
    out = proc.stdout + proc.stderr
    assert out.count("a new reward head (score, 32 -> 1) on its backbone") == 1 and "--head_init_std 0.1741" in out, out
    assert "model.norm.weight" in out and "score.weight" not in out and "lm_head.weight" not in out, out


def test_nodes_that_do_not_share_the_output_folder_stop_before_training(tmp_path, small_pairs_file):
    """Nodes in different folders with a relative --output_dir both stop at start-up with one line, within a minute."""
    started, agents = time.time(), []
    for node in (0, 1):
        os.makedirs(tmp_path / f"node{node}")
        agents.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--node_rank",
                    str(node),
                    "--nproc_per_node",
                    "1",
                    "--master_addr",
                    "127.0.0.1",
                    "--master_port",
                    str(29500 + os.getpid() % 1000),
                    os.path.join(ROOT, "rm.py"),
                    "--dataset_name",
                    small_pairs_file,
                    "--max_steps",
                    "4",
                    "--output_dir",
                    "out",
                ],
                cwd=tmp_path / f"node{node}",
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
        )
    errors = [agent.communicate(timeout=120)[1] for agent in agents]
    assert time.time() - started < 60
    for node, (agent, err) in enumerate(zip(agents, errors)):
        assert agent.returncode != 0 and "exitcode  : 2" in err, err[-2000:]
        assert "error: --output_dir out: rank 1 does not see the file rank 0 has just written there" in err
        assert sorted(os.listdir(tmp_path / f"node{node}")) == (["out"] if node == 0 else [])
    assert os.listdir(tmp_path / "node0" / "out") == []  # nothing trained, nothing saved


def test_a_check_failed_on_one_rank_ends_every_rank_with_its_message(tmp_path):
    """A reward function failing on rank 1 alone ends both ranks with its message (no wait in a collective)."""
    fn = tmp_path / "rank_reward.py"
    fn.write_text(
        "import os\n\ndef reward(prompts, responses):\n"
        "    return [float('nan') if os.environ['RANK'] == '1' else 1.0 for _ in prompts]\n"
    )
    started = time.time()
    proc = run_script(
        [
            "ppo.py",
            "--reward_fn",
            f"{fn}:reward",
            "--total_episodes",
            "8",
            "--per_device_train_batch_size",
            "2",
            "--num_mini_batches",
            "1",
            "--response_length",
            "8",
            "--output_dir",
            str(tmp_path / "out"),
        ],
        nproc=2,
        check=False,
    )
    assert time.time() - started < 60 and proc.returncode != 0
    assert proc.stderr.count(f"error: --reward_fn {fn}:reward returned nan; it must return one finite number") == 2


def test_a_full_disk_on_one_rank_during_a_sharded_checkpoint_is_one_line_on_every_rank(tmp_path, small_pairs_file):
    """Rank 1's checkpoint writer fails (ENOSPC): every rank stops with one line, the partial checkpoint removed, the
    last one whole and `latest`."""
    base = [
        "tests/faults.py",
        "rm.py",
        "--dataset_name",
        small_pairs_file,
        "--max_steps",
        "6",
        "--save_steps",
        "2",
        "--num_evals",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--output_dir",
        str(tmp_path),
    ]
    assert run_script(base, nproc=2, check=False, env=dict(STOP_AFTER_SAVE="2")).returncode != 0
    before = snapshot(tmp_path / "checkpoints")
    proc = run_script(base + ["--resume"], nproc=2, check=False, env=dict(FULL_DISK_RANK="1"))
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr
    assert proc.stderr.count("checkpoints: no room to save") == 2 and "CheckpointException" not in proc.stderr
    assert snapshot(tmp_path / "checkpoints") == before  # no step_00000004.tmp; step 2 whole, still latest


@pytest.mark.parametrize("script", ["rm.py", "ppo.py"])
def test_a_full_disk_at_the_final_save_is_one_line_on_every_rank(tmp_path, small_pairs_file, script):
    """Rank 0's final save fails (ENOSPC): both ranks stop with its one line, nothing half-written left."""
    flags = (
        [
            "--dataset_name",
            small_pairs_file,
            "--max_steps",
            "2",
            "--num_evals",
            "1",
            "--per_device_train_batch_size",
            "4",
        ]
        if script == "rm.py"
        else [
            "--reward_fn",
            "common:gold_rewards",
            "--total_episodes",
            "8",
            "--per_device_train_batch_size",
            "2",
            "--num_mini_batches",
            "1",
            "--response_length",
            "8",
        ]
    )
    started = time.time()
    proc = run_script(
        ["tests/faults.py", script, *flags, "--output_dir", str(tmp_path / "out")],
        nproc=2,
        check=False,
        env=dict(FULL_DISK_AT_END="0"),
    )
    assert time.time() - started < 120 and proc.returncode != 0 and "exitcode  : 2" in proc.stderr
    assert proc.stderr.count(": no room to save") == 2 and "OSError" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out" / ".saving").exists()
    assert not any(f.startswith(("model", "config.json")) for f in os.listdir(tmp_path / "out"))


def test_a_dataset_prepared_in_datasets_own_cache_is_found_offline(tmp_path, monkeypatch):
    """A hub dataset prepared in `datasets`' own cache is found offline; a name in neither cache is refused."""
    from datasets import config

    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: True)
    monkeypatch.setattr(config, "HF_DATASETS_CACHE", str(tmp_path))
    (tmp_path / "Anthropic___hh-rlhf").mkdir()
    (tmp_path / "trl-lib___my_prefs").mkdir()  # "MyPrefs", as its loader names it: snake case
    common.check_source("Anthropic/hh-rlhf", "--dataset_name", "dataset")
    common.check_source("trl-lib/MyPrefs", "--dataset_name", "dataset")
    with pytest.raises(common.UserError, match="not in the hub cache"):
        common.check_source("Anthropic/other", "--dataset_name", "dataset")
