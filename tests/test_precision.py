"""bfloat16 that is right, and attention that cannot produce NaN: what the scripts compute under --bf16, checked
under CPU bfloat16 autocast against formulas computed in float32."""

import json
import random
import shutil
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_families import preference_rows, write_jsonl
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import common
import ppo
import rm
from conftest import ROOT, read_metrics, run_main, run_script, without_inductor
from families import DECODERS

TOK = common.embedded_tokenizer()


def first_mini_batch_spy(monkeypatch, loss="policy_loss"):
    """Record the largest |new - old| of each call of the loss (log-probs; value_loss: values and its clip's centre)."""
    calls, real = [], getattr(ppo, loss)

    def spy(new, old, third, *a, **k):  # (third: the advantages or returns, 0 exactly on padding only)
        calls.append(((new - old).abs() * (third != 0)).max().item())
        return real(new, old, third, *a, **k)

    monkeypatch.setattr(ppo, loss, spy)
    return calls


FIRST_UPDATE = dict(
    total_episodes=16,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_mini_batches=2,
    num_ppo_epochs=1,
    bf16=True,
)


@pytest.mark.parametrize("lora, fused", [(0, False), (4, False), (0, True), (4, True)])
def test_bf16_first_mini_batch_is_on_policy_and_the_kl_at_initialisation_is_zero(
    lora, fused, reward_model_path, tmp_path, monkeypatch
):
    """Under bfloat16 decode and learning forward round differently: the old log-probs and values are recomputed on the
    first epoch's own partition, so its first mini-batch's ratio is exactly 1 and the KL at initialisation 0, full
    fine-tuning (the KV cache in bfloat16) and LoRA (its frozen base in bfloat16), on the plain path and with
    --fused_logits (in blocks of 3 tokens x 50 vocabulary rows)."""
    calls, value_calls = first_mini_batch_spy(monkeypatch), first_mini_batch_spy(monkeypatch, "value_loss")
    monkeypatch.setattr(ppo, "FUSED_BLOCK", (3, 50))
    ppo.main(
        ppo.Args(
            reward_model_path=reward_model_path,
            output_dir=str(tmp_path),
            lora_r=lora,
            fused_logits=fused,
            **FIRST_UPDATE,
        )
    )
    steps_per_mini_batch = len(calls) // 2
    for moved in (calls, value_calls):
        assert moved[:steps_per_mini_batch] == [0.0] * steps_per_mini_batch  # every forward of the first mini-batch
        assert max(moved[steps_per_mini_batch:]) > 0  # the models moved after the first step
    m = read_metrics(tmp_path)[0]
    assert m["objective/kl"] == 0.0 and np.isfinite(m["loss/policy"])


SPIED = """import json, os, sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import common, ppo, rm
calls, seen, loss, linear = [], set(), ppo.policy_loss, common.Float32Linear.forward
def spy_loss(new, old, adv, *a, **k):
    calls.append(((new - old).abs() * (adv != 0)).max().item())
    return loss(new, old, adv, *a, **k)
def spy_linear(self, x):
    seen.add(("head" if self.out_features == 1 else "output layer", str(self.weight.dtype)))
    return linear(self, x)
ppo.policy_loss, common.Float32Linear.forward = spy_loss, spy_linear
dist.init_process_group("gloo")
dist.init_process_group = dist.destroy_process_group = lambda *a, **k: None  # (one group, every run: tests/jobs.py)
for name, (script, kwargs) in json.loads(sys.argv[1]).items():
    calls.clear(), seen.clear()
    {{"rm": rm, "ppo": ppo}}[script].main({{"rm": rm, "ppo": ppo}}[script].Args(**kwargs))
    with open(os.path.join(sys.argv[2], name + "." + os.environ["RANK"]), "w") as f:
        json.dump(dict(calls=calls, seen=sorted(seen)), f)
sys.stdout.flush(), os._exit(0)
"""


