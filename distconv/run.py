"""``python -m distconv.run``: ``torchrun``, whose failed job ends in one line per rank.

It takes torchrun's arguments (``python -m distconv.run --nproc-per-node 4 train.py --lr 0.1``)
and starts the same job through ``torch.distributed.run``. Where a rank fails, torchrun's agent
raises an error of its own after the ranks have reported theirs and prints its traceback and a
failure summary; here each failed rank is reported as one line instead::

    [rank0]: ValueError: launch(fn, 4) runs in a job of 2 processes ...     (the rank's own line)
    distconv.run: rank 0 failed (exit code 1): ValueError: launch(fn, 4) runs in a job of ...
    distconv.run: rank 1 failed (stopped by SIGTERM): ValueError: launch(fn, 4) runs in ...

(torchrun stops the other ranks once one fails: a rank stopped after it wrote its line says
so), and the command exits with the first failed rank's exit code. A rank's line is what the rank
wrote to torchrun's error file: the library's one-line refusal (:func:`distconv.launch.launch`),
the last line of a traceback recorded by torch's ``@record``, or the signal that ended it.
``DISTCONV_TRACEBACK=1`` keeps every traceback, torchrun's included.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _first_line(failure: Any) -> str:
    """One line for a rank's failure, from torchrun's ``ProcessFailure``."""
    msg = failure.message
    if isinstance(msg, dict):  # an error file: {"message": ..., "extraInfo": {...}}
        msg = msg.get("message") or msg.get("extraInfo", {}).get("py_callstack", "")
    lines = [ln.strip() for ln in str(msg or "").splitlines() if ln.strip()]
    if lines and lines[0].startswith("Traceback"):
        return lines[-1]  # a recorded traceback: its last line is the exception
    if lines and not lines[0].startswith("To enable traceback"):
        return lines[0]
    signal = failure.signal_name()
    return f"ended by {signal}" if signal and signal != "<N/A>" else "see its output above"


def main(argv: Sequence[str] | None = None) -> int:
    """Run torchrun with ``argv`` (default ``sys.argv[1:]``); return the job's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    keep = os.environ.get("DISTCONV_TRACEBACK", "").strip() not in ("", "0")
    if keep:
        run(args)
        return 0
    # the agent logs each failed rank as a multi-line error record: the lines below say it
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            how = (f"exit code {failure.exitcode}" if failure.exitcode >= 0
                   else f"stopped by {failure.signal_name()}")  # (torchrun stops the others)
            print(f"distconv.run: rank {rank} failed ({how}): {_first_line(failure)}",
                  file=sys.stderr, flush=True)
        _, first = exc.get_first_failure()
        return first.exitcode if first.exitcode and first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
