"""The memory plan (benchmarks/memory_plan.py, from meta-device models): what 7B-scale runs need per GPU, its command
line, and that the plan is what the scripts really hold."""

import dataclasses
import json
import os
import re
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import ppo
import rm
from conftest import ROOT, run_script
from families import build_config, build_tokenizer

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import memory_plan as mp  # noqa: E402

GB = 1e9
# The anchor (Huang et al. 2024): Pythia 6.9B, and a Llama 3 8B shape; parameter counts as their model cards give them.
SHAPES = {
    "pythia-6.9b": (
        dict(
            model_type="gpt_neox",
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            intermediate_size=16384,
            vocab_size=50432,
            rotary_pct=0.25,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        ),
        6.857e9,
    ),
    "llama-3-8b": (
        dict(
            model_type="llama",
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=8192,
            tie_word_embeddings=False,
        ),
        8.030e9,
    ),
}


def states(rows):
    """Bytes per rank of each model's states, from a plan's rows."""
    return {m.name: sum(m.bytes().values()) for m in rows if isinstance(m, mp.Planned)}


def saved_config(folder, shape, architecture):
    """A model folder holding a config.json and no weights."""
    fields = dict(SHAPES[shape][0])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, architectures=[architecture], num_labels=1)
    config.save_pretrained(folder)
    return str(folder)


