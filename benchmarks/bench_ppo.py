"""ppo.py against TRL 1.12's PPOTrainer (TRL's last release with PPO), side by side on one machine.

    python -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && \
        .venv-trl/bin/pip install -r requirements.txt -r benchmarks/requirements-ppo.txt
    python benchmarks/bench_ppo.py --trl_python .venv-trl/bin/python     # writes benchmarks/results/ppo_cpu.json
    python benchmarks/bench_ppo.py --workloads short-152k --rows ours ours_fused ours_fast \
        --out benchmarks/results/ppo_cpu_fused.json                       # learning beside its output layer alone
    python benchmarks/bench_ppo.py --workloads long-152k --rows ours ours_fused --repeats 1 --no_profile \
        --out benchmarks/results/ppo_cpu_long152k.json                    # the memory probe: peak RSS of each

Each row runs in its own process on the same policy (Llama-shaped, 4 layers x 256, random init, a byte-level
tokenizer), the same reward model (trained briefly by rm.py from that policy; it is the value model's initialisation
too), the same prompt token ids, sizes and sampling settings. Workloads:
- short: embedded-task prompts, 48 new tokens with no stop token, temperature 0.7, rollout batch 16 in one mini-batch,
  4 PPO epochs, 128 episodes;
- long: HH-RLHF prompts (../shared/data/hh-rlhf-harmless-base) cut to their last 256 tokens, 128 new tokens, stop at
  EOS, same sizes, 64 episodes;
- long-8k: the long workload with a byte-level BPE tokenizer of 8,000 tokens trained on the HH-RLHF text (its own
  policy, same shape, and reward model): a vocabulary whose output layer is a third of the model, as in the small
  pretrained models (GPT-2, Pythia, Qwen2.5-0.5B: a fifth to a third), where the byte-level one is a few percent.
- long-152k (a memory probe, run only when named): 16 responses of 512 tokens at Qwen2's vocabulary, hidden 64, one
  update: the plain path holds a micro-batch's 8,192 x 151,936 float32 logits (5 GB), --fused_logits no such tensor.
ppo.py runs three times: its default (plain) path; with --fused_logits alone (the same shapes, one pass over the
vocabulary); and with its opt-in speed flags together (SPEED_FLAGS: --group_by_length --fused_logits). Episodes/s is
over the training loop (TRL: inside train(); ppo.py: the sum of its updates' times). The time split is generation;
reference + reward + value forwards; learning (the PPO epochs). Peak memory is the process's peak RSS.
Beside each ppo.py row's learning: its output layer timed alone at the learning phase's shapes (batch x
response_length tokens, hidden, vocabulary) on the same machine, in a process of its own: the three matrix products no
path avoids (the logits, the gradients of the hidden states and of the weights); the output layer as the row's path
computes it (plain: those products, the division by the temperature, log-softmax, gather and entropy, and their
backward; --fused_logits: FusedLogprobs forward and backward); and the part of learning that is neither (learning less
its output layer alone: the transformer, the losses, the optimizer).
Last, ppo.py's learning phase of one update per workload runs under the profiler: its share of time in matrix
products and their GFLOP/s, against one large product's on the same machine (the ceiling).

On a busy machine: --beside_threads N runs every row beside a second process, a torch matrix-product loop on N threads
(a second training run, or a test suite), and writes benchmarks/results/ppo_cpu_busy.json; --omp_wait_policy passive
runs the rows (not that neighbour) with OpenMP threads that sleep at a barrier instead of spinning:

    python benchmarks/bench_ppo.py --trl_python .venv-trl/bin/python --workloads short --beside_threads 2
    python benchmarks/bench_ppo.py --trl_python .venv-trl/bin/python --workloads short --beside_threads 2 \
        --omp_wait_policy passive --out benchmarks/results/ppo_cpu_busy_passive.json
"""

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HH = os.path.join(ROOT, "..", "shared", "data", "hh-rlhf-harmless-base", "test.jsonl.gz")
WORKLOADS = {
    "short": dict(episodes=128, response_length=48, stop=False, prompt_length=256, vocab=258, prompts="short"),
    "long": dict(episodes=64, response_length=128, stop=True, prompt_length=256, vocab=258, prompts="long"),
    "long-8k": dict(episodes=64, response_length=128, stop=True, prompt_length=256, vocab=8000, prompts="long"),
    # memory at a real vocabulary: the short workload with Qwen2's 151,936-row embedding and output layer
    "short-152k": dict(
        episodes=128, response_length=48, stop=False, prompt_length=256, vocab=258, prompts="short", model_vocab=151_936
    ),
    # a memory probe, not in the default list: 16 x 512 response tokens at Qwen2's vocabulary, hidden 64, one update
    "long-152k": dict(
        episodes=16,
        response_length=512,
        stop=False,
        prompt_length=256,
        vocab=258,
        prompts="short",
        model_vocab=151_936,
        hidden=64,
    ),
}
DEFAULT_WORKLOADS = ["short", "long", "long-8k", "short-152k"]
SIZES = dict(batch=16, epochs=4, temperature=0.7, lr=3e-6, kl_coef=0.05, seed=1)


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>")


