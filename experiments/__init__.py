"""The experiments, each a command: ``python -m experiments.NAME``.

Python imports this package before the experiment's module, whose imports can take a second
(jax's: most commands import it only once they have parsed their flags). Meanwhile a SIGINT (Ctrl-C) or SIGTERM stops the command at once: one line
``stopped by SIGINT during start-up ...`` on stderr and the shell's exit code for the signal
(130, 143), as ``common.command`` gives, never a KeyboardInterrupt's traceback. The command's
own handlers (``common.stop_on_signals``, ``loop.run.stop_on_signals``) replace these while it
runs. Imported otherwise (a test, a notebook), this package changes no handler.
"""

import os
import signal
import sys


def _stop(signum, frame):
    """Exit at once with 128 + ``signum`` and one line; nothing of the command has run."""
    name = signal.Signals(signum).name
    importing = False
    while frame is not None and not importing:
        importing = frame.f_code.co_filename.startswith("<frozen importlib")
        frame = frame.f_back
    sys.stdout.flush()
    print(f"stopped by {name} during start-up (importing its modules), before the command "
          f"began; nothing was written" if importing else f"stopped by {name}",
          file=sys.stderr, flush=True)
    os._exit(128 + signum)


# sys.argv[0] is "-m" while ``python -m experiments.NAME`` looks for the module; an ignored
# signal (a background job's SIGINT) stays ignored.
if sys.argv[:1] == ["-m"]:
    for _signum, _default in ((signal.SIGINT, signal.default_int_handler),
                              (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(_signum) is _default:
            signal.signal(_signum, _stop)
