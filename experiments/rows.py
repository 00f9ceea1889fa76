"""The warm process in which ``experiments.speedup`` trains its rows, one after another.

``python -m experiments.rows`` reads one row per line of its standard input, as JSON
``{"module": NAME, "argv": [...], "stdout": PATH, "stderr": PATH}``, runs it as ``python -m
NAME ARGV >>stdout 2>stderr`` would (that module's ``main``, its output to those files) and
writes the row's exit code as a line of its own standard output. Only the first row pays for
the imports and JAX's start (2-4 s a row on a CPU). It ends with its input, after a row that a signal cut
(the signal stops the experiment), or at once on a signal between rows (the ``experiments``
package's start-up handlers). Not a command of its own: speedup starts it (``RowProcess``).
"""

import gc
import importlib
import json
import os
import sys
import traceback

STOPPED = (130, 143)        # a row's exit code when SIGINT or SIGTERM cut it


def run_row(main, request: dict) -> int:
    """``main(argv)`` with file descriptors 1 and 2 on the row's files: its exit code, as a
    process's would be (an exception's traceback goes to the row's stderr, code 1)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(request["stdout"], "a") as out, open(request["stderr"], "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = main(request["argv"])
        except SystemExit as e:         # as the interpreter reports one
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:           # noqa: BLE001 - a row's failure is its exit code
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    gc.collect()        # the row's arrays go now, not in the next row's first steps
    return code


def serve(requests, answers) -> None:
    for line in requests:
        request = json.loads(line)
        code = run_row(importlib.import_module(request["module"]).main, request)
        answers.write(f"{code}\n")
        answers.flush()
        if code in STOPPED:
            return


if __name__ == "__main__":
    serve(sys.stdin, os.fdopen(os.dup(sys.stdout.fileno()), "w"))
