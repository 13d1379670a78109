"""run_ranks' driver, one torchrun launch: each rank runs the command lines in argv[2] (a JSON list of [script,
*flags]) one after the other through the command line's entry point, in the one process group this launch makes (a
group made again in these processes would meet the last one's keys in torchrun's store). Each job's exit code is
written to argv[1]/<job>.<rank>."""

import json
import os
import sys

import torch
import torch.distributed as dist
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import conftest  # noqa: E402,F401 (its ppo.Args: no evaluation unless asked)
import ppo  # noqa: E402
import rm  # noqa: E402

if os.environ.get("COMPILE_BACKEND"):  # (conftest.without_inductor)
    compile_ = torch.compile
    torch.compile = lambda fn, mode=None, **kwargs: compile_(fn, backend=os.environ["COMPILE_BACKEND"], **kwargs)
dist.init_process_group("gloo")
dist.init_process_group = dist.destroy_process_group = lambda *args, **kwargs: None  # (the scripts' own: no-ops)
os._exit, exit_ = lambda code: (_ for _ in ()).throw(SystemExit(code)), os._exit  # (exit_on_user_error's, under
# torchrun: the job's exit code, the process going on to the next job)
for i, (script, *flags) in enumerate(json.loads(sys.argv[2])):
    module = {"rm.py": rm, "ppo.py": ppo}[script]
    try:
        common.exit_on_user_error(module.main, tyro.cli(module.Args, args=flags, use_underscores=True))
    except SystemExit as e:
        with open(os.path.join(sys.argv[1], f"{i}.{os.environ['RANK']}"), "w") as f:
            f.write(str(e.code))
    dist.barrier()  # (a failed job's peers may be waiting in a collective: the launch times out, every job fails)
exit_(0)  # (the group is destroyed by no one: the interpreter's teardown must not meet gloo's threads)
