"""Runs kiln commands one after another in one process, as they arrive: `python
tests/kiln_in_one_process.py LOG` reads one JSON request a line on stdin, `{"name": ..., "cwd":
..., "args": [...]}`, runs `kiln ARGS` in `cwd` through the console script's own entry point
(`flows.cli.main`: the same signal handling, typer app and exit codes), and answers each with
a JSON line on stdout, `{"name": ..., "exit_code": ...}`. Everything the commands print goes to
LOG, each command's part between `@@ NAME begins` and `@@ NAME ends` lines.

For a test fixture that runs several long commands (tests/test_families.py: `kiln build` of
three models): each `kiln` process would import torch, transformers, Prefect and MLflow and
start a temporary Prefect server of its own before any work, 10-15 s of CPU apiece; here
the imports and the server are paid once. The fixture sends each request as soon as its
input exists, so the commands run while it prepares the next one's.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def run_commands(log_path: str) -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 (the process's stdout and stderr from here on)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    from flows.cli import main as kiln

    for line in sys.stdin:
        request = json.loads(line)
        os.chdir(request["cwd"])
        print(f"@@ {request['name']} begins", flush=True)
        sys.argv = ["kiln", *request["args"]]
        try:
            kiln()
            exit_code = 0
        except SystemExit as stop:
            exit_code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
        except Exception:  # what would end a `kiln` process with a traceback and exit 1; the next command still runs
            traceback.print_exc()
            exit_code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"@@ {request['name']} ends", flush=True)
        answers.write(json.dumps({"name": request["name"], "exit_code": exit_code}) + "\n")


def output_of(log_text: str, name: str) -> str:
    """What the command named `name` printed, from the LOG of `run_commands`."""
    begins, ends = f"@@ {name} begins\n", f"@@ {name} ends\n"
    start = log_text.find(begins)
    if start < 0:
        return log_text[-6000:]  # it never began: the tail says why
    end = log_text.find(ends, start)
    return log_text[start + len(begins) : end if end >= 0 else len(log_text)]


if __name__ == "__main__":
    run_commands(sys.argv[1])