@pytest.fixture(scope="module")
def bf16_fsdp_runs(reward_model_path, tmp_path_factory):
    """rm.py and ppo.py under FSDP2 --bf16 on 2 ranks, full and LoRA (one launch), spied on: ppo.py's largest
    |new - old| log-prob at each policy-loss call; the weights' dtypes each Float32Linear computed from."""
    tmp = tmp_path_factory.mktemp("bf16_fsdp")
    (tmp / "spied.py").write_text(SPIED.format(root=ROOT))
    rm_run = dict(
        dataset_mixer_list=["embedded", "64"],
        fsdp=True,
        bf16=True,
        max_steps=2,
        per_device_train_batch_size=4,
        num_evals=1,
    )
    ppo_run = dict(
        reward_model_path=reward_model_path,
        fsdp=True,
        bf16=True,
        total_episodes=16,
        per_device_train_batch_size=4,
        num_mini_batches=2,
        num_ppo_epochs=1,
        num_evals=1,
        num_eval_prompts=4,
    )
    runs = {
        "rm0": ("rm", rm_run),
        "ppo0": ("ppo", ppo_run),
        "rm4": ("rm", dict(rm_run, lora_r=4)),
        "ppo4": ("ppo", dict(ppo_run, lora_r=4)),
        "ppo4_policy_critic": ("ppo", dict(ppo_run, lora_r=4, critic_init="policy")),
    }
    runs = {name: (script, dict(kwargs, output_dir=str(tmp / name))) for name, (script, kwargs) in runs.items()}
    run_script([str(tmp / "spied.py"), json.dumps(runs), str(tmp)], nproc=2)
    return tmp, [{name: json.load(open(tmp / f"{name}.{r}")) for name in runs} for r in (0, 1)]


def test_bf16_fsdp_on_two_ranks_first_mini_batch_is_on_policy(bf16_fsdp_runs):
    """The same under FSDP2 on 2 ranks: the reference is sharded as the policy is, so it computes as the policy does."""
    for spied in bf16_fsdp_runs[1]:
        assert spied["ppo0"]["calls"][0] == 0.0 and spied["ppo0"]["calls"][1] > 0, spied  # a forward per mini-batch
    first, *_ = (m for m in read_metrics(bf16_fsdp_runs[0] / "ppo0") if "objective/kl" in m)
    assert first["objective/kl"] == 0.0 and read_metrics(bf16_fsdp_runs[0] / "ppo0")[0]["eval/kl"] == 0.0


def test_scalar_heads_compute_from_float32_weights_under_fsdp_bf16(bf16_fsdp_runs):
    """Under FSDP --bf16 the scalar heads (and the policy's output layer) are their own units gathered in float32, not
    the root's bfloat16; with LoRA (peft wrapping the heads) too."""
    for spied in bf16_fsdp_runs[1]:
        for run, kinds in (
            ("rm0", ("head",)),
            ("ppo0", ("head", "output layer")),
            ("rm4", ("head",)),
            ("ppo4", ("head",)),
            ("ppo4_policy_critic", ("head",)),
        ):
            assert {dtype for kind, dtype in spied[run]["seen"] if kind in kinds} == {"torch.float32"}, (run, spied)


def test_bf16_runs_of_both_scripts_reach_the_float32_results_within_noise(tmp_path):
    """--bf16 against float32: rm.py's accuracy, well above chance, within 3 points; ppo.py on the gold reward, from the
    same policy with the same random streams, changes the gold score by the same amount within 0.2."""
    results = {}
    for precision in ("fp32", "bf16"):
        flags = ["--bf16"] if precision == "bf16" else []
        out = tmp_path / precision
        run_main(
            [
                "rm.py",
                "--max_steps",
                "200",
                "--num_evals",
                "1",
                "--output_dir",
                str(out / "rm"),
                *flags,
            ]
        )
        history = ppo.main(
            ppo.Args(
                reward_fn="common:gold_rewards",
                output_dir=str(out / "ppo"),
                total_episodes=384,
                sample_every=100,
                bf16=precision == "bf16",
            )
        )
        results[precision] = (
            json.load(open(out / "rm" / "eval_results.json"))["accuracy"],
            np.mean([h["gold/mean"] for h in history[-3:]]) - np.mean([h["gold/mean"] for h in history[:3]]),
        )
    (acc32, gain32), (acc16, gain16) = results["fp32"], results["bf16"]
    assert min(acc16, acc32) > 0.6 and abs(acc16 - acc32) < 0.03, results
    assert abs(gain16 - gain32) < 0.2, results


