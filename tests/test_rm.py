import collections
import copy
import gzip
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch
import transformers
import tyro
from test_errors import snapshot
from test_families import write_jsonl
from transformers import AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, MistralConfig, SchedulerType

import common
import ppo
import rm
from conftest import ROOT, assert_saved_models_equal, read_checkpoint, read_metrics, run_main, run_ranks, run_script
from families import build_tokenizer

TOK = common.embedded_tokenizer()


def tiny_reward_model(arch="embedded-llama", seed=0):
    args = rm.Args(model_name_or_path=arch, seed=seed)
    return rm.RewardModel(rm.load_reward_model(args, TOK)[0]).eval()


def random_pairs(n, seed, margin=0.0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(20, len(TOK), (k,), generator=g).tolist()  # noqa: E731
    return [
        {
            "prompt": ids(int(torch.randint(1, 8, (1,), generator=g))),
            "chosen": ids(int(torch.randint(1, 9, (1,), generator=g))) + [TOK.eos_token_id],
            "rejected": ids(int(torch.randint(1, 9, (1,), generator=g))) + [TOK.eos_token_id],
            "margin": margin,
        }
        for _ in range(n)
    ]


# --- the math -------------------------------------------------------------------------------------------------------


def test_rm_and_ppo_state_the_same_conventions():
    """Each script states its own method; where they share one, they agree: a long prompt's truncation, where a
    sequence's reward is read (the last real token, by the mask) and what it reads there, dropout off."""
    eos = 3  # right padding, left padding, and pad id == eos id with a real final EOS: only the mask tells them apart
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    ids = torch.tensor([[5, 6, eos, eos, eos], [eos, eos, 5, 6, eos], [5, eos, 6, eos, eos], [5, 6, 7, 8, eos]])
    assert rm.last_token_index(mask).tolist() == [2, 4, 3, 4]
    naive_first_pad = (ids == eos).int().argmax(1) - 1  # what pad-id search would return for row 0
    assert naive_first_pad[0].item() == 1  # ... which is the wrong token, hence the mask
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 30))]
        bos, limit = rng.choice([None, 7, ids[0] if ids else None]), rng.randrange(1, 20)
        kept = rm.truncate_prompt(ids, limit, bos)
        assert kept == ppo.truncate_prompt(ids, limit, bos)
        lead = ids[:1] if bos is not None and ids[:1] == [bos] and len(ids) > limit else []
        assert kept == (ids if len(ids) <= limit else lead + ids[len(ids) - limit + len(lead) :])  # its end, and BOS
    mask = (torch.rand(16, 12, generator=torch.Generator().manual_seed(0)) > 0.3).long()
    assert torch.equal(rm.last_token_index(mask), ppo.last_token_index(mask))
    config = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=40,
        num_labels=1,
        pad_token_id=0,
        resid_pdrop=0.3,
        embd_pdrop=0.3,
        attn_pdrop=0.3,
        summary_first_dropout=0.3,
        layerdrop=0.3,
        router_jitter_noise=0.3,
    )  # (the last two: OPT's and MoE routers' training-mode randomness)
    models = [AutoModelForSequenceClassification.from_config(copy.deepcopy(config)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model, script in zip(models, (rm, ppo)):
        script.disable_dropout(model).train()  # (training mode: only dropout's probability can differ)
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
        assert model.config.layerdrop == model.config.router_jitter_noise == 0 and all(
            v == 0 for k, v in vars(model.config).items() if "pdrop" in k or "dropout" in k
        )
    ids, right = (
        torch.randint(1, 40, (4, 9)),
        torch.tensor([[1] * 9, [1] * 5 + [0] * 4, [0] * 3 + [1] * 6, [1] * 2 + [0] * 7]),
    )
    rewards = [script.sequence_reward(model, ids, right) for model, script in zip(models, (rm, ppo))]
    assert torch.equal(rewards[0], rewards[1])
    hidden = (
        models[0]
        .base_model(input_ids=ids, attention_mask=right, position_ids=(right.cumsum(1) - 1).clamp(min=0))
        .last_hidden_state
    )
    last = [max(i for i in range(9) if right[r, i]) for r in range(4)]  # the last real token, written out
    assert torch.allclose(rewards[0], models[0].score(hidden[torch.arange(4), last]).squeeze(-1), atol=1e-6)


def test_the_loss_its_probability_and_the_evaluation_losses_match_formulas():
    """The loss log(1 + exp(-(r_c - r_r - margin))) and its gradient, exact even where exp overflows float32; its
    probability, ECE, Pearson's r and the evaluation's losses (with the centering term) as written out here."""
    rc, rr, m = torch.tensor([1.0, -2.0, 0.3, 5.0]), torch.tensor([0.5, 1.0, 0.3, -5.0]), torch.tensor([0.0, 0.5, 1, 2])
    expected = [math.log(1 + math.exp(-(c - r - mm))) for c, r, mm in zip(rc.tolist(), rr.tolist(), m.tolist())]
    assert torch.allclose(rm.preference_loss(rc, rr, m), torch.tensor(expected), atol=1e-6)
    logistic = [1 / (1 + math.exp(-(c - r - mm))) for c, r, mm in zip(rc.tolist(), rr.tolist(), m.tolist())]
    assert torch.allclose(torch.exp(-rm.preference_loss(rc, rr, m)), torch.tensor(logistic), atol=1e-6)
    pairs = [{"chosen": [1], "rejected": [2], "gold": None}] * 4
    metrics = rm.pair_metrics(rc, rr, m, pairs, rm.Args(center_rewards_coefficient=0.5), "eval/")
    assert metrics["eval/calibration_error"] == pytest.approx(rm.calibration_error(torch.sigmoid(rc - rr)), abs=1e-6)
    pair = -sum(math.log(p) for p in logistic) / 4
    assert metrics["eval/preference_loss"] == pytest.approx(pair, rel=1e-6)
    assert metrics["eval/loss"] == pytest.approx(pair + 0.5 * ((rc + rr) ** 2).mean().item(), rel=1e-6)
    gap = torch.cat([torch.linspace(-150, 150, 301), torch.tensor([-1e4, 88.5, 1e4])])
    r_chosen = gap.clone().requires_grad_()
    loss = rm.preference_loss(r_chosen, torch.zeros_like(gap), torch.full_like(gap, 0.5))
    loss.sum().backward()
    x = 0.5 - gap.double()
    assert torch.isfinite(loss).all() and torch.isfinite(r_chosen.grad).all()
    assert torch.allclose(loss.double(), torch.nn.functional.softplus(x), rtol=1e-6, atol=1e-6)
    assert torch.allclose(r_chosen.grad.double(), -torch.sigmoid(x), rtol=1e-6, atol=1e-6)
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 500)
    both_p, both_y = np.concatenate([p, 1 - p]), np.concatenate([np.ones(500), np.zeros(500)])
    ece = 0.0
    for b in range(10):
        lo, hi = b / 10, (b + 1) / 10
        inside = (both_p >= lo) & ((both_p < hi) if b < 9 else (both_p <= hi))
        if inside.any():
            ece += inside.mean() * abs(both_p[inside].mean() - both_y[inside].mean())
    assert rm.calibration_error(torch.tensor(p)) == pytest.approx(ece, abs=1e-9)
    x, y = rng.normal(size=100), rng.normal(size=100)
    assert rm.pearson(torch.tensor(x), torch.tensor(y)) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-9)


def test_the_calibration_error_is_of_the_probability_the_model_states_not_of_the_margin_loss():
    """With margins in the data, the calibration reported is that of P(chosen wins) = sigmoid(r_c - r_r), the model's
    own probability, and not that of sigmoid(r_c - r_r - margin), which the loss reads."""
    g = torch.Generator().manual_seed(0)
    rc, rr, margin = torch.randn(400, generator=g), torch.randn(400, generator=g), torch.full((400,), 1.5)
    pairs = [{"chosen": [1], "rejected": [2], "gold": None}] * 400
    reported = rm.pair_metrics(rc, rr, margin, pairs, rm.Args(), "eval/")["eval/calibration_error"]
    stated = [1 / (1 + math.exp(-(c - r))) for c, r in zip(rc.tolist(), rr.tolist())]
    with_margin = [1 / (1 + math.exp(-(c - r - 1.5))) for c, r in zip(rc.tolist(), rr.tolist())]
    assert reported == pytest.approx(rm.calibration_error(torch.tensor(stated)), abs=1e-6)
    assert abs(reported - rm.calibration_error(torch.tensor(with_margin))) > 0.05


