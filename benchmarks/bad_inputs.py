"""How the public API answers bad inputs: every case of the bad-input catalogue
(``tests/test_validation.py``'s ``CATALOG``), sorted into

* clear: the documented exception type, and a message holding every expected word (the
  argument's name and the value received, and where listed what is allowed);
* vague: an exception, but of another type or without those words;
* silent: no exception at all (the bad value was used).

Prints the figures and the cases that are not clear, and writes
``benchmarks/results/bad_inputs.json``.

    .venv/bin/python benchmarks/bad_inputs.py
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_validation import CATALOG  # noqa: E402


def classify(call: Any, exc_type: type[BaseException], words: list[str]) -> tuple[str, str]:
    """``(verdict, what happened)`` for one catalogue case."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
    except Exception as exc:  # noqa: BLE001 - every answer is sorted, not handled
        message = str(exc)
        missing = [w for w in words if w not in message]
        said = f"{type(exc).__name__}: {message.splitlines()[0][:200] if message else ''}"
        if isinstance(exc, exc_type) and not missing:
            return "clear", said
        why = (f"expected {exc_type.__name__}" if not isinstance(exc, exc_type)
               else f"message lacks {missing}")
        return "vague", f"{said} ({why})"
    return "silent", "no exception"


def main() -> None:
    rows = [(name, *classify(call, exc, words)) for name, call, exc, words in CATALOG]
    counts = {k: sum(1 for _, v, _ in rows if v == k) for k in ("clear", "vague", "silent")}
    figures = {"cases": len(rows), **counts}
    print(f"bad inputs: {figures['cases']} cases, {counts['clear']} clear refusals, "
          f"{counts['vague']} vague, {counts['silent']} silent")
    for name, verdict, said in rows:
        if verdict != "clear":
            print(f"  {verdict:6s} {name}: {said}")
    out = ROOT / "benchmarks" / "results" / "bad_inputs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": ".venv/bin/python benchmarks/bad_inputs.py",
        "figures": figures,
        "cases": [{"id": n, "verdict": v, "answer": s} for n, v, s in rows],
    }, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
