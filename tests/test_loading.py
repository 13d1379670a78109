"""Sharded loading under FSDP on 2 gloo ranks: rank 0 loads the model whole, the other builds it on the meta device,
and after sharding (common.shard_from_rank0) both hold exactly the model one process loads, bit for bit."""

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import common
from conftest import read_metrics, run_main, run_ranks
from families import save_family


def load_as_the_scripts_do(path, kind, on_meta, grow):
    """The model at path as ppo.py / rm.py load it (rm.py: the table grown by a pad token, a head drawn)."""
    config = AutoConfig.from_pretrained(path)
    config.num_labels = 1
    torch.manual_seed(0)
    auto = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    model = common.load_model(auto, path, "--model", on_meta, config=config, dtype=torch.float32)
    if grow:
        model.resize_token_embeddings(model.get_input_embeddings().num_embeddings + 1, mean_resizing=False)
    if kind == "classifier":
        torch.nn.init.normal_(model.score.weight, std=0.1)
    return model


def _load_sharded(rank, folder, cases):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    for name, (path, kind, frozen_bf16, grow) in cases.items():
        model = load_as_the_scripts_do(path, kind, rank != 0, grow)
        out = {"meta": next(model.parameters()).is_meta}

        def shard(model):
            if frozen_bf16:  # noqa: B023, shard runs in this iteration. ppo.py's frozen models under --bf16
                for p in model.parameters():
                    p.data = p.data.to(torch.bfloat16)
            for block in next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
                fully_shard(block)
            fully_shard(model)

        common.shard_from_rank0(model, shard, torch.device("cpu"))
        out["weights"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
        out["local"] = sum(p.to_local().numel() for p in model.parameters())
        torch.save(out, os.path.join(folder, f"{name}.rank{rank}.pt"))
    dist.destroy_process_group()


def saved(tmp_path, family, base=False, bin_weights=False):
    """A tiny model of the family stored in bfloat16 (float32 for GPT-2) as safetensors shards (base: its backbone
    alone, keys without the base model's prefix, as GPT-2's hub checkpoint; bin_weights: a pytorch_model.bin)."""
    path = save_family(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path)
    os.remove(path / "model.safetensors")
    if bin_weights:
        torch.save(model.state_dict(), path / "pytorch_model.bin")
        return str(path)
    (model.base_model if base else model).save_pretrained(path, max_shard_size="40KB")
    if base:
        config = model.config  # (the backbone's saved config names the backbone: the causal LM is what's loaded)
        config.architectures = [type(model).__name__]
        config.save_pretrained(path)
    return str(path)


CASES = {  # (family, saved's options, kind, held in bfloat16 as ppo.py's frozen models, the table grown by a token)
    "llama3": ("llama3", {}, "causal", False, False),
    "neox": ("neox", {}, "causal", False, False),
    "gpt2-backbone": ("gpt2", dict(base=True), "causal", True, False),
    "classifier": ("llama3", {}, "classifier", False, True),
    "bin": ("llama3", dict(bin_weights=True), "causal", False, False),
}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Each case loaded on 2 ranks (one spawn for all): {case: (its arguments, [rank 0's, rank 1's results])}."""
    root = tmp_path_factory.mktemp("sharded")
    cases = {name: (saved(root / name, family, **options), *rest) for name, (family, options, *rest) in CASES.items()}
    torch.multiprocessing.spawn(_load_sharded, args=(str(root), cases), nprocs=2)
    return {
        name: (case, [torch.load(root / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)])
        for name, case in cases.items()
    }


@pytest.mark.parametrize("name", list(CASES))
def test_a_sharded_checkpoint_is_the_model_one_process_loads(name, sharded):
    """Both ranks hold what one process loads, bit for bit (RoPE's buffers included): a bfloat16 checkpoint in several
    safetensors files (Llama, NeoX), loaded into float32 by rank 0 and broadcast into the shards; GPT-2's layout (keys
    `h.0...`, the output layer tied to the embedding, in float32) read into a causal LM whose keys are
    `transformer.h.0...` and held in bfloat16; rm.py's start, a classifier on a causal LM's checkpoint (its output
    layer ignored, its new head drawn by rank 0) with the table grown by a pad token; .bin weights."""
    (path, kind, frozen_bf16, grow), ranks = sharded[name]
    whole = load_as_the_scripts_do(path, kind, False, grow)
    expected = {k: v.to(torch.bfloat16) if frozen_bf16 else v for k, v in whole.state_dict().items()}
    assert [r["meta"] for r in ranks] == [False, True]
    for rank in ranks:
        assert rank["weights"].keys() == expected.keys()
        for k, v in expected.items():
            assert rank["weights"][k].dtype == v.dtype and torch.equal(rank["weights"][k], v), k
        for k, v in whole.named_buffers():  # RoPE's inverse frequencies too (outside the state dict)
            assert torch.equal(rank["buffers"][k], v), k
    n = sum(p.numel() for p in whole.parameters())
    assert ranks[0]["local"] + ranks[1]["local"] == n and ranks[1]["local"] < 0.6 * n  # each holds its shard alone
    if name == "gpt2-backbone":
        assert ranks[0]["weights"]["lm_head.weight"].dtype == torch.bfloat16
    if name == "classifier":
        assert ranks[1]["weights"]["score.weight"].std() > 0


def test_ppo_critic_from_the_policy_on_two_sharded_ranks_trains_as_one_process(tmp_path):
    """ppo.py's critic from the policy's backbone (a copy of rank 0's model, of the other ranks' skeletons) and a new
    head rank 0 draws: 2 FSDP ranks train as 1 process does."""
    path = saved(tmp_path, "llama3")
    base = [
        "ppo.py",
        "--sft_model_path",
        path,
        "--reward_fn",
        "common:gold_rewards",
        "--critic_init",
        "policy",
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
    run_main(base + ["--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one")])
    run_ranks([base + ["--fsdp", "--output_dir", str(tmp_path / "fsdp")]], tmp_path)
    one, fsdp = (read_metrics(tmp_path / k) for k in ("one", "fsdp"))
    for key in ("objective/scores", "loss/policy", "loss/value", "policy/grad_norm"):
        assert [m[key] for m in one if key in m] == pytest.approx(
            [m[key] for m in fsdp if key in m], abs=1e-5, rel=1e-5
        ), key
