"""Plumbing shared by rm.py and ppo.py, in sections. Each script states its own method."""

import codecs
import collections
import contextlib
import copy
import dataclasses
import functools
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import sys
import time
import traceback
import typing
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401 (imported before any process group, see leave_together)
import torch.nn.functional as F
import transformers
import tyro

# ---------------------------------------------------------------------------------------------------------------------
# Errors. A mistake the user can fix is said in one line with exit code 2, on every rank at once.


class UserError(Exception):
    """Bad input the user can fix, such as a file, row, field or value. main() prints it and exits with code 2."""


def cli(args_class):
    """Returns args_class parsed by tyro; a field's trailing comment is its help. Only rank 0 prints help and errors."""
    registry, inside, no_hint = tyro.constructors.ConstructorRegistry(), [], tyro.conf.arg(help_behavior_hint="")

    @registry.struct_rule
    def without_none_hint(info):  # no "(default: None)": such a field's help says what None stands for
        if info.type is args_class and not inside:
            inside.append(info)
            spec = registry.get_struct_spec(info)  # the fields as tyro makes them
            inside.pop()
            return dataclasses.replace(
                spec,
                fields=tuple(
                    dataclasses.replace(f, type=typing.Annotated[f.type, no_hint]) if f.default is None else f
                    for f in spec.fields
                ),
            )

    quiet = int(os.environ.get("RANK", 0)) != 0
    with (
        contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext(),
        contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext(),
    ):
        return tyro.cli(args_class, use_underscores=True, registry=registry)


LEFT = []  # the process groups of ended runs, held until the process ends; see leave_together


def leave_together():
    """Ends a run on several ranks. Every rank waits, then destroys the process group but holds it in LEFT. DDP's
    reducer, releasing it, would join gloo's threads, which can wait an hour on a peer already gone. A group's threads
    end only when nothing holds it. torch._dynamo imports torch.distributed.nn with the first optimizer, which binds
    the group of that moment as a default argument, so this file imports it before any group. Else teardown can abort
    with SIGABRT ("terminate called without an active exception") while gloo's threads release the last tensors."""
    if dist.is_initialized():
        dist.barrier()
        LEFT.append(dist.group.WORLD)
        dist.destroy_process_group()


def first_line(error):
    """Returns the first line of an exception's message, or its type's name. A library's errors can run to pages."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def exit_on_user_error(fn, *args):
    """Runs main and prints a UserError in one line, with exit code 2. Under torchrun it then leaves by os._exit,
    however main ended, since the interpreter's teardown would destroy the groups that leave_together holds."""
    distributed, result = int(os.environ.get("WORLD_SIZE", "1")) > 1, None
    try:
        result, code = fn(*args), 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C before training, or a second Ctrl-C during it; see stop_on_signals
        print("stopped at once by Ctrl-C; --resume continues from the last checkpoint, if any", file=sys.stderr)
        code = 128 + signal.SIGINT
    except BaseException as e:  # exit_stopped's code 130 or 143, or a bug
        if not distributed:
            raise
        code = e.code if isinstance(e, SystemExit) else traceback.print_exc() or 1
    if distributed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
    return result


def agreed(check):
    """Returns check()'s result on every rank, or raises the first failing rank's error on all, so none hangs."""
    try:
        result, error = check(), None
    except Exception as e:
        result, error = None, e
    if dist.is_initialized():
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(
            verdicts,
            None
            if error is None
            else str(error)
            if isinstance(error, UserError)
            else f"rank {dist.get_rank()}: {type(error).__name__}: {first_line(error)}",
        )
        first = next((v for v in verdicts if v is not None), None)
        if error is None and first is not None:
            raise UserError(first)
    if error is not None:
        raise error
    return result


def load_pretrained(loader, name, flag, **kwargs):
    """Returns loader.from_pretrained(name), or its base model's for a peft adapter. An error names the flag."""
    own_tokenizer = loader.__name__ == "AutoTokenizer" and os.path.exists(os.path.join(name, "tokenizer_config.json"))
    name = name if own_tokenizer else adapter_base(name) or name
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{flag} {name}: cannot load it ({first_line(e)[:200]}); pass a local model folder or a hub name"
        ) from None


def check_source(name, flag, repo_type="model"):
    """Checks that a model or dataset exists, as a path, in a cache or on the hub, before any model loads."""
    if name.startswith("embedded") or os.path.exists(name):
        return
    import huggingface_hub

    missing = f"{flag} {name}: no such file or folder"
    if (
        not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)
        or name.startswith(".")
        or name.removesuffix(".gz").endswith(tuple(LOCAL_BUILDERS))
    ):  # a path, not a hub name
        raise UserError(f"{missing}; check the path")
    if os.path.isdir(os.path.join(huggingface_hub.constants.HF_HUB_CACHE, f"{repo_type}s--{name.replace('/', '--')}")):
        return
    if repo_type == "dataset":  # offline clusters prepare a dataset once, into the cache of `datasets`
        from datasets.naming import camelcase_to_snakecase

        *owner, last = name.split("/")
        if os.path.isdir(
            os.path.join(hf_datasets().config.HF_DATASETS_CACHE, "___".join([*owner, camelcase_to_snakecase(last)]))
        ):
            return
    if huggingface_hub.is_offline_mode():
        raise UserError(f"{missing}, and not in the hub cache (HF_HUB_OFFLINE is set); pass a local path")
    try:
        exists = huggingface_hub.repo_exists(name, repo_type=repo_type)
    except Exception as e:  # no network; transformers would retry for half a minute, then say the same
        raise UserError(
            f"{missing}, and the hub is unreachable ({first_line(e)}); pass a local path, or set "
            "HF_HUB_OFFLINE=1 to read the hub cache"
        ) from None
    if not exists:
        raise UserError(
            f"{missing}, nor a {repo_type} on the hub (or a private one your token cannot read); pass a "
            "local path or a hub name"
        )


def seed_of(*keys):
    """Hashes keys such as seed, "prompt order" and epoch into a stream's seed, so seed s + 1 never replays seed s."""
    return int(
        np.random.SeedSequence(
            [k if isinstance(k, int) else int.from_bytes(k.encode(), "little") for k in keys]
        ).generate_state(1, np.uint64)[0]
        >> 1
    )


