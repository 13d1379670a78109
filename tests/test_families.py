"""The conformance suite: every invariant the scripts rely on, on a tiny model of every family in tests/families.py,
loaded by path through transformers as a user's model would be."""

import json
import os
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import common
import ppo
import rm
from conftest import assert_saved_models_equal, read_metrics, replayed_samples, run_main, run_ranks, write_jsonl
from families import DECODERS, ENCODERS, FAMILIES, TEMPLATED, WINDOW, WINDOWED, save_family  # noqa: F401

PADDED_FAMILIES = ENCODERS + ["bloom"]  # encoders pool over the whole sequence; BLOOM's ALiBi takes no position ids


def preference_rows(family, n, seed=0):
    """Embedded-task pairs, as chat messages for families with a chat template, as text otherwise."""
    rows = []
    for r in common.embedded_pairs(n, seed):
        if family in TEMPLATED:
            question = r["prompt"].removeprefix("User: ").removesuffix(" Assistant:")
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "chosen": [{"role": "assistant", "content": r["chosen"].strip()}],
                    "rejected": [{"role": "assistant", "content": r["rejected"].strip()}],
                }
            )
        else:
            rows.append({k: r[k] for k in ("prompt", "chosen", "rejected")})
    return rows


@pytest.fixture(scope="session")
def trained_rm(family_dir, tmp_path_factory):
    """rm.py run for a few steps on each family's model (by path), saved; cached per family."""
    made = {}

    def get(family):
        if family not in made:
            out = tmp_path_factory.mktemp(f"rm-{family}")
            data = write_jsonl(out / "pairs.jsonl", preference_rows(family, 160))
            rm.main(
                rm.Args(
                    model_name_or_path=family_dir(family),
                    dataset_name=data,
                    output_dir=str(out / "model"),
                    max_steps=4,
                    per_device_train_batch_size=8,
                    learning_rate=3e-3,
                    num_evals=1,
                    logging_steps=1,
                    max_length=64,
                    min_prompt_length=32,
                )
            )
            made[family] = str(out / "model")
        return made[family]

    return get


def reward_model_of(path, **kw):
    args = rm.Args(model_name_or_path=path, **kw)
    tokenizer = rm.load_tokenizer(path)
    return rm.RewardModel(rm.load_reward_model(args, tokenizer)[0]), tokenizer, args


