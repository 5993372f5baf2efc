"""Run docs/repro/ scripts under SGLang's settings, many per process: SGLang and torch are imported once, then each
(script, setting) runs in a forked child with the setting in its environment (SGLang reads SGLANG_INVARIANT_CHECK and
SGLANG_DEBUG_MEMORY_POOL from os.environ at each call / construction, never caches them). Prints one JSON line:
[[script, setting, exit code, stdout, stderr], ...]. Usage: python repro_driver.py SETTINGS_JSON SCRIPT...
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings

warnings.simplefilter("ignore")
import torch  # noqa: E402

torch.set_num_threads(1)  # no OpenMP team in the parent: a forked child would hang in a parallel region
for name in ("sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.mem_cache.allocator.swa",
             "sglang.srt.managers.schedule_policy", "sglang.srt.mem_cache.pool_host.mla"):
    __import__(name)


def run(script: str, env: dict[str, str]) -> tuple[int, str, str]:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: the setting, the script as __main__, its exit code
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.environ.update(env)
                os.chdir(os.path.dirname(script))
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:  # noqa: BLE001 - SGLang's check raised: the traceback is the result
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read(), err.read()


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    results = [[s, name, *run(s, env)] for s in sys.argv[2:] for name, env in settings.items()]
    print(json.dumps(results))
