"""LoRA through peft: merged saves equal the adapted model, the reference is the policy with its adapter off, only
adapters and heads train, and runs split over ranks or resumed equal one uninterrupted process."""

import copy
import dataclasses
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_families import preference_rows, tokenized_pairs, write_jsonl
from test_rm import killed_after_checkpoint, no_timings
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common
import ppo
import rm
from conftest import assert_saved_models_equal, read_checkpoint, read_metrics, run_main, run_ranks
from families import DECODERS, FAMILIES

LORA = dict(lora_r=4, lora_alpha=8.0)


def perturb_adapters(model, seed=0):
    """Every adapter and head copy moved off its start (LoRA's B starts at 0): a wrong merge or switch shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def sft_adapter(family_dir, path, targets=None, task="CAUSAL_LM"):
    """An SFT model as a peft LoRA adapter folder: on the tiny Llama, perturbed as if trained, saved at path."""
    adapter = get_peft_model(
        AutoModelForCausalLM.from_pretrained(family_dir("llama"), dtype=torch.float32),
        LoraConfig(r=4, target_modules=targets or ["q_proj", "v_proj"], task_type=task),
    )
    perturb_adapters(adapter, seed=1)
    adapter.save_pretrained(path)
    return adapter


def policy_logprobs(model, tokenizer, n=3):
    rng = random.Random(0)
    seqs = common.tokenize_prompts(tokenizer, [common.embedded_prompt(rng) + " cat dog" * i for i in range(n)])
    ids, mask = ppo.pad_left(seqs, max(map(len, seqs)), tokenizer.pad_token_id)
    with torch.no_grad():
        return ppo.response_logprobs(model, ids, mask.long(), 4, 1.0)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_merged_saves_load_without_peft_and_the_reference_is_the_policy_with_its_adapter_off(
    family, family_dir, tmp_path
):
    """Only adapters and head train; a merged reward model or policy gives the adapted model's numbers; the reference
    is the initial policy, the adapter off."""
    args = rm.Args(model_name_or_path=family_dir(family), padding_free=False, **LORA)
    tokenizer = rm.load_tokenizer(args.model_name_or_path)
    hf, lora, _ = rm.load_reward_model(args, tokenizer)
    trained = {n for n, p in hf.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or "modules_to_save" in n for n in trained), trained
    assert any("modules_to_save" in n for n in trained)  # the head is trained in full beside the adapters
    assert all(p.dtype == torch.float32 for n, p in hf.named_parameters() if n in trained)
    ids, mask = rm.collate(tokenized_pairs(family, tokenizer), tokenizer.pad_token_id)
    with torch.no_grad():
        before = rm.RewardModel(hf.eval())(ids, mask)
        perturb_adapters(hf)
        adapted = rm.RewardModel(hf)(ids, mask)
    assert not torch.allclose(adapted, before, atol=1e-3)
    rm.save_reward_model(hf, lora, hf.state_dict(), tokenizer, str(tmp_path / "rm"), 0.0, 1.0)
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        assert torch.allclose(rm.RewardModel(merged)(ids, mask), adapted, atol=1e-4, rtol=1e-4)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "rm" / "adapter"))
    if family not in DECODERS:
        return
    args = ppo.Args(sft_model_path=family_dir(family), **LORA)
    tokenizer = ppo.load_tokenizer(args)
    policy = ppo.load_policy(args, tokenizer).eval()
    initial = policy_logprobs(copy.deepcopy(policy), tokenizer)
    lora = common.add_lora(policy, args, "CAUSAL_LM")
    assert torch.equal(policy_logprobs(policy, tokenizer), initial)  # B = 0: the first update's ratio is exactly 1
    perturb_adapters(policy)
    adapted = policy_logprobs(policy, tokenizer)
    assert not torch.allclose(adapted, initial, atol=1e-3)
    with lora.disable_adapter():
        assert torch.equal(policy_logprobs(policy, tokenizer), initial)
    policy_dir = str(tmp_path / "policy")
    common.save_lora(policy, lora, policy.state_dict(), tokenizer, policy_dir).save_pretrained(policy_dir)
    assert os.path.exists(tmp_path / "policy" / "adapter" / "adapter_model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    assert torch.allclose(policy_logprobs(reloaded, tokenizer), adapted, atol=1e-4)


def test_an_sft_adapter_as_the_initial_policy_is_the_reference_not_its_base(family_dir, tmp_path):
    """A policy given as an adapter folder is merged at load: the reference is the SFT model, not its base."""
    base_path = family_dir("llama")
    tokenizer = ppo.load_tokenizer(ppo.Args(sft_model_path=base_path))
    sft = sft_adapter(family_dir, tmp_path / "sft", "all-linear", None)
    sft_logprobs = policy_logprobs(sft.eval(), tokenizer)
    base_logprobs = policy_logprobs(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), tokenizer)
    assert not torch.allclose(sft_logprobs, base_logprobs, atol=1e-3)

    args = ppo.Args(sft_model_path=str(tmp_path / "sft"), **LORA)
    assert len(ppo.load_tokenizer(args)) == len(tokenizer)  # the base's tokenizer: the adapter folder has none
    policy = ppo.load_policy(args, tokenizer).eval()
    lora = common.add_lora(policy, args, "CAUSAL_LM")
    perturb_adapters(policy, seed=2)
    with lora.disable_adapter():
        assert torch.allclose(policy_logprobs(policy, tokenizer), sft_logprobs, atol=1e-5)
    assert isinstance(sft, PeftModel)


def test_an_sft_adapter_starts_a_reward_model_merged_with_a_new_head_as_documented(family_dir, tmp_path):
    """An SFT adapter folder (with a task type or none) starts a reward model: the adapter merged into its base, a new
    head drawn with --head_init_std; ppo.py refuses it, or a causal LM, as a reward model (a random head)."""
    ids, base = torch.tensor([[1, 5, 9, 12, 30]]), AutoModelForCausalLM.from_pretrained(family_dir("llama"))
    with torch.no_grad():
        base = base.float().base_model(input_ids=ids)[0]
    for task in ("CAUSAL_LM", None):  # an SFT adapter; one of no task type (peft's default), which holds no head
        adapter = sft_adapter(family_dir, tmp_path / str(task), task=task)
        args = rm.Args(model_name_or_path=str(tmp_path / str(task)), head_init_std=3.0)
        hf, _, _ = rm.load_reward_model(args, rm.load_tokenizer(args.model_name_or_path))
        with torch.no_grad():
            expected = adapter.eval().get_base_model().base_model(input_ids=ids).last_hidden_state
            assert not torch.allclose(expected, base, atol=1e-3)
            assert torch.allclose(hf.eval().base_model(input_ids=ids).last_hidden_state, expected, atol=1e-5), task
        assert 1.5 < hf.score.weight.std().item() < 6, task  # --head_init_std, not transformers' 0.02
    sft, tokenizer = family_dir("llama"), ppo.load_tokenizer(ppo.Args(sft_model_path=family_dir("llama")))
    for path in (sft, str(tmp_path / "CAUSAL_LM")):  # as ppo.py's --reward_model_path: a random head, refused
        with pytest.raises(common.UserError, match="not a reward model"):
            ppo.load_reward(ppo.Args(sft_model_path=sft, reward_model_path=path), tokenizer)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_rm_trains_from_an_sft_adapter_folder_merged_in_full_or_with_new_adapters(lora_r, family_dir, tmp_path):
    """An SFT adapter folder trains merged: every weight with --lora_r 0 (peft loads it frozen), new adapters else."""
    adapter = sft_adapter(family_dir, tmp_path / "sft")
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows("llama", 40))
    rm.main(
        rm.Args(
            model_name_or_path=str(tmp_path / "sft"),
            dataset_name=data,
            output_dir=str(tmp_path / "rm"),
            lora_r=lora_r,
            max_steps=3,
            per_device_train_batch_size=4,
            num_evals=1,
            learning_rate=1e-2,
            max_length=64,
            min_prompt_length=32,
        )
    )
    start = adapter.merge_and_unload().model.state_dict()  # the SFT model: the start, merged
    saved = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").model.state_dict()
    # (the rows of the SFT model's vocabulary: rm.py's pad token adds one)
    moved = {k for k, v in start.items() if not torch.equal(saved[k][tuple(map(slice, v.shape))], v)}
    linear = {k for k in start if k.endswith("proj.weight")}
    assert moved == set(start) if not lora_r else moved == linear, sorted(set(start) ^ moved)


def test_a_lora_reward_model_is_read_from_its_merged_folder_or_its_adapter_alike(family_dir, tmp_path):
    out = tmp_path / "rm"
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows("llama", 96))
    rm.main(
        rm.Args(
            model_name_or_path=family_dir("llama"),
            dataset_name=data,
            output_dir=str(out),
            max_steps=3,
            per_device_train_batch_size=8,
            learning_rate=3e-2,
            num_evals=1,
            max_length=64,
            min_prompt_length=32,
            reward_normalization="shift_scale",
            **LORA,
        )
    )
    shift = json.load(open(out / "eval_results.json"))["reward_shift"]
    tokenizer = ppo.load_tokenizer(ppo.Args(sft_model_path=family_dir("llama")))
    rewards = [ppo.load_reward(ppo.Args(reward_model_path=str(p)), tokenizer) for p in (out, out / "adapter")]
    assert rewards[0].model.shift == rewards[1].model.shift != 0 and shift != 0
    ids = torch.tensor([tokenizer("tell me about animals such as cat dog")["input_ids"]])
    with torch.no_grad():
        scores = [r.model(ids, torch.ones_like(ids)) for r in rewards]
    assert torch.allclose(scores[0], scores[1], atol=1e-5)
    evals = {}
    for name in ("rm", "rm/adapter"):
        rm.main(
            rm.Args(
                model_name_or_path=str(tmp_path / name),
                dataset_name=data,
                eval_only=True,
                output_dir=str(tmp_path / f"eval-{len(evals)}"),
                max_length=64,
                min_prompt_length=32,
            )
        )
        evals[name] = json.load(open(tmp_path / f"eval-{len(evals)}" / "eval_results.json"))
    for key in ("accuracy", "loss", "reward_shift", "reward_scale", "normalized_reward_mean"):
        assert evals["rm"][key] == pytest.approx(evals["rm/adapter"][key], abs=1e-5), key


# --- training runs ----------------------------------------------------------------------------------------------------

PPO_TINY = [
    "--total_episodes",
    "32",
    "--per_device_train_batch_size",
    "4",
    "--num_mini_batches",
    "2",
    "--num_ppo_epochs",
    "2",
    "--response_length",
    "8",
    "--lora_r",
    "4",
    "--lora_alpha",
    "8",
]


def test_ppo_lora_two_ranks_equal_one_and_under_fsdp_bf16_the_adapters_stay_float32(tmp_path, reward_model_path):
    base = [
        "ppo.py",
        "--reward_model_path",
        reward_model_path,
        *PPO_TINY,
        "--num_evals",
        "1",
        "--num_eval_prompts",
        "5",
    ]
    run_main(base + ["--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one")])
    run_ranks(
        [
            base + ["--output_dir", str(tmp_path / "ddp")],
            base + ["--fsdp", "--output_dir", str(tmp_path / "fsdp")],
            base + ["--fsdp", "--bf16", "--save_steps", "1", "--output_dir", str(tmp_path / "bf16")],
        ],
        tmp_path,
    )
    evals = {k: [m for m in read_metrics(tmp_path / k) if "eval/score" in m] for k in ("one", "ddp", "fsdp")}
    assert [m["step"] for m in evals["one"]] == [0, 2] and evals["one"][0]["eval/kl"] == 0.0
    for key in ("eval/score", "eval/kl", "eval/length"):  # the held-out evaluation: 2 ranks, DDP and FSDP, equal 1
        for k in ("ddp", "fsdp"):
            assert np.allclose([m[key] for m in evals[k]], [m[key] for m in evals["one"]], atol=1e-5), (key, k)
    runs = {k: [m for m in read_metrics(tmp_path / k) if "eval/score" not in m] for k in ("one", "ddp")}
    assert abs(runs["one"][0]["objective/kl"]) < 1e-5  # the reference is the policy with its adapter (B = 0) off
    for key in ("objective/scores", "objective/kl", "loss/policy", "loss/value", "policy/approxkl", "policy/grad_norm"):
        one = [m[key] for m in runs["one"]]
        assert np.allclose([m[key] for m in runs["ddp"]], one, atol=1e-5, rtol=1e-5), key
    assert runs["one"][-1]["objective/kl"] != 0  # the policy moved
    assert_saved_models_equal([tmp_path / k for k in runs], "AutoModelForCausalLM")

    ckpt = read_checkpoint(common.latest_checkpoint(str(tmp_path / "bf16")))
    dtypes = {
        ("lora_" in k or "modules_to_save" in k): v.dtype
        for k, v in ckpt["model"].items()
        if v.is_floating_point() and "layers" in k or "score" in k
    }
    assert dtypes == {True: torch.float32, False: torch.bfloat16}  # adapters train in float32, the base is held in bf16
    assert {v.dtype for v in ckpt["optimizer"].values() if v.numel() > 1} == {torch.float32}


@pytest.mark.parametrize("critic_init", ["reward", "policy"])
def test_ppo_lora_bf16_holds_every_frozen_weight_in_bfloat16_and_trains_in_float32(critic_init, reward_model_path):
    args = ppo.Args(reward_model_path=reward_model_path, bf16=True, critic_init=critic_init, **LORA)
    ppo.fill_defaults(args, ppo.position_limit(args))
    models = ppo.build_models(args, ppo.load_tokenizer(args), torch.device("cpu"), 0, 1)
    policy, critic, reward = models.policy, models.critic, models.reward
    assert models.reference is policy  # the reference is the policy with its adapter off: no copy
    if critic_init == "reward":  # ... and the reward model is the critic with its adapter off
        assert reward.model.func is ppo.critic_as_reward
    else:  # (its scalar head float32, as every scalar head: README's precision table)
        assert {(".score." in n, p.dtype) for n, p in reward.model.named_parameters()} == {
            (False, torch.bfloat16),
            (True, torch.float32),
        }
    for model in (policy, critic):
        dtypes = {(p.requires_grad, p.dtype) for n, p in model.named_parameters() if ".score." not in n}
        assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}, dtypes
    assert {p.dtype for n, p in critic.named_parameters() if ".score." in n} == {torch.float32}


def test_ppo_lora_reward_read_from_the_critic_with_its_adapter_off_equals_the_reward_model(reward_model_path, tmp_path):
    """With LoRA and a critic from the reward model, scores read from the critic with its adapter off equal the reward
    model's normalized rewards, however far the critic has trained."""
    shutil.copytree(reward_model_path, tmp_path / "rm")
    config = json.load(open(tmp_path / "rm" / "config.json"))
    json.dump(dict(config, reward_scale=2.5), open(tmp_path / "rm" / "config.json", "w"))  # shift_scale's normalization
    args = ppo.Args(reward_model_path=str(tmp_path / "rm"), **LORA)
    ppo.fill_defaults(args, ppo.position_limit(args))
    tokenizer = ppo.load_tokenizer(args)
    models = ppo.build_models(args, tokenizer, torch.device("cpu"), 0, 1)
    critic, reward = models.critic, models.reward
    separate = ppo.load_reward(args, tokenizer)
    assert reward.model.func is ppo.critic_as_reward and isinstance(separate.model, ppo.SequenceReward)
    assert separate.model.scale != 1 and separate.model.shift != 0
    perturb_adapters(critic)
    rng = random.Random(0)
    texts = [common.embedded_prompt(rng) for _ in range(6)]
    prompts = common.tokenize_prompts(tokenizer, texts)
    query, query_mask = ppo.pad_left(prompts, max(map(len, prompts)), tokenizer.pad_token_id)
    responses = common.tokenize_responses(tokenizer, texts, [" cat dog red" * (1 + i % 3) for i in range(6)])
    padded = tokenizer.pad({"input_ids": responses}, padding_side="right", return_tensors="pt")
    mask = padded["attention_mask"].bool()
    batch = ppo.Rollout(
        torch.cat([query, padded["input_ids"]], 1), torch.cat([query_mask, mask], 1).long(), query.shape[1], mask
    )
    out = []
    for r in (reward, separate):
        ppo.score(r, batch, texts, tokenizer, tokenizer.eos_token_id, args)
        out.append(batch.scores)
    assert torch.allclose(out[0], out[1], atol=1e-4), out
    with torch.no_grad():  # with its adapter on, the critic reads otherwise: the switch is what makes them equal
        ids, ids_mask = batch.query_response, batch.attention_mask
        adapted = critic(ids, ids_mask).gather(1, ppo.last_token_index(ids_mask)[:, None])[:, 0]
    assert not torch.allclose(adapted, out[1], atol=1e-2)