# ---------------------------------------------------------------------------------------------------------------------
# The embedded task needs no download. A user asks about a topic, names one or two of its words as examples, and may
# name another topic to avoid. A response is a few words. Its gold reward is known exactly for any prompt and response,
# and it depends on the topic avoided as well as the topic asked, so a reward model and a policy must read the prompt.
# A small transformer learns it. A policy can raise it or overoptimize a proxy (benchmarks/overoptimization.py).

TOPICS = {
    "animals": "cat dog horse fox owl bear wolf deer frog duck goat lion".split(),
    "colors": "red blue green black white pink gray gold teal cyan amber violet".split(),
    "foods": "bread rice soup cake apple pear plum corn bean salad cheese honey".split(),
    "places": "city lake hill river beach forest farm town island valley desert harbor".split(),
}
AVOIDED = {"animals": "animal", "colors": "color", "foods": "food", "places": "place"}  # a topic's name to avoid it
TOPIC_NAMED = {name: t for t, name in AVOIDED.items()}
WORDS = [w for ws in TOPICS.values() for w in ws]
TOPIC_OF = {w: t for t, ws in TOPICS.items() for w in ws}
# A prompt: an opening, the asked topic, an example clause, and an avoid clause naming another topic, or none.
OPENINGS = ["tell me about", "name some", "talk about"]
EXAMPLE_CLAUSES = ["such as", "like", "including"]
AVOID_CLAUSES = ["but not", "without", "except"]
SPECIAL = ["<pad>", "<unk>", "<bos>", "<eos>"]
TEMPLATE = [
    "User:",
    "Assistant:",
    "tell",
    "me",
    "about",
    "such",
    "as",
    "user:",
    "assistant:",
    "system:",
    "name",
    "some",
    "talk",
    "like",
    "including",
    "and",
    "but",
    "not",
    "without",
    "except",
] + list(AVOIDED.values())
PREFERENCE_BETA = 3.0  # the task's Bradley-Terry model: P(a preferred) = sigmoid(beta * (gold_a - gold_b))
_values = random.Random(1234)
WORD_VALUE = {w: round(_values.gauss(0.0, 1.0), 3) for w in WORDS}
TOPIC_BONUS = 1.0  # added to a word of the asked topic
NON_WORD_VALUE = -3.0  # the value of a template, special or unknown token, and of a word of the avoided topic
REPEAT_VALUE = -1.0  # the value of a word said again, whatever the word
MIN_WORDS, MAX_WORDS = 3, 10
# The splits. Prompts that ask about OOD_PAIR[0] and avoid OOD_PAIR[1] are the out-of-distribution split, `ood`:
# both topics occur in training in both roles, but never this pair. The other prompts fall in train, validation or
# test by a hash of their text.
OOD_PAIR = ("places", "foods")
EMBEDDED_SPLITS = {"train": 0, "test": 1, "validation": 2, "ood": 3}  # the seed of each split's pairs
EMBEDDED_PAIRS = {"train": 40000, "test": 4000, "validation": 4000, "ood": 4000}  # pairs in each split


def embedded_tokenizer():
    """Returns a word-level tokenizer over the task's words, built locally. It is saved beside every model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(SPECIAL + TEMPLATE + list(TOPICS) + WORDS)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tok


def embedded_model_config(name, vocab_size, num_labels=None, flag="--model_name_or_path"):
    """Returns a tiny Llama- or GPT-NeoX-shaped config, so both code paths run offline. flag is the model's option."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=False,
    )
    if name not in ("embedded-llama", "embedded-neox"):
        raise UserError(f"{flag} {name}: unknown embedded model; use embedded-llama or embedded-neox")
    cfg = (
        transformers.LlamaConfig(num_key_value_heads=4, **common)
        if name == "embedded-llama"
        else transformers.GPTNeoXConfig(use_parallel_residual=True, rotary_pct=0.25, **common)
    )
    cfg.num_labels = num_labels or cfg.num_labels
    return cfg


def prompt_parts(prompt):
    """Returns the asked topic and the avoided topic of a prompt, each None if it names none."""
    words = prompt.split()
    asked = next((w for w in words if w in TOPICS), None)
    avoided = next((TOPIC_NAMED[w] for w in words if w in TOPIC_NAMED), None)
    return asked, avoided


def prompt_split(text):
    """Returns the split a prompt text belongs to: ood for the held-out pair of topics, else by a hash of the text."""
    if prompt_parts(text) == OOD_PAIR:
        return "ood"
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") % 10
    return "validation" if bucket == 0 else "test" if bucket == 1 else "train"


def embedded_prompt(rng, split="train"):
    """Draws a prompt of the split: a topic, one or two of its words as examples, and a quarter of the time none to
    avoid, else one of the three other topics."""
    while True:
        asked = OOD_PAIR[0] if split == "ood" else rng.choice(list(TOPICS))
        avoided = OOD_PAIR[1] if split == "ood" else rng.choice([None] + [t for t in TOPICS if t != asked])
        examples = " and ".join(rng.sample(TOPICS[asked], rng.randint(1, 2)))
        avoid = f" {rng.choice(AVOID_CLAUSES)} {AVOIDED[avoided]}" if avoided else ""
        text = f"User: {rng.choice(OPENINGS)} {asked} {rng.choice(EXAMPLE_CLAUSES)} {examples}{avoid} Assistant:"
        if prompt_split(text) == split:
            return text


def gold_reward(prompt, response):
    """Returns the mean over the response's words of each word's value.

    A word's value is its hidden value, plus 1 if of the asked topic. A word of the avoided topic is worth -3, as a
    non-word. A word said again is worth -1, below the initial policy's mean gold of about -0.2. Repeats change a pair's
    gold little, so a reward model learns them last. A policy that repeats the words a proxy likes then lowers the gold
    below what it had reached: the proxy rewards a direction the gold does not (Gao et al. 2022, sec. 4)."""
    asked, avoided = prompt_parts(prompt)
    words = [w for w in response.split() if w != "<eos>"]
    if not words:
        return NON_WORD_VALUE
    vals = [
        REPEAT_VALUE
        if w in words[:i]
        else NON_WORD_VALUE
        if w not in WORD_VALUE or TOPIC_OF[w] == avoided
        else WORD_VALUE[w] + TOPIC_BONUS * (TOPIC_OF[w] == asked)
        for i, w in enumerate(words)
    ]
    return sum(vals) / len(vals)


def gold_rewards(prompts, responses):
    """Returns the gold rewards, a reward function for PPO against the truth (`--reward_fn common:gold_rewards`)."""
    return [gold_reward(p, r) for p, r in zip(prompts, responses)]


def embedded_response(rng):
    return " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS)))


