"""Sharded loading under FSDP on 2 gloo ranks: each rank reads only its own slices of a safetensors checkpoint and holds
exactly the model rank 0 would have loaded whole and broadcast (the path kept for .bin weights and LoRA)."""

import copy
import json
import os

import pytest
import torch
from families import save_family

import common

KINDS = {"causal": "AutoModelForCausalLM", "classifier": "AutoModelForSequenceClassification"}


def _load_both_ways(rank, folder, path, kind, frozen_bf16, grow):
    """On each rank, the model at path loaded as ppo.py / rm.py do under --fsdp, first every rank reading its slices
    (skeleton on every rank), then rank 0 loading it whole (skeleton on rank 1 only); the full state dicts, buffers,
    and what each rank read, saved for the test."""
    import safetensors
    import torch.distributed as dist
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    config = transformers.AutoConfig.from_pretrained(path)
    config.num_labels = 1
    loader = getattr(transformers, KINDS[kind])
    read, real_open = [], safetensors.safe_open

    class Spy:  # what shard_from_rank0 reads: each slice's key, its shape and the whole tensor's
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def get_slice(self, key):
            self.key, self.whole = key, self.f.get_slice(key)
            return self

        def __getitem__(self, index):
            part = self.whole[index]
            read.append((self.key, list(part.shape), self.whole.get_shape()))
            return part

        def get_tensor(self, key):
            read.append((key, None, None))
            return self.f.get_tensor(key)

    out = {}
    for way, skeleton in (("sliced", True), ("rank 0", rank != 0)):
        torch.manual_seed(0)
        model = common.load_model(loader, path, "--model", skeleton, config=copy.deepcopy(config), dtype=torch.float32)
        out[f"{way} meta"] = next(model.parameters()).is_meta
        if grow:  # rm.py's pad token: the table grown, then its new head drawn
            common.read_on_rank0(model.get_input_embeddings())
            model.resize_token_embeddings(model.get_input_embeddings().num_embeddings + 1, mean_resizing=False)
        if kind == "classifier":
            torch.nn.init.normal_(model.score.weight, std=0.1)

        def shard(model):
            if frozen_bf16:  # ppo.py's frozen models under --bf16: float32 read, held in bfloat16
                for p in model.parameters():
                    p.data = p.data.to(torch.bfloat16)
            for block in next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
                fully_shard(block)
            fully_shard(model)

        safetensors.safe_open, read[:] = Spy, []
        common.shard_from_rank0(model, shard, torch.device("cpu"))
        safetensors.safe_open = real_open
        out[f"{way} read"] = list(read)
        out[way] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[f"{way} buffers"] = {n: b.clone() for n, b in model.named_buffers()}
        out[f"{way} trained"] = {n: p.requires_grad for n, p in model.named_parameters()}
    torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


