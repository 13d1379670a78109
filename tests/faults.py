"""`python tests/faults.py rm.py|ppo.py --flags...` (alone or under torchrun): the script's command line, with faults
set by environment variables: STOP_AFTER_SAVE=N (every rank exits 3 right after step N's checkpoint), TRACE=PATH (each
rank appends the sampling seeds of its episodes, or its pairs, of each step to PATH.rank<R>), FULL_DISK_RANK=R (rank
R's checkpoint writer fails with ENOSPC), FULL_DISK_AT_END=R (rank R's final save_pretrained fails so)."""

import errno
import json
import os
import sys

import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import conftest  # noqa: E402,F401 (its ppo.Args: no evaluation unless asked)
import ppo  # noqa: E402
import rm  # noqa: E402

script, rank = {"rm.py": rm, "ppo.py": ppo}[os.path.basename(sys.argv[1])], os.environ.get("RANK", "0")


def patch(owner, name, wrap):
    setattr(owner, name, wrap(getattr(owner, name)))


def record(items):
    with open(f"{os.environ['TRACE']}.rank{rank}", "a") as f:
        f.write(json.dumps(items) + "\n")


if "STOP_AFTER_SAVE" in os.environ:

    def stop_after(save):
        def save_then_stop(*args, **kwargs):
            save(*args, **kwargs)
            if args[3] == int(os.environ["STOP_AFTER_SAVE"]):
                sys.exit(3)

        return save_then_stop

    patch(common, "save_training", stop_after)

if "TRACE" in os.environ:
    patch(
        ppo,
        "generate",
        lambda generate: (
            lambda model, query, query_mask, seeds, *args: (
                record(seeds.tolist()),
                generate(model, query, query_mask, seeds, *args),
            )[1]
        ),
    )
    patch(
        rm,
        "train_step",
        lambda step: (
            lambda model, micro_batches, *args: (
                record([[p["prompt"], p["chosen"], p["rejected"]] for mb in micro_batches for p in mb]),
                step(model, micro_batches, *args),
            )[1]
        ),
    )

if os.environ.get("FULL_DISK_RANK") == rank:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    def full_disk(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    HuggingFaceStorageWriter.write_data = full_disk

if os.environ.get("FULL_DISK_AT_END") == rank:
    from transformers import PreTrainedModel

    def full_disk_at_end(self, path, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    PreTrainedModel.save_pretrained = full_disk_at_end

common.exit_on_user_error(script.main, tyro.cli(script.Args, args=sys.argv[2:], use_underscores=True))