def tokenized_pairs(family, tokenizer, n=6):
    rows = [dict(r, _source="mem", _row=i) for i, r in enumerate(preference_rows(family, n, seed=3))]
    pairs, _ = rm.tokenize_pairs(rows, tokenizer, rm.Args(max_length=64, min_prompt_length=32))
    return pairs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_layout_gives_the_padded_rewards_and_gradients_and_no_dropout_anywhere(family, family_dir):
    """--padding_free on every family: packed where its start-up check passes, then the padded batch's rewards and
    gradients (each sequence alone's rewards), else padded; no dropout anywhere (reward model and policy)."""
    model, tokenizer, args = reward_model_of(family_dir(family), padding_free=True)
    padded_model = reward_model_of(family_dir(family))[0]
    assert model.hf.dtype == torch.float32  # trained in float32 whatever the stored dtype
    chosen_args, layout = rm.choose_layout(model, args, len(tokenizer))
    assert chosen_args.padding_free == (family not in PADDED_FAMILIES)
    assert layout.startswith("padded" if family in PADDED_FAMILIES else "prefix-shared + packed: one row"), layout
    pairs = tokenized_pairs(family, tokenizer)
    if family in WINDOWED:
        assert max(len(p["prompt"]) + len(p["chosen"]) for p in pairs) > WINDOW  # the window matters here
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        padded_inputs = rm.model_inputs(pairs, pad, rm.Args())
        assert torch.equal(padded_model.train()(**padded_inputs), padded_model.eval()(**padded_inputs))
        alone = torch.cat(
            [
                padded_model(
                    torch.tensor([p["prompt"] + p[k]]), torch.ones(1, len(p["prompt"] + p[k]), dtype=torch.long)
                )
                for k in ("chosen", "rejected")
                for p in pairs
            ]
        )  # each sequence alone, unpadded
    results = {}
    for name, m, inputs in (
        ("padded", padded_model, padded_inputs),
        ("packed", model, rm.model_inputs(pairs, pad, chosen_args)),
    ):
        m.train()
        rewards = m(**inputs)
        rc, rr = rewards.chunk(2)
        rm.preference_loss(rc, rr, torch.zeros(len(pairs))).mean().backward()
        results[name] = rewards.detach(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None])
    assert torch.allclose(results["padded"][0], alone, atol=1e-5)
    assert torch.allclose(results["packed"][0], alone, atol=1e-5)
    assert torch.allclose(results["packed"][1], results["padded"][1], atol=1e-5, rtol=1e-4)
    if family in DECODERS:
        policy = ppo.load_policy(ppo.Args(sft_model_path=family_dir(family)), tokenizer)
        ids = torch.tensor([pairs[0]["prompt"] + pairs[0]["chosen"]])
        with torch.no_grad():
            assert torch.equal(policy.train()(input_ids=ids).logits, policy.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("family", DECODERS)
def test_sampler_draws_from_the_learning_forwards_distribution(family, family_dir):
    """The KV-cached decode draws from the whole-sequence forward's logits with the episode's uniforms."""
    args = ppo.Args(sft_model_path=family_dir(family), response_length=6, temperature=0.8)
    tokenizer = ppo.load_tokenizer(args)
    policy = ppo.load_policy(args, tokenizer).eval()
    rng = random.Random(0)
    prompts = common.tokenize_prompts(tokenizer, [common.embedded_prompt(rng) + " cat" * i for i in range(4)])
    query, query_mask = ppo.pad_left(prompts, max(map(len, prompts)), tokenizer.pad_token_id)
    responses = ppo.generate(
        policy, query, query_mask, torch.arange(4), args, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    drawn, steps = replayed_samples(
        policy, query, query_mask, responses, torch.arange(4), args.temperature, tokenizer.eos_token_id
    )
    assert torch.equal(drawn, responses[:, :steps])


@pytest.mark.parametrize("family", DECODERS)
def test_reward_is_read_at_the_token_where_the_policy_stops_and_prompts_agree(family, family_dir, tmp_path):
    """rm.py and ppo.py cut a prompt alike; rm.py's response ends at the policy's stop token, once, nothing after it."""
    path = family_dir(family)
    rows = preference_rows(family, 16, seed=4)
    # cut (keeping the leading BOS; rm.py cuts a prompt only where the pair does not fit --max_length, to what the
    # longer response leaves, and drops a pair that does not fit with the prompt at --min_prompt_length), and whole
    for max_prompt_length, max_length in ((5, 20), (64, 96)):
        args = ppo.Args(
            sft_model_path=path,
            dataset_name=write_jsonl(tmp_path / "p.jsonl", rows),
            max_prompt_length=max_prompt_length,
        )
        tokenizer = ppo.load_tokenizer(args)
        kept, cut = [], 0
        for i, (row, whole) in enumerate(zip(rows, ppo.load_prompts(args, tokenizer)[0])):  # (before ppo.main cuts)
            pairs, _ = rm.tokenize_pairs(
                [dict(row, _source="m", _row=i)],
                rm.load_tokenizer(path),
                rm.Args(max_length=max_length, min_prompt_length=max_prompt_length),
            )
            for pair in pairs:
                left = max_length - max(len(pair["chosen"]), len(pair["rejected"]))  # >= max_prompt_length
                assert left >= max_prompt_length and pair["prompt"] == ppo.truncate_prompt(
                    whole, left, common.leading_id(tokenizer)
                )  # ppo.py's cut, to that length
                kept.append((pair, row))
                cut += len(pair["prompt"]) < len(whole)
        assert kept and (cut > 0) == (max_length == 20), (len(kept), cut)
    prompt_ids = [pair["prompt"] for pair, _ in kept]
    stop = tokenizer.eos_token_id
    for pair, row in kept:
        response = pair["chosen"]
        assert response[-1] == stop and stop not in response[:-1]
        text = row["chosen"] if isinstance(row["chosen"], str) else " " + row["chosen"][0]["content"]
        assert tokenizer.decode(response[:-1]).strip() == text.strip()
    if tokenizer.bos_token_id is not None and common.leading_id(tokenizer) is not None:
        assert all(p[0] == tokenizer.bos_token_id and p[1] != tokenizer.bos_token_id for p in prompt_ids)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_saved_reward_model_reloads_with_transformers_and_gives_the_training_rewards(family, trained_rm):
    path = trained_rm(family)
    results = json.load(open(os.path.join(path, "eval_results.json")))
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [dict(r, _source="m", _row=i) for i, r in enumerate(preference_rows(family, 160))]
    held_out = rm.hold_out_by_prompt(rows, 0.1, 1, tokenizer)[1]  # rm.py's hold-out (seed 1)
    evals, _ = rm.tokenize_pairs(held_out, tokenizer, rm.Args(max_length=64, min_prompt_length=32))
    ids, mask = rm.collate(evals, tokenizer.pad_token_id)
    with torch.no_grad():
        ours = rm.RewardModel(hf)(ids, mask)
        plain = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)  # transformers' own pooling
    assert torch.allclose(ours, plain, atol=1e-5)
    assert ours[: len(evals)].mean().item() == pytest.approx(results["chosen_reward"], abs=1e-4)
    assert ours[len(evals) :].mean().item() == pytest.approx(results["rejected_reward"], abs=1e-4)


def whole_and_micro_batches(base, tmp_path, monkeypatch, **speed_paths):
    """ppo.py's first update's metrics: one micro-batch of 8; 4 of 2 in length groups (and the speed paths given)."""
    ppo.main(ppo.Args(output_dir=str(tmp_path / "whole"), per_device_train_batch_size=8, **base))
    monkeypatch.setattr(ppo, "GROUP_OVERHEAD_TOKENS", 0)
    ppo.main(
        ppo.Args(
            output_dir=str(tmp_path / "micro"),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            group_by_length=True,
            **speed_paths,
            **base,
        )
    )
    return read_metrics(tmp_path / "whole")[0], read_metrics(tmp_path / "micro")[0]


def ppo_base(family, family_dir, trained_rm, **kw):
    return dict(
        sft_model_path=family_dir(family),
        reward_model_path=trained_rm(family),
        total_episodes=8,
        num_mini_batches=1,
        num_ppo_epochs=2,
        response_length=6,
        learning_rate=1e-3,
        sample_every=1,
        max_prompt_length=32,
        **kw,
    )


@pytest.mark.parametrize("family", DECODERS)
def test_ppo_on_every_decoder_family_is_independent_of_the_micro_batch_split(
    family, family_dir, trained_rm, tmp_path, monkeypatch
):
    """The plain path and the speed paths (length groups, --fused_logits in blocks of 3 tokens x 50 vocabulary rows):
    the same update."""
    monkeypatch.setattr(ppo, "FUSED_BLOCK", (3, 50))
    whole, micro = whole_and_micro_batches(
        ppo_base(family, family_dir, trained_rm), tmp_path, monkeypatch, fused_logits=True
    )
    for key in ("objective/scores", "objective/kl", "loss/policy", "loss/value", "policy/entropy", "policy/grad_norm"):
        assert whole[key] == pytest.approx(micro[key], abs=1e-5, rel=1e-5), key
    assert whole["policy/approxkl"] > 0  # the second epoch saw a changed policy
    AutoModelForCausalLM.from_pretrained(tmp_path / "whole")  # the saved policy loads


@pytest.mark.parametrize("family", DECODERS)
def test_fused_logits_give_the_plain_paths_numbers_and_gradients_on_every_decoder_family(
    family, family_dir, monkeypatch
):
    """--fused_logits against the plain path on each family's model as ppo.py loads it (Gemma 2's softcapping, tied
    output layers): log-probs, entropies, and the gradients of a loss of both wrt the output layer's inputs (the
    hidden states) and its weights, with and without the entropy's gradient, in float32 and under bfloat16 autocast,
    in ragged blocks of 5 tokens x 64 vocabulary rows. Within 1e-5, as the plain path's own runs over micro-batches of
    other shapes agree (test_ppo_on_every_decoder_family_is_independent_of_the_micro_batch_split)."""
    path = family_dir(family)
    tokenizer = ppo.load_tokenizer(ppo.Args(sft_model_path=path))
    policy = ppo.load_policy(ppo.Args(sft_model_path=path), tokenizer)
    ppo.check_output_logits(policy, "--sft_model_path", path)
    head = policy.get_output_embeddings()
    monkeypatch.setattr(ppo, "FUSED_BLOCK", (5, 64))
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(tokenizer), (3, 14), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded prompt
    incoming = torch.randn(2, 3, 9, generator=generator)  # the loss's weights on each log-prob and each entropy
    hidden_grads = {}
    for bf16, entropy_grad in [(False, False), (False, True), (True, False), (True, True)]:
        results = {}
        for fused in (False, True):
            policy.zero_grad()
            seen = []
            with head.register_forward_pre_hook(lambda module, args: seen.append(args[0])):  # noqa: B023
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logprobs, entropy = ppo.response_logprobs(
                        policy, ids, mask, 5, 0.7, entropy=True, entropy_grad=entropy_grad, fused=fused
                    )
            seen[0].retain_grad()  # the hidden states, as the layer's first call reads them
            ((incoming[0] * logprobs).sum() + (incoming[1] * entropy).sum() * entropy_grad).backward()
            results[fused] = logprobs.detach(), entropy.detach(), seen[0].grad, head.weight.grad.clone()
        for name, plain, fused in zip(("log-probs", "entropies", "hidden", "weight"), results[False], results[True]):
            assert torch.allclose(plain, fused, atol=1e-5, rtol=1e-5), (name, bf16, entropy_grad, plain - fused)
        assert results[True][2].abs().sum() > 0 and results[True][3].abs().sum() > 0
        hidden_grads[bf16, entropy_grad] = results[True][2]
    assert not torch.allclose(hidden_grads[False, False], hidden_grads[False, True])  # (the entropy's term counts)


@pytest.mark.parametrize("family", DECODERS)
def test_critic_free_estimators_on_every_decoder_family_are_independent_of_the_micro_batch_split(
    family, family_dir, trained_rm, tmp_path, monkeypatch
):
    """The critic-free estimators, KL places and loss averages over the families: the same update in length groups."""
    i = DECODERS.index(family)
    estimator = [
        dict(advantage_estimator="rloo"),
        dict(advantage_estimator="grpo"),
        dict(advantage_estimator="reinforce_pp", num_samples_per_prompt=2),
        dict(advantage_estimator="grpo", scale_rewards=False),
    ][i % 4]
    base = ppo_base(
        family,
        family_dir,
        trained_rm,
        kl_penalty=["loss", "reward"][i % 2],
        loss_aggregation=["sequence_mean", "constant", "token_mean"][i % 3],
        **estimator,
    )
    whole, micro = whole_and_micro_batches(base, tmp_path, monkeypatch)
    kl = ("loss/kl",) if base["kl_penalty"] == "loss" else ()
    for key in ("objective/scores", "objective/kl", "loss/policy", "policy/entropy", "policy/grad_norm", *kl):
        assert whole[key] == pytest.approx(micro[key], abs=1e-5, rel=1e-5), key
    assert whole["policy/approxkl"] > 0 and not any(k.startswith(("val/", "loss/value")) for k in whole)


@pytest.mark.parametrize("reward_family", ["llama", "bert", "deberta"])
def test_reward_model_with_another_tokenizer_reads_what_rm_py_trained_it_on(
    reward_family, family_dir, trained_rm, tmp_path
):
    """A reward model of another vocabulary (or an encoder) reads exactly rm.py's tokens of the same text; PPO runs."""
    policy_path, rm_path = family_dir("gpt2"), trained_rm(reward_family)
    args = ppo.Args(sft_model_path=policy_path, reward_model_path=rm_path, max_prompt_length=32)
    tokenizer = ppo.load_tokenizer(args)
    reward = ppo.load_reward(args, tokenizer)
    assert not reward.reads_policy_tokens
    prompt, answers = "User: tell me about foods such as pear Assistant:", [" cat dog", " rice soup honey"]
    query, query_mask = ppo.pad_left(
        common.tokenize_prompts(tokenizer, [prompt] * 2),
        len(common.tokenize_prompts(tokenizer, [prompt])[0]),
        tokenizer.pad_token_id,
    )
    responses = common.tokenize_responses(tokenizer, [prompt] * 2, answers)
    padded = tokenizer.pad({"input_ids": responses}, padding_side="right", return_tensors="pt")
    responses, mask = padded["input_ids"], padded["attention_mask"]
    batch = ppo.Rollout(
        torch.cat([query, responses], 1), torch.cat([query_mask, mask.bool()], 1).long(), query.shape[1], mask.bool()
    )
    ids, ids_mask = ppo.reward_model_tokens(batch, torch.arange(2), tokenizer.eos_token_id, tokenizer, reward, args)
    rm_tokenizer = AutoTokenizer.from_pretrained(rm_path)
    rows = [{"prompt": prompt, "chosen": answers[0], "rejected": answers[1], "_source": "m", "_row": 0}]
    pair = rm.tokenize_pairs(rows, rm_tokenizer, rm.Args(max_length=64, min_prompt_length=32))[0][0]
    assert ids[0][ids_mask[0].bool()].tolist() == pair["prompt"] + pair["chosen"]
    assert ids[1][ids_mask[1].bool()].tolist() == pair["prompt"] + pair["rejected"]
    # ... and ppo.py's score of each episode is the reward model's normalized reward on those tokens
    hf = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    c_ids, c_mask = rm.collate([pair], rm_tokenizer.pad_token_id)
    with torch.no_grad():
        expected = (rm.RewardModel(hf)(c_ids, c_mask) - hf.config.reward_shift) / hf.config.reward_scale
    policy = ppo.load_policy(args, tokenizer)
    critic = ppo.critic_from(ppo.Args(critic_init="policy"), policy, reward)
    mine, theirs = critic.base_model.state_dict(), policy.base_model.state_dict()  # the policy's whole backbone
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ppo.score(reward, batch, [prompt] * 2, tokenizer, tokenizer.eos_token_id, args)
    scores = batch.scores
    assert torch.allclose(scores, expected, atol=1e-5)
    ppo.score(
        reward,
        batch,
        [prompt] * 2,
        tokenizer,
        tokenizer.eos_token_id,
        ppo.Args(**{**vars(args), "per_device_train_batch_size": 1}),
    )
    assert torch.allclose(batch.scores, scores, atol=1e-6)  # scoring in micro-batches of 1 row changes nothing
    history = ppo.main(
        ppo.Args(
            sft_model_path=policy_path,
            reward_model_path=rm_path,
            total_episodes=8,
            per_device_train_batch_size=4,
            num_mini_batches=2,
            num_ppo_epochs=1,
            response_length=6,
            output_dir=str(tmp_path / "ppo"),
            max_prompt_length=32,
        )
    )
    assert len(history) == 1 and np.isfinite(history[0]["objective/scores"])


@pytest.mark.parametrize("family", ["gemma2", "bert"])
def test_two_ranks_equal_one_process_on_an_eager_decoder_and_an_encoder(family, family_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(family, 96))
    base = [
        "rm.py",
        "--model_name_or_path",
        family_dir(family),
        "--dataset_name",
        data,
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--num_evals",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "3e-3",
        "--max_length",
        "64",
        "--min_prompt_length",
        "32",
        "--padding_free",
    ]
    run_main(base + ["--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one")])
    proc, _ = run_ranks([base + ["--output_dir", str(tmp_path / "ddp")]], tmp_path)
    assert "batch layout: " + ("padded" if family in PADDED_FAMILIES else "prefix-shared + packed") in proc.stdout
    one, ddp = ([m for m in read_metrics(tmp_path / k) if "train/loss" in m] for k in ("one", "ddp"))
    for key in ("train/loss", "train/grad_norm"):
        assert np.allclose([m[key] for m in one], [m[key] for m in ddp], atol=1e-5), key