def bpe_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|pad|>", "<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|pad|>")


def model_shape(workload):
    """(tokenizer vocabulary, model vocabulary, hidden size) of a workload's models."""
    w = WORKLOADS[workload]
    return w["vocab"], w.get("model_vocab", w["vocab"]), w.get("hidden", 256)


def model_dir(root, workload, kind):
    """policy or rm, of the workload's vocabulary and width."""
    vocab, model_vocab, hidden = model_shape(workload)
    return os.path.join(root, f"{kind}-{vocab}-{model_vocab}" + ("" if hidden == 256 else f"-h{hidden}"))


def make_assets(root, workloads):
    """Per vocabulary the workloads use: a policy and a reward model (rm.py, 60 steps on the embedded task from the
    policy's weights); and the prompt files."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import common
    import rm

    with gzip.open(HH, "rt") as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(root, "pairs.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in common.embedded_pairs(1200, seed=0))
    for workload in sorted({min(w for w in workloads if model_shape(w) == model_shape(v)) for v in workloads}):
        vocab, model_vocab, hidden = model_shape(workload)
        tokenizer = (
            byte_tokenizer()
            if vocab == 258
            else bpe_tokenizer([r["chosen"] for r in rows] + [r["rejected"] for r in rows], vocab)
        )
        config = LlamaConfig(
            vocab_size=max(len(tokenizer), model_vocab),
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
        policy, rm_dir = (model_dir(root, workload, kind) for kind in ("policy", "rm"))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(policy)
        tokenizer.save_pretrained(policy)
        rm.main(
            rm.Args(
                model_name_or_path=policy,
                dataset_name=os.path.join(root, "pairs.jsonl"),
                max_steps=60,
                per_device_train_batch_size=16,
                learning_rate=1e-4,
                num_evals=1,
                output_dir=rm_dir,
                max_length=256,
                min_prompt_length=128,
            )
        )
    rng = random.Random(0)
    short = [common.embedded_prompt(rng) for _ in range(WORKLOADS["short"]["episodes"])]
    long = [common.shared_prefix_split(r["chosen"], r["rejected"])[0] for r in rows[: WORKLOADS["long"]["episodes"]]]
    for name, prompts in (("short", short), ("long", long)):
        with open(os.path.join(root, f"{name}.jsonl"), "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p}) + "\n")


def prompt_ids(root, workload, tokenizer):
    """The prompts as ppo.py tokenizes and truncates them; TRL is handed the same ids."""
    import common
    import ppo

    with open(os.path.join(root, f"{WORKLOADS[workload]['prompts']}.jsonl")) as f:
        texts = [json.loads(line)["prompt"] for line in f]
    bos = common.leading_id(tokenizer)
    return [
        ppo.truncate_prompt(p, WORKLOADS[workload]["prompt_length"], bos)
        for p in common.tokenize_prompts(tokenizer, texts)
    ]


SPEED_FLAGS = dict(group_by_length=True, fused_logits=True)  # ppo.py's opt-in speed paths, the "ours_fast" row
ROW_FLAGS = {"ours": {}, "ours_fused": dict(fused_logits=True), "ours_fast": SPEED_FLAGS}


def run_ours(root, workload, episodes=None, flags=None):
    import ppo

    w, out = WORKLOADS[workload], tempfile.mkdtemp()
    ppo.main(
        ppo.Args(
            **(flags or {}),
            sft_model_path=model_dir(root, workload, "policy"),
            reward_model_path=model_dir(root, workload, "rm"),
            dataset_name=os.path.join(root, f"{w['prompts']}.jsonl"),
            max_prompt_length=w["prompt_length"],
            total_episodes=episodes or w["episodes"],
            per_device_train_batch_size=SIZES["batch"],
            num_mini_batches=1,
            num_ppo_epochs=SIZES["epochs"],
            response_length=w["response_length"],
            temperature=SIZES["temperature"],
            stop_token="eos" if w["stop"] else "none",
            learning_rate=SIZES["lr"],
            kl_coef=SIZES["kl_coef"],
            seed=SIZES["seed"],
            sample_every=10**6,
            num_evals=0,
            output_dir=out,
        )
    )  # training alone, as TRL's row (no held-out evaluation)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        ms = [json.loads(line) for line in f if "perf/episodes_per_s" in line]
    return {
        "train_s": sum(SIZES["batch"] / m["perf/episodes_per_s"] for m in ms),
        "generation_s": sum(m["perf/time_rollout"] for m in ms),
        "scoring_s": sum(m["perf/time_score"] for m in ms),
        "learning_s": sum(m["perf/time_learn"] for m in ms),
        "generated_tokens": sum(m["response/length"] * SIZES["batch"] for m in ms),
        "updates": len(ms),
    }


def run_trl(root, workload):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as module

    w = WORKLOADS[workload]
    tokenizer = AutoTokenizer.from_pretrained(model_dir(root, workload, "policy"), padding_side="left")
    timers = {"generation_s": 0.0, "scoring_s": 0.0, "generated_tokens": 0}
    real_generation, real_forward, real_reward = module.batch_generation, module.forward, module.get_reward

    def generation(model, queries, *a, **k):
        t = time.time()
        query_responses, logits = real_generation(model, queries, *a, **k)
        timers["generation_s"] += time.time() - t
        responses = query_responses[:, queries.shape[1] :]
        if w["stop"]:
            is_stop = responses == tokenizer.eos_token_id
            after = (is_stop.cumsum(1) - is_stop.long()) > 0
            timers["generated_tokens"] += int((~after).sum())
        else:
            timers["generated_tokens"] += responses.numel()
        return query_responses, logits

    def timed(real):
        def call(*a, **k):
            if torch.is_grad_enabled():  # the learning phase's forward
                return real(*a, **k)
            t = time.time()
            out = real(*a, **k)
            timers["scoring_s"] += time.time() - t
            return out

        return call

    module.batch_generation, module.forward, module.get_reward = generation, timed(real_forward), timed(real_reward)
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=SIZES["batch"],
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=SIZES["epochs"],
        total_episodes=w["episodes"],
        response_length=w["response_length"],
        temperature=SIZES["temperature"],
        stop_token="eos" if w["stop"] else None,
        learning_rate=SIZES["lr"],
        kl_coef=SIZES["kl_coef"],
        seed=SIZES["seed"],
        local_rollout_forward_batch_size=SIZES["batch"],
        num_sample_generations=0,
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        bf16=False,
        fp16=False,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"input_ids": prompt_ids(root, workload, tokenizer)})
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=AutoModelForCausalLM.from_pretrained(model_dir(root, workload, "policy")),
        ref_model=None,
        reward_model=AutoModelForSequenceClassification.from_pretrained(model_dir(root, workload, "rm")),
        value_model=AutoModelForSequenceClassification.from_pretrained(model_dir(root, workload, "rm")),
        train_dataset=dataset,
    )
    t = time.time()
    trainer.train()
    train_s = time.time() - t
    return {"train_s": train_s, **timers, "learning_s": train_s - timers["generation_s"] - timers["scoring_s"]}


def matmul_peak(n=2048, reps=10):
    """GFLOP/s of one large fp32 matrix product on this machine: the ceiling of a matmul-bound phase."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.time()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.time() - t) / 1e9