# --- the model --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["embedded-llama", "embedded-neox"])
def test_fused_forward_equals_separate_unpadded_forwards(arch):
    model = tiny_reward_model(arch)
    pairs = random_pairs(6, seed=1)
    with torch.no_grad():
        ids, mask = rm.collate(pairs, TOK.pad_token_id)
        fused = model(ids, mask)
        shift = (1 - mask).sum(1, keepdim=True)  # each row's padding moved to its left: last_token_index reads either
        index = (torch.arange(ids.shape[1]) - shift) % ids.shape[1]
        left = model(ids.gather(1, index), mask.gather(1, index))
        separate = [
            model(torch.tensor([p["prompt"] + p[k]]), torch.ones(1, len(p["prompt"] + p[k]), dtype=torch.long))
            for k in ("chosen", "rejected")
            for p in pairs
        ]
    assert torch.allclose(fused, torch.cat(separate), atol=1e-5)
    assert torch.allclose(left, fused, atol=1e-5)


def test_new_head_init_std_dropout_off_and_defaults_by_model():
    """--head_init_std (0: zeros; None: 1 / sqrt(hidden + 1)), dropout off, epochs and learning rate by the model."""
    args = rm.Args(model_name_or_path="embedded-llama", head_init_std=0.5)
    hf, _, _ = rm.load_reward_model(args, TOK)
    assert hf.score.weight.std().item() == pytest.approx(0.5, rel=0.2)
    default, _, filled = rm.load_reward_model(rm.Args(), TOK)
    assert filled.head_init_std == pytest.approx(1 / math.sqrt(64 + 1))
    assert default.score.weight.std().item() == pytest.approx(1 / math.sqrt(64 + 1), rel=0.2)
    assert all(m.p == 0 for m in default.modules() if isinstance(m, torch.nn.Dropout))
    model = AutoModelForSequenceClassification.from_config(common.embedded_model_config("embedded-llama", 40, 1))
    rm.new_head(model, rm.fill_defaults(rm.Args(head_init_std=0.0), model).head_init_std)
    assert model.score.weight.abs().sum() == 0
    rm.new_head(model, rm.fill_defaults(rm.Args(), model).head_init_std)
    assert 0.05 < model.score.weight.std() < 0.2  # 1 / sqrt(65)
    for name, epochs in (("embedded-llama", 3), ("someone/pretrained", 1)):
        assert rm.schedule(rm.fill_defaults(rm.Args(model_name_or_path=name), model), 64, 8, rank=0)[1] == 8 * epochs
    args = rm.fill_defaults(rm.Args(model_name_or_path="someone/pretrained", num_train_epochs=2.0), model)
    assert rm.schedule(args, 64, 8, rank=0)[1] == 16 and args.learning_rate == 1e-5


# --- data -----------------------------------------------------------------------------------------------------------


def ids_of(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_explicit_implicit_and_conversational_formats_give_the_same_ids_and_encoders_their_separator_once():
    prompt, chosen, rejected = "User: tell me about animals Assistant:", " cat dog", " red rice"
    conv = {
        "prompt": [{"role": "user", "content": "tell me about animals"}],
        "chosen": [{"role": "assistant", "content": "cat dog"}],
        "rejected": [{"role": "assistant", "content": "red rice"}],
    }
    rows = [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected},
        {"chosen": prompt + chosen, "rejected": prompt + rejected},
        conv,
    ]
    rows = [dict(r, _source="mem", _row=i) for i, r in enumerate(rows)]
    pairs, counts = rm.tokenize_pairs(rows, TOK, rm.Args(max_length=512, min_prompt_length=384))
    assert not counts and len(pairs) == 3
    eos = TOK.eos_token_id
    for p in pairs[:2]:
        assert p["prompt"] == ids_of(prompt)
        assert p["chosen"] == ids_of("cat dog") + [eos] and p["rejected"] == ids_of("red rice") + [eos]
    conv_pair = pairs[2]  # rendered by the chat template: "user: ... assistant: cat dog "
    assert conv_pair["prompt"] == ids_of("user: tell me about animals assistant:")
    assert conv_pair["chosen"] == ids_of("cat dog") + [eos] and conv_pair["rejected"] == ids_of("red rice") + [eos]
    text_prompt = dict(conv, prompt="tell me about animals")  # a text prompt before message responses: the user turn
    assert common.split_pair(text_prompt, TOK, "m") == common.split_pair(conv, TOK, "m")
    assert common.split_pair(text_prompt, TOK, "m")[0] == "user: tell me about animals assistant:"
    # an encoder's tokenizer: prompts never end with the separator it appends, responses end with one
    for family in ("roberta", "bert", "deberta"):
        tok = build_tokenizer(family)
        prefix, suffix = common.special_affixes(tok)
        assert prefix and suffix
        [prompt] = common.tokenize_prompts(tok, ["User: tell me about animals Assistant:"])
        assert prompt[: len(prefix)] == prefix and prompt[-1] not in suffix
        [response] = common.tokenize_responses(tok, ["User: tell me"], [" cat dog"])
        assert response[-1] == common.end_id(tok) and response.count(response[-1]) == 1