def test_a_checkpoint_stored_in_bfloat16_trains_exactly_as_its_float32_copy(family_dir, trained_rm, tmp_path):
    """Training is in float32 whatever the stored dtype: bfloat16 and float32 copies train to the same models, in both
    scripts (in bfloat16, lr-sized updates would round away)."""
    stored = family_dir("llama")
    as_float32 = str(tmp_path / "float32")
    AutoModelForCausalLM.from_pretrained(stored, dtype=torch.float32).save_pretrained(as_float32)
    AutoTokenizer.from_pretrained(stored).save_pretrained(as_float32)
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows("llama", 64))
    for name, path in (("bf16", stored), ("fp32", as_float32)):
        rm.main(
            rm.Args(
                model_name_or_path=path,
                dataset_name=data,
                output_dir=str(tmp_path / f"rm-{name}"),
                max_steps=3,
                per_device_train_batch_size=8,
                learning_rate=1e-5,
                num_evals=1,
                max_length=64,
                min_prompt_length=32,
            )
        )
        ppo.main(
            ppo.Args(
                sft_model_path=path,
                reward_model_path=trained_rm("llama"),
                total_episodes=8,
                per_device_train_batch_size=4,
                num_mini_batches=2,
                num_ppo_epochs=2,
                response_length=6,
                learning_rate=1e-5,
                max_prompt_length=32,
                output_dir=str(tmp_path / f"ppo-{name}"),
            )
        )
    for script, auto in (("rm", "AutoModelForSequenceClassification"), ("ppo", "AutoModelForCausalLM")):
        import transformers

        saved = [getattr(transformers, auto).from_pretrained(tmp_path / f"{script}-{n}") for n in ("bf16", "fp32")]
        assert all(m.dtype == torch.float32 for m in saved)  # saved as trained, and config.json says so
        assert json.load(open(tmp_path / f"{script}-bf16" / "config.json"))["dtype"] == "float32"
        start = AutoModelForCausalLM.from_pretrained(as_float32).state_dict()
        for k, v in saved[0].state_dict().items():
            assert torch.equal(v, saved[1].state_dict()[k]), (script, k)
        moved = [k for k, v in saved[0].state_dict().items() if k in start and not torch.equal(v, start[k])]
        assert moved, script  # training changed the weights (lr 1e-5 updates survive)