@functools.cache
def embedded_split(split):
    """Returns one split's pairs, drawn once in a process: each split is the same every time it is read."""
    return tuple(embedded_pairs(EMBEDDED_PAIRS[split], EMBEDDED_SPLITS[split], split))


def embedded_pairs(n, seed, split="train"):
    """Returns n pairs of the split labelled by the gold reward's Bradley-Terry model. Their gold values give the
    Bayes-optimal accuracy."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt = embedded_prompt(rng, split)
        a, b = embedded_response(rng), embedded_response(rng)
        ga, gb = gold_reward(prompt, a), gold_reward(prompt, b)
        if rng.random() >= 1 / (1 + math.exp(-PREFERENCE_BETA * (ga - gb))):
            a, b, ga, gb = b, a, gb, ga
        rows.append({"prompt": prompt, "chosen": a, "rejected": b, "gold_chosen": ga, "gold_rejected": gb})
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Preference data in explicit, implicit or conversational format, from the hub, a file, a folder or the embedded task.

LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def mixture(mixer):
    """Returns open-instruct's dataset mixer, --dataset_mixer_list's [name, weight, ...], as [(name, weight), ...]."""
    if len(mixer) % 2:
        raise UserError("--dataset_mixer_list: expected pairs of NAME WEIGHT, e.g. 'data.jsonl 1.0 other 500'")
    for name, weight in zip(mixer[::2], mixer[1::2]):
        if not 0 < as_number(weight) < math.inf:
            raise UserError(f"--dataset_mixer_list: weight {weight!r} of {name} must be a number above 0")
    return [(name, float(weight)) for name, weight in zip(mixer[::2], mixer[1::2])]


def load_rows(name, config=None, split="train"):
    """Returns one split's rows, or None if there is none. Each row names its `_source` and its `_row` or `_line`."""
    if name == "embedded":  # four splits, each drawn with its own seed
        if split not in EMBEDDED_SPLITS:
            return None
        return [dict(r, _source=name, _row=i) for i, r in enumerate(embedded_split(split))]
    ext = os.path.splitext(name.removesuffix(".gz"))[1]
    try:
        if os.path.isdir(name):
            return load_folder(name, config, split)
        if ext in LOCAL_BUILDERS:
            if not os.path.exists(name):
                raise UserError(f"{name}: file not found; pass an existing .jsonl/.json/.parquet/.csv(.gz) path")
            if split != "train":
                return None  # a single file has one split, and the caller holds out an eval fraction
            if ext == ".jsonl":  # read here, so errors name the line and no Arrow cache lands beside the user's data
                return read_jsonl(name)
            rows = hf_datasets().load_dataset(LOCAL_BUILDERS[ext], data_files=name, split="train")
            return [
                dict(r, _source=name, _row=i, **({"_line": i + 2} if ext == ".csv" else {}))  # after the header
                for i, r in enumerate(rows)
            ]
        if split not in hf_datasets().get_dataset_split_names(name, config):
            return None
        return [
            dict(r, _source=name, _row=i) for i, r in enumerate(hf_datasets().load_dataset(name, config, split=split))
        ]
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"{name}: cannot load dataset ({first_line(e)}); check the name, config and file format"
        ) from None


def hold_out(keys, fraction, seed):
    """Returns the keys held out for evaluation, given one key per row. Whole keys are drawn by seed until their rows
    make up `fraction` of the rows, and at least one. Every row of a held key is held, so a repeated prompt is never
    both trained on and evaluated. rm.py holds out pairs by prompt, and ppo.py holds out prompts by their text."""
    order, size = list(dict.fromkeys(keys)), collections.Counter(keys)
    random.Random(seed).shuffle(order)
    before = itertools.accumulate((size[k] for k in order), initial=0)  # rows held before each key in turn
    return {k for k, n in zip(order, before) if n < max(1, int(len(keys) * fraction))}


def hf_datasets():
    """Returns the `datasets` library, progress bars off. It is imported only when needed: it costs 90 MB a process."""
    import datasets

    datasets.disable_progress_bars()
    return datasets


def load_folder(path, config, split):
    """Returns one split's rows of a folder, or None. It may be from save_to_disk, a hub clone, or of split files."""
    datasets = hf_datasets()
    if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
        ds = datasets.load_from_disk(path)
        ds = ds.get(split) if isinstance(ds, datasets.DatasetDict) else ds if split == "train" else None
        return None if ds is None else [dict(r, _source=path, _row=i) for i, r in enumerate(ds)]
    top = [
        f
        for f in sorted(os.listdir(path))
        if os.path.isfile(os.path.join(path, f)) and os.path.splitext(f.removesuffix(".gz"))[1] in LOCAL_BUILDERS
    ]
    if any(f.split(".")[0] in ("train", "test", "validation", split) for f in top):  # subfolders may hold outputs
        return next((load_rows(os.path.join(path, f)) for f in top if f.split(".")[0] == split), None)
    # A README.md with `configs:` names the files. Otherwise the usual patterns apply, such as data/train-*.
    files = {str(k): v for k, v in (datasets.load_dataset_builder(path, config).config.data_files or {}).items()}
    return [row for f in files[split] for row in load_rows(str(f))] if split in files else None


def split_names(name, config=None):
    """Returns the splits a dataset has, as load_rows finds them. An error names them when a split is missing."""
    if name == "embedded":
        return list(EMBEDDED_SPLITS)
    if not os.path.isdir(name):  # a local file has one split; else a hub dataset
        return (
            ["train"]
            if os.path.splitext(name.removesuffix(".gz"))[1] in LOCAL_BUILDERS
            else hf_datasets().get_dataset_split_names(name, config)
        )
    if os.path.exists(os.path.join(name, "dataset_dict.json")) or os.path.exists(os.path.join(name, "state.json")):
        ds = hf_datasets().load_from_disk(name)
        return list(ds) if isinstance(ds, hf_datasets().DatasetDict) else ["train"]
    top = [
        f.split(".")[0]
        for f in sorted(os.listdir(name))
        if os.path.splitext(f.removesuffix(".gz"))[1] in LOCAL_BUILDERS and os.path.isfile(os.path.join(name, f))
    ]
    if any(t in ("train", "test", "validation") for t in top):  # split files at the top, as load_folder reads them
        return top
    return [str(k) for k in hf_datasets().load_dataset_builder(name, config).config.data_files or {}]