def test_implicit_prompt_extraction_on_real_hh_rlhf(hh_path):
    with gzip.open(hh_path, "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2312
    for row in rows:
        prompt, chosen, rejected = common.shared_prefix_split(row["chosen"], row["rejected"])
        assert prompt + chosen == row["chosen"] and prompt + rejected == row["rejected"]
        assert chosen[:1].isspace() or chosen == "" or prompt == ""  # responses start at a word boundary
    first = common.shared_prefix_split(rows[0]["chosen"], rows[0]["rejected"])[0]
    assert first.startswith("\n\nHuman:") and first.rstrip().endswith("Assistant:")
    for row in rows:  # the prompt is the whole dialogue through the final "Assistant:" (plus shared first words)
        final_turn = min(row[k].rfind("\n\nAssistant:") for k in ("chosen", "rejected")) + len("\n\nAssistant:")
        assert common.shared_prefix_split(row["chosen"], row["rejected"])[0].startswith(row["chosen"][:final_turn])


def test_truncation_cuts_the_prompt_never_a_response_and_drops_what_does_not_fit():
    prompt, chosen, rejected = [2, 10, 11, 12, 13, 14], [20, 21, 22, 3], [30, 3]
    # a pair past max_length: the prompt keeps its end and BOS, as many tokens as the longer response leaves
    assert rm.truncate_pair(prompt, chosen, rejected, 8, 3, bos_id=2) == ([2, 12, 13, 14], None)
    assert rm.truncate_pair(prompt[1:], chosen, rejected, 8, 3, bos_id=2) == ([11, 12, 13, 14], None)
    assert rm.truncate_pair([5], [6, 3], [7, 3], 10, 5) == ([5], None)
    # the prompt is cut only where the pair would not fit, and only by what the longer response needs
    assert rm.truncate_pair(prompt, [20, 3], [30], 8, 4, bos_id=2) == (prompt, None)
    assert rm.truncate_pair(prompt, [20, 3], [30], 7, 4, bos_id=2) == ([2, 11, 12, 13, 14], None)
    # past max_length even with the prompt at min_prompt_length: dropped, not read mid-response
    assert rm.truncate_pair(prompt, chosen, rejected, 7, 4, bos_id=2) == (None, "too long")
    assert rm.truncate_pair([5], list(range(9)), [7, 3], 8, 4) == (None, "too long")
    assert rm.truncate_pair([5, 6], [7, 3], [7, 3], 99, 4) == (None, "identical")


def test_the_prompts_floor_is_named_as_one_and_max_prompt_length_is_not_taken(capsys):
    """rm.py's floor on a cut prompt is --min_prompt_length, its --help says it is a floor, and fill_defaults names it.
    --max_prompt_length, a cap in TRL and in ppo.py, is no rm.py option: the command line refuses it (exit code 2)."""
    with pytest.raises(SystemExit) as refused:
        tyro.cli(rm.Args, args=["--max_prompt_length", "32"], use_underscores=True)
    assert refused.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        tyro.cli(rm.Args, args=["--help"], use_underscores=True)
    help_text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "--min_prompt_length" in help_text and "A floor, not a cap" in help_text
    model = transformers.AutoModelForSequenceClassification.from_config(
        common.embedded_model_config("embedded-llama", len(TOK), num_labels=1)
    )
    args = rm.fill_defaults(rm.Args(), model)
    assert args.min_prompt_length == min(256, args.max_length * 3 // 4)
    assert f"--min_prompt_length {args.min_prompt_length}" in capsys.readouterr().out


def test_a_pair_past_max_length_is_dropped_whole_and_every_kept_response_ends_with_its_eos(tmp_path):
    """No response is cut (its reward is read at its EOS): a pair that does not fit with the prompt cut is dropped, and
    over half of them dropped stops the run in one line naming --max_length."""
    rng = random.Random(0)
    rows = [
        {
            "prompt": "User: tell me about animals Assistant:",
            "chosen": " cat" * rng.randrange(1, 12),
            "rejected": " dog" * rng.randrange(1, 4),
        }
        for _ in range(60)
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    args = rm.Args(dataset_name=data, max_length=16, min_prompt_length=6)
    train, evals, _ = rm.load_data(args, TOK, 0)
    kept = train + evals
    eos = TOK.eos_token_id
    assert 0 < len(kept) < 60 and all(p["chosen"][-1] == eos and p["rejected"][-1] == eos for p in kept)
    assert all(len(p["prompt"]) + max(len(p["chosen"]), len(p["rejected"])) <= 16 for p in kept)
    fits = sum(
        min(len(ids_of(r["prompt"])), 6) + max(len(ids_of(r[k])) for k in ("chosen", "rejected")) + 1 <= 16
        for r in rows
    )  # (+ 1: the EOS each response ends with)
    assert len(kept) == fits  # (over half dropped stops the run: test_errors.py's CASES)


def test_a_response_with_an_eos_inside_keeps_every_token_and_the_run_counts_it(tmp_path, capsys):
    """A response with an EOS inside, such as a multi-turn answer, keeps every token and ends with one EOS more, where
    its reward is read. A pair whose responses differ only after an inner EOS is kept, not dropped as identical, and
    the run counts such pairs. A chat template's newline after the last end token is no part of the response."""
    eos = TOK.eos_token_id
    rows = [
        {"prompt": f"User: tell me about animals such as {w} Assistant:", "chosen": " cat <eos> dog", "rejected": r}
        for w, r in zip(["owl", "bee", "fox"] * 10, [" cat <eos> owl", " red", " cat"] * 10)
    ]
    pairs, counts = rm.tokenize_pairs(
        [dict(r, _source="m", _row=i) for i, r in enumerate(rows[:3])],
        TOK,
        rm.Args(max_length=64, min_prompt_length=32),
    )
    assert len(pairs) == 3 and counts == {"inner EOS": 3}  # none dropped as identical
    assert [p["chosen"] for p in pairs] == [ids_of("cat") + [eos] + ids_of("dog") + [eos]] * 3
    assert [p["rejected"] for p in pairs] == [ids_of("cat") + [eos] + ids_of("owl") + [eos], ids_of("red") + [eos]] + [
        ids_of("cat") + [eos]
    ]
    train, evals, _ = rm.load_data(
        rm.Args(dataset_name=write_jsonl(tmp_path / "d.jsonl", rows), max_length=64, min_prompt_length=32), TOK, 0
    )
    assert len(train + evals) == 30 and "kept whole with an EOS inside a response 30" in capsys.readouterr().out
    chatml = build_tokenizer("qwen2")  # <|im_end|> is its EOS, and the template writes a newline after it
    answer = lambda first, last: [  # noqa: E731
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and foods?"},
        {"role": "assistant", "content": last},
    ]
    user = [{"role": "user", "content": "tell me about animals"}]
    row = {"chosen": user + answer("cat", "rice"), "rejected": user + answer("owl", "soup"), "_source": "m", "_row": 0}
    [pair], _ = rm.tokenize_pairs([row], chatml, rm.Args(max_length=128, min_prompt_length=32))
    for key, first, last in (("chosen", "cat", "rice"), ("rejected", "owl", "soup")):
        text = chatml.decode(pair[key])
        assert (
            text
            == f"{first}<|im_end|>\n<|im_start|>user\nand foods?<|im_end|>\n<|im_start|>assistant\n{last}<|im_end|>"
        )
        assert pair[key].count(chatml.eos_token_id) == 3 and pair[key][-1] == chatml.eos_token_id


# --- training runs ----------------------------------------------------------------------------------------------------


def test_two_process_ddp_and_fsdp_match_one_process_in_full_and_with_lora(tmp_path, small_pairs_file):
    """2 ranks (DDP, FSDP2) train as 1 process accumulating their micro-batches, in full and with LoRA (where only the
    adapters and the head move); each rank's memory peak is logged once; 2 ranks evaluate a single pair."""
    full = [
        "rm.py",
        "--dataset_name",
        small_pairs_file,
        "--max_steps",
        "6",
        "--logging_steps",
        "1",
        "--num_evals",
        "2",
        "--warmup_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
    ]
    lora = [
        "rm.py",
        "--dataset_name",
        small_pairs_file,
        "--max_steps",
        "6",
        "--logging_steps",
        "1",
        "--num_evals",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--learning_rate",
        "1e-2",
    ]
    one_pair = tmp_path / "one_pair"  # an eval split of one pair: fewer pairs than ranks
    one_pair.mkdir()
    shutil.copy(small_pairs_file, one_pair / "train.jsonl")
    with open(small_pairs_file) as f, open(one_pair / "test.jsonl", "w") as g:
        g.write(f.readline())
    run_main(full + ["--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one")])
    run_main(lora + ["--gradient_accumulation_steps", "2", "--save_steps", "5", "--output_dir", str(tmp_path / "lora")])
    run_ranks(
        [
            full + ["--output_dir", str(tmp_path / "ddp")],
            full + ["--fsdp", "--output_dir", str(tmp_path / "fsdp")],
            lora + ["--output_dir", str(tmp_path / "lora-ddp")],
            lora + ["--fsdp", "--output_dir", str(tmp_path / "lora-fsdp")],
            [
                "rm.py",
                "--dataset_name",
                str(one_pair),
                "--max_steps",
                "2",
                "--num_evals",
                "1",
                "--output_dir",
                str(tmp_path / "one_pair_out"),
            ],
        ],
        tmp_path,
    )
    assert json.load(open(tmp_path / "one_pair_out" / "eval_results.json"))["accuracy"] in (0.0, 1.0)
    runs = {k: [m for m in read_metrics(tmp_path / k) if "train/loss" in m] for k in ("one", "ddp", "fsdp")}
    assert [m["step"] for m in runs["one"]] == list(range(1, 7))
    for key in ("train/loss", "train/accuracy", "train/grad_norm"):
        one, ddp, fsdp = ([m[key] for m in runs[k]] for k in ("one", "ddp", "fsdp"))
        assert np.allclose(one, ddp, atol=1e-5, rtol=0), (key, one, ddp)
        assert np.allclose(fsdp, ddp, atol=1e-5, rtol=0), (key, fsdp, ddp)
    assert len(set(m["train/loss"] for m in runs["one"])) > 1  # the model is actually learning something
    evals = {k: json.load(open(tmp_path / k / "eval_results.json")) for k in runs}
    assert evals["one"]["accuracy"] == evals["ddp"]["accuracy"] == evals["fsdp"]["accuracy"]
    assert_saved_models_equal([tmp_path / k for k in runs], "AutoModelForSequenceClassification")
    for k, run in runs.items():  # the first log has the peak memory of every rank, once
        ranks = [f"memory/peak_gb_rank{r}" for r in range(1 if k == "one" else 2)]
        assert [m for m in run[0] if m.startswith("memory/")] == ranks and all(run[0][m] > 0.1 for m in ranks)
        assert not any(m.startswith("memory/") for later in run[1:] for m in later)

    runs = {k: [m for m in read_metrics(tmp_path / k) if "train/loss" in m] for k in ("lora", "lora-ddp", "lora-fsdp")}
    for key in ("train/loss", "train/grad_norm"):
        for k in ("lora-ddp", "lora-fsdp"):
            assert np.allclose([m[key] for m in runs[k]], [m[key] for m in runs["lora"]], atol=1e-5, rtol=0), (key, k)
    assert_saved_models_equal([tmp_path / k for k in runs], "AutoModelForSequenceClassification")
    initial, _, _ = rm.load_reward_model(rm.Args(seed=1, lora_r=4, lora_alpha=8.0), rm.load_tokenizer("embedded-llama"))
    trained = read_checkpoint(common.latest_checkpoint(str(tmp_path / "lora")))["model"]
    moved = {
        k.removeprefix("hf.")
        for k, v in trained.items()
        if not torch.equal(v, initial.state_dict()[k.removeprefix("hf.")])
    }
    assert moved and all("lora_" in k or "modules_to_save" in k for k in moved), moved
    assert any("lora_B" in k for k in moved) and any("modules_to_save" in k for k in moved)


def test_embedded_default_reaches_accuracy_target_and_reloads(tmp_path):
    out = tmp_path / "rm"
    # the default task and model, a shorter schedule (the full default run is measured in README)
    run_main(
        [
            "rm.py",
            "--output_dir",
            str(out),
            "--max_steps",
            "800",
            "--num_evals",
            "1",
            "--per_device_train_batch_size",
            "32",
        ]
    )
    results = json.load(open(out / "eval_results.json"))
    # 0.873 measured at these 800 steps (2026-12-07, a repeat worth -1; the full default run 0.957), above the 0.830 a
    # model blind to the avoided topic can reach: the model reads the prompt.
    assert results["accuracy_vs_bayes"] >= 0.85, results

    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    rows = common.load_rows("embedded", split="validation")[:256]  # the first eval pairs
    pairs, _ = rm.tokenize_pairs(
        [dict(r, _source="m", _row=i) for i, r in enumerate(rows)], tok, rm.Args(max_length=512, min_prompt_length=384)
    )
    ids, mask = rm.collate(pairs, tok.pad_token_id)
    with torch.no_grad():
        ours = rm.RewardModel(hf)(ids, mask)
        plain = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)  # transformers' own pooling
    assert torch.allclose(ours, plain, atol=1e-5)
    rc, rr = ours.chunk(2)
    assert (rc > rr).float().mean() > 0.6
    assert hf.config.reward_shift == pytest.approx(results["reward_shift"]) and hf.config.reward_scale == 1.0


def no_timings(metrics):
    """A run's logged metrics less its timings and memory peaks (which a resumed run may log otherwise)."""
    return [{k: v for k, v in m.items() if not k.startswith(("perf/", "memory/"))} for m in metrics]


def killed_after_checkpoint(main, args, step, monkeypatch):
    """main(args), the job killed right after its checkpoint of `step` is written."""
    real_save = common.commit_checkpoint

    def save_then_crash(root, name, state, keep=2):
        real_save(root, name, state, keep)
        if state["step"] == step:
            raise KeyboardInterrupt

    monkeypatch.setattr(common, "commit_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        main(args)
    monkeypatch.setattr(common, "commit_checkpoint", real_save)


def test_resume_after_interruption_reproduces_uninterrupted_run(tmp_path, small_pairs_file, monkeypatch):
    args = dict(
        dataset_name=small_pairs_file,
        max_steps=8,
        logging_steps=1,
        num_evals=4,
        save_steps=3,
        per_device_train_batch_size=8,
    )
    rm.main(rm.Args(output_dir=str(tmp_path / "full"), **args))
    killed_after_checkpoint(rm.main, rm.Args(output_dir=str(tmp_path / "cut"), **args), 6, monkeypatch)
    assert sorted(os.listdir(tmp_path / "cut" / "checkpoints")) == ["latest", "step_00000003", "step_00000006"]
    shutil.copytree(tmp_path / "cut", tmp_path / "short")
    rm.main(rm.Args(output_dir=str(tmp_path / "cut"), resume=True, **args))
    assert no_timings(read_metrics(tmp_path / "cut")) == no_timings(read_metrics(tmp_path / "full"))
    assert (
        json.load(open(tmp_path / "cut" / "eval_results.json"))["loss"]
        == json.load(open(tmp_path / "full" / "eval_results.json"))["loss"]
    )

    # resumed with a total the checkpoint (step 6) has already passed: no step to run; the checkpoint's model is
    # evaluated and saved, and the log closed
    rm.main(rm.Args(output_dir=str(tmp_path / "short"), resume=True, **dict(args, max_steps=5)))
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "short").state_dict()
    at_6 = read_checkpoint(common.latest_checkpoint(tmp_path / "short"))["model"]
    assert all(torch.equal(saved[k.removeprefix("hf.")], v) for k, v in at_6.items())
    assert [m["step"] for m in read_metrics(tmp_path / "short")][-1] == 6
    assert "accuracy" in json.load(open(tmp_path / "short" / "eval_results.json"))


def test_a_finished_run_is_replaced_only_when_asked(tmp_path, small_pairs_file, monkeypatch):
    """A second run into a finished run's folder stops before loading anything, in one line, the files left byte for
    byte; --resume then does nothing, --overwrite_output_dir trains afresh, --resume into an empty folder trains."""
    out = tmp_path / "run"
    argv = ["--dataset_name", small_pairs_file, "--max_steps", "3", "--num_evals", "1", "--save_steps", "2"]

    def run(*flags, folder=out, check=True):
        return run_main(["rm.py", *argv, "--output_dir", str(folder), *flags], check=check)

    run()
    before = snapshot(out)
    real_load = rm.load_tokenizer
    monkeypatch.setattr(rm, "load_tokenizer", lambda name: pytest.fail("loaded before refusing"))
    proc = run(check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert all(
        word in proc.stderr
        for word in ("holds a finished run", "--resume", "--overwrite_output_dir", "another --output_dir")
    )
    monkeypatch.setattr(rm, "load_tokenizer", real_load)
    assert "the run is complete (step 3 of 3); nothing to do" in run("--resume").stdout
    assert snapshot(out) == before
    assert "final eval accuracy" in run("--overwrite_output_dir").stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step_00000002"]  # no step_00000002_1 beside it
    printed = run("--resume", folder=tmp_path / "new").stdout
    assert f"--resume: no checkpoint in {tmp_path / 'new'}; starting from the first step" in printed
    assert [m["step"] for m in read_metrics(tmp_path / "new") if "train/loss" in m] == [3]


def test_sigint_stops_at_a_step_with_a_checkpoint_that_resumes_the_run(tmp_path, small_pairs_file, capsys):
    """Ctrl-C: a checkpoint after the step under way, one line saying how to resume, exit code 130; --resume then
    ends as the uninterrupted run does. A second Ctrl-C stops at once, in one line."""
    args = dict(
        dataset_name=small_pairs_file, max_steps=30, logging_steps=1, num_evals=2, per_device_train_batch_size=8
    )
    flags = [f for k, v in args.items() for f in (f"--{k}", str(v))]
    cut = tmp_path / "cut"
    job = subprocess.Popen(
        [sys.executable, "rm.py", *flags, "--output_dir", str(cut)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    log, deadline = cut / "metrics.jsonl", time.time() + 300
    while not (log.exists() and log.read_text().count("\n") >= 2) and job.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    job.send_signal(signal.SIGINT)
    stderr = job.communicate(timeout=120)[1]
    assert job.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    stopped = common.load_latest_checkpoint(cut)["step"]
    assert 2 <= stopped < 30 and stderr.strip().splitlines()[-1].startswith(f"stopped by SIGINT after step {stopped}")
    assert "--resume" in stderr.strip().splitlines()[-1] and not (cut / "model.safetensors").exists()
    rm.main(rm.Args(output_dir=str(cut), resume=True, **args))
    rm.main(rm.Args(output_dir=str(tmp_path / "full"), **args))
    assert no_timings(read_metrics(cut)) == no_timings(read_metrics(tmp_path / "full"))
    assert_saved_models_equal([cut, tmp_path / "full"], "AutoModelForSequenceClassification")

    # a second SIGINT stops at once (the first asks for a stop at the next step): one line, exit code 130
    def train():
        common.stop_on_signals()
        os.kill(os.getpid(), signal.SIGINT)
        assert common.STOP["signal"] == signal.SIGINT  # asked, not stopped
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        pytest.fail("the second SIGINT did not stop the run")

    capsys.readouterr()  # (the runs' output above)
    try:
        with pytest.raises(SystemExit) as exit_:
            common.exit_on_user_error(train)
    finally:
        common.stop_on_signals(False)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers from before, back
    err = capsys.readouterr().err
    assert exit_.value.code == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("stopped at once")


def test_resume_on_another_number_of_ranks_continues_where_the_pairs_left_off(tmp_path, small_pairs_file):
    """Global batch 16, cut on 2 ranks and resumed on 1 and the reverse: every pair trained once in the uninterrupted
    order, its learning rates and steps continued; another global batch is refused, naming the flags that keep it."""
    base = [
        "tests/faults.py",
        "rm.py",
        "--dataset_name",
        small_pairs_file,
        "--num_train_epochs",
        "1",
        "--logging_steps",
        "1",
        "--num_evals",
        "1",
        "--warmup_ratio",
        "0.2",
        "--per_device_train_batch_size",
        "8",
    ]
    one = ["--gradient_accumulation_steps", "2"]

    def trained(name, flags=(), **kw):
        out, env = tmp_path / name, dict(TRACE=str(tmp_path / f"{name}.trace"), **kw)
        proc = run_script(
            base + list(flags) + ["--output_dir", str(out)], nproc=2 if "two" in name else 1, check=not kw, env=env
        )
        assert proc.returncode == (0 if not kw else 1 if "two" in name else 3), proc.stderr[-2000:]
        return [
            json.loads(line)
            for r in (0, 1)
            if os.path.exists(f"{env['TRACE']}.rank{r}")
            for line in open(f"{env['TRACE']}.rank{r}")
        ]

    whole = trained("whole", one)
    whole_lr = {m["step"]: m["lr"] for m in read_metrics(tmp_path / "whole") if "lr" in m}
    for cut, resumed in (("two_cut", "one_resumed"), ("one_cut", "two_resumed")):
        steps = trained(cut, ["--save_steps", "2"] + (one if "one" in cut else []), STOP_AFTER_SAVE="4")
        os.rename(tmp_path / cut, tmp_path / resumed)
        steps += trained(resumed, ["--resume"] + (one if "one" in resumed else []))
        pairs = lambda steps: sorted(json.dumps(p) for step in steps for p in step)  # noqa: E731
        assert pairs(steps) == pairs(whole) and len(pairs(whole)) == len(whole) * 16  # each pair once, all of them
        logged = [m for m in read_metrics(tmp_path / resumed) if "lr" in m]
        assert [m["step"] for m in logged] == list(whole_lr)  # rising by one across the cut
        assert [m["lr"] for m in logged] == list(whole_lr.values())

    proc = run_script(base + ["--resume", "--output_dir", str(tmp_path / "two_resumed")], check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: --resume: the checkpoint was trained in global batches of 16, this run's is 8; resume with "
        "--per_device_train_batch_size x --gradient_accumulation_steps = 16 on 1 rank (or --overwrite_output_dir to "
        "train afresh)"
    ), proc.stderr[-2000:]


def _save_and_resume_random_streams(rank, folder):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    torch.manual_seed(10 + rank)
    random.seed(10 + rank)
    saved = torch.get_rng_state(), random.getstate()
    common.save_training(model, optimizer, scheduler, 1, rank, folder, global_batch=2)
    torch.manual_seed(99)
    random.seed(99)
    batch = types.SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=1)  # x 2 ranks
    common.resume_training(model, optimizer, scheduler, folder, batch, world=2)
    assert torch.equal(torch.get_rng_state(), saved[0]) and random.getstate() == saved[1]
    dist.destroy_process_group()  # gloo's threads gone (a process ending with them alive can die of SIGABRT)
    assert not [t for t in os.listdir("/proc/self/task") if "gloo" in open(f"/proc/self/task/{t}/comm").read()]


def test_each_rank_resumes_its_own_random_streams(tmp_path):
    """Each of 2 ranks resumes its own random streams; one process resuming the checkpoint gets rank 0's."""
    torch.multiprocessing.spawn(_save_and_resume_random_streams, args=(str(tmp_path),), nprocs=2)
    torch.manual_seed(10)
    rank0 = torch.get_rng_state()
    torch.manual_seed(99)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    common.resume_training(
        model,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        str(tmp_path),
        types.SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1),
        world=1,
    )
    assert torch.equal(torch.get_rng_state(), rank0)


def test_only_the_schedules_that_run_are_offered(capsys):
    """--lr_scheduler_type offers every transformers SchedulerType but those stepped by a metric, which rm.py's loop
    does not pass; the command line refuses those itself (exit code 2), listing the choices."""
    offered = set(rm.Args.__annotations__["lr_scheduler_type"].__args__)
    assert offered == {s.value for s in SchedulerType} - {"reduce_lr_on_plateau", "greedy"}
    for schedule in ("greedy", "reduce_lr_on_plateau"):
        with pytest.raises(SystemExit) as refused:
            tyro.cli(rm.Args, args=["--lr_scheduler_type", schedule], use_underscores=True)
        assert refused.value.code == 2 and "cosine" in capsys.readouterr().err
    assert run_main(["rm.py", "--lr_scheduler_type", "greedy"], check=False).returncode == 2


@pytest.mark.parametrize("schedule", list(rm.Args.__annotations__["lr_scheduler_type"].__args__))
def test_every_lr_schedule_runs_or_is_refused_in_one_line(tmp_path, small_pairs_file, schedule, capsys):
    """Every offered schedule runs, logging the rate each step used (an --lr_end not below the rate refused in one
    line); the run records the rate filled in for the model."""
    args = rm.Args(
        dataset_name=small_pairs_file,
        max_steps=5,
        warmup_steps=1,
        lr_scheduler_type=schedule,
        lr_end=1e-4,
        output_dir=str(tmp_path),
        num_evals=1,
        logging_steps=1,
    )
    m = rm.main(args)
    lrs = [x["lr"] for x in read_metrics(tmp_path) if "lr" in x]
    assert (
        len(lrs) == 5
        and m["eval/accuracy"] > 0
        and lrs[0]
        == {"constant": 1e-3, "cosine_warmup_with_min_lr": 1e-3, "warmup_stable_decay": 1e-4}.get(schedule, 0)
    )
    assert json.load(open(tmp_path / "eval_results.json"))["args"]["learning_rate"] == 1e-3
    assert "defaults for this model: --learning_rate 0.001, --num_train_epochs 3" in capsys.readouterr().out
    if schedule == "linear":  # each step's logged rate is the one it used: warm-up from 0, then down to 0 at step 6
        assert lrs == pytest.approx([0, 1e-3, 7.5e-4, 5e-4, 2.5e-4])
    if schedule == "polynomial":  # power 1: linear from 1e-3 after warm-up down to --lr_end at step 6
        assert lrs == pytest.approx([0, 1e-3, 1e-4 + 0.75 * 9e-4, 1e-4 + 0.5 * 9e-4, 1e-4 + 0.25 * 9e-4])
        with pytest.raises(common.UserError, match="--lr_scheduler_type polynomial: lr_end"):  # not below the rate
            rm.main(
                rm.Args(
                    dataset_name=small_pairs_file,
                    max_steps=2,
                    lr_scheduler_type="polynomial",
                    lr_end=1e-3,
                    output_dir=str(tmp_path / "refused"),
                )
            )
    if schedule == "cosine_warmup_with_min_lr":  # (its warm-up starts at 1 / warm-up steps; it ends at --lr_end)
        assert lrs[-1] == pytest.approx(1e-4)
    if schedule == "cosine_with_min_lr":
        assert lrs[-1] == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(0.75 * math.pi)), rel=0.05)
    if schedule == "warmup_stable_decay":  # stable, then the last fifth (one step here) decays from 1e-3
        assert lrs[1:] == pytest.approx([1e-3] * 4)
    elif schedule.startswith("constant"):
        assert lrs[-1] == pytest.approx(1e-3)
    else:
        assert lrs[-1] < 1e-3


