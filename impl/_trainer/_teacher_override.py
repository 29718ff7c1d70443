"""`--teacher DOMAIN=PATH`: a teacher of the user's own in place of a trained domain teacher.

The path is either a file saved by `TorchTeacher.save` or a Hugging Face model folder. Either is
checked against the task when it is loaded (its vocabulary covers the task's tokens, its context
holds a prompt and its answer), so a wrong model fails at once, naming the path, rather than
as an index error deep in the first scoring call. torch is imported only when a teacher is
loaded, and transformers only for a Hugging Face folder, so parsing needs neither.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from groupflow.impl._trainer._tasks import ANSWER_LENGTH, DOMAINS, PROMPT_LENGTH, VOCAB
from groupflow.model.errors import (
    ArgumentError,
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointNotFound,
    Unavailable,
)

if TYPE_CHECKING:
    from groupflow.impl._teachers._torch import LogprobTeacher

SEQUENCE_LENGTH = PROMPT_LENGTH + ANSWER_LENGTH


def parse_domain_value(text: str, *, flag: str, what: str, example: str) -> tuple[str, str]:
    """`"count=VALUE"` -> `("count", "VALUE")` for a `flag DOMAIN=WHAT` option; bad text is
    refused in one line that names it."""
    domain, sep, value = text.partition("=")
    domain, value = domain.strip(), value.strip()
    if not sep:
        raise ArgumentError(
            f"{flag} {text!r}: expected DOMAIN={what} (e.g. {example}), "
            f"with DOMAIN one of {sorted(DOMAINS)}"
        )
    if domain not in DOMAINS:
        raise ArgumentError(
            f"{flag} {text!r}: unknown domain {domain!r}; use one of {sorted(DOMAINS)}"
        )
    if not value:
        raise ArgumentError(
            f"{flag} {text!r}: no {what.lower()} after '=' (expected DOMAIN={what})"
        )
    return domain, value


def parse_teacher_override(text: str) -> tuple[str, Path]:
    """`"count=/models/count.pt"` -> `("count", Path("/models/count.pt"))`; bad text is refused
    in one line that names it."""
    domain, path = parse_domain_value(
        text, flag="--teacher", what="PATH", example="count=teachers/count.pt"
    )
    return domain, Path(path).expanduser()


def teacher_from_path(path: Path | str, *, device: str = "auto") -> LogprobTeacher:
    """The teacher saved at `path`: a `TorchTeacher.save` file (loaded weights-only) or a Hugging
    Face model folder (`HFTeacher`, nothing downloaded; needs `groupflow[hf]`), verified to fit
    the task. `CheckpointNotFound`, `CheckpointCorrupt` (does not load) or `CheckpointMismatch`
    (does not fit), each in one line naming the path."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _hf_teacher(path, device=device)
    if not path.is_file():
        raise CheckpointNotFound(
            f"teacher {path}: no such file or folder (a TorchTeacher.save file or a Hugging "
            f"Face model folder)"
        )
    return _torch_teacher(path, device=device)


def _torch_teacher(path: Path, *, device: str) -> LogprobTeacher:
    from groupflow.impl._teachers._torch import TorchTeacher

    teacher = TorchTeacher.load(path, device=device)  # CheckpointCorrupt, naming the path
    cfg = teacher.model.cfg
    _check_fits(path, vocab=cfg.vocab_size, context=cfg.max_len)
    return teacher


def _hf_teacher(path: Path, *, device: str) -> LogprobTeacher:
    from groupflow.impl._teachers._hf import HFTeacher

    if not (path / "config.json").is_file():
        raise CheckpointNotFound(
            f"teacher {path} is a folder without config.json: not a Hugging Face model folder"
        )
    try:
        teacher = HFTeacher.from_pretrained(path, device=device)
    except Unavailable:
        raise  # transformers is not installed: the message says how to install it
    except Exception as exc:  # no weights, a broken config, an unknown architecture
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointCorrupt(
            f"teacher {path} does not load as a Hugging Face model: {reason}"
        ) from exc
    config = teacher.model.config
    _check_fits(
        path,
        vocab=int(getattr(config, "vocab_size", 0)),
        context=getattr(config, "max_position_embeddings", None),
    )
    return teacher


def _check_fits(path: Path, *, vocab: int, context: int | None) -> None:
    if vocab < VOCAB:
        raise CheckpointMismatch(
            f"teacher {path} has a vocabulary of {vocab} tokens; the task's ids go up to "
            f"{VOCAB - 1}, so it needs at least {VOCAB}"
        )
    if context is not None and context < SEQUENCE_LENGTH:
        raise CheckpointMismatch(
            f"teacher {path} holds {context} tokens at most; a prompt and its answer are "
            f"{SEQUENCE_LENGTH}"
        )