def read_jsonl(path):
    rows = []
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        for line_number, raw in enumerate(f, 1):  # as an editor numbers lines, blank ones included
            where = f"{path}: line {line_number}"
            try:  # the byte-order mark some Windows tools write is not part of the first row
                line = (raw.removeprefix(codecs.BOM_UTF8) if line_number == 1 else raw).decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{where}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not valid JSON ({e.msg}); fix or remove that line") from None
            if not isinstance(value, dict):
                raise UserError(
                    f"{where}: a JSON {type(value).__name__} is not a row; each line must be an object, "
                    'e.g. {"prompt": ..., "chosen": ..., "rejected": ...}'
                )
            rows.append(dict(value, _source=path, _row=len(rows), _line=line_number))
    return rows


def where(row):
    """Returns 'file: line N' for JSON lines and CSV, else 'dataset: row N', to name a row in error messages."""
    return f"{row['_source']}: " + (f"line {row['_line']}" if "_line" in row else f"row {row['_row']}")


def as_number(value):
    """Returns float(value) of a number or of text that reads as one, such as a CSV cell, else NaN."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def shared_prefix_split(a, b):
    """Splits an implicit pair at the longest common prefix that ends before a space. Responses start with a space."""
    i = max(0, min(len(os.path.commonprefix([a, b])), len(a) - 1, len(b) - 1))
    while i > 0 and not (a[i].isspace() and b[i].isspace()):
        i -= 1
    while i > 0 and a[i - 1].isspace():  # a run of whitespace belongs to the responses
        i -= 1
    return a[:i], a[i:], b[i:]


ROLES = {"system", "user", "assistant", "tool", "developer"}
ROLE_ALIASES = {"human": "user", "gpt": "assistant"}  # ShareGPT's names for the same turns
_RENDERED_ROLES = {}  # whether a tokenizer's chat template renders a role, by (id(tokenizer), role)


def renders_role(tokenizer, role):
    """Returns whether the chat template writes a message of this role, alone or after a user turn, or drops it."""
    if (id(tokenizer), role) not in _RENDERED_ROLES:
        mark, shown = "\u2042probe\u2042", False
        for context in ([], [{"role": "user", "content": "hi"}]):
            with contextlib.suppress(Exception):
                shown |= mark in tokenizer.apply_chat_template(
                    context + [{"role": role, "content": mark}], tokenize=False
                )
        _RENDERED_ROLES[(id(tokenizer), role)] = shown
    return _RENDERED_ROLES[(id(tokenizer), role)]


def checked_messages(messages, tokenizer, where, field):
    """Returns a row's messages checked, ShareGPT's roles renamed. A role the chat template would drop is refused."""
    if not isinstance(messages, list):
        raise UserError(f"{where}: field '{field}' is {type(messages).__name__}; expected a list of messages")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(
                f"{where}: field '{field}', message {k}: expected {{'role': text, 'content': text}}, got {str(m)[:60]}"
            )
    messages = [dict(m, role=ROLE_ALIASES.get(m["role"], m["role"])) for m in messages]
    for k, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise UserError(
                f"{where}: field '{field}', message {k}: role {m['role']!r} is not one of "
                f"{', '.join(sorted(ROLES))} (or ShareGPT's human, gpt); rename it"
            )
        if not renders_role(tokenizer, m["role"]):
            raise UserError(
                f"{where}: field '{field}', message {k}: role {m['role']!r} is not one the chat template "
                "renders (the message would be dropped); use the roles the template knows, e.g. "
                "'system', 'user', 'assistant'"
            )
    return messages


def render_chat(tokenizer, messages, where, generation_prompt=False):
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:
        raise UserError(f"{where}: the chat template cannot render these messages ({first_line(e)})") from None


def split_pair(row, tokenizer, where):
    """Returns the prompt, chosen and rejected text of one row in any supported format. `where` names the row."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object with 'chosen' and 'rejected', got {type(row).__name__}")
    for field in ("chosen", "rejected"):
        if row.get(field) is None:
            raise UserError(f"{where}: field '{field}' is missing; every row needs 'chosen' and 'rejected'")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, list) or isinstance(rejected, list):  # conversational: lists of {role, content}
        if isinstance(prompt, str):  # a text prompt before message responses is the user's turn
            prompt = [{"role": "user", "content": prompt}]
        chosen, rejected = (
            checked_messages(v, tokenizer, where, f) for v, f in ((chosen, "chosen"), (rejected, "rejected"))
        )
        prompt = checked_messages(prompt, tokenizer, where, "prompt") if prompt else prompt
        if not prompt:  # the messages both share are the prompt
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        p = render_chat(tokenizer, prompt, where, generation_prompt=True)  # as ppo.py renders it, so tokens match
        full = [render_chat(tokenizer, prompt + m, where) for m in (chosen, rejected)]
        if all(f.startswith(p) for f in full):
            return p, full[0][len(p) :], full[1][len(p) :]
        return shared_prefix_split(*full)
    for field, value in (("chosen", chosen), ("rejected", rejected), ("prompt", prompt)):
        if value is not None and not isinstance(value, str):
            raise UserError(f"{where}: field '{field}' is {type(value).__name__}; expected text or a list of messages")
    return (prompt, chosen, rejected) if prompt is not None else shared_prefix_split(chosen, rejected)


# ---------------------------------------------------------------------------------------------------------------------
# Tokens. A prompt is a tokenizer's leading special tokens, such as BOS, then the text's tokens, never trailing ones.


def special_affixes(tokenizer):
    """Returns the special token ids the tokenizer's post-processor writes before and after a text."""
    plain = tokenizer("a b", add_special_tokens=False)["input_ids"]
    if not plain:  # e.g. a word-level tokenizer saved beside a Qwen2 config, loaded by AutoTokenizer as Qwen2Tokenizer
        raise UserError(
            f"tokenizer {tokenizer.name_or_path!r} ({type(tokenizer).__name__}) gives no tokens for the "
            "text 'a b': it is loaded as the wrong class; name its class in tokenizer_config.json"
        )
    full = tokenizer("a b", add_special_tokens=True)["input_ids"]
    k = next((k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain), None)
    return ([], []) if k is None else (full[:k], full[k + len(plain) :])


def leading_id(tokenizer):
    """Returns the special token a prompt starts with, such as BOS or [CLS], or None. Truncation keeps it."""
    return next(iter(special_affixes(tokenizer)[0]), None)


def end_id(tokenizer):
    """Returns the token that ends a text. That is EOS, or for an encoder without one, the separator it appends."""
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    if not (suffix := special_affixes(tokenizer)[1]):
        raise UserError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to end a response with; set eos_token")
    return suffix[-1]