def saved_pair(tmp_path, shape):
    """(policy, reward model) folders of that shape, config.json only."""
    prefix = {"pythia-6.9b": "GPTNeoX", "llama-3-8b": "Llama"}[shape]
    return (
        saved_config(tmp_path / "policy", shape, f"{prefix}ForCausalLM"),
        saved_config(tmp_path / "reward", shape, f"{prefix}ForSequenceClassification"),
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_7b_plans_fit_one_8_gpu_node_with_fsdp_and_bf16(tmp_path, shape):
    policy, reward = saved_pair(tmp_path, shape)
    n = SHAPES[shape][1]
    args = ppo.Args(sft_model_path=policy, reward_model_path=reward, fsdp=True, bf16=True)
    plan = states(mp.plan("ppo", args, 8))
    # trained: 16 bytes a parameter (float32 weights, gradients, two AdamW moments); frozen: 2 (bfloat16); over 8
    assert plan["policy"] == pytest.approx(16 * n / 8, rel=0.01)
    head = SHAPES[shape][0]["vocab_size"] * 4096
    headless = n - head  # critic and reward model: a scalar head, no output layer
    assert plan["critic"] == pytest.approx(16 * headless / 8, rel=0.01)
    # the reference's output layer stays in float32 (as the policy's is gathered): its logits are the policy's
    assert plan["reference policy"] == pytest.approx((2 * headless + 4 * head) / 8, rel=0.001)
    assert plan["reward model"] == pytest.approx(2 * headless / 8, rel=0.01)
    assert sum(plan.values()) < 40 * GB  # of 80: the rest for activations
    assert sum(states(mp.plan("rm", rm.Args(model_name_or_path=policy, fsdp=True, bf16=True), 8)).values()) < 20 * GB

    # Without --fsdp every rank holds every model whole: refused, naming a fix.
    replicated = ppo.Args(sft_model_path=policy, reward_model_path=reward, bf16=True)
    assert re.fullmatch(
        r"the learning phase needs [23]\d\d\.\d GB per GPU \(8 ranks; the plan above\), more than "
        r"90% of the GPU's 80.0 GB: pass --fsdp",
        mp.refusal("ppo", replicated, 8, 80 * GB),
    )
    # on 4 GPUs, sharded with frozen models in bfloat16: Pythia 6.9B's states would fit (61 GB), not its rollout
    # beside them (the gathered policy and the KV cache: 80 GB); Llama 8B's states (70 GB) do not fit; LoRA does
    assert mp.refusal("ppo", replicated, 4, 80 * GB).endswith(": pass --lora_r 16 --bf16")
    assert mp.refusal("ppo", args, 8, 80 * GB) is None


def test_offloaded_shards_are_off_the_gpu_a_replica_never_and_the_plan_states_the_host_memory_loading_takes(tmp_path):
    """--offload_inference_models: under FSDP on several ranks the frozen models' shards live in host memory (a GPU
    the plan fits only so is not refused); under DDP, or on one rank, a replica stays on the GPU."""
    policy, reward = saved_pair(tmp_path, "pythia-6.9b")
    args = ppo.Args(sft_model_path=policy, reward_model_path=reward, fsdp=True, bf16=True)
    offload = dataclasses.replace(args, offload_inference_models=True)
    plan, offloaded = mp.plan("ppo", args, 8), [m for m in mp.plan("ppo", offload, 8) if isinstance(m, mp.Planned)]
    assert [m.on_host for m in offloaded] == [m.name in ("reference policy", "reward model") for m in offloaded]
    assert [m.bytes() for m in offloaded] == [m.bytes() for m in plan if isinstance(m, mp.Planned)]
    assert mp.states_bytes(offloaded) == pytest.approx(states(plan)["policy"] + states(plan)["critic"])
    assert "(host memory)" in mp.table(mp.plan("ppo", offload, 8), 8)

    # a GPU between the two peaks
    on_gpu, host = (max(mp.peaks(mp.plan("ppo", a, 8)).values()) for a in (args, offload))
    assert host < on_gpu
    capacity = (on_gpu + host) / 2 / mp.FRACTION
    assert mp.refusal("ppo", args, 8, capacity).startswith("the learning phase needs")
    assert mp.refusal("ppo", offload, 8, capacity) is None

    for a, world in ((dataclasses.replace(args, fsdp=False), 8), (args, 1)):
        on, off = mp.plan("ppo", a, world), mp.plan("ppo", dataclasses.replace(a, offload_inference_models=True), world)
        assert off == on and not any(m.on_host for m in off if isinstance(m, mp.Planned))

    # Loading: under FSDP rank 0 builds each model whole in float32, three at most at once (81.5 GB); under DDP or in
    # one process every rank builds all its replicas
    three = (2 * mp.shape(policy, "causal")[0] + mp.shape(reward, "reward")[0]) * 4
    assert three == pytest.approx(81.5e9, rel=1e-3)
    assert mp.table(mp.plan("ppo", args, 8), 8).splitlines()[-1] == (
        f"  host memory while loading: {three / 1e9:.1f} GB on rank 0, at most three models whole at once (each freed "
        "after its broadcast into the shards; the other ranks build on the meta device)"
    )
    largest = mp.shape(policy, "causal")[0] * 4
    for a, world in ((dataclasses.replace(args, fsdp=False), 8), (args, 1)):
        rows = mp.plan("ppo", a, world)
        every = sum(m.parameters for m in rows if isinstance(m, mp.Planned)) * 4
        assert every > 3 * largest
        assert mp.table(rows, world).splitlines()[-1] == (
            f"  host memory while loading: up to {every / 1e9:.1f} GB on each rank, its replicas built in float32"
        )
    lora = dataclasses.replace(args, lora_r=8)  # bfloat16 bases: the reward model, the policy, the critic copied
    adapted = [
        mp.shape(path, kind, None, mp.lora_of(lora))[0] for path, kind in ((policy, "causal"), (reward, "reward"))
    ]
    assert f": {(mp.shape(reward, 'reward')[0] + sum(adapted)) * 2 / 1e9:.1f} GB on rank 0" in mp.table(
        mp.plan("ppo", lora, 8), 8
    )


def test_plan_is_what_the_scripts_hold_on_2_ranks(tmp_path, reward_model_path):
    """Built as the scripts build them, after one optimizer step: each model's states on each of 2 ranks as planned."""
    runs = [
        ["ppo", ["--reward_model_path", reward_model_path, "--fsdp", "--bf16"]],
        ["ppo", ["--reward_model_path", reward_model_path, "--advantage_estimator", "grpo", "--lora_r", "4", "--bf16"]],
        ["ppo", ["--reward_model_path", reward_model_path]],
        ["rm", ["--fsdp"]],
        ["rm", ["--lora_r", "4", "--bf16"]],
    ]
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


def saved_bytes(fn, params):
    """What autograd keeps of fn()'s forward for its backward: the bytes of every distinct storage saved, less the
    parameters and their casts (autocast's copies: states, not activations)."""
    ids, seen = {p.untyped_storage().data_ptr() for p in params}, {}

    def pack(t):
        node = t.grad_fn  # a parameter's cast, or a view of one: back through casts and views to a parameter
        while type(node).__name__ in ("ToCopyBackward0", "TBackward0", "ViewBackward0"):
            node = node.next_functions[0][0]
        if t.untyped_storage().data_ptr() not in ids and type(node).__name__ != "AccumulateGrad":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_planned_activations_are_what_autograd_saves(tmp_path, family):
    """ppo.py's learning forward of a micro-batch (a model of the family widened to 256): the plan's activations row
    against the bytes autograd keeps, in float32 and bfloat16 autocast, with and without activation checkpointing."""
    config = build_config(family, build_tokenizer(family))
    config.update(
        dict(
            hidden_size=256,
            intermediate_size=688 if family == "llama" else 1024,
            num_attention_heads=8,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            max_position_embeddings=512,
        )
    )
    config.save_pretrained(tmp_path)
    torch.manual_seed(0)
    model = ppo.output_layer_in_float32(AutoModelForCausalLM.from_config(config).train())
    batch, prompt, response = 4, 32, 64
    ids = torch.randint(3, config.vocab_size, (batch, prompt + response))
    for bf16 in (False, True):
        measured = {}
        for checkpointing in (False, True):
            if checkpointing:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

            def forward():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # noqa: B023, run in this iteration
                    ppo.response_logprobs(
                        model, ids, torch.ones_like(ids), prompt, 1.0, entropy=True, entropy_grad=False
                    )

            measured[checkpointing] = saved_bytes(forward, model.parameters())
            args = ppo.Args(
                sft_model_path=str(tmp_path),
                reward_fn="common:gold_rewards",
                advantage_estimator="grpo",
                per_device_train_batch_size=batch,
                max_prompt_length=prompt,
                response_length=response,
                bf16=bf16,
                gradient_checkpointing=checkpointing,
            )
            planned = {
                r.name.split(" (")[0]: r.size
                for r in mp.plan("ppo", args, 1)
                if isinstance(r, mp.Transient) and r.phase == "learning"
            }["activations"]
            if checkpointing:  # + one block recomputed in the backward pass, and as much for its gradients
                measured[True] += 2 * (measured[False] - measured[True]) / config.num_hidden_layers
            assert planned == pytest.approx(measured[checkpointing], rel=0.25), (bf16, checkpointing)
        model.activation_checkpointing_disable()


def test_pythia_7b_peaks_and_the_command_line_exits_2_naming_the_flags_that_fit(tmp_path, capsys):
    """Pythia 6.9B PPO on 8 ranks, --fsdp --bf16, 16 prompts x (256 + 512) tokens per GPU: the rollout holds the
    gathered policy and a KV cache beside the states; learning without checkpointing does not fit 80 GB.
    `python benchmarks/memory_plan.py ppo|rm ...` from config.json files alone: a plan that does not fit exits 2
    naming the flag that makes it fit, one that fits 0; bad input is one line on stderr, exit 2."""
    policy, reward = saved_pair(tmp_path, "pythia-6.9b")
    rows = mp.plan(
        "ppo",
        ppo.Args(
            sft_model_path=policy,
            reward_model_path=reward,
            fsdp=True,
            bf16=True,
            num_mini_batches=1,
            per_device_train_batch_size=16,
            max_prompt_length=256,
            response_length=512,
        ),
        8,
    )
    size = {r.name.split(" (")[0]: r.size for r in rows if isinstance(r, mp.Transient)}
    n, head, tokens = SHAPES["pythia-6.9b"][1], 50432 * 4096, 16 * 768
    assert size["policy gathered"] == pytest.approx(2 * (n - head) + 4 * head, rel=0.01)  # 14 GB
    assert size["KV cache"] == 2 * 32 * 4096 * 2 * tokens  # keys and values, every layer, bfloat16: 6.4 GB
    assert 50 * GB < size["activations"] < 70 * GB  # ~34 bytes x hidden per token and layer (Korthikanti et al.)
    peaks = mp.peaks(rows)
    assert peaks["rollout"] == pytest.approx(51 * GB, rel=0.02) and 85 * GB < peaks["learning"] < 100 * GB

    def plan(*argv, process=False):  # as a user runs it (a process), or its main in this process
        if process:
            proc = run_script(["benchmarks/memory_plan.py", *argv], check=False)
            return proc.returncode, proc.stdout, proc.stderr.strip().splitlines()
        capsys.readouterr()
        code, (out, err) = mp.main(list(argv)), capsys.readouterr()
        return code, out, err.strip().splitlines()

    gpus = ["--world_size", "8", "--gpu_memory_gb", "80"]
    ppo_flags = [
        "--sft_model_path",
        policy,
        "--reward_model_path",
        reward,
        "--fsdp",
        "--bf16",
        "--num_mini_batches",
        "1",
        "--per_device_train_batch_size",
        "16",
        "--max_prompt_length",
        "256",
        "--response_length",
        "512",
    ]
    code, out, err = plan("ppo", *gpus, *ppo_flags, process=True)
    assert code == 2 and "learning peak" in out and "does not fit" in out and len(err) == 1, err
    assert err[0].startswith("error: the learning phase needs 9") and err[0].endswith("pass --gradient_checkpointing")
    code, out, err = plan("ppo.py", *ppo_flags, "--gradient_checkpointing", *gpus)
    assert code == 0 and "fits: 90% of a 80.0 GB GPU" in out and err == []
    code, _, err = plan("rm", *gpus, "--model_name_or_path", policy, "--per_device_train_batch_size", "8", "--bf16")
    assert code == 2 and err[0].endswith("pass --fsdp")

    for argv in (
        ["ppo", "--sft_model_path", str(tmp_path / "missing"), "--reward_fn", "common:gold_rewards"],
        ["sft", "--model_name_or_path", policy],
    ):
        code, out, err = plan(*argv)
        assert code == 2 and out == "" and len(err) == 1 and err[0].startswith("error: "), err
