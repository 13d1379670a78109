import contextlib
import dataclasses
import functools
import io
import json
import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
import transformers
import tyro
from torch.distributed.checkpoint import HuggingFaceStorageReader, load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HH_PATH = os.path.join(ROOT, "..", "shared", "data", "hh-rlhf-harmless-base", "test.jsonl.gz")

import common  # noqa: E402
import ppo  # noqa: E402
import rm  # noqa: E402
from families import save_family  # noqa: E402


@dataclasses.dataclass
class Args(ppo.Args):
    """ppo.py's Args, with no held-out evaluation unless a test asks for one (--num_evals). At its default, six
    evaluations of 256 prompts would cost many times the training of a test's tiny run."""

    num_evals: int = 0


ppo.Args = Args  # also in tests/jobs.py and tests/faults.py, which import this module

# One intra-op thread, as each rank of a subprocess has (OMP_NUM_THREADS=1): tiny models gain nothing from a second,
# and on busy cores its waits at every parallel region made in-process runs many times slower.
torch.set_num_threads(1)


def save_checkpoint(output_dir, step, state, keep=2):
    """A checkpoint of state alone, in one process, through the scripts' commit protocol."""
    common.commit_checkpoint(*common.new_checkpoint_dir(output_dir, step), state, keep)


def read_checkpoint(path):
    """A checkpoint's tensors, whole, in one process: {"model": {name: t}, "optimizer": {name.moment: t}}."""
    meta = HuggingFaceStorageReader(path).read_metadata().state_dict_metadata
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        load(flat, storage_reader=HuggingFaceStorageReader(path))
    out = {"model": {}, "optimizer": {}}
    for k, v in flat.items():
        part, name = k.split(".", 1)
        out[part][name] = v
    return out


def run_script(args, nproc=1, check=True, env=None, timeout=600):
    """Run a script as a user would: `python X.py` for one process, `torchrun` for several. Returns the process."""
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(29500 + os.getpid() % 1000),
        ]
    )
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    proc = subprocess.run(launcher + args, cwd=ROOT, capture_output=True, text=True, env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def run_main(args, check=True):
    """`python rm.py|ppo.py ARGS` in this process, through the command line's own entry point (flags parsed by tyro,
    main under exit_on_user_error), its output captured: the same run without a process's seconds of imports."""
    module, out, err = {"rm.py": rm, "ppo.py": ppo}[args[0]], io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            common.exit_on_user_error(module.main, tyro.cli(module.Args, args=args[1:], use_underscores=True))
            code = 0
        except SystemExit as e:
            code = e.code
    if check and code:
        raise AssertionError(f"{' '.join(args)} failed ({code}):\n{err.getvalue()[-3000:]}")
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def without_inductor(monkeypatch):
    """torch.compile through dynamo and AOT autograd, without inductor's C++ compilation (minutes on 2 cold cores;
    test_compiled_decode_samples_the_plain_decodes_tokens runs inductor), here and under torchrun (tests/jobs.py)."""
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kwargs: compile(fn, backend="aot_eager", **kwargs))
    monkeypatch.setenv("COMPILE_BACKEND", "aot_eager")


def run_ranks(jobs, folder, check=True):
    """Command lines ([script, *flags] each) on 2 ranks of one torchrun launch, one after the other (tests/jobs.py: a
    launch costs seconds of imports). Returns the launch's process and each job's error (None: every rank exited 0)."""
    os.makedirs(folder, exist_ok=True)
    folder = tempfile.mkdtemp(dir=folder, prefix="codes-")
    proc = run_script(["tests/jobs.py", str(folder), json.dumps(jobs)], nproc=2, check=False)
    codes = [
        [open(p).read() if os.path.exists(p := os.path.join(folder, f"{i}.{r}")) else "none" for r in (0, 1)]
        for i in range(len(jobs))
    ]
    errors = [
        None if c == ["0", "0"] else f"{' '.join(job)} failed (exit codes {c}):\n{proc.stderr[-3000:]}"
        for job, c in zip(jobs, codes)
    ]
    if check and any(errors):
        raise AssertionError("\n".join(e for e in errors if e))
    return proc, errors


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def read_metrics(output_dir):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_saved_models_equal(dirs, auto_class):
    models = [getattr(transformers, auto_class).from_pretrained(d).state_dict() for d in dirs]
    for other in models[1:]:
        assert other.keys() == models[0].keys()
        for k in models[0]:
            assert torch.allclose(other[k], models[0][k], atol=1e-5), k


@pytest.fixture(scope="session")
def small_pairs_file(tmp_path_factory):
    """A small local copy of the embedded task (exercises the local-file path; far quicker than 40k pairs)."""
    return write_jsonl(tmp_path_factory.mktemp("data") / "pairs.jsonl", common.embedded_pairs(600, seed=5))


@pytest.fixture
def hh_path():
    if not os.path.exists(HH_PATH):
        pytest.skip(f"real HH-RLHF pairs not found at {HH_PATH} (the project's ../shared folder)")
    return HH_PATH


@pytest.fixture(scope="session")
def reward_model_path(tmp_path_factory, small_pairs_file):
    """A small reward model trained by rm.py on the embedded task (a short run: enough signal for PPO to follow)."""
    out = tmp_path_factory.mktemp("rm")
    run_main(
        [
            "rm.py",
            "--dataset_name",
            small_pairs_file,
            "--max_steps",
            "60",
            "--per_device_train_batch_size",
            "16",
            "--num_evals",
            "1",
            "--output_dir",
            str(out),
        ]
    )
    return str(out)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """A tiny saved model of a family in tests/families.py, by path (made once per session)."""
    root = tmp_path_factory.mktemp("families")
    return functools.cache(lambda family: str(save_family(family, root / family)))


def replayed_samples(policy, query, query_mask, responses, seeds, temperature, stop_id):
    """The tokens the sampler should have drawn, recomputed without its KV cache: a whole-sequence forward's logits
    (the model's own float32 logits at each response position / temperature, as ppo.response_logprobs reads them)
    drawn with each episode's uniform at each step (ppo.sample_tokens; seeds: (B,) int64). Equal to `responses`
    (generate's raw output) iff the cached decode samples from the distribution the learning forward computes."""
    stopped = [(r == stop_id).nonzero() for r in responses]
    steps = responses.shape[1] if any(len(s) == 0 for s in stopped) else max(int(s[0]) + 1 for s in stopped)
    ids = torch.cat([query, responses[:, :steps]], 1)
    mask = torch.cat([query_mask.long(), torch.ones_like(responses[:, :steps])], 1)
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        logits = logits[:, query.shape[1] - 1 : -1].float() / temperature
    drawn = [ppo.sample_tokens(logits[:, t], seeds, t) for t in range(steps)]
    return torch.stack(drawn, 1), steps