def test_a_text_prompt_before_message_responses_is_one_prompt_in_both_scripts(family_dir, tmp_path):
    """A text prompt before message responses is the user's turn in rm.py and the prompt ppo.py samples from."""
    path = family_dir("llama3")
    rows = [
        {
            "prompt": "tell me about foods",
            "chosen": [{"role": "assistant", "content": "rice"}],
            "rejected": [{"role": "assistant", "content": "owl"}],
        }
    ]
    tokenizer = rm.load_tokenizer(path)
    pair = rm.tokenize_pairs(
        [dict(rows[0], _source="m", _row=0)], tokenizer, rm.Args(max_length=96, min_prompt_length=72)
    )[0][0]
    args = ppo.Args(sft_model_path=path, dataset_name=write_jsonl(tmp_path / "p.jsonl", rows), max_prompt_length=72)
    prompt_ids, texts = ppo.load_prompts(args, ppo.load_tokenizer(args))
    assert prompt_ids[0] == pair["prompt"] and "<|start_header_id|>user" in texts[0]


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama"])
def test_lengths_beyond_the_declared_positions_are_refused_at_the_start(family, family_dir, tmp_path):
    """Past a learned position table (GPT-2, OPT) or the positions a rotary model declares (Llama), in one line."""
    key = "n_positions" if family == "gpt2" else "max_position_embeddings"
    with pytest.raises(
        common.UserError,
        match=rf"--max_length 300: 300 tokens, but .* declares 256 positions \({key} in its config\); pass at most 256",
    ):
        rm.main(
            rm.Args(
                model_name_or_path=family_dir(family),
                max_length=300,
                min_prompt_length=32,
                dataset_name=write_jsonl(tmp_path / "d.jsonl", preference_rows(family, 80)),
                output_dir=str(tmp_path / "rm"),
            )
        )
    with pytest.raises(common.UserError, match=r"--response_length \(272\): .* declares 256 positions"):
        ppo.main(
            ppo.Args(
                sft_model_path=family_dir(family),
                reward_fn="common:gold_rewards",
                response_length=16,
                max_prompt_length=256,
                output_dir=str(tmp_path / "ppo"),
            )
        )
    assert not os.path.exists(tmp_path / "rm" / "metrics.jsonl")  # refused before anything was written