@pytest.mark.parametrize("script", ["rm", "ppo"])
def test_lora_resume_after_interruption_reproduces_uninterrupted_run(
    script, tmp_path, small_pairs_file, reward_model_path, monkeypatch
):
    main, args = (
        (
            rm.main,
            rm.Args(
                dataset_name=small_pairs_file,
                max_steps=6,
                logging_steps=1,
                num_evals=2,
                save_steps=2,
                per_device_train_batch_size=8,
                **LORA,
            ),
        )
        if script == "rm"
        else (
            ppo.main,
            ppo.Args(
                reward_model_path=reward_model_path,
                total_episodes=48,
                per_device_train_batch_size=4,
                num_mini_batches=2,
                num_ppo_epochs=2,
                response_length=8,
                save_steps=2,
                **LORA,
            ),
        )
    )
    main(dataclasses.replace(args, output_dir=str(tmp_path / "full")))
    killed_after_checkpoint(main, dataclasses.replace(args, output_dir=str(tmp_path / "cut")), 4, monkeypatch)
    main(dataclasses.replace(args, output_dir=str(tmp_path / "cut"), resume=True))
    assert no_timings(read_metrics(tmp_path / "cut")) == no_timings(read_metrics(tmp_path / "full"))
    auto = "AutoModelForSequenceClassification" if script == "rm" else "AutoModelForCausalLM"
    assert_saved_models_equal([tmp_path / "cut", tmp_path / "full"], auto)