def tokenize_prompts(tokenizer, texts):
    prefix = special_affixes(tokenizer)[0]
    lead = tokenizer.decode(prefix) if prefix else None  # chat templates often write BOS as text; never add it twice
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    return [x if lead and t.startswith(lead) else prefix + x for t, x in zip(texts, ids)]


def tokenize_responses(tokenizer, prompts, responses):
    """Returns response ids tokenized after their prompt, as the policy writes them, each ending at one end token.
    Every token is kept, an end token inside a response too, such as a multi-turn answer's. The end token is appended
    unless the response ends with one; only whitespace after it, a chat template's newline, is dropped."""
    if not responses:
        return []
    end = end_id(tokenizer)
    joint, alone_p, alone_r = (
        tokenizer(texts, add_special_tokens=False)["input_ids"]
        for texts in ([p + r for p, r in zip(prompts, responses)], list(prompts), list(responses))
    )
    out = [j[len(p) :] if j[: len(p)] == p and len(j) > len(p) else r for j, p, r in zip(joint, alone_p, alone_r)]
    last = [len(x) - 1 - x[::-1].index(end) if end in x else None for x in out]
    return [
        x[: k + 1] if k is not None and not tokenizer.decode(x[k + 1 :]).strip() else x + [end]
        for x, k in zip(out, last)
    ]


UNKNOWN_SHARE = 0.5  # Measured (benchmarks/README.md): English is 95-96% unknown to the embedded tokenizer


def check_vocabulary(tokenizer, ids, data, model, flag):
    """Refuses a tokenizer that does not cover the data. A model learns nothing from unknown tokens, yet exits 0."""
    sample = ids[:: max(1, len(ids) // 2000)]
    n_tokens = sum(map(len, sample))
    if tokenizer.unk_token_id is None or not n_tokens:  # byte-level tokenizers have no unknown token
        return
    share = sum(x.count(tokenizer.unk_token_id) for x in sample) / n_tokens
    if share > UNKNOWN_SHARE:
        raise UserError(
            f"{data}: {share:.0%} of its tokens are {tokenizer.unk_token} to {model}'s tokenizer, which "
            f"does not cover this data; pass {flag} a model whose tokenizer does (e.g. a hub model trained "
            "on such text)"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Models. Scalar heads compute in float32, attention never gives NaN, and lengths fit the declared positions.


class Float32Linear(torch.nn.Linear):
    """Computes in float32 whatever autocast asks. Bfloat16 rewards move in steps of 1/128 their size, so pairs tie."""

    def forward(self, x):
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


def scalar_head_in_float32(model):
    """Returns the model with its head computed in float32. The head is `score` or `classifier`'s last linear layer."""
    head = getattr(model, "score", None)
    if head is None and hasattr(model, "classifier"):
        head = [m for m in model.classifier.modules() if isinstance(m, torch.nn.Linear)][-1]
    if type(head) is torch.nn.Linear:
        head.__class__ = Float32Linear
    return model


def attention_without_nan(device):
    """Makes attention never give NaN. transformers' SDPA mask is patched globally to let each position see itself,
    as real tokens do already. Else left padding sees no real key, some kernels answer NaN, and 0 x NaN reaches real
    tokens. cuDNN's SDPA is off: with a boolean mask its backward gives NaN at some lengths (pytorch #196678)."""

    def sdpa_mask_with_diagonal(*args, q_offset=0, kv_offset=0, **kwargs):
        mask = transformers.masking_utils.sdpa_mask(*args, q_offset=q_offset, kv_offset=kv_offset, **kwargs)
        if not torch.is_tensor(mask):  # None means no mask is needed (is_causal)
            return mask
        q = torch.arange(mask.shape[-2], device=mask.device) + q_offset
        kv = torch.arange(mask.shape[-1], device=mask.device) + kv_offset
        return mask | (q[:, None] == kv[None, :])

    transformers.AttentionMaskInterface.register("sdpa", sdpa_mask_with_diagonal)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


# The config keys that declare a model's positions, by family: most, GPT-2 and Jais, Falcon's old configs, ChatGLM and
# Qwen 1, MPT, and GPT-2's old configs.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len", "n_ctx")


def declared_positions(config):
    """Returns (the positions a model's config declares, the key that declares them), or (None, None) where none does.
    A learned table (GPT-2, OPT, BERT) has that many rows; a rotary or ALiBi model was trained to that length. A RoPE
    scaling factor stretches the limit, over the original length where the config gives one."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    key = next((k for k in POSITION_KEYS if isinstance(getattr(config, k, None), int) and getattr(config, k) > 0), None)
    if key is None:
        return None, None
    limit, rope = getattr(config, key), getattr(config, "rope_parameters", None) or {}
    for p in [rope] if "rope_type" in rope else [v for v in rope.values() if isinstance(v, dict)]:
        if p.get("rope_type", "default") != "default" and isinstance(p.get("factor"), int | float):
            limit = max(limit, int(p["factor"] * (p.get("original_max_position_embeddings") or limit)))
    return limit, getattr(config, "attribute_map", {}).get(key, key)  # GPT-2 stores n_positions


def position_table(model):
    """Returns the positions a model declares, learned, rotary or ALiBi, or None where its config declares none."""
    return declared_positions(model.config)[0]


def check_position_table(model, length, flag):
    """Refuses a given length past the model's positions now, rather than as an index error or a silent failure
    later."""
    limit, key = declared_positions(model.config)
    if limit and length > limit:
        raise UserError(
            f"{flag}: {length} tokens, but {model.config.name_or_path or 'the model'} declares {limit} positions "
            f"({key} in its config); pass at most {limit}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# LoRA (Hu et al. 2021) through peft, and loading models whole or on the meta device.


def add_lora(model, args, task_type):
    """Adds LoRA adapters on the backbone's linear layers in place, and returns the peft model. A classifier's head
    trains in full beside them. Only these train, in float32. The model keeps its class and forward."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    # No dropout here or anywhere, so rollout and learning, or a pair's two passes, read one network.
    config = LoraConfig(
        task_type=task_type,
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
    )
    try:
        with warnings.catch_warnings():  # peft calls a transformers method deprecated in v5
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            peft_model = get_peft_model(model, config)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise UserError(
            f"--lora_target_modules {' '.join(targets)}: peft cannot put LoRA adapters on "
            f"{type(model).__name__} ({first_line(e)[:200]}); name its linear layers, or pass --lora_r "
            "0"
        ) from None
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return peft_model


def save_lora(model, peft_model, state_dict, tokenizer, output_dir):
    """Saves the adapter in output_dir/adapter. Returns the model with it merged in, which loads without peft."""
    from peft import get_peft_model

    plain = meta_model(lambda: type(model)(model.config))  # no weights allocated; the state dict's are assigned
    template = get_peft_model(plain, copy.deepcopy(peft_model.peft_config["default"]))
    plain.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}, assign=True)
    plain.tie_weights()  # assigned tensors are separate, so a tied output layer is tied to the embedding again
    save_pretrained_atomic(template, tokenizer, os.path.join(output_dir, "adapter"))
    return template.merge_and_unload()


def adapter_base(name):
    """Returns the base model of a peft adapter folder, or None for a model. An adapter folder has no config.json."""
    path = os.path.join(name, "adapter_config.json")
    if not os.path.exists(path) or os.path.exists(os.path.join(name, "config.json")):
        return None
    with open(path) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base or base.startswith("embedded-"):
        raise UserError(
            f"{name}: an adapter of {base or 'an unnamed base'}, a model built at random in its run: load "
            "the merged model saved beside it (its parent folder)"
        )
    return base


def adapter_holds_head(name):
    """Returns whether a peft adapter folder holds a classifier head's weights, as rm.py's do (modules_to_save)."""
    from peft.utils import load_peft_weights

    return any(".score." in k or ".classifier." in k for k in load_peft_weights(name, device="cpu"))


def load_model(loader, name, flag, on_meta=False, **kwargs):
    """Returns loader.from_pretrained(name), or for a peft adapter folder, its base model with the adapter merged in
    and the reward normalization rm.py saved beside it. With on_meta, the model is built from its config on the meta
    device, reading no weight, for FSDP's ranks other than 0. shard_from_rank0 then gives them rank 0's weights."""
    from peft import PeftConfig, PeftModel

    if on_meta and not adapter_base(name):
        config = kwargs.get("config") or load_pretrained(transformers.AutoConfig, name, flag)
        return meta_model(lambda: loader.from_config(config, dtype=kwargs.get("dtype")))
    model = load_pretrained(loader, name, flag, **kwargs)
    if adapter_base(name):
        vocab = len(load_pretrained(transformers.AutoTokenizer, name, flag))  # with a pad token added in training
        if vocab > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(vocab, mean_resizing=False)
        config = PeftConfig.from_pretrained(name)
        if config.task_type == "CAUSAL_LM" and not model.can_generate():  # an SFT adapter on a classifier's backbone
            config.task_type = None  # its layers' adapters merge, and the classifier keeps its own new head
        model = PeftModel.from_pretrained(model, name, config=config).merge_and_unload()
        model.requires_grad_(True)  # peft loads an adapter frozen, for inference; the merged model trains whole
        if os.path.exists(norm := os.path.join(name, "reward_normalization.json")):
            with open(norm) as f:
                model.config.update(json.load(f))
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Logging to stdout through tqdm, to metrics.jsonl, and optionally to Weights & Biases and TensorBoard.


def open_log(path, resume_step=None):
    """Opens path to append. A new run empties it. A resumed run drops the lines after its step, to be redone."""
    kept = []
    if resume_step is not None and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line).get("step", 0) <= resume_step]
    write_atomic(path, "".join(kept))
    return open(path, "a")