def load_both_ways(tmp_path, path, kind="causal", frozen_bf16=False, grow=False):
    torch.multiprocessing.spawn(_load_both_ways, args=(str(tmp_path), path, kind, frozen_bf16, grow), nprocs=2)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def saved(tmp_path, family, base=False, shard_size="40KB"):
    """A tiny model of the family stored in bfloat16 (float32 for GPT-2) as safetensors shards (base: its backbone
    alone, keys without the base model's prefix, as GPT-2's hub checkpoint)."""
    import transformers

    path = save_family(family, tmp_path / family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    os.remove(path / "model.safetensors")
    (model.base_model if base else model).save_pretrained(path, max_shard_size=shard_size)
    if base:
        config = model.config  # (the backbone's saved config names the backbone: the causal LM is what's loaded)
        config.architectures = [type(model).__name__]
        config.save_pretrained(path)
    return str(path)


def assert_equal_ways(ranks, sliced_meta=True):
    zero, one = ranks
    assert zero["sliced meta"] is sliced_meta and one["sliced meta"] and not zero["rank 0 meta"]
    for rank in ranks:
        assert rank["sliced"].keys() == zero["rank 0"].keys()
        for k, v in zero["rank 0"].items():
            assert rank["sliced"][k].dtype == v.dtype and torch.equal(rank["sliced"][k], v), k
        for k, v in zero["rank 0 buffers"].items():
            assert torch.equal(rank["sliced buffers"][k], v), k
        assert rank["sliced trained"] == zero["rank 0 trained"]


@pytest.mark.parametrize("family", ["llama3", "neox"])
def test_each_rank_reads_only_its_slices_of_a_sharded_bf16_checkpoint(family, tmp_path):
    """A bfloat16 checkpoint in several safetensors files, loaded into float32: each rank reads the rows of its own
    shard of every tensor (together, each tensor once), and both ranks hold what rank 0's whole model broadcast
    gives, bit for bit (RoPE's buffers included); rank 0's whole path reads nothing."""
    path = saved(tmp_path, family)
    assert len(set(json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"].values())) > 1
    ranks = load_both_ways(tmp_path, path)
    assert_equal_ways(ranks)
    mine = [{key: got for key, got, _ in rank["sliced read"]} for rank in ranks]
    shapes = {key: shape for key, _, shape in ranks[0]["sliced read"] + ranks[1]["sliced read"]}
    assert len(shapes) == len(ranks[0]["rank 0"])  # every tensor read (an output layer of its own included)
    for key, shape in shapes.items():
        rows = [m[key][0] if key in m else 0 for m in mine]
        assert sum(rows) == shape[0] and all(r < shape[0] for r in rows), key  # each its rows, none twice
        assert all(m[key][1:] == shape[1:] for m in mine if key in m), key
    for rank in ranks:
        assert rank["rank 0 read"] == []


def test_a_backbone_checkpoint_without_the_prefix_into_a_tied_causal_lm(tmp_path):
    """GPT-2's layout (keys `h.0...`, the output layer tied to the embedding, stored in float32), read into a causal
    LM whose keys are `transformer.h.0...`, and held in bfloat16 as ppo.py's frozen models: the same as broadcast."""
    path = saved(tmp_path, "gpt2", base=True)
    assert all(not k.startswith("transformer.") for k in json.load(open(os.path.join(
        path, "model.safetensors.index.json")))["weight_map"])
    ranks = load_both_ways(tmp_path, path, frozen_bf16=True)
    assert_equal_ways(ranks)
    assert ranks[0]["sliced"]["lm_head.weight"].dtype == torch.bfloat16


def test_a_classifier_from_a_causal_lm_checkpoint_grown_by_a_token(tmp_path):
    """rm.py's start: a classifier on a causal LM's checkpoint (its output layer ignored, its new head made by rank 0
    as from_pretrained makes it, then drawn again by the script) with the table grown by a pad token: the same
    weights, head and new row as rank 0's whole model gives, on both ranks."""
    path = saved(tmp_path, "llama3")
    ranks = load_both_ways(tmp_path, path, kind="classifier", grow=True)
    assert_equal_ways(ranks)
    assert all("lm_head" not in key for rank in ranks for key, *_ in rank["sliced read"])
    assert ranks[0]["sliced"]["score.weight"].std() > 0


def test_bin_weights_are_loaded_whole_by_rank_0(tmp_path):
    """.bin weights (and a hub name not in the local cache) take the broadcast path: rank 0 loads the model whole,
    the same model results."""
    import transformers

    path = str(save_family("llama3", tmp_path / "llama3"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    assert common.safetensors_index(path) is None and common.safetensors_index("nobody/no-such-model") is None
    ranks = load_both_ways(tmp_path, path)
    assert_equal_ways(ranks, sliced_meta=False)
    assert all(rank[f"{way} read"] == [] for rank in ranks for way in ("sliced", "rank 0"))


def test_the_plan_states_the_host_memory_of_the_path_taken(tmp_path):
    """The memory plan's loading line: sharded from safetensors, each rank's slices (a tensor at a time: the largest,
    the embedding, in float32); with LoRA, or no safetensors, rank 0's whole models."""
    import ppo
    import rm

    path = saved(tmp_path, "llama3")
    table = lambda args, world=2: common.plan_table(ppo.memory_plan(args, world), world, lora=args.lora_r)  # noqa
    c = common.model_config(path)
    assert table(ppo.Args(sft_model_path=path, reward_model_path=path, fsdp=True)).splitlines()[-1] == (
        "  host memory while loading: each rank reads its own slices of the policy, reference policy, critic, reward "
        f"model, up to {c.vocab_size * c.hidden_size * 4 / 1e9:.1f} GB at a time")
    assert "rank 0 builds the policy, critic whole in float32" in table(ppo.Args(
        sft_model_path=path, reward_model_path=path, fsdp=True, lora_r=4))
    assert "on each rank (a replica each)" in table(ppo.Args(sft_model_path=path, reward_model_path=path), 1)
    for name in os.listdir(path):  # config only, as --plan_only may read it (or .bin weights)
        if "safetensors" in name:
            os.remove(os.path.join(path, name))
    assert common.plan_table(rm.memory_plan(rm.Args(model_name_or_path=path, fsdp=True), 2), 2).splitlines()[-1] == (
        "  host memory while loading: rank 0 builds the reward model whole in float32 "
        f"({common.model_shape(path, 'reward')[0] * 4 / 1e9:.1f} GB), then broadcasts into the shards")


def test_ppo_critic_from_the_policy_on_two_sliced_ranks_trains_as_one_process(tmp_path):
    """ppo.py's critic from the policy's backbone (a copy of its skeleton: read from the policy's checkpoint) and a new
    head rank 0 draws: 2 FSDP ranks reading their slices train as 1 process does."""
    from conftest import read_metrics, run_script

    path = saved(tmp_path, "llama3")
    base = ["ppo.py", "--sft_model_path", path, "--reward_fn", "common:gold_rewards", "--critic_init", "policy",
            "--total_episodes", "16", "--per_device_train_batch_size", "4", "--num_mini_batches", "1",
            "--response_length", "6", "--max_prompt_length", "32", "--learning_rate", "1e-3"]
    run_script(base + ["--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path / "one")])
    out = run_script(base + ["--fsdp", "--output_dir", str(tmp_path / "fsdp")], nproc=2).stdout
    assert "host memory while loading: each rank reads its own slices of the policy, reference policy, critic," in out
    one, fsdp = (read_metrics(tmp_path / k) for k in ("one", "fsdp"))
    for key in ("objective/scores", "loss/policy", "loss/value", "policy/grad_norm"):
        assert [m[key] for m in one if key in m] == pytest.approx([m[key] for m in fsdp if key in m], abs=1e-5,
                                                                 rel=1e-5), key
