"""The lifecycle table rendered for people: a text table, Graphviz DOT and Mermaid.

Every rendering is generated from `TRANSITIONS`, so the README, the CLI and the code can never
describe different lifecycles.
"""

from __future__ import annotations

from collections.abc import Sequence

from groupflow.model.lifecycle import TRANSITIONS, Guard, Transition
from groupflow.model.states import TERMINAL_STATES, GroupState


def _label(row: Transition) -> str:
    label = str(row.event)
    if row.guard is not Guard.ALWAYS:
        label += f" [{row.guard}]"
    return label


def _actors(row: Transition) -> str:
    return ", ".join(sorted(str(a) for a in row.actors))


def to_text_table(rows: Sequence[Transition] = TRANSITIONS) -> str:
    """A fixed-width table with one line per row: from, event, guard, to, fired by, side effect."""
    header = ("from", "event", "guard", "to", "fired by", "side effect")
    lines = [
        (
            "-" if r.source is None else str(r.source),
            str(r.event),
            "" if r.guard is Guard.ALWAYS else str(r.guard),
            str(r.target),
            _actors(r),
            r.effect,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *(fmt(line) for line in lines)]) + "\n"


def to_dot(rows: Sequence[Transition] = TRANSITIONS) -> str:
    """A Graphviz digraph; terminal states are drawn with a double border."""
    out = [
        "digraph lifecycle {",
        "  rankdir=LR;",
        '  node [shape=box, style=rounded, fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
        "  start [shape=point];",
    ]
    for state in GroupState:
        peripheries = 2 if state in TERMINAL_STATES else 1
        out.append(f"  {state.value} [peripheries={peripheries}];")
    for r in rows:
        source = "start" if r.source is None else r.source.value
        out.append(f'  {source} -> {r.target.value} [label="{_label(r)}\\n({_actors(r)})"];')
    out.append("}")
    return "\n".join(out) + "\n"


def to_mermaid(rows: Sequence[Transition] = TRANSITIONS) -> str:
    """A Mermaid `stateDiagram-v2`, which GitHub renders inside a README."""
    out = ["stateDiagram-v2"]
    for r in rows:
        source = "[*]" if r.source is None else r.source.value
        out.append(f"    {source} --> {r.target.value}: {_label(r)} ({_actors(r)})")
    for state in sorted(TERMINAL_STATES, key=lambda s: s.value):
        out.append(f"    {state.value} --> [*]")
    return "\n".join(out) + "\n"
