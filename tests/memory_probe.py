"""Run under torchrun by test_memory.py: for each (script, flags) given as JSON, build the models as that script does,
take one optimizer step, and write what this rank really holds (memory_plan.held_bytes, after the step, gradients
still in place) beside the script's memory plan (benchmarks/memory_plan.py), to OUT.rank<N>.json."""

import json
import os
import sys

import torch
import tyro

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import memory_plan  # noqa: E402

import ppo  # noqa: E402
import rm  # noqa: E402


def ppo_held(flags, rank, world, device):
    args = tyro.cli(ppo.Args, args=flags)
    ppo.check_args(args)
    ppo.fill_defaults(args, ppo.position_limit(args), rank)
    tokenizer = ppo.load_tokenizer(args)
    models = ppo.build_models(args, tokenizer, device, rank, world)
    policy, critic = models.policy, models.critic
    trainable, optimizer, _ = ppo.build_optimizer(policy, critic, args, 10)
    ids = torch.randint(3, len(tokenizer), (2, 12))
    mask = torch.ones_like(ids)
    loss = policy(input_ids=ids, attention_mask=mask).logits.float().mean()
    if critic is not None:
        loss = loss + critic(ids, mask).mean()
    loss.backward()
    optimizer.step()
    held = {
        "policy": policy,
        "critic": critic,
        "reference policy": None if models.lora else models.reference,
        "reward model": models.reward.model if isinstance(models.reward.model, torch.nn.Module) else None,
    }
    plan = memory_plan.plan("ppo", args, world, len(tokenizer))
    return plan, {name: memory_plan.held_bytes(m, optimizer) for name, m in held.items() if m is not None}


def rm_held(flags, rank, world, device):
    args = tyro.cli(rm.Args, args=flags)
    tokenizer = rm.load_tokenizer(args.model_name_or_path)
    hf_model, _, args = rm.load_reward_model(args, tokenizer)
    model = rm.parallelize(rm.RewardModel(hf_model), args, device)
    optimizer, _ = rm.build_optimizer(model, args, 10)
    ids = torch.randint(3, len(tokenizer), (2, 12))
    model(ids, torch.ones_like(ids)).float().mean().backward()
    optimizer.step()
    held = {"reward model": memory_plan.held_bytes(model, optimizer)}
    return memory_plan.plan("rm", args, world, len(tokenizer)), held


if __name__ == "__main__":
    out, runs = sys.argv[1], json.loads(sys.argv[2])
    results, (rank, world, device) = [], ppo.setup_distributed()
    for script, flags in runs:
        plan, held = (ppo_held if script == "ppo" else rm_held)(flags, rank, world, device)
        plan = {m.name: m.bytes() for m in plan if isinstance(m, memory_plan.Planned)}
        results.append({"flags": [script] + flags, "plan": plan, "held": held})
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
