"""Which student architecture on-policy distillation can train on the embedded task: the same
run in this process (the student samples in torch, the teachers score in torch: no server),
with the teachers of a served run (`LlamaLM`s) and three students: the embedded run's
`CausalLM` (learned absolute positions), the served run's `GPT2LM` (learned absolute
positions, heads of 32), and a `LlamaLM` (rotary positions, heads of 64, spread 0.2). Prints
each one's greedy accuracy per domain and KL side by side, and draws their curves.

    python bench/student_architectures.py --steps 300 --plot docs/student-architectures.png

The served trainer (`groupflow train --engine vllm`) trains the GPT-2; a Llama in its place
learns `count` and not `reverse`, here as on vLLM: see docs/measurements.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import trio

import groupflow.impl._trainer._run as run_module
from groupflow.impl._teachers._served_lm import GPT2LMConfig, LlamaLMConfig
from groupflow.impl._teachers._torch import LMConfig, new_lm
from groupflow.impl._trainer import TrainConfig
from groupflow.impl._trainer._domain_teachers import ENGINE_RECIPE
from groupflow.impl._trainer._provision import provide_teachers
from groupflow.impl._trainer._run_folder import RunFolder
from groupflow.impl._trainer._student import ENGINE_CONTEXT, SEQUENCE_LENGTH
from groupflow.impl._trainer._tasks import VOCAB

STUDENTS: dict[str, LMConfig | GPT2LMConfig | LlamaLMConfig] = {
    "CausalLM (embedded)": LMConfig(
        vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_len=SEQUENCE_LENGTH
    ),
    "GPT2LM (served)": GPT2LMConfig(
        vocab_size=VOCAB, d_model=64, n_heads=2, n_layers=2, max_len=ENGINE_CONTEXT
    ),
    "LlamaLM": LlamaLMConfig(
        vocab_size=VOCAB,
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_len=ENGINE_CONTEXT,
        init_std=0.2,
    ),
}


def run(name: str, steps: int, out: Path) -> dict[str, Any]:
    """One in-process run of `steps` with student `name` and the served run's teachers."""
    shape = STUDENTS[name]
    real = getattr(run_module, "run_student")  # noqa: B009 (the run's own, patched here)
    setattr(run_module, "run_student", lambda config: new_lm(shape, seed=config.seed))  # noqa: B010
    try:
        config = TrainConfig(steps=steps)
        teachers = provide_teachers(config, recipe=ENGINE_RECIPE)
        summary = trio.run(
            lambda: run_module.train(
                RunFolder.new(out, config), teachers=teachers, plot=False, progress=None
            )
        )
    finally:
        setattr(run_module, "run_student", real)  # noqa: B010
    curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"summary": summary, "curve": curve}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plot", type=Path, default=None, help="where to draw the curves")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(STUDENTS):
            results[name] = run(name, args.steps, Path(tmp) / str(i))
            s = results[name]["summary"]
            print(
                f"{name:20s} count {s.accuracy_after['count']:.2f}  reverse "
                f"{s.accuracy_after['reverse']:.2f}  KL {s.kl_first:.3f} -> {s.kl_last:.3f}  "
                f"{s.steps_per_s:.1f} steps/s",
                flush=True,
            )
    if args.plot is not None:
        _plot(results, args.plot)
        print(f"wrote {args.plot}")


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, result in results.items():
        curve = result["curve"]
        steps = [r["step"] for r in curve]
        for ax, key in zip(axes, ("kl", "accuracy/count", "accuracy/reverse"), strict=True):
            values = [r.get(key, float("nan")) for r in curve]
            smooth = [
                sum(values[max(0, i - 19) : i + 1]) / len(values[max(0, i - 19) : i + 1])
                for i in range(len(values))
            ]
            ax.plot(steps, smooth, label=name)
            ax.set_title(key.replace("accuracy/", "accuracy on rollouts: "))
            ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
