"""Mutation testing of the modules where a bug loses or duplicates data or hangs a run.

A real mutation tool, cosmic-ray (`pip install -e '.[mutation]'`), makes each small change
(an operator, a comparison, a constant, a `break`) to one module at a time, and the module's
own tests run against it: a mutant they fail is killed, one they pass survived. Each module is
tried by the tests of its own subject, so a killed mutant says where the bug was seen. Survivors
judged equivalent (no test could tell them apart from the original) are listed, with a reason
each, in `bench/mutation_equivalent.toml`; the score leaves them out.

cosmic-ray rather than mutmut: it mutates the file on disk, one mutant at a time, and runs any
command, so it needs nothing of the package layout (groupflow maps four top-level folders onto
one namespace package, which mutmut's copied `mutants/` tree does not import), and a mutant
that hangs is ended by this script's time limit without touching the others.

Run: `python bench/mutation.py` (every module in `MODULES`), or `--module model/decisions.py`;
`--out DIR` (default `runs/mutation`) receives `results.json` and `report.md`, written after
each module. `--again RESULTS` runs only the survivors of an earlier results.json: a re-check
after triage, not a score. A run stopped by Ctrl-C or SIGTERM writes the mutants it measured,
marked as stopped. A module whose tests fail unmutated is refused before any mutant
runs. The file is restored after each mutant and at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = Path(__file__).with_name("mutation_equivalent.toml")

_CHECKPOINT_TESTS = (
    "tests/pipeline/test_checkpoint.py",
    "tests/pipeline/test_checkpoint_write.py",
    "tests/pipeline/test_checkpoint_disk.py",
)

MODULES: dict[str, tuple[str, ...]] = {
    "model/decisions.py": ("tests/model/test_decisions.py",),
    "impl/_core/_buffer.py": (
        "tests/core/test_buffer_lifecycle.py",
        "tests/core/test_buffer_refusals.py",
        "tests/core/test_buffer_concurrency.py",
        "tests/core/test_buffer_store_calls.py",
        "tests/core/test_buffer_state.py",
    ),
    "impl/_core/_buffer_state.py": ("tests/core/test_buffer_state.py",),
    "impl/_core/_ledger.py": ("tests/core/test_ledger.py",),
    "impl/_core/_ordinals.py": ("tests/core/test_ledger.py",),
    "impl/_pipeline/_scoring_stage.py": ("tests/pipeline/test_scoring_stage.py",),
    # one subject, checkpoints: the saving, the folders on disk, what a load verifies
    "impl/_pipeline/_checkpoint.py": _CHECKPOINT_TESTS,
    "impl/_pipeline/_checkpoint_disk.py": _CHECKPOINT_TESTS,
    "impl/_pipeline/_supervisor.py": ("tests/pipeline/test_supervisor.py",),
    # the train pump: each step once, in order, its groups released, the run's end
    "impl/_pipeline/_train.py": (
        "tests/pipeline/test_train_pump.py",
        "tests/pipeline/test_extra_stage.py",
        "tests/pipeline/test_runs.py",
        "tests/pipeline/test_failures.py",
        "tests/pipeline/test_one_failure.py",
        "tests/pipeline/test_checkpoint.py",
        "tests/pipeline/test_races.py",
        "tests/pipeline/test_trace.py",
    ),
    "sim/verify/replay.py": ("tests/sim/verify/test_replay.py",),
}
"""Each module and the tests of its own subject."""

TIME_LIMIT_FACTOR = 4.0
"""A mutant's tests may take this many times the unmutated run (plus 10 s) before it counts
as killed by a hang: the tests' own time limits would end it too, later."""


def _tool() -> Path:
    tool = Path(sys.executable).with_name("cosmic-ray")
    if not tool.exists():
        sys.exit("bench/mutation.py: cosmic-ray is not installed: pip install -e '.[mutation]'")
    return tool


def _test_command(tests: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]