# GPT-2: an output layer tied to the input embeddings, learned positions; Qwen2: an output layer of its own (an FSDP
# unit of its own in ppo.py), RoPE buffers
@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_fsdp_ranks_fill_their_shards_from_rank_0s_copy_of_saved_models(family, family_dir, trained_rm, tmp_path):
    """Under --fsdp only rank 0 reads saved weights and broadcasts them into the shards: 2 ranks train as 1 process."""
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(family, 64))
    rm_base = [
        "rm.py",
        "--model_name_or_path",
        family_dir(family),
        "--dataset_name",
        data,
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--num_evals",
        "1",
        "--max_length",
        "64",
        "--min_prompt_length",
        "32",
        "--learning_rate",
        "3e-3",
        "--center_rewards_coefficient",
        "0.01",
    ]
    # (the centering: without it a final layer norm's bias, which shifts both rewards of a pair alike, has no gradient
    # in exact arithmetic, and AdamW turns its rounding noise, other on 1 and 2 ranks, into steps of the rate's size)
    ppo_base = [
        "ppo.py",
        "--sft_model_path",
        family_dir(family),
        "--reward_model_path",
        trained_rm(family),
        "--total_episodes",
        "16",
        "--per_device_train_batch_size",
        "4",
        "--num_mini_batches",
        "1",
        "--response_length",
        "6",
        "--max_prompt_length",
        "32",
        "--learning_rate",
        "1e-3",
    ]
    run_ranks(
        [b + ["--fsdp", "--output_dir", str(tmp_path / f"{b[0][:-3]}-fsdp")] for b in (rm_base, ppo_base)], tmp_path
    )
    for script, base, auto in (
        ("rm", rm_base, "AutoModelForSequenceClassification"),
        ("ppo", ppo_base, "AutoModelForCausalLM"),
    ):
        run_main(base + ["--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / f"{script}-one")])
        one, fsdp = (read_metrics(tmp_path / f"{script}-{k}") for k in ("one", "fsdp"))
        keys = (
            ("train/loss", "train/grad_norm")
            if script == "rm"
            else ("objective/scores", "loss/policy", "loss/value", "policy/grad_norm")
        )
        for key in keys:
            assert [m[key] for m in one if key in m] == pytest.approx(
                [m[key] for m in fsdp if key in m], abs=1e-5, rel=1e-5
            ), (script, key)
        assert_saved_models_equal([tmp_path / f"{script}-{k}" for k in ("one", "fsdp")], auto)
