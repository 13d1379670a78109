"""The memory plan (common.Planned rows from meta-device models): what 7B-scale runs need per GPU, and that the plan
is what the scripts really hold."""

import json
import os

import pytest
import torch
from conftest import run_script

import common
import ppo
import rm

GB = 1e9
# The anchor (Huang et al. 2024): Pythia 6.9B, and a Llama 3 8B shape; parameter counts as their model cards give them.
SHAPES = {
    "pythia-6.9b": (dict(model_type="gpt_neox", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         intermediate_size=16384, vocab_size=50432, rotary_pct=0.25, max_position_embeddings=2048,
                         tie_word_embeddings=False), 6.857e9),
    "llama-3-8b": (dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                        max_position_embeddings=8192, tie_word_embeddings=False), 8.030e9),
}


def saved_config(folder, shape, architecture):
    """A model folder holding a config.json and no weights."""
    from transformers import AutoConfig

    fields = dict(SHAPES[shape][0])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, architectures=[architecture], num_labels=1)
    config.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("shape", SHAPES)
def test_7b_plans_fit_one_8_gpu_node_with_fsdp_and_bf16(tmp_path, shape, monkeypatch):
    prefix = {"pythia-6.9b": "GPTNeoX", "llama-3-8b": "Llama"}[shape]
    policy = saved_config(tmp_path / "policy", shape, f"{prefix}ForCausalLM")
    reward = saved_config(tmp_path / "reward", shape, f"{prefix}ForSequenceClassification")
    n = SHAPES[shape][1]
    args = ppo.Args(sft_model_path=policy, reward_model_path=reward, fsdp=True, bf16=True)
    plan = {m.name: sum(m.bytes().values()) for m in ppo.memory_plan(args, 8)}
    # trained: 16 bytes a parameter (float32 weights, gradients, two AdamW moments); frozen: 2 (bfloat16); over 8
    assert plan["policy"] == pytest.approx(16 * n / 8, rel=0.01)
    head = SHAPES[shape][0]["vocab_size"] * 4096
    headless = n - head  # critic and reward model: a scalar head, no output layer
    assert plan["critic"] == pytest.approx(16 * headless / 8, rel=0.01)
    # the reference's output layer stays in float32 (as the policy's is gathered): its logits are the policy's
    assert plan["reference policy"] == pytest.approx((2 * headless + 4 * head) / 8, rel=0.001)
    assert plan["reward model"] == pytest.approx(2 * headless / 8, rel=0.01)
    assert sum(plan.values()) < 40 * GB  # of 80: the rest for activations
    assert sum(sum(m.bytes().values()) for m in rm.memory_plan(rm.Args(model_name_or_path=policy, fsdp=True,
                                                                        bf16=True), 8)) < 20 * GB

    # Without --fsdp every rank holds every model whole: the run is stopped before loading, naming a fix.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * GB}))
    replicated = ppo.Args(sft_model_path=policy, reward_model_path=reward, bf16=True)
    with pytest.raises(common.UserError, match=r"the models' states need [23]\d\d\.\d GB per GPU \(8 ranks.*has "
                                               r"80.0 GB: pass --fsdp$"):
        common.check_memory_plan(ppo.memory_plan, replicated, 8, torch.device("cuda", 0), rank=1)
    # on 4 GPUs: Pythia 6.9B fits sharded with frozen models in bfloat16 (61 GB); Llama 8B (70 GB) needs LoRA
    with pytest.raises(common.UserError, match=r"pass --lora_r 16 --bf16$" if shape == "llama-3-8b" else
                       r"pass --fsdp$"):
        common.check_memory_plan(ppo.memory_plan, replicated, 4, torch.device("cuda", 0), rank=1)
    assert common.check_memory_plan(ppo.memory_plan, args, 8, torch.device("cuda", 0), rank=1)


def test_frozen_models_offloaded_to_the_host_count_on_the_gpu_only_while_they_compute(tmp_path, monkeypatch):
    """--offload_inference_models: sharded frozen models take no GPU memory between uses; a replica is copied in
    whole while it scores, one at a time, so the largest one counts. A GPU the states fit only with it: not stopped."""
    import dataclasses

    policy = saved_config(tmp_path / "policy", "pythia-6.9b", "GPTNeoXForCausalLM")
    reward = saved_config(tmp_path / "reward", "pythia-6.9b", "GPTNeoXForSequenceClassification")
    for fsdp in (True, False):
        args = ppo.Args(sft_model_path=policy, reward_model_path=reward, fsdp=fsdp, bf16=True)
        plan = {m.name: sum(m.bytes().values()) for m in ppo.memory_plan(args, 8)}
        trained = plan["policy"] + plan["critic"]
        offloaded = ppo.memory_plan(dataclasses.replace(args, offload_inference_models=True), 8)
        assert [m.on_host for m in offloaded] == [m.name in ("reference policy", "reward model") for m in offloaded]
        frozen = 0 if fsdp else max(plan["reference policy"], plan["reward model"])
        assert common.plan_bytes(offloaded) == pytest.approx(trained + frozen)
        assert common.plan_bytes(offloaded) < sum(plan.values())

    # a GPU between FSDP's two totals
    args = ppo.Args(sft_model_path=policy, reward_model_path=reward, fsdp=True, bf16=True)
    on_gpu = common.plan_bytes(ppo.memory_plan(args, 8))
    trained = sum(sum(m.bytes().values()) for m in ppo.memory_plan(args, 8) if m.name in ("policy", "critic"))
    capacity = (trained + on_gpu) / 2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": capacity}))
    with pytest.raises(common.UserError, match="the models' states need"):
        common.check_memory_plan(ppo.memory_plan, args, 8, torch.device("cuda", 0), rank=1)
    common.check_memory_plan(ppo.memory_plan, dataclasses.replace(args, offload_inference_models=True), 8,
                             torch.device("cuda", 0), rank=1)


def test_plan_is_what_the_scripts_hold_on_2_ranks(tmp_path, reward_model_path):
    """Built as ppo.py and rm.py build them, after one optimizer step: each model's weights, gradients and AdamW
    state on each of 2 ranks, as the plan says (FSDP: a half each, frozen models in bfloat16; DDP: a replica)."""
    runs = [["ppo", ["--reward_model_path", reward_model_path, "--fsdp", "--bf16"]],
            ["ppo", ["--reward_model_path", reward_model_path, "--advantage_estimator", "grpo", "--lora_r", "4",
                     "--bf16"]],
            ["ppo", ["--reward_model_path", reward_model_path]],
            ["rm", ["--fsdp"]], ["rm", ["--lora_r", "4", "--bf16"]]]
    run_script(["tests/memory_probe.py", str(tmp_path / "held"), json.dumps(runs)], nproc=2)
    for rank in (0, 1):
        with open(tmp_path / f"held.rank{rank}.json") as f:
            results = json.load(f)
        assert len(results) == len(runs)
        for r in results:
            assert set(r["held"]) == set(r["plan"]), r["flags"]
            for name, held in r["held"].items():
                for kind, planned in r["plan"][name].items():
                    assert held[kind] == pytest.approx(planned, rel=0.02, abs=2048), (r["flags"], name, kind)
                assert held["weights"] > 0