def test_scalar_heads_logits_and_entropy_are_float32_under_bf16_autocast():
    """Rewards, values, log-probs and entropies under bfloat16 autocast equal their float32 formulas on the same hidden
    states: no bfloat16 rounding of a reward (ties) or of the output layer."""
    torch.manual_seed(0)
    reward_model = common.scalar_head_in_float32(
        AutoModelForSequenceClassification.from_config(
            common.embedded_model_config("embedded-llama", len(TOK), num_labels=1)
        )
    )
    with torch.no_grad():
        reward_model.score.weight.mul_(40)  # rewards of size 4-16, where bfloat16's steps are 0.03-0.06
    ids = torch.randint(20, len(TOK), (6, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rewards = ppo.sequence_reward(reward_model, ids, mask)
        hidden = reward_model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
        values = ppo.Critic(reward_model)(ids, mask)[:, -1]
    expected = hidden.double() @ reward_model.score.weight.double().T
    assert rewards.dtype == torch.float32 and rewards.abs().max() > 4
    assert torch.allclose(rewards.double(), expected[:, 0], atol=1e-4) and torch.allclose(values, rewards)

    policy = ppo.output_layer_in_float32(ppo.embedded_sft_policy("embedded-llama", TOK, seed=0, steps=3))
    for fused in (False, True):  # the plain path and --fused_logits
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs, entropy = ppo.response_logprobs(policy, ids, mask, 4, 0.7, entropy=True, fused=fused)
            h = ppo.head_inputs(policy, input_ids=ids, attention_mask=mask)[:, 3:-1]
        logp = torch.log_softmax(h.double() @ policy.lm_head.weight.double().T / 0.7, -1)
        assert torch.allclose(logprobs.double(), logp.gather(-1, ids[:, 4:, None]).squeeze(-1), atol=1e-5), fused
        assert torch.allclose(entropy.double(), -(logp.exp() * logp).sum(-1), atol=1e-5), fused


def test_critic_initialised_from_the_reward_model_starts_at_the_normalized_reward(reward_model_path, tmp_path):
    """(w / scale) . h - shift / scale: the critic's value at the last token is the normalized score, shift included."""
    shutil.copytree(reward_model_path, tmp_path / "rm")
    config = json.load(open(tmp_path / "rm" / "config.json"))
    json.dump(dict(config, reward_shift=0.7, reward_scale=2.5), open(tmp_path / "rm" / "config.json", "w"))
    args = ppo.Args(reward_model_path=str(tmp_path / "rm"))
    ppo.fill_defaults(args, ppo.position_limit(args))
    models = ppo.build_models(args, TOK, torch.device("cpu"), 0, 1)
    critic, reward = models.critic, models.reward
    rng = random.Random(0)
    texts = [common.embedded_prompt(rng) for _ in range(4)]
    seqs = [
        p + r
        for p, r in zip(
            common.tokenize_prompts(TOK, texts),
            common.tokenize_responses(TOK, texts, [" cat dog", " red", " rice soup cake", " owl"]),
        )
    ]
    ids, mask = ppo.pad_left(seqs, max(map(len, seqs)), TOK.pad_token_id)
    with torch.no_grad():
        values = critic(ids, mask.long())[:, -1]
        scores = (ppo.sequence_reward(reward.model.hf, ids, mask.long()) - 0.7) / 2.5
    assert torch.allclose(values, scores, atol=1e-5), (values, scores)


@pytest.mark.parametrize("family", DECODERS)
def test_no_query_attends_to_nothing_and_real_tokens_are_unchanged(family, family_dir, monkeypatch):
    """Left padding: every SDPA mask row sees a key (a fully masked row is NaN on some CUDA kernels); real tokens'
    logits are those of transformers' own mask."""
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32).eval()
    ids = torch.randint(5, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, :1] = 0, 0
    position = (mask.cumsum(1) - 1).clamp(min=0)
    masks, real = [], F.scaled_dot_product_attention

    def spy(*a, **k):
        masks.append(k.get("attn_mask"))
        return real(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "sdpa", sdpa_mask)  # transformers' own
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
    common.attention_without_nan(torch.device("cpu"))
    masks.clear()
    with torch.no_grad():
        guarded = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
    for m in masks:
        if torch.is_tensor(m) and m.dtype == torch.bool:
            assert m.any(-1).all()
    assert torch.allclose(own[mask.bool()], guarded[mask.bool()], atol=1e-6)


def test_default_lengths_fit_a_short_position_table_and_given_ones_are_refused(family_dir, tmp_path, capsys):
    """Default lengths beyond a learned position table of 256 are fitted to it, said and recorded; the runs finish."""
    data = write_jsonl(tmp_path / "d.jsonl", preference_rows("gpt2", 40))
    rm.main(
        rm.Args(
            model_name_or_path=family_dir("gpt2"),
            dataset_name=data,
            max_steps=2,
            per_device_train_batch_size=4,
            num_evals=1,
            output_dir=str(tmp_path / "rm"),
        )
    )
    assert "--max_length 256, --min_prompt_length 192" in capsys.readouterr().out  # (fill_defaults says so)
    saved = json.load(open(tmp_path / "rm" / "eval_results.json"))["args"]
    assert (saved["max_length"], saved["min_prompt_length"]) == (256, 192)
    ppo.main(
        ppo.Args(
            sft_model_path=family_dir("gpt2"),
            reward_fn="common:gold_rewards",
            total_episodes=8,
            per_device_train_batch_size=4,
            num_mini_batches=2,
            num_ppo_epochs=1,
            output_dir=str(tmp_path / "ppo"),
        )
    )
    assert "--max_prompt_length 240" in capsys.readouterr().out.split("defaults: ")[1].splitlines()[0]  # (said)
    assert json.load(open(tmp_path / "ppo" / "ppo_results.json"))["args"]["max_prompt_length"] == 240  # (recorded)


def test_default_lengths_fit_the_positions_a_rotary_model_declares_and_given_ones_past_them_are_refused(capsys):
    """The embedded Llama is rotary and declares 128 positions. rm.py's --max_length and ppo.py's --max_prompt_length
    default to what fits them, each with a line saying so; a length given past them is refused in one line."""
    model = AutoModelForSequenceClassification.from_config(
        common.embedded_model_config("embedded-llama", len(TOK), num_labels=1)
    )
    assert common.position_table(model) == model.config.max_position_embeddings == 128
    capsys.readouterr()
    args = rm.fill_defaults(rm.Args(), model)
    assert (args.max_length, args.min_prompt_length) == (128, 96)
    assert "--max_length 128: the positions the model declares (max_position_embeddings)" in capsys.readouterr().out
    assert rm.fill_defaults(rm.Args(max_length=128), model).max_length == 128
    assert "the positions the model declares" not in capsys.readouterr().out  # (a given length needs no line)
    rm.load_backbone(rm.Args(max_length=128), TOK)  # as many as declared: taken
    with pytest.raises(
        common.UserError,
        match=r"^--max_length 129: 129 tokens, but the model declares 128 positions \(max_position_embeddings in its "
        r"config\); pass at most 128$",
    ):
        rm.load_backbone(rm.Args(max_length=129), TOK)
    limit = ppo.position_limit(ppo.Args(reward_fn="common:gold_rewards"))
    assert limit == 128 and "--max_prompt_length 112: what the 128 positions the models declare" in (
        capsys.readouterr().out
    )
    args = ppo.Args(reward_fn="common:gold_rewards")
    ppo.fill_defaults(args, limit)
    assert args.max_prompt_length + args.response_length == 128
    capsys.readouterr()
    ppo.position_limit(ppo.Args(reward_fn="common:gold_rewards", max_prompt_length=64))
    assert "--max_prompt_length" not in capsys.readouterr().out


def test_layout_check_runs_once_on_rank_0_in_the_runs_precision(monkeypatch):
    """The packed-layout check: one forward pair on rank 0 only (the others take its verdict), in the run's autocast."""
    model = rm.RewardModel(
        AutoModelForSequenceClassification.from_config(
            common.embedded_model_config("embedded-llama", len(TOK), num_labels=1)
        )
    )
    seen, real = [], rm.RewardModel.forward

    def spy(self, *a, **k):
        seen.append(torch.is_autocast_enabled("cpu"))
        return real(self, *a, **k)

    monkeypatch.setattr(rm.RewardModel, "forward", spy)
    args, layout = rm.choose_layout(model, rm.Args(bf16=True), len(TOK), rank=0)
    assert seen == [True, True] and args.padding_free and "packed" in layout
    model.hf.config._attn_implementation = "sdpa"
    seen.clear()
    args, layout = rm.choose_layout(model, rm.Args(), len(TOK), rank=1)  # no process group: rank 0's verdict is None
    assert seen == [] and model.hf.config._attn_implementation == "rm_segments"


def test_evaluation_holds_out_whole_prompts_uses_validation_and_whole_eval_splits(tmp_path, capsys):
    """Held-out pairs share no prompt with training; a `validation` split is evaluated on, said; a weight cuts training
    pairs only."""
    rng = random.Random(0)
    words = [w for w in common.WORDS if w != "gold"]
    rows = [
        {
            "prompt": f"User: tell me about {t} such as {w} Assistant:",
            "chosen": f" {rng.choice(words)}",
            "rejected": " gold",
        }
        for t in common.TOPICS
        for w in common.TOPICS[t]
        for _ in range(5)
    ]
    write_jsonl(tmp_path / "many.jsonl", rows)
    args = rm.Args(dataset_name=str(tmp_path / "many.jsonl"), max_length=64, min_prompt_length=32)
    train, evals, _ = rm.load_data(args, TOK, 0)
    prompts = lambda pairs: {tuple(p["prompt"]) for p in pairs}  # noqa: E731
    assert not prompts(train) & prompts(evals) and len(evals) >= 0.1 * len(rows) - 5

    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", rows[:100])
    write_jsonl(folder / "validation.jsonl", rows[100:130])
    write_jsonl(folder / "test.jsonl", rows[130:150])  # validation comes first: a run tuned on it never sees test
    args = rm.Args(dataset_mixer_list=[str(folder), "0.5"], max_length=64, min_prompt_length=32)
    train, evals, eval_sets = rm.load_data(args, TOK, 0)
    assert len(evals) == 30 and len(train) == 50  # the weight halves the training pairs, never the eval split
    assert eval_sets == {str(folder): "split 'validation'"}
    assert f"{folder}: evaluating on split 'validation' (30 pairs)" in capsys.readouterr().out


def test_evaluation_loss_calibration_and_per_dataset_numbers_match_formulas():
    """rm.evaluate's loss is the training objective with its centering term; its ECE is of the probability the loss
    models with margins, sigmoid(r_c - r_r - margin); a mixture's numbers per dataset are each dataset's alone."""
    r_c, r_r, margin = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.2, 0.5, 1.5]), torch.zeros(3)
    expected = np.mean([np.log1p(np.exp(-(c - r))) for c, r in zip(r_c.tolist(), r_r.tolist())]) + 0.1 * np.mean(
        [(c + r) ** 2 for c, r in zip(r_c.tolist(), r_r.tolist())]
    )
    assert rm.reward_model_loss(r_c, r_r, margin, 0.1).item() == pytest.approx(expected, rel=1e-6)
    model = rm.RewardModel(rm.load_reward_model(rm.Args(), TOK)[0]).eval()

    def evaluate(pairs, **kw):
        return rm.evaluate(model, pairs, rm.Args(padding_free=False, **kw), 0, torch.device("cpu"), 0, 1)

    pairs = [{"prompt": [2, 4], "chosen": [20, 3], "rejected": [21, 22, 3], "margin": 0.0, "gold": None}] * 4
    for coefficient in (0.0, 0.5):
        ev, rewards = evaluate(pairs, center_rewards_coefficient=coefficient)
        assert ev["eval/loss"] == pytest.approx(
            rm.reward_model_loss(rewards[:, 0], rewards[:, 1], torch.zeros(4), coefficient).item(), rel=1e-6
        )

    g = torch.Generator().manual_seed(0)
    pairs = [
        {
            "prompt": [2, 4],
            "chosen": torch.randint(20, 40, (3,), generator=g).tolist() + [3],
            "rejected": torch.randint(20, 40, (2,), generator=g).tolist() + [3],
            "margin": m,
            "gold": None,
        }
        for m in [0.0, 1.0, 3.0, -2.0] * 8
    ]
    ev, rewards = evaluate(pairs)
    rc, rr = rewards[:, 0].double(), rewards[:, 1].double()
    margin = torch.tensor([p["margin"] for p in pairs], dtype=torch.float64)
    p, y = torch.cat([torch.sigmoid(rc - rr), 1 - torch.sigmoid(rc - rr)]), torch.arange(64) < 32  # the model's own
    bins = (p * 10).long().clamp(max=9)
    ece = sum(
        (bins == b).float().mean() * (p[bins == b].mean() - y[bins == b].double().mean()).abs()
        for b in range(10)
        if (bins == b).any()
    )
    assert ev["eval/calibration_error"] == pytest.approx(ece.item(), abs=1e-6)
    assert abs(rm.calibration_error(torch.sigmoid(rc - rr - margin)) - ece.item()) > 0.05  # not the margin's

    rows = [dict(r, _source="m", _row=i, _dataset="ab"[i % 2]) for i, r in enumerate(common.embedded_pairs(24, 3))]
    pairs, _ = rm.tokenize_pairs(rows, TOK, rm.Args(max_length=64, min_prompt_length=32))
    both = evaluate(pairs)[0]
    for name in "ab":
        alone = evaluate([p for p in pairs if p["dataset"] == name])[0]
        assert all(both[f"eval/{name}/{k[5:]}"] == pytest.approx(v, abs=1e-5) for k, v in alone.items())
    assert "eval/a/accuracy" not in evaluate([p for p in pairs if p["dataset"] == "a"])[0]  # one dataset: overall