def _mutants(module: str, tests: tuple[str, ...], work: Path) -> list[dict[str, Any]]:
    """Every mutation cosmic-ray's operators make in `module`, from its session database."""
    config = work / "config.toml"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(module)}\n"
        "timeout = 600.0\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(' '.join(_test_command(tests)))}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    session = work / "session.sqlite"
    subprocess.run([_tool(), "init", config, session], cwd=ROOT, check=True)
    dump = subprocess.run(
        [_tool(), "dump", session], cwd=ROOT, check=True, capture_output=True, text=True
    )
    out = []
    for line in dump.stdout.splitlines():
        item, _ = json.loads(line)
        (mutation,) = item["mutations"]
        out.append(mutation)
    return sorted(out, key=lambda m: (m["start_pos"], m["operator_name"], m["occurrence"]))


def _run(argv: list[str], limit: float) -> tuple[str, float]:
    """Run `argv` in its own process group; its outcome as cosmic-ray's JSON line, or
    "timeout" when it ran past `limit` (the whole group is ended)."""
    began = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _end(proc)
        return "timeout", time.perf_counter() - began
    except BaseException:  # a stop (Ctrl-C, SIGTERM): the mutant's tests go with it
        _end(proc)
        raise
    return stdout, time.perf_counter() - began


def _end(proc: subprocess.Popen[str]) -> None:
    """End `proc`, its group, and every process below it: cosmic-ray starts the test command in
    a session of its own, which the group's end does not reach (a mutant that loops would go on
    taking a core from every mutant after it)."""
    below = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, read from /proc (Linux); none elsewhere."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _equivalents() -> list[dict[str, str]]:
    """The survivors judged equivalent: module, operator, original line and (optionally) the
    mutant's line, each a pattern where `*` stands for anything, and why no test can tell the
    mutant apart."""
    if not EQUIVALENT.exists():
        return []
    entries: list[dict[str, str]] = tomllib.loads(EQUIVALENT.read_text(encoding="utf-8"))[
        "equivalent"
    ]
    return entries


ANNOTATION = (
    "an annotation: never evaluated (the module has `from __future__ import annotations`), "
    "so the mutant is not run"
)


