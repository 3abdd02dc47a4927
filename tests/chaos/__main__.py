"""Run the chaos suite:  python -m tests.chaos [--full] [--seed N] [--write] [-- PYTEST ARGS]

Without --full: the CI-sized run (the same one the default `pytest` run includes).
With --full: every scenario at full scale (>= 500 kill rounds, every syscall, 100 power cuts ...),
and tests/chaos/RESULTS.md is rewritten from the figures of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def render(doc: dict[str, Any], scale: str, seed: str, seconds: float, exit_code: int) -> str:
    """RESULTS.md: one row per scenario, then what was skipped or is a known failure."""
    lines = [
        "# Chaos results",
        "",
        "Written by `make chaos` (`python -m tests.chaos --full`) from the figures of that run; do not edit.",
        "",
        f"- run: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, scale `{scale}`, CHAOS_SEED={seed}, "
        f"{seconds / 60:.1f} min, pytest exit {exit_code} ({'passed' if exit_code == 0 else 'FAILED'})",
        f"- machine: Linux {platform.release()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "",
        "Invariant violations must be 0. Rows marked *broken copier* run a deliberately broken protocol "
        "to prove the harness can fail: there, a violation is the harness catching it.",
        "",
        "| scenario | rounds | faults injected | invariant violations |",
        "| --- | ---: | --- | ---: |",
    ]
    notes: list[str] = []
    for row in doc["tallies"]:
        faults = "; ".join(f"{kind} x{n}" for kind, n in row["faults"].items()) or "-"
        total = sum(row["faults"].values())
        faults = f"{total}: {faults}" if row["faults"] else faults
        if row["expect_violations"]:
            violations = f"{row['violations']} (caught: broken copier)"
        else:
            violations = str(row["violations"])
        lines.append(f"| {row['scenario']} | {row['rounds']} | {faults} | {violations} |")
        notes += [f"- {row['scenario']}: {note}" for note in row["notes"]]
        notes += [f"- {row['scenario']}: finding: {finding}" for finding in row.get("findings", ())]
    if notes:
        lines += ["", "## Notes", "", *notes]
    odd = [t for t in doc["tests"] if t["outcome"] not in ("passed",)]
    if odd:
        lines += ["", "## Not run, or known failures", ""]
        lines += [f"- `{t['test']}`: {t['outcome']}" + (f" - {t['reason']}" if t["reason"] else "") for t in odd]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="full scale; rewrites tests/chaos/RESULTS.md")
    parser.add_argument("--seed", help="CHAOS_SEED for every scenario (default: a fresh one, printed)")
    parser.add_argument(
        "--write",
        type=Path,
        metavar="FILE",
        help="write the results table here (default with --full: tests/chaos/RESULTS.md)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    scale = "full" if args.full else "ci"
    seed = args.seed or str(random.SystemRandom().randrange(2**32))
    out = args.write or (HERE / "RESULTS.md" if args.full else None)
    with tempfile.TemporaryDirectory(prefix="mirrord-chaos-") as tmp:
        results = Path(tmp) / "results.json"
        env = {**os.environ, "CHAOS_SCALE": scale, "CHAOS_SEED": seed, "CHAOS_RESULTS": str(results)}
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "tests/chaos",
            "-q",
            "-rsx",
            "-p",
            "no:cacheprovider",
            f"--timeout={7200 if args.full else 600}",
            *args.pytest_args,
        ]
        print(f"chaos: scale {scale}, CHAOS_SEED={seed}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        code = subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode
        seconds = time.monotonic() - started
        if not results.exists():
            print("chaos: no results were recorded", file=sys.stderr)
            return code or 1
        doc = json.loads(results.read_text())
    table = render(doc, scale, seed, seconds, code)
    if out is not None:
        out.write_text(table)
        print(f"chaos: results written to {out}")
    else:
        print(table)
    return code


if __name__ == "__main__":
    sys.exit(main())
