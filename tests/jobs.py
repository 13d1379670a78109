"""run_ranks' driver, one torchrun launch: each rank runs the command lines in argv[2] (a JSON list of [script,
*flags]) one after the other, as the command line would (tyro's flags; a UserError is exit code 2), in the one process
group this launch makes (the scripts' own init and destroy become no-ops: a group made again in these processes would
meet the last one's keys in torchrun's store). Each job's exit code is written to argv[1]/<job>.<rank>."""
import os
import sys
import traceback

import torch.distributed as dist
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import json  # noqa: E402

import common  # noqa: E402
import ppo  # noqa: E402
import rm  # noqa: E402

folder, jobs, rank = sys.argv[1], json.loads(sys.argv[2]), int(os.environ["RANK"])
if os.environ.get("COMPILE_BACKEND"):  # (tests/test_options.py: --compile without inductor's C++ compilation)
    import torch

    compile_ = torch.compile
    torch.compile = lambda fn, mode=None, **kwargs: compile_(fn, backend=os.environ["COMPILE_BACKEND"], **kwargs)
dist.init_process_group("gloo")
dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None
for i, (script, *flags) in enumerate(jobs):
    try:
        {"rm.py": rm, "ppo.py": ppo}[script].main(tyro.cli({"rm.py": rm, "ppo.py": ppo}[script].Args, args=flags,
                                                           use_underscores=True))
        code = 0
    except common.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    with open(os.path.join(folder, f"{i}.{rank}"), "w") as f:
        f.write(str(code))
    dist.barrier()  # (a failed job's peers may be waiting in a collective: the launch times out, every job fails)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # (the group is destroyed by no one: the interpreter's teardown must not meet gloo's threads)