# --- padding-free and prefix-shared batches ---------------------------------------------------------------------------


def shared_prefix_pairs(n, seed):
    """Random pairs whose responses sometimes start with the same tokens, with very different lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda k: torch.randint(20, len(TOK), (k,), generator=g).tolist()  # noqa: E731
    pairs = []
    for _ in range(n):
        common_start = ids(int(torch.randint(0, 3, (1,), generator=g)))
        pairs.append(
            {
                "prompt": ids(int(torch.randint(1, 30, (1,), generator=g))),
                "chosen": common_start + ids(int(torch.randint(1, 12, (1,), generator=g))) + [TOK.eos_token_id],
                "rejected": common_start + ids(int(torch.randint(0, 20, (1,), generator=g))) + [TOK.eos_token_id],
                "margin": 0.0,
            }
        )
    return pairs


@pytest.mark.parametrize("arch", ["embedded-llama", "embedded-neox"])
@pytest.mark.parametrize("pad_id", [0, 3])  # 3 is the EOS id: pad == eos
def test_padded_packed_and_prefix_shared_rewards_and_gradients_agree(arch, pad_id, monkeypatch):
    model, padded_model = tiny_reward_model(arch, seed=2), tiny_reward_model(arch, seed=2)
    args, layout = rm.choose_layout(model, rm.Args(padding_free=True), TOK.vocab_size)
    assert "one row, attention per block of pairs" in layout and args.padding_free
    pairs = shared_prefix_pairs(12, seed=4)
    batches = {
        "padded": rm.model_inputs(pairs, pad_id, rm.Args()),
        "prefix-shared + packed": rm.model_inputs(pairs, pad_id, args),
    }
    for block_tokens in (1, 10**6):  # every pair a block alone; the whole row one block
        monkeypatch.setattr(rm, "BLOCK_TOKENS", block_tokens)
        batches[f"prefix-shared + packed, blocks of {block_tokens}"] = rm.model_inputs(pairs, pad_id, args)
    assert len(batches["prefix-shared + packed, blocks of 1"]["packed"].blocks) == len(pairs)
    assert len(batches[f"prefix-shared + packed, blocks of {10**6}"]["packed"].blocks) == 1
    assert batches["prefix-shared + packed"]["input_ids"].numel() == sum(
        len(p["prompt"]) + len(p["chosen"]) + len(p["rejected"]) for p in pairs
    )  # no padding at all
    results = {}
    for name, inputs in batches.items():
        m = padded_model if name.startswith("padded") else model  # a packed model takes packed rows only
        m.zero_grad()
        rewards = m(**inputs)
        rc, rr = rewards.chunk(2)
        rm.preference_loss(rc, rr, torch.zeros(len(pairs))).mean().backward()
        grads = torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
        results[name] = (rewards.detach(), grads)
    ref_rewards, ref_grads = results["padded"]
    for name, (rewards, grads) in results.items():
        assert torch.allclose(rewards, ref_rewards, atol=1e-4), name
        assert torch.allclose(grads, ref_grads, atol=1e-4, rtol=1e-3), name


def test_prefix_shared_mask_hides_chosen_from_rejected_and_blocks_hold_whole_pairs(monkeypatch):
    pair = {"prompt": [30, 31], "chosen": [40, 3], "rejected": [50, 51, 3], "margin": 0.0}
    monkeypatch.setattr(rm, "BLOCK_TOKENS", 15)  # two pairs of 7 tokens fit, the third starts a block
    inputs = rm.model_inputs([pair, pair, pair], 0, rm.Args(padding_free=True))
    ids, segments = inputs["input_ids"], inputs["packed"]
    assert "attention_mask" not in inputs  # attention is kept inside each sequence by segment_attention
    assert ids[0].tolist() == [30, 31, 40, 3, 50, 51, 3] * 3
    assert segments.position.tolist() == [0, 1, 2, 3, 2, 3, 4] * 3  # rejected continues from the prompt's end
    assert segments.blocks == [(0, 14), (14, 21)]
    q = torch.zeros(1, 1, 21, 2)  # (batch, heads, tokens, head size): segment_attention builds each mask it uses
    for window in (None, 2):
        rm.segment_attention(None, q, q, q, None, sliding_window=window, rm_segments=segments)
    m = segments.masks[0, None].int()
    assert m[4].tolist() == [1, 1, 0, 0, 1, 0, 0] + [0] * 7  # first rejected token: prompt and itself only
    assert m[6].tolist() == [1, 1, 0, 0, 1, 1, 1] + [0] * 7
    assert m[3].tolist() == [1, 1, 1, 1, 0, 0, 0] + [0] * 7
    assert m[7].tolist() == [0] * 7 + [1] + [0] * 6  # the second pair sees nothing of the first
    window = segments.masks[0, 2].int()  # a sliding window of 2 positions: i - j < 2
    assert window[6].tolist() == [0, 0, 0, 0, 0, 1, 1] + [0] * 7
    assert window[4].tolist() == [0, 1, 0, 0, 1, 0, 0] + [0] * 7  # position 2 sees the prompt's position 1
    assert segments.read.tolist() == [3, 10, 17, 6, 13, 20]  # chosen rewards, then rejected


def test_gradient_checkpointing_recomputes_attention_per_block():
    pairs = shared_prefix_pairs(8, seed=5)
    grads = []
    for checkpointing in (False, True):
        model = tiny_reward_model("embedded-llama", seed=2)
        args = rm.choose_layout(model, rm.Args(padding_free=True), TOK.vocab_size)[0]
        if checkpointing:  # the backward pass re-runs each layer's forward: it must see the segments again
            model.hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        rc, rr = model(**rm.model_inputs(pairs, 0, args)).chunk(2)
        rm.preference_loss(rc, rr, torch.zeros(len(pairs))).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("config_name", ["MistralConfig", "Gemma2Config"])
def test_packed_attention_honours_sliding_windows_softcapping_and_gqa(config_name):
    # a window of 5 tokens, shorter than most sequences; 2 key/value heads for 4 query heads; Gemma 2 alternates
    # windowed and full layers and squashes its attention logits (softcapping, set low here so that it matters)
    extra = (
        dict(head_dim=8, attn_logit_softcapping=2.0, layer_types=["sliding_attention", "full_attention"])
        if config_name == "Gemma2Config"
        else {}
    )
    config, wide = (
        getattr(transformers, config_name)(
            vocab_size=TOK.vocab_size,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=window,
            num_labels=1,
            pad_token_id=0,
            **extra,
        )
        for window in (5, 1000)
    )
    torch.manual_seed(0)
    model = rm.RewardModel(AutoModelForSequenceClassification.from_config(config)).eval()
    without_window = rm.RewardModel(AutoModelForSequenceClassification.from_config(wide)).eval()
    without_window.load_state_dict(model.state_dict())  # the same weights, a window longer than any sequence
    pairs = shared_prefix_pairs(12, seed=7)
    assert max(len(p["prompt"]) + len(p["chosen"]) for p in pairs) > 5
    with torch.no_grad():
        padded = model(*rm.collate(pairs, 0))
        alone = torch.cat(
            [
                model(torch.tensor([p["prompt"] + p[k]]), torch.ones(1, len(p["prompt"] + p[k]), dtype=torch.long))
                for k in ("chosen", "rejected")
                for p in pairs
            ]
        )
        without_window = without_window(*rm.collate(pairs, 0))
    args, layout = rm.choose_layout(model, rm.Args(padding_free=True), TOK.vocab_size)
    assert "one row" in layout
    with torch.no_grad():
        inputs = rm.model_inputs(pairs, 0, args)
        packed, calls = model(**inputs), inputs["packed"]
    assert calls.calls == rm.declared_windows(config) and 5 in calls.calls  # each layer's own window reached it
    assert torch.allclose(padded, alone, atol=1e-5)
    assert torch.allclose(packed, alone, atol=1e-5)
    assert not torch.allclose(without_window, alone, atol=1e-3)  # the window changes the rewards: the test can fail


def test_packed_gqa_attention_on_cuda_never_gives_sdpa_a_mask_with_grouped_heads(monkeypatch):
    """On CUDA (forced here) a boolean mask never goes with enable_gqa (it can fall to the math kernel): keys and
    values are repeated per query head instead, the same rewards."""
    config = MistralConfig(
        vocab_size=TOK.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = rm.RewardModel(AutoModelForSequenceClassification.from_config(config)).eval()
    rm.use_segment_attention(model.hf)
    pairs, sdpa, calls = shared_prefix_pairs(6, seed=3), rm.F.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, enable_gqa=False, **kwargs):
        calls.append((attn_mask is not None, enable_gqa, q.shape[1] == k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    monkeypatch.setattr(rm.F, "scaled_dot_product_attention", spy)
    assert rm.sdpa_takes_groups_with_mask(torch.device("cpu"))
    assert not rm.sdpa_takes_groups_with_mask(torch.device("cuda", 0))
    with torch.no_grad():
        grouped = model(**rm.model_inputs(pairs, 0, rm.Args(padding_free=True)))
        assert calls and all(c == (True, True, False) for c in calls)  # on a CPU: grouped heads beside the mask
        calls.clear()
        monkeypatch.setattr(rm, "sdpa_takes_groups_with_mask", lambda device: False)
        repeated = model(**rm.model_inputs(pairs, 0, rm.Args(padding_free=True)))
    assert calls and all(c == (True, False, True) for c in calls)  # CUDA's choice: never both
    assert torch.allclose(repeated, grouped, atol=1e-6)


@pytest.mark.parametrize("error", [None, TypeError, RuntimeError, ValueError])
def test_a_model_whose_attention_cannot_be_packed_keeps_the_padded_batch_and_says_why(error, monkeypatch):
    """Layers that never call segment_attention (None), or a packed forward that raises: --padding_free falls back to
    the padded batch, the reason in the start-up line."""
    model = tiny_reward_model("embedded-llama")
    forward = model.hf.base_model.forward

    def strict(input_ids=None, position_ids=None, rm_segments=None, **kwargs):
        if rm_segments is not None:
            raise error("forward() got an unexpected keyword argument 'rm_segments'")
        return forward(input_ids=input_ids, position_ids=position_ids, **kwargs)

    if error is None:
        monkeypatch.setattr(
            rm.RewardModel,
            "forward",
            lambda self, input_ids, attention_mask=None, packed=None: torch.zeros(
                len(input_ids) if packed is None else len(packed.read)
            ),
        )
    else:
        monkeypatch.setattr(model.hf.base_model, "forward", strict)
    args, layout = rm.choose_layout(model, rm.Args(padding_free=True), TOK.vocab_size)
    assert not args.padding_free and model.hf.config._attn_implementation != "rm_segments"
    if error is None:
        assert layout.startswith("padded: its layers called segment_attention with windows []"), layout
    else:
        assert (
            layout == f"padded: its forward fails on a packed row ({error.__name__}: "
            "forward() got an unexpected keyword argument 'rm_segments')"
        )


def test_packed_checkpointed_and_bf16_training_curves_track_the_plain_run(tmp_path, small_pairs_file):
    """--padding_free and --gradient_checkpointing change no loss (recomputation, packing); --bf16 stays near."""

    def curve(name, *flags):
        run_main(
            [
                "rm.py",
                "--dataset_name",
                small_pairs_file,
                "--logging_steps",
                "1",
                "--num_evals",
                "1",
                *flags,
                "--output_dir",
                str(tmp_path / name),
            ]
        )
        assert json.load(open(tmp_path / name / "eval_results.json"))["args"]["padding_free"] == (name == "packed")
        return [m["train/loss"] for m in read_metrics(tmp_path / name) if "train/loss" in m]

    eight = ["--max_steps", "8", "--per_device_train_batch_size", "8"]
    default, packed = curve("default", *eight), curve("packed", *eight, "--padding_free")
    assert len(default) == 8
    assert np.allclose(packed, default, atol=1e-4), (packed, default)
    fp32, checkpointed = (
        curve("fp32", "--max_steps", "4"),
        curve("checkpointed", "--max_steps", "4", "--gradient_checkpointing"),
    )
    bf16 = curve("bf16", "--max_steps", "4", "--bf16")
    assert np.allclose(checkpointed, fp32, atol=1e-5)
    assert np.allclose(bf16, fp32, atol=0.05) and bf16 != fp32


def test_dataset_mixer_takes_fractions_and_counts_and_evaluates_each_dataset_on_its_split_or_held_out_pairs(tmp_path):
    for name, n in (("a.jsonl", 40), ("b.jsonl", 30)):
        write_jsonl(tmp_path / name, [{"chosen": f" {name} {i}", "rejected": " x"} for i in range(n)])
    rows = [
        r
        for name, weight in common.mixture([str(tmp_path / "a.jsonl"), "0.5", str(tmp_path / "b.jsonl"), "12"])
        for r in rm.take_share(common.load_rows(name), weight, seed=0)
    ]
    sources = [os.path.basename(r["_source"]) for r in rows]
    assert sources.count("a.jsonl") == 20 and sources.count("b.jsonl") == 12
    assert all(r["chosen"] == f" {os.path.basename(r['_source'])} {r['_row']}" for r in rows)  # rows keep their number
    with pytest.raises(common.UserError, match="weight 'many' of"):
        common.mixture([str(tmp_path / "a.jsonl"), "many"])
    # each mixed dataset is evaluated on its own eval split, or on its own held-out pairs
    with_split = tmp_path / "with_split"
    with_split.mkdir()
    for split, n in (("train", 40), ("test", 7)):
        write_jsonl(
            with_split / f"{split}.jsonl", [{"prompt": "User:", "chosen": f" cat {split}", "rejected": " dog"}] * n
        )
    alone = write_jsonl(tmp_path / "alone.jsonl", [{"prompt": "User:", "chosen": " red", "rejected": " blue"}] * 50)
    args = rm.Args(
        dataset_mixer_list=[str(with_split), "1.0", alone, "1.0"], eval_holdout=0.2, max_length=64, min_prompt_length=32
    )
    train, evals, _ = rm.load_data(args, TOK, 0)
    red, cat = TOK.convert_tokens_to_ids("red"), TOK.convert_tokens_to_ids("cat")
    assert sum(p["chosen"][0] == red for p in evals) == 10 and sum(p["chosen"][0] == cat for p in evals) == 7
    assert len(train) == 40 + 40


def test_a_mixture_count_past_the_rows_of_its_dataset_is_refused_in_one_line(tmp_path):
    """A count (a weight above 1) larger than the dataset is refused, naming the dataset, the count and its rows."""
    small = write_jsonl(tmp_path / "small.jsonl", [{"chosen": f" cat {i}", "rejected": " dog"} for i in range(30)])
    other = write_jsonl(tmp_path / "other.jsonl", [{"chosen": f" red {i}", "rejected": " dog"} for i in range(60)])
    flags = ["--dataset_mixer_list", other, "0.5", small, "500", "--output_dir", str(tmp_path / "out")]
    proc = run_main(["rm.py", *flags], check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"error: --dataset_mixer_list asks for 500 rows of {small}, but its training split has 30; ask for at most 30, "
        "or 1.0 for all of them"
    ), proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")
    assert len(rm.take_share(common.load_rows(small), 30, seed=0)) == 30  # all of its rows, asked by count


def test_a_mixture_holds_out_prompts_from_all_its_datasets_and_by_their_weights(tmp_path):
    """A prompt held out of one dataset is trained on in none; a dataset weighted 0.05 gets its share of evaluation."""
    rng = random.Random(0)
    shared = [
        {
            "prompt": f"User: tell me about {t} such as {w} Assistant:",
            "chosen": f" {rng.choice(common.WORDS)}",
            "rejected": " gold",
        }
        for t in common.TOPICS
        for w in common.TOPICS[t]
        for _ in range(3)
    ]
    big = [
        {"prompt": f"User: {w} {v} Assistant:", "chosen": f" {w}", "rejected": " gold"}
        for w in common.WORDS
        for v in common.WORDS[:40]
    ]
    files = [write_jsonl(tmp_path / f"{n}.jsonl", r) for n, r in (("a", shared), ("b", shared[::-1]), ("big", big))]
    args = rm.Args(
        dataset_mixer_list=[files[0], "1.0", files[1], "1.0", files[2], "0.05"], max_length=64, min_prompt_length=32
    )
    train, evals, eval_sets = rm.load_data(args, TOK, 0)
    assert not {tuple(p["prompt"]) for p in train} & {tuple(p["prompt"]) for p in evals}
    in_eval = collections.Counter(p["dataset"] for p in evals)
    in_train = collections.Counter(p["dataset"] for p in train)
    assert in_eval[files[2]] / len(evals) < 2 * in_train[files[2]] / len(train) and in_eval[files[2]] > 0
    assert in_eval[files[0]] == in_eval[files[1]] > 0  # a held-out prompt takes its pairs out of both copies
    assert set(eval_sets) == set(files) and "held out by prompt" in eval_sets[files[2]]


def test_normalization_is_fitted_on_the_training_pairs_and_eval_only_reproduces_training(tmp_path, small_pairs_file):
    """reward_shift and reward_scale are the saved model's rewards' mean and std on the training pairs, all of them as
    they are fewer than 2048, and the record says how many; --eval_only on its held-out pairs gives training's numbers,
    for a plain transformers classifier too."""
    train_dir = tmp_path / "trained"
    rm.main(
        rm.Args(
            dataset_name=small_pairs_file,
            max_steps=6,
            num_evals=1,
            output_dir=str(train_dir),
            reward_normalization="shift_scale",
        )
    )
    trained = json.load(open(train_dir / "eval_results.json"))
    train, _, _ = rm.load_data(rm.Args(dataset_name=small_pairs_file, max_length=128, min_prompt_length=96), TOK, 0)
    hf = AutoModelForSequenceClassification.from_pretrained(train_dir).eval()
    with torch.no_grad():
        rewards = rm.RewardModel(hf)(*rm.collate(train, TOK.pad_token_id))
    assert hf.config.reward_shift == pytest.approx(rewards.mean().item(), abs=1e-4)
    assert hf.config.reward_scale == pytest.approx(rewards.std().item(), rel=1e-4)
    assert len(train) < 2048 and trained["reward_normalization_fitted_on"] == f"{len(train)} training pairs"
    assert abs(trained["reward_shift"] - trained["reward_mean"]) > 1e-3  # the eval pairs' mean is another number

    held_out = tmp_path / "held_out"  # the same held-out pairs, as an eval split of their own
    held_out.mkdir()
    rows = common.load_rows(small_pairs_file)
    for split, part in zip(("train", "test"), rm.hold_out_by_prompt(rows, 0.1, 1, TOK)):  # rm.py's hold-out (seed 1)
        write_jsonl(held_out / f"{split}.jsonl", [{k: v for k, v in r.items() if not k.startswith("_")} for r in part])
    proc = run_main(
        [
            "rm.py",
            "--eval_only",
            "--model_name_or_path",
            str(train_dir),
            "--dataset_name",
            str(held_out),
            "--output_dir",
            str(tmp_path / "eval"),
        ]
    )
    assert "evaluated" in proc.stdout
    evaluated = json.load(open(tmp_path / "eval" / "eval_results.json"))
    for key in ("accuracy", "loss", "reward_gap", "calibration_error", "length_correlation"):
        assert evaluated[key] == pytest.approx(trained[key], abs=1e-5), key
    assert evaluated["normalized_reward_mean"] == pytest.approx(
        (trained["reward_mean"] - trained["reward_shift"]) / trained["reward_scale"], abs=1e-5
    )
    del hf.config.reward_shift, hf.config.reward_scale
    hf.save_pretrained(tmp_path / "plain")
    TOK.save_pretrained(tmp_path / "plain")
    rm.main(
        rm.Args(
            eval_only=True,
            model_name_or_path=str(tmp_path / "plain"),
            dataset_name=str(held_out),
            output_dir=str(tmp_path / "eval_plain"),
        )
    )
    assert json.load(open(tmp_path / "eval_plain" / "eval_results.json"))["accuracy"] == evaluated["accuracy"]


def test_tensorboard_events_hold_the_logged_metrics_and_wandb_runs_offline(tmp_path, small_pairs_file):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_script(
        [
            "rm.py",
            "--dataset_name",
            small_pairs_file,
            "--max_steps",
            "2",
            "--track",
            "--output_dir",
            str(tmp_path / "wandb_run"),
        ],
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
    )
    assert any(d.startswith("offline-run") for d in os.listdir(tmp_path / "wandb_run" / "wandb"))
    rm.main(
        rm.Args(
            dataset_name=small_pairs_file,
            max_steps=3,
            logging_steps=1,
            num_evals=1,
            tensorboard=True,
            output_dir=str(tmp_path / "tb_run"),
        )
    )
    events = EventAccumulator(str(tmp_path / "tb_run" / "tensorboard")).Reload()
    logged = [m for m in read_metrics(tmp_path / "tb_run") if "train/loss" in m]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([m["train/loss"] for m in logged])
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert "eval/accuracy" in events.Tags()["scalars"]


def hub_layouts(root):
    """One small preference dataset in each on-disk layout people have: a Hub clone (data/*.parquet), a README with
    configs:, DatasetDict.save_to_disk, Dataset.save_to_disk (one split), split files."""
    import datasets

    rows = [
        {"prompt": "User: tell me about animals Assistant:", "chosen": f" cat{' dog' * (i % 5)}", "rejected": " red"}
        for i in range(30)
    ]
    train, test = datasets.Dataset.from_list(rows[:24]), datasets.Dataset.from_list(rows[24:])
    (root / "hub" / "data").mkdir(parents=True)
    train.to_parquet(str(root / "hub" / "data" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(root / "hub" / "data" / "test-00000-of-00001.parquet"))
    (root / "configs" / "files").mkdir(parents=True)
    train.to_json(str(root / "configs" / "files" / "mine.jsonl"))
    test.to_json(str(root / "configs" / "files" / "held.jsonl"))
    (root / "configs" / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n"
        "  - split: train\n    path: files/mine.jsonl\n"
        "  - split: test\n    path: files/held.jsonl\n---\n# pairs\n"
    )
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(root / "saved_dict"))
    datasets.concatenate_datasets([train, test]).save_to_disk(str(root / "saved_one"))
    (root / "split_files").mkdir()
    train.to_json(str(root / "split_files" / "train.jsonl"))
    test.to_csv(str(root / "split_files" / "test.csv"))
    return {"hub": (24, 6), "configs": (24, 6), "saved_dict": (24, 6), "saved_one": (30, None), "split_files": (24, 6)}


def test_local_folders_in_every_layout_load_with_their_splits(tmp_path):
    for name, (n_train, n_test) in hub_layouts(tmp_path).items():
        train = common.load_rows(str(tmp_path / name), split="train")
        test = common.load_rows(str(tmp_path / name), split="test")
        assert len(train) == n_train, name
        assert (len(test) if test is not None else None) == n_test, name
        assert train[3]["chosen"] == " cat dog dog dog", name
        assert set(common.split_names(str(tmp_path / name))) == ({"train", "test"} if n_test else {"train"}), name
    (tmp_path / "split_files" / "runs" / "rm").mkdir(parents=True)  # a run's outputs inside the data folder
    (tmp_path / "split_files" / "runs" / "rm" / "eval_results.json").write_text('{"accuracy": 0.5}')
    assert len(common.load_rows(str(tmp_path / "split_files"), split="test")) == 6


def test_readme_scoring_snippet_gives_the_rewards_of_training(reward_model_path):
    """The README's snippet, pasted into a fresh Python, appends the EOS where rm.py reads the reward, and scores as
    rm.py's own RewardModel does with the saved normalization. Without the EOS the score is another number."""
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    before, after = readme.split("<!-- scoring snippet -->")
    assert "EOS" in before[-400:] and "normalization" in before[-400:]
    snippet = after.split("```python")[1].split("```")[0].replace('"runs/rm"', repr(reward_model_path))
    assert "+ [tokenizer.eos_token_id]" in snippet  # (the EOS, appended where a reader sees it)
    run_script(["-c", snippet])
    scope = {}
    exec(snippet, scope)  # noqa: S102 - the README's own code, as a user would paste it
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_path).eval()
    rows = [
        {
            "prompt": scope["prompt"],
            "chosen": scope["responses"][0],
            "rejected": scope["responses"][1],
            "_source": "m",
            "_row": 0,
        }
    ]
    pairs, _ = rm.tokenize_pairs(rows, scope["tokenizer"], rm.Args(max_length=512, min_prompt_length=384))
    assert [x[-1] for x in scope["ids"]] == [scope["tokenizer"].eos_token_id] * 2
    assert scope["ids"] == [pairs[0]["prompt"] + pairs[0][k] for k in ("chosen", "rejected")]  # rm.py's tokens
    ids, mask = rm.collate(pairs, scope["tokenizer"].pad_token_id)
    with torch.no_grad():
        trained = (rm.RewardModel(hf)(ids, mask) - hf.config.reward_shift) / hf.config.reward_scale
        without_eos = torch.cat([hf(input_ids=torch.tensor([x[:-1]])).logits[:, 0] for x in scope["ids"]])
    assert torch.allclose(scope["rewards"], trained, atol=1e-5)
    assert not torch.allclose((without_eos - hf.config.reward_shift) / hf.config.reward_scale, trained, atol=1e-3)


def test_num_evals_is_the_number_of_evaluations(tmp_path, small_pairs_file, capsys):
    """7 steps, 5 evaluations: 5, the last at the end; more than the steps: one per step, said in one line."""
    for max_steps, num_evals, expected in ((7, 5, 5), (3, 5, 3)):
        rm.main(
            rm.Args(
                dataset_name=small_pairs_file,
                max_steps=max_steps,
                num_evals=num_evals,
                logging_steps=100,
                per_device_train_batch_size=8,
                output_dir=str(tmp_path / str(max_steps)),
            )
        )
        evals = [m["step"] for m in read_metrics(tmp_path / str(max_steps)) if "eval/accuracy" in m]
        assert len(evals) == expected and evals[-1] == max_steps, evals
    assert "--num_evals 5: 3, one after each of the 3 steps" in capsys.readouterr().out