def _annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Where `source`'s annotations are, as ((row, col), (end row, end col)); none unless the
    module postpones their evaluation, which makes a mutant inside one equivalent by
    construction."""
    tree = ast.parse(source)
    postponed = any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )
    if not postponed:
        return []
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns:
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
    return [
        ((a.lineno, a.col_offset), (a.end_lineno or a.lineno, a.end_col_offset or 0)) for a in found
    ]


def _in_annotation(
    spans: list[tuple[tuple[int, int], tuple[int, int]]], start: tuple[int, int]
) -> bool:
    return any(begin <= start < end for begin, end in spans)


def _mutated_line(diff: str) -> str:
    """The line the mutant has instead of the original (the diff's one added line)."""
    added = [
        line[1:]
        for line in diff.splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]
    return added[0].strip() if added else ""


def _glob(text: str, pattern: str) -> bool:
    """`pattern` matches `text`, where `*` alone is special (source lines hold brackets)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), text) is not None


def _why_equivalent(
    equivalents: list[dict[str, str]], module: str, operator: str, source: str, diff: str
) -> str | None:
    for e in equivalents:
        if (
            _glob(module, e["module"])
            and _glob(operator, e["operator"])
            and _glob(source, e["line"].strip())
            and _glob(_mutated_line(diff), e.get("mutant", "*").strip())
        ):
            return e["why"]
    return None


def _outcome(raw: str) -> tuple[str, str]:
    if raw == "timeout":
        return "killed", "timed out (a hang the tests' own time limits would end too)"
    data = json.loads(raw)
    if data["worker_outcome"] != "normal":
        return "incompetent", data["worker_outcome"]
    return {"killed": "killed", "survived": "survived"}.get(
        data["test_outcome"], "incompetent"
    ), data.get("diff") or ""


def mutate(
    module: str,
    tests: tuple[str, ...],
    *,
    quiet: bool,
    only: set[tuple[str, str, int]] | None = None,
) -> dict[str, Any]:
    """Every mutant of `module` against `tests`; counts, survivors and the score. With `only`
    (the operator, source line and column of each), just those: a re-check, not a score."""
    path = ROOT / module
    original = path.read_bytes()
    lines = original.decode("utf-8").splitlines()
    began = time.perf_counter()
    baseline = subprocess.run(
        _test_command(tests), cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    baseline_s = time.perf_counter() - began
    if baseline.returncode != 0:
        said = (baseline.stdout + baseline.stderr).strip().splitlines()[-5:]
        sys.exit(
            f"bench/mutation.py: {module}'s tests fail unmutated: {' '.join(tests)}\n"
            + "\n".join(said)
        )
    limit = baseline_s * TIME_LIMIT_FACTOR + 10.0
    equivalents = _equivalents()
    annotations = _annotation_spans(original.decode("utf-8"))
    results: list[dict[str, Any]] = []
    stopped = False
    with tempfile.TemporaryDirectory(prefix="groupflow-mutation-") as tmp:
        mutants = _mutants(module, tests, Path(tmp))
        if only is not None:
            mutants = [m for m in mutants if _key(m, lines) in only]
        try:
            for i, m in enumerate(mutants, start=1):
                row, col = m["start_pos"]
                source = lines[row - 1] if 0 < row <= len(lines) else ""
                if _in_annotation(annotations, (row, col)):
                    results.append(_result(m, source, "equivalent", ANNOTATION, 0.0))
                    continue
                argv = [
                    str(_tool()),
                    "mutate-and-test",
                    module,
                    m["operator_name"],
                    str(m["occurrence"]),
                    " ".join(_test_command(tests)),
                ]
                raw, seconds = _run(argv, limit)
                path.write_bytes(original)  # whatever the worker did or failed to undo
                if raw == "timeout":
                    # a loaded machine can stall a run that would have ended: once more, with
                    # twice the time, before it counts as a hang
                    raw, seconds = _run(argv, 2 * limit)
                    path.write_bytes(original)
                outcome, detail = _outcome(raw)
                why = _why_equivalent(
                    equivalents, module, m["operator_name"], source.strip(), detail
                )
                if outcome == "survived" and why is not None:
                    outcome = "equivalent"
                detail = why if outcome == "equivalent" and why is not None else detail
                results.append(_result(m, source, outcome, detail, seconds))
                if not quiet:
                    counts = Counter(r["outcome"] for r in results)
                    print(
                        f"\r{module}: {i}/{len(mutants)} mutants, "
                        f"{counts['killed']} killed, {counts['survived']} survived",
                        end="",
                        file=sys.stderr,
                        flush=True,
                    )
        except KeyboardInterrupt:
            # stopped: what was measured is kept, and says it covers part of the module
            stopped = True
        finally:
            path.write_bytes(original)
            if not quiet:
                print(file=sys.stderr)
    counts = Counter(r["outcome"] for r in results)
    judged = counts["killed"] + counts["survived"]
    return {
        "module": module,
        "tests": list(tests),
        "mutants": len(results),
        "killed": counts["killed"],
        "survived": counts["survived"],
        "equivalent": counts["equivalent"],
        "incompetent": counts["incompetent"],
        "score": counts["killed"] / judged if judged else 1.0,
        "baseline_s": round(baseline_s, 2),
        "source_sha256": hashlib.sha256(original).hexdigest(),
        "partial": only is not None or stopped,
        "stopped": f"after {len(results)} of {len(mutants)} mutants" if stopped else None,
        "results": results,
    }


def _result(
    mutant: dict[str, Any], source: str, outcome: str, detail: str, seconds: float
) -> dict[str, Any]:
    """One mutant's line of results.json."""
    row, col = mutant["start_pos"]
    return {
        "operator": mutant["operator_name"],
        "occurrence": mutant["occurrence"],
        "line": row,
        "column": col,
        "source": source.strip(),
        "function": mutant.get("definition_name"),
        "outcome": outcome,
        "detail": detail,
        "seconds": round(seconds, 2),
    }


def _key(mutant: dict[str, Any], lines: list[str]) -> tuple[str, str, int]:
    """A mutant by what it changes (operator, the line's text, the column), which survives
    edits elsewhere in the module, unlike cosmic-ray's occurrence numbers."""
    row, col = mutant["start_pos"]
    source = lines[row - 1].strip() if 0 < row <= len(lines) else ""
    return mutant["operator_name"], source, col


def _survivors(results: Path, module: str) -> set[tuple[str, str, int]]:
    """The survivors of `module` in an earlier run's results.json."""
    for run in json.loads(results.read_text()):
        if run["module"] == module:
            return {
                (x["operator"], x["source"], x["column"])
                for x in run["results"]
                if x["outcome"] == "survived"
            }
    sys.exit(f"bench/mutation.py: {results} has no run of {module}")


def _report(runs: list[dict[str, Any]]) -> str:
    out = [
        "| module | mutants | killed | survived | equivalent | incompetent | score |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r.get("stopped"):
            again = f" (stopped {r['stopped']})"
        else:
            again = " (re-check of earlier survivors)" if r.get("partial") else ""
        out.append(
            f"| `{r['module']}`{again} | {r['mutants']} | {r['killed']} | {r['survived']} | "
            f"{r['equivalent']} | {r['incompetent']} | {r['score']:.1%} |"
        )
    for r in runs:
        survivors = [x for x in r["results"] if x["outcome"] == "survived"]
        if survivors:
            out += ["", f"Survivors in `{r['module']}`:", ""]
            out += [
                f"- line {x['line']} ({x['function']}), {x['operator']}: `{x['source']}`"
                for x in survivors
            ]
    return "\n".join(out) + "\n"


def _stop(signum: int, frame: object) -> None:
    """SIGTERM stops a run as Ctrl-C does: the mutants measured so far are written."""
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(MODULES))
    parser.add_argument("--out", type=Path, default=Path("runs/mutation"))
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.add_argument(
        "--again",
        type=Path,
        metavar="RESULTS",
        help="run only the mutants that survived in this earlier results.json (a re-check "
        "after triage; its figures are not a score)",
    )
    args = parser.parse_args()
    if (
        shutil.which("git")
        and subprocess.run(
            ["git", "diff", "--quiet", "--", *(args.module or MODULES)], cwd=ROOT
        ).returncode
    ):
        sys.exit("bench/mutation.py: the modules to mutate have uncommitted changes; commit first")
    imported = subprocess.run(
        [sys.executable, "-c", "import groupflow.model as m; print(m.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(imported).resolve().is_relative_to(ROOT):
        # a mutant written here would never be imported: every one would survive
        sys.exit(
            f"bench/mutation.py: this Python imports groupflow from {imported or 'nowhere'}, "
            f"not from {ROOT}: run it with the Python of a venv where this checkout is "
            "installed (pip install -e '.[test,mutation]')"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)
    runs: list[dict[str, Any]] = []
    for module in args.module or MODULES:
        only = _survivors(args.again, module) if args.again else None
        runs.append(mutate(module, MODULES[module], quiet=args.quiet, only=only))
        # written after each module: a long run's finished modules can be triaged meanwhile
        (args.out / "results.json").write_text(json.dumps(runs, indent=1))
        (args.out / "report.md").write_text(_report(runs))
        if runs[-1]["stopped"]:
            break
    print(_report(runs), end="")
    print(f"written: {args.out / 'results.json'}, {args.out / 'report.md'}")


if __name__ == "__main__":
    main()
