"""A :class:`~distconv.testing.WorkerPool` rank: ``python -m distconv.testing.worker``.

Started by the pool (one process per rank for gloo, under ``mpiexec`` for MPI) with one thread
(``OMP_NUM_THREADS=1`` in its environment from the start, ``torch.set_num_threads(1)``), it
connects back to the driver over loopback, joins the world and runs the tasks it receives until
told to stop.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # in case it is started by hand

import importlib
import importlib.util
import json
import pickle
import sys
import traceback
from multiprocessing.connection import Client
from typing import Any

from distconv.testing._protocol import (
    ENV_ADDRESS,
    ENV_ARGV,
    ENV_AUTHKEY,
    ENV_BACKEND,
    ENV_TIMEOUT,
)

_main_modules: dict[str, Any] = {}


def resolve(ref: tuple[str, str, str | None]) -> Any:
    """The function named by ``(module, qualname, main_path)``; a ``__main__`` function is found
    by loading the driver's script under another name (its ``__main__`` block does not run)."""
    module_name, qualname, main_path = ref
    if module_name == "__main__" and main_path:
        mod = _main_modules.get(main_path)
        if mod is None:
            spec = importlib.util.spec_from_file_location("__distconv_main__", main_path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load the driver's script {main_path!r}")
            mod = importlib.util.module_from_spec(spec)
            sys.modules["__distconv_main__"] = mod
            spec.loader.exec_module(mod)
            _main_modules[main_path] = mod
    else:
        mod = importlib.import_module(module_name)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_error(exc: BaseException) -> tuple[str, bytes | None, str]:
    text = "".join(traceback.format_exception(exc))
    try:
        blob: bytes | None = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:
        blob = None
    return (text, blob, f"{type(exc).__name__}: {exc}")


def main() -> None:
    import torch

    torch.set_num_threads(1)
    from distconv import comm as dcomm

    if ENV_ARGV in os.environ:  # a launch()ed script's workers see its command line
        sys.argv = json.loads(os.environ[ENV_ARGV])

    host, port = os.environ[ENV_ADDRESS].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[ENV_AUTHKEY]))
    try:
        world = dcomm.init(os.environ[ENV_BACKEND], timeout=float(os.environ[ENV_TIMEOUT]))
    except BaseException as exc:
        conn.send(("failed", _encode_error(exc)))
        raise
    conn.send(("ready", world.rank, world.size, os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        ref, payload = msg
        try:
            fn = resolve(ref)
            args, kw = pickle.loads(payload)
            result = fn(world, *args, **kw)
            reply = ("ok", pickle.dumps(result))
        except BaseException as exc:
            reply = ("err", _encode_error(exc))
        conn.send(reply)
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # the pool is done with this world: skip the slow interpreter and library teardown
    os._exit(0)


if __name__ == "__main__":
    main()