class Logger:
    """Writes the same metrics to metrics.jsonl, Weights & Biases (--track) and TensorBoard (--tensorboard)."""

    def __init__(self, args, project, resume_step=None):
        os.makedirs(args.output_dir, exist_ok=True)
        if args.overwrite_output_dir:  # the replaced run's checkpoints go, so --resume never finds them
            shutil.rmtree(os.path.join(args.output_dir, "checkpoints"), ignore_errors=True)
        self.file = open_log(os.path.join(args.output_dir, "metrics.jsonl"), resume_step)
        self.wandb = self.tensorboard = None
        if args.track:
            import wandb

            self.wandb = wandb.init(
                project=project, name=args.run_name, config=dataclasses.asdict(args), dir=args.output_dir
            )
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(
                os.path.join(args.output_dir, "tensorboard"),
                purge_step=None if resume_step is None else resume_step + 1,
            )

    def log(self, metrics):
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        scalars = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}
        if self.wandb:
            self.wandb.log(scalars, step=metrics["step"])
        for k, v in scalars.items() if self.tensorboard else ():
            self.tensorboard.add_scalar(k, v, metrics["step"])

    def close(self):
        for closer in (self.file, self.wandb and self.wandb.finish, self.tensorboard):
            closer and (closer() if callable(closer) else closer.close())


def format_metrics(m):
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


# ---------------------------------------------------------------------------------------------------------------------
# A run's life in its --output_dir: its start, its resumption, and its stop on a signal.