def time_output_layer(workload, reps=3):
    """The output layer of one learning forward and backward at the workload's shapes (batch x response_length tokens,
    hidden, vocabulary; temperature as the rows'), timed alone, in seconds per update (num_ppo_epochs of them, one
    micro-batch each): its three matrix products, which no path avoids (logits, gradient of the hidden states, gradient
    of the weights); the plain path's output layer (the products, / temperature, log-softmax, gather, entropy without a
    graph, and their backward, as response_logprobs computes them); --fused_logits' (FusedLogprobs forward and
    backward). Each the least of `reps` timings after a first, untimed."""
    import torch
    import torch.nn.functional as F

    import ppo

    _, model_vocab, hidden = model_shape(workload)
    n, temperature = SIZES["batch"] * WORKLOADS[workload]["response_length"], SIZES["temperature"]
    torch.manual_seed(0)
    x = torch.randn(n, hidden, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(model_vocab, hidden) / hidden**0.5)
    targets = torch.randint(model_vocab, (n,))
    grad = torch.randn(n, model_vocab)

    def matmuls():
        with torch.no_grad():
            x @ weight.T, grad @ weight, grad.T @ x

    def plain():
        logp_all = torch.log_softmax(F.linear(x, weight).float() / temperature, -1)
        logprobs = logp_all.gather(-1, targets[:, None])
        with torch.no_grad():
            ppo.entropy_of(logp_all)
        logprobs.sum().backward()

    def fused():
        logprobs, _ = ppo.FusedLogprobs.apply(x / temperature, weight, None, targets, lambda a: a, True)
        logprobs.sum().backward()

    def least(fn):
        times = []
        for _ in range(reps + 1):
            x.grad = weight.grad = None
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times[1:]) * SIZES["epochs"]

    return {"matmuls_s": least(matmuls), "plain_s": least(plain), "fused_s": least(fused), "tokens": n}


