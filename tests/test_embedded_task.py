"""The embedded task: its prompts and splits, its gold reward, each split's Bayes-optimal accuracy, and that neither
script trains on a validation or out-of-distribution prompt."""

import itertools
import json
import math

import pytest
import torch

import common
import ppo
import rm

SPLITS = ("train", "validation", "test", "ood")


@pytest.fixture(scope="module")
def split_rows():
    return {s: common.load_rows("embedded", split=s) for s in SPLITS}


def every_prompt():
    """Every prompt text the task's parts can make, written out here from the parts."""
    for asked, avoided, opening, example_clause, k in itertools.product(
        common.TOPICS, [None, *common.TOPICS], common.OPENINGS, common.EXAMPLE_CLAUSES, (1, 2)
    ):
        if avoided == asked:
            continue
        for words in itertools.permutations(common.TOPICS[asked], k):
            for avoid in [f" {c} {common.AVOIDED[avoided]}" for c in common.AVOID_CLAUSES] if avoided else [""]:
                yield f"User: {opening} {asked} {example_clause} {' and '.join(words)}{avoid} Assistant:"


def test_thousands_of_prompts_fall_in_four_splits_and_ood_holds_only_the_held_out_pair(split_rows):
    universe = set(every_prompt())
    assert len(universe) >= 10000
    by_split = {s: {p for p in universe if common.prompt_split(p) == s} for s in SPLITS}
    assert all(len(by_split[s]) > 1000 for s in SPLITS), {s: len(v) for s, v in by_split.items()}
    texts = {s: {r["prompt"] for r in rows} for s, rows in split_rows.items()}
    for s in SPLITS:
        assert texts[s] <= by_split[s] and len(texts[s]) > 1000, s  # the rows' prompts are the split's own
        assert all((common.prompt_parts(p) == common.OOD_PAIR) == (s == "ood") for p in texts[s]), s
    for a, b in itertools.combinations(SPLITS, 2):
        assert not texts[a] & texts[b], (a, b)
    # Both held-out topics occur in training, asked and avoided, only never as this pair.
    pairs = {common.prompt_parts(p) for p in texts["train"]}
    asked, avoided = common.OOD_PAIR
    assert any(a == asked for a, _ in pairs) and any(b == asked for _, b in pairs)
    assert any(a == avoided for a, _ in pairs) and any(b == avoided for _, b in pairs)
    assert len(pairs) == 4 * 4 - 1 and common.OOD_PAIR not in pairs  # 4 asked x (3 avoided or none), less the pair


def test_the_gold_reward_reads_the_asked_and_the_avoided_topic():
    v, n, again = common.WORD_VALUE, common.NON_WORD_VALUE, -1.0  # a word said again is worth -1
    asked = "User: name some animals such as cat and owl Assistant:"
    assert common.gold_reward(asked, " cat red cat dog") == pytest.approx(
        (v["cat"] + 1 + v["red"] + again + v["dog"] + 1) / 4
    )
    assert common.gold_reward(asked, " owl owl owl owl <eos>") == pytest.approx((v["owl"] + 1 + 3 * again) / 4)
    assert common.gold_reward(asked, " cat me") == pytest.approx((v["cat"] + 1 + n) / 2)
    avoiding = "User: tell me about animals like cat without food Assistant:"
    assert common.gold_reward(avoiding, " cat pear red pear") == pytest.approx(
        (v["cat"] + 1 + n + v["red"] + again) / 4
    )
    assert common.gold_reward("user: talk about foods like pear assistant:", " pear red") == pytest.approx(
        (v["pear"] + 1 + v["red"]) / 2
    )
    assert common.gold_reward(avoiding, "") == n


def bayes_accuracy(rows):
    """The Bayes-optimal accuracy of pairs, from gold rewards computed again from their texts."""
    gaps = [common.gold_reward(r["prompt"], r["chosen"]) - common.gold_reward(r["prompt"], r["rejected"]) for r in rows]
    return sum(max(p, 1 - p) for p in (1 / (1 + math.exp(-common.PREFERENCE_BETA * g)) for g in gaps)) / len(rows)


def test_each_splits_bayes_accuracy_is_a_direct_computation_from_its_gold_rewards(split_rows, tmp_path):
    tok, args = common.embedded_tokenizer(), rm.Args(max_length=512, min_prompt_length=256)
    for s in SPLITS:
        pairs, _ = rm.tokenize_pairs(split_rows[s], tok, args)
        zeros = torch.zeros(len(pairs))
        metrics = rm.pair_metrics(zeros, zeros, zeros, pairs, args, "")
        assert metrics["bayes_accuracy"] == pytest.approx(bayes_accuracy(split_rows[s]), abs=1e-6), s
    # rm.py reports the out-of-distribution split's when asked for it.
    rm.main(rm.Args(eval_only=True, eval_split="ood", output_dir=str(tmp_path / "ood")))
    results = json.load(open(tmp_path / "ood" / "eval_results.json"))
    assert results["num_pairs"] == len(split_rows["ood"])
    assert results["bayes_accuracy"] == pytest.approx(bayes_accuracy(split_rows["ood"]), abs=1e-6)


def test_neither_script_trains_on_a_validation_or_ood_prompt(monkeypatch, tmp_path):
    """rm.py's training pairs, ppo.py's training prompts and the SFT policy's training prompts are all of the train
    split, and ppo.py's eval prompts are of the split asked for."""
    tok = common.embedded_tokenizer()
    args = rm.Args(max_length=512, min_prompt_length=256, dataset_mixer_list=["embedded", "3000"])
    train, evals, _ = rm.load_data(args, tok, rank=0)
    assert {tuple(p["prompt"]) for p in train}.isdisjoint({tuple(p["prompt"]) for p in evals})
    assert {common.prompt_split(tok.decode(p["prompt"])) for p in train} == {"train"}
    assert {common.prompt_split(tok.decode(p["prompt"])) for p in evals} == {"validation"}
    for split in (None, "ood", "test"):
        prompts, eval_prompts = ppo.train_and_eval_prompts(ppo.Args(eval_split=split, max_prompt_length=64), tok)
        assert {common.prompt_split(t) for t in prompts.texts} == {"train"}
        assert {common.prompt_split(t) for t in eval_prompts.texts} == {split or "validation"}
        assert len(set(eval_prompts.texts)) == len(eval_prompts.texts) == ppo.Args.num_eval_prompts
    seen, draw = [], common.embedded_prompt

    def spy(rng, split="train"):
        seen.append(draw(rng, split))
        return seen[-1]

    monkeypatch.setattr(common, "embedded_prompt", spy)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # trained here, not read from a cache
    ppo.embedded_sft_policy("embedded-llama", tok, seed=0, steps=2, batch_size=32)
    assert len(seen) == 64 and {common.prompt_split(t) for t in seen} == {"train"}