def finished_progress(output_dir):
    """Returns the last step logged in output_dir's metrics.jsonl, or None."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return max((json.loads(line).get("step", 0) for line in f), default=0)


def check_output_dir(args, rank):
    """Refuses to continue or replace a finished run or checkpoints in --output_dir unless asked."""
    logged = finished_progress(args.output_dir) is not None
    held = (
        "a finished run"
        if logged and os.path.exists(os.path.join(args.output_dir, "config.json"))
        else "checkpoints"
        if latest_checkpoint(args.output_dir)
        else "a run's log"
        if logged
        else None
    )
    if args.resume and args.overwrite_output_dir:
        raise UserError("--resume continues the run in --output_dir and --overwrite_output_dir replaces it: pass one")
    if held and not (args.resume or args.overwrite_output_dir):
        raise UserError(
            f"--output_dir {args.output_dir} holds {held}: pass --resume to continue it, "
            "--overwrite_output_dir to replace it, or another --output_dir"
        )
    if args.resume and held is None and rank == 0:
        print(f"--resume: no checkpoint in {args.output_dir}; starting from the first step")


def run_complete(args, total, rank):
    """Returns whether --resume finds the run in output_dir logged to step `total` and saved, with nothing to do."""
    logged = finished_progress(args.output_dir) if args.resume else None
    if logged is None or logged < total or not os.path.exists(os.path.join(args.output_dir, "config.json")):
        if logged and latest_checkpoint(args.output_dir) is None:  # step 0, an evaluation, is redone
            raise UserError(
                f"--resume: {args.output_dir} holds a run logged to step {logged} and no checkpoint to "
                f"continue it to step {total}; pass --overwrite_output_dir to train afresh, or another "
                "--output_dir"
            )
        return False
    if rank == 0:
        print(f"{args.output_dir}: the run is complete (step {logged} of {total}); nothing to do")
    if dist.is_initialized():
        dist.destroy_process_group()
    return True


STOP = {}  # the signal that asked this process to stop at the next step boundary; see stop_on_signals
SAVE_EVERY_S = 1800  # without --save_steps, a checkpoint every 30 minutes of training


def stop_on_signals(enabled=True):
    """Makes SIGINT and SIGTERM, preemption's notice, end the run at the next step with a checkpoint. A second SIGINT
    stops it at once. enabled=False restores the handlers from before."""
    if not enabled:
        for s, handler in STOP.pop("previous", {}).items():
            signal.signal(s, handler)
        return

    def ask(signum, frame):
        if "signal" in STOP:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return  # a second SIGTERM, since a scheduler and torchrun may both send one
        STOP["signal"] = signum
        if int(os.environ.get("RANK", 0)) == 0:  # a print could re-enter a write the signal interrupted
            os.write(
                2,
                f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint (Ctrl-C "
                "again to stop at once)\n".encode(),
            )

    STOP.pop("signal", None)  # "previous" keeps the first handlers if an earlier run here ended by an exception
    STOP.setdefault("previous", {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)})
    for s in STOP["previous"]:
        signal.signal(s, ask)


def step_end(step, save_steps, last_save, device):
    """Returns (save, stop), agreed by all ranks. Saves come on a stop and every save_steps steps or SAVE_EVERY_S."""
    due = step % save_steps == 0 if save_steps else save_steps is None and time.time() - last_save >= SAVE_EVERY_S
    flags = torch.tensor([float(due), float(STOP.get("signal", 0))], device=device)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0].item()) or flags[1].item() > 0, int(flags[1].item())


def exit_stopped(signum, step, args, rank, bar):
    """Says how to resume after a signal's checkpoint. Every rank exits with 128 + the signal, as a shell does."""
    bar.close()
    if rank == 0:
        print(
            f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved in {args.output_dir}: "
            "run the same command with --resume to continue",
            file=sys.stderr,
            flush=True,
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(128 + signum)


def check_shared_output_dir(output_dir, rank):
    """Checks that every rank reads back a token rank 0 writes into output_dir. Nodes must share the shards' folder."""
    if not dist.is_initialized():
        return
    path, token = os.path.join(output_dir, ".rank0"), [os.urandom(8).hex()]
    agreed(lambda: rank == 0 and (os.makedirs(output_dir, exist_ok=True) or write_atomic(path, token[0])))
    dist.broadcast_object_list(token, src=0)

    def read():
        with contextlib.suppress(OSError):
            with open(path) as f:
                if f.read() == token[0]:
                    return
        raise UserError(
            f"--output_dir {output_dir}: rank {rank} does not see the file rank 0 has just written there; "
            "every rank writes its shards of each checkpoint into this folder, so it must be one folder on "
            "a file system every node mounts (pass it as an absolute path)"
        )

    try:
        agreed(read)
    finally:
        if rank == 0:
            os.remove(path)


# ---------------------------------------------------------------------------------------------------------------------
# Saving. Files and checkpoints are written under a temporary name and renamed, so a crash leaves earlier saves whole
# and `latest` naming a complete one. Neither safetensors nor state.pt, read with weights_only, runs code on load.


def write_atomic(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def write_json_atomic(path, obj):
    write_atomic(path, json.dumps(obj, indent=2))


def save_figure(fig, path):
    import matplotlib.pyplot as plt

    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=100)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


WEIGHT_FILES = ("model.safetensors", "model-", "pytorch_model", "adapter_model")


def save_pretrained_atomic(model, tokenizer, output_dir, **kwargs):
    """Saves into a temporary folder, then moves it in over an earlier save, whose other weight files go."""
    tmp = os.path.join(output_dir, ".saving")
    os.makedirs(output_dir, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, **kwargs)
        tokenizer.save_pretrained(tmp)
    except (OSError, RuntimeError) as e:
        save_failed(e, tmp, output_dir, state_bytes(kwargs.get("state_dict") or model.state_dict()))
    new = set(os.listdir(tmp))
    for name in os.listdir(output_dir):
        if name.startswith(WEIGHT_FILES) and name not in new:
            os.remove(os.path.join(output_dir, name))
    for name in new:
        os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
    os.rmdir(tmp)


def state_bytes(obj):
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(state_bytes(v) for v in values)


def save_failed(error, partial, folder, needed):
    """Removes `partial`, the save's temporary folder if given, and raises error again. A full disk is one line."""
    if partial:
        shutil.rmtree(partial, ignore_errors=True)
    free = shutil.disk_usage(folder).free
    if free < needed * 1.1 or getattr(error, "errno", None) == 28 or "No space left" in str(error):  # ENOSPC
        raise UserError(
            f"{folder}: no room to save ({needed / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free); the "
            "partial files were removed and earlier saves are intact: free space or pass another "
            "--output_dir"
        ) from None
    raise error


def new_checkpoint_dir(output_dir, step):
    """Makes a new, empty root/NAME.tmp for this step's checkpoint and returns (root, NAME). NAME is always new."""
    root = os.path.join(output_dir, "checkpoints")
    name, n = f"step_{step:08d}", 1
    while os.path.exists(os.path.join(root, name)):  # a directory from an earlier run into the same output_dir
        name, n = f"step_{step:08d}_{n}", n + 1
    shutil.rmtree(os.path.join(root, name + ".tmp"), ignore_errors=True)
    os.makedirs(os.path.join(root, name + ".tmp"))
    return root, name


def commit_checkpoint(root, name, state, keep=2):
    """Writes state.pt beside the shards, renames NAME.tmp to NAME, and names it in `latest`. The newest `keep` stay."""
    tmp = os.path.join(root, name + ".tmp")
    try:
        with open(os.path.join(tmp, "state.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as a RuntimeError
        save_failed(e, tmp, root, state_bytes(state))

    def durable(folder):  # a renamed folder or new file in it is on disk before the next step
        fd = os.open(folder, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    durable(tmp)
    os.replace(tmp, os.path.join(root, name))
    durable(root)
    write_atomic(os.path.join(root, "latest"), name)
    durable(root)
    done = sorted(
        (d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp") and d != name),
        key=lambda d: os.path.getmtime(os.path.join(root, d)),
    )
    for old in done[: max(len(done) - (keep - 1), 0)]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def latest_checkpoint(output_dir):
    try:
        with open(os.path.join(output_dir, "checkpoints", "latest")) as f:
            return os.path.join(output_dir, "checkpoints", f.read().strip())
    except FileNotFoundError:
        return None


def load_latest_checkpoint(output_dir):
    path = latest_checkpoint(output_dir)
    return None if path is None else torch.load(os.path.join(path, "state.pt"), weights_only=True)


def sharded_state(model, optimizer):
    """Returns this rank's shards of weights and optimizer state by name, and the param_groups, kept in state.pt."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd["state"]}, optim_sd["param_groups"]


def save_training(model, optimizer, scheduler, step, rank, output_dir, global_batch, **extra):
    """Saves a checkpoint. Each rank writes its shards, and rank 0 the rest: schedule, progress, global_batch and every
    rank's random streams. A failure on any rank, such as a full disk, stops all and removes the partial checkpoint."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter, save
    from torch.distributed.checkpoint.api import CheckpointException

    tensors, param_groups = sharded_state(model, optimizer)
    where = [new_checkpoint_dir(output_dir, step) if rank == 0 else None]
    rngs = [
        {
            "python": random.getstate(),
            "torch": torch.get_rng_state(),  # cuda: this rank's device's
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }
    ]
    if dist.is_initialized():
        dist.broadcast_object_list(where, src=0)
        gathered = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(rngs[0], gathered, dst=0)
        rngs = gathered
    root, name = where[0]
    try:
        with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            save(
                tensors,
                storage_writer=HuggingFaceStorageWriter(os.path.join(root, name + ".tmp"), save_distributed=True),
            )
    except (Exception, CheckpointException) as e:  # a CheckpointException tells every rank of any rank's failure
        save_failed(e, rank == 0 and os.path.join(root, name + ".tmp"), root, state_bytes(tensors))
    agreed(
        lambda: (
            rank == 0
            and commit_checkpoint(
                root,
                name,
                {  # after every shard is written and fsynced
                    "optimizer_param_groups": param_groups,
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "global_batch": global_batch,
                    "rng": rngs,
                    **extra,
                },
            )
        )
    )


def resume_training(model, optimizer, scheduler, output_dir, args, world):
    """Restores the latest checkpoint in output_dir on any number of ranks. Returns its state, whose "step" is the next
    step, or None. Another global batch's checkpoint is refused, because its step would count other batches."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if (path := latest_checkpoint(output_dir)) is None:
        return None
    ckpt = load_latest_checkpoint(output_dir)
    other = getattr(args, "num_mini_batches", 1)  # ppo.py's mini-batches per update
    batch, saved = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * other * world,
        ckpt["global_batch"],
    )
    if batch != saved:
        keep = (
            f"--per_device_train_batch_size x --gradient_accumulation_steps = {saved // (other * world)} on "
            f"{world} rank{'s' * (world > 1)}"
            if saved % (other * world) == 0
            else f"a number of ranks that divides {saved // other}"
        )
        raise UserError(
            f"--resume: the checkpoint was trained in global batches of {saved}, this run's is {batch}; "
            f"resume with {keep} (or --overwrite_output_dir to train afresh)"
        )
    tensors, _ = sharded_state(model, optimizer)
    with warnings.catch_warnings():  # one process: "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
        load(tensors, storage_reader=HuggingFaceStorageReader(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=tensors["model"],
        optim_state_dict={"state": tensors["optimizer"], "param_groups": ckpt.pop("optimizer_param_groups")},
    )
    scheduler.load_state_dict(ckpt.pop("scheduler"))
    rngs, rank = ckpt.pop("rng"), dist.get_rank() if dist.is_initialized() else 0
    if rank < len(rngs):
        random.setstate(rngs[rank]["python"])
        torch.set_rng_state(rngs[rank]["torch"])
        if rngs[rank]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rngs[rank]["cuda"])
    return ckpt


# ---------------------------------------------------------------------------------------------------------------------
# Sharded loading with FSDP2 on several ranks, as torchtitan does it.


def meta_model(build):
    """Returns build() run on the meta device. The model has its parameters and modules, but no weight allocated."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build()


def shard_from_rank0(model, shard, device, host=False):
    """Shards model on every rank with shard(model) and broadcasts rank 0's weights into the shards. Rank 0 holds the
    whole model on its host, one model at a time, and the others a meta-device skeleton. Shards go on device, or in
    host memory for FSDP's CPU offload. Buffers the state dict lacks, such as RoPE's inverse frequencies, follow."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    weights, buffers = (model.state_dict(), dict(model.named_buffers())) if rank0 else ({}, {})
    on_meta = {}  # one meta parameter per parameter keeps tied ones tied, which Module.to("meta") would not
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = on_meta.setdefault(id(p), torch.nn.Parameter(p.to("meta"), p.requires_grad))
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to("meta")
    shard(model)
    model.to_empty(device="cpu" if host else device)
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():
        if rank0:
            buffer.copy_(buffers[name])
        dist.broadcast(buffer, 0)
    return model


def shard_input_embeddings(model, fully_shard, **options):
    """Shards the input embeddings as their own FSDP2 unit, unless an output layer shares their weight. A rank then
    holds a large vocabulary's whole table only for the lookup. Its gradient needs the ids, never the table."""
    hf = next(m for m in model.modules() if hasattr(m, "get_input_embeddings"))
    table, head = hf.get_input_embeddings(), getattr(hf, "get_output_embeddings", lambda: None)()
    if head is not None and head.weight is table.weight:
        return
    fully_shard(table, **options)
    # only a plain lookup; Gemma's scaled embedding multiplies its output by a constant after it
    if isinstance(table, torch.nn.Embedding) and [n for n, _ in table.named_parameters()] == ["weight"]:
        table.set_unshard_in_backward(False)


def peak_memory(device):
    """Returns memory/peak_gb_rank<r>, the most GB each rank has held so far on its GPU, or on CPU its peak RSS."""
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )  # ru_maxrss is in kilobytes on Linux
    peaks = torch.tensor([peak / 1e9], dtype=torch.float64, device=device)
    if dist.is_initialized():
        out = [torch.zeros_like(peaks) for _ in range(dist.get_world_size())]
        dist.all_gather(out, peaks)
        peaks = torch.cat(out)
    return {f"memory/peak_gb_rank{r}": v for r, v in enumerate(peaks.tolist())}