def profile_learning(root, workload):
    """ppo.py's learning phase of one update (the second: warm) under the profiler: the share of its time in matrix
    products and their GFLOP/s, against matmul_peak()."""
    import inspect

    import torch
    from torch.profiler import ProfilerActivity, profile

    import ppo

    real_learn, found = ppo.learn, {}

    def profiled(*a, **k):
        if inspect.signature(real_learn).bind(*a, **k).arguments["update"] != 1:
            return real_learn(*a, **k)
        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as p:
            out = real_learn(*a, **k)
        ops = p.key_averages()
        total = sum(e.self_cpu_time_total for e in ops)
        mm = [e for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")]
        attention = [e for e in ops if "scaled_dot_product" in e.key]
        mm_us = sum(e.self_cpu_time_total for e in mm)
        found.update(
            mm_share=mm_us / total,
            mm_gflops=sum(e.flops for e in mm) / mm_us / 1e3,
            attention_share=sum(e.self_cpu_time_total for e in attention) / total,
            top=[
                (e.key, round(e.self_cpu_time_total / total, 3))
                for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:6]
            ],
        )
        return out

    ppo.learn = profiled
    run_ours(root, workload, episodes=2 * SIZES["batch"])
    ppo.learn = real_learn
    return found | {"matmul_peak_gflops": matmul_peak(), "threads": torch.get_num_threads()}


def row(args):
    t = time.time()
    if args.code_root:  # an earlier checkout of this project: its ppo.py and common.py imported first
        sys.path.insert(0, args.code_root)
    if args.row == "profile":
        return print("RESULT " + json.dumps(profile_learning(args.assets, args.workload)))
    if args.row == "layer":
        return print("RESULT " + json.dumps(time_output_layer(args.workload)))
    result = (
        run_trl(args.assets, args.workload)
        if args.row == "trl"
        else run_ours(args.assets, args.workload, flags=ROW_FLAGS[args.row])
    )
    with open("/proc/self/status") as f:  # VmHWM: this process's own peak (ru_maxrss counts the parent's at fork)
        peak_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    result |= {
        "process_s": time.time() - t + args.startup_s,
        "peak_rss_mb": peak_kb / 1024,
        "episodes": WORKLOADS[args.workload]["episodes"],
    }
    print("RESULT " + json.dumps(result))