def test_gpu_check_runs_every_section_at_tiny_shapes(tmp_path, monkeypatch):
    """benchmarks/gpu_check.py (scarce device time) at --quick shapes on the CPU, in this process (its compile without
    inductor's C++): every section runs, packed equals padded, no NaN, the first ratio 1 and the KL at start 0."""
    monkeypatch.syspath_prepend(f"{ROOT}/benchmarks")
    import gpu_check

    sections = ["attention", "packed", "logprobs", "shapes", "rm_shapes", "decode_profile"]
    without_inductor(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--quick", "--out", str(tmp_path), "--sections", *sections])
    gpu_check.main()
    report = json.load(open(tmp_path / "report.json"))
    assert [s for s in sections if "error" in report[s]] == [], [report[s] for s in sections if "error" in report[s]]
    assert not report["attention"]["ppo_left_padded_nan"] and not report["packed"]["fp32_cudnn_off"]["nan"]
    assert report["packed"]["fp32_cudnn_off"]["max_reward_diff"] < 1e-5
    assert report["packed"]["fp32_cudnn_off"]["grad_rel_diff"] < 1e-5
    for width in report["logprobs"].values():
        for weights in ("bf16_weights", "fp32_weights_autocast"):  # the first ratio exactly 1, the KL exactly 0
            assert width[weights]["max_abs_diff"] == 0.0 == width[weights]["kl_per_sequence_at_initialisation"]
    assert report["shapes"]["rollout"]["ms_per_token"] > 0
    assert report["decode_profile"]["plain"]["wall_ms_per_token"] > 0 < report["decode_profile"]["compile"]["compile_s"]