def main():
    p = argparse.ArgumentParser()
    p.add_argument(
        "--trl_python", default=sys.executable, help="a Python with TRL 1.12 (benchmarks/requirements-ppo.txt)"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--workloads",
        nargs="+",
        default=DEFAULT_WORKLOADS,
        choices=list(WORKLOADS),
        help="long-152k (a memory probe) runs only when named",
    )
    p.add_argument(
        "--rows",
        nargs="+",
        default=["first", "ours", "ours_fused", "ours_fast"],
        choices=["first", "ours", "ours_fused", "ours_fast"],
        help="first: TRL's, or the earlier checkout's with --before; ours: ppo.py's default; ours_fused: "
        "--fused_logits; ours_fast: SPEED_FLAGS",
    )
    p.add_argument("--no_profile", action="store_true", help="skip the profiler's run of the learning phase")
    p.add_argument("--no_layer", action="store_true", help="skip the output layer timed alone")
    p.add_argument("--out", help="default: benchmarks/results/ppo_cpu.json, ppo_cpu_busy.json with --beside_threads")
    p.add_argument(
        "--beside_threads",
        type=int,
        default=0,
        help="run each row beside a torch matrix-product loop on this many threads (0: an idle machine)",
    )
    p.add_argument("--omp_wait_policy", choices=["passive", "active"], help="OMP_WAIT_POLICY of the rows")
    p.add_argument(
        "--before",
        help="a checkout of an earlier commit of this project: its ppo.py runs as a row beside "
        "today's, in place of TRL's (before/after comparisons of one change)",
    )
    p.add_argument("--row", choices=["trl", *ROW_FLAGS, "profile", "layer"], help=argparse.SUPPRESS)
    p.add_argument("--code_root", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--assets", help=argparse.SUPPRESS)
    p.add_argument("--startup_s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:
        return row(args)
    busy = args.beside_threads > 0
    if args.before:
        args.before = os.path.abspath(args.before)
        args.before_commit = (
            subprocess.run(
                ["git", "-C", args.before, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            or args.before
        )
    args.out = args.out or os.path.join(ROOT, "benchmarks", "results", f"ppo_cpu{'_busy' if busy else ''}.json")
    if not os.path.exists(HH):
        sys.exit(f"the long workload needs the HH-RLHF pairs at {HH}")
    assets = tempfile.mkdtemp()
    make_assets(assets, args.workloads)
    results, profiles, layers = [], {}, {}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    neighbour_env = {k: v for k, v in env.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()

    def child(python, row, workload, code_root=None):
        neighbour = busy and subprocess.Popen(
            [
                sys.executable,
                "-c",
                (
                    f"import torch\ntorch.set_num_threads({args.beside_threads})\n"
                    "a = torch.randn(512, 512)\nwhile True: a @ a"
                ),
            ],
            env=neighbour_env,
        )
        try:
            proc = subprocess.run(
                [
                    python,
                    __file__,
                    "--row",
                    row,
                    "--workload",
                    workload,
                    "--assets",
                    assets,
                    *(["--code_root", code_root] if code_root else []),
                ],
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
            )
        finally:
            if neighbour:
                neighbour.kill()
                neighbour.wait()
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{row} on {workload} failed:\n{proc.stderr[-4000:]}")
        return json.loads(lines[-1][7:])

    for workload in [] if args.no_layer else [w for w in args.workloads if w != "long-152k"]:
        layers[workload] = p = child(sys.executable, "layer", workload)  # (long-152k's would hold 5 GB tensors)
        print(
            f"{workload}: the output layer alone at {p['tokens']} tokens, per update: its three matrix products "
            f"{p['matmuls_s']:.2f} s, the plain path {p['plain_s']:.2f} s, --fused_logits {p['fused_s']:.2f} s",
            flush=True,
        )
    first = (
        (f"ppo.py at {args.before_commit}", sys.executable, args.before, "ours")
        if args.before
        else ("TRL 1.12 PPOTrainer", args.trl_python, None, "trl")
    )
    rows = {
        "first": first,
        "ours": ("ppo.py", sys.executable, None, "ours"),
        "ours_fused": ("ppo.py --fused_logits", sys.executable, None, "ours_fused"),
        "ours_fast": ("ppo.py " + " ".join(f"--{k}" for k in SPEED_FLAGS), sys.executable, None, "ours_fast"),
    }
    for repeat in range(args.repeats):
        for workload in args.workloads:
            for name, python, code_root, kind in (rows[r] for r in args.rows):
                t = time.time()
                r = child(python, kind, workload, code_root)
                r |= {
                    "row": name,
                    "workload": workload,
                    "repeat": repeat,
                    "whole_process_s": time.time() - t,
                    "beside_threads": args.beside_threads,
                    "omp_wait_policy": env.get("OMP_WAIT_POLICY", "default"),
                }
                r["episodes_per_s"] = r["episodes"] / r["train_s"]
                r["generated_tokens_per_s"] = r["generated_tokens"] / r["train_s"]
                r |= split_learning(r, layers.get(workload), kind)
                results.append(r)
                print(
                    f"[{repeat}] {workload:5s} {name:20s} {r['episodes_per_s']:6.2f} episodes/s in the loop, "
                    f"whole process {r['whole_process_s']:6.1f} s, generation {r['generation_s']:.1f} s, scoring "
                    f"{r['scoring_s']:.1f} s, learning {r['learning_s']:.1f} s, peak RSS {r['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
                if "layer_s" in r:
                    print(
                        f"    learning per update {r['learning_per_update_s']:.2f} s: its output layer alone "
                        f"{r['layer_s']:.2f} s, of which the three matrix products {r['matmuls_s']:.2f} s; neither "
                        f"{r['neither_s']:.2f} s",
                        flush=True,
                    )
    for workload in [] if busy or args.no_profile else args.workloads:  # where the learning phase spends its time
        profiles[workload] = p = child(sys.executable, "profile", workload)
        print(
            f"{workload}: learning phase {100 * p['mm_share']:.0f}% in matrix products at {p['mm_gflops']:.0f} "
            f"GFLOP/s (one large product: {p['matmul_peak_gflops']:.0f}), {100 * p['attention_share']:.0f}% in "
            f"attention; top ops {p['top']}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "sizes": SIZES,
                "workloads": WORKLOADS,
                "results": results,
                "learning_profile": profiles,
                "output_layer_alone": layers,
            },
            f,
            indent=2,
        )
    print(table(results))
    print(learning_table(results))


def split_learning(r, layer, kind):
    """A ppo.py row's learning per update beside its output layer timed alone (the row's path) and that layer's three
    matrix products; neither: learning less the layer alone. None for TRL's row or without the timing."""
    if layer is None or kind == "trl" or not r.get("updates"):
        return {}
    per_update = r["learning_s"] / r["updates"]
    alone = layer["plain_s" if kind == "ours" else "fused_s"]
    return {
        "learning_per_update_s": per_update,
        "layer_s": alone,
        "matmuls_s": layer["matmuls_s"],
        "neither_s": per_update - alone,
    }


def learning_table(results):
    """Learning per update of each ppo.py row, its output layer alone, that layer's matrix products, and neither."""
    lines = [
        "| workload | row | learning per update (s) | its output layer alone (s) | the layer's three matrix products "
        "alone (s) | neither (s) |",
        "|" + "---|" * 6,
    ]
    for workload in dict.fromkeys(r["workload"] for r in results):
        for name in dict.fromkeys(r["row"] for r in results if r["workload"] == workload and "layer_s" in r):
            rs = [r for r in results if r["workload"] == workload and r["row"] == name]
            means = [
                sum(r[k] for r in rs) / len(rs) for k in ("learning_per_update_s", "layer_s", "matmuls_s", "neither_s")
            ]
            lines.append(f"| {workload} | {name} | " + " | ".join(f"{m:.2f}" for m in means) + " |")
    return "\n".join(lines)


def table(results):
    """Each row against the workload's first (TRL's, or the earlier commit's with --before), repeat by repeat."""
    lines = [
        "| workload | row | episodes/s (loop) | generated tokens/s | whole process (s) | generation / scoring / "
        "learning (s) | peak RSS (MB) | vs first row (loop) | vs first row (process) |",
        "|" + "---|" * 9,
    ]
    for workload in dict.fromkeys(r["workload"] for r in results):
        names = list(dict.fromkeys(r["row"] for r in results if r["workload"] == workload))
        for name in names:
            rs = [r for r in results if r["workload"] == workload and r["row"] == name]
            trl = [r for r in results if r["workload"] == workload and r["row"] == names[0]]
            eps = [r["episodes_per_s"] for r in rs]
            ratio = [r["episodes_per_s"] / t["episodes_per_s"] for r, t in zip(rs, trl)]
            proc = [t["whole_process_s"] / r["whole_process_s"] for r, t in zip(rs, trl)]
            span = lambda xs, f="{:.2f}": f.format(min(xs)) + ("" if len(xs) == 1 else "–" + f.format(max(xs)))  # noqa
            lines.append(
                f"| {workload} | {name} | {span(eps)} | {span([r['generated_tokens_per_s'] for r in rs], '{:.0f}')}"
                f" | {span([r['whole_process_s'] for r in rs], '{:.1f}')} | "
                f"{sum(r['generation_s'] for r in rs) / len(rs):.1f} / {sum(r['scoring_s'] for r in rs) / len(rs):.1f}"
                f" / {sum(r['learning_s'] for r in rs) / len(rs):.1f} | "
                f"{span([r['peak_rss_mb'] for r in rs], '{:.0f}')} | {span(ratio)}x | {span(proc)}x |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
