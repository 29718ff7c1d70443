"""Each domain's teacher for a run: a saved one the user names, one served at a URL, or the
domain's own, trained on first use and cached; and the routes from domains to them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from groupflow.impl._teachers import AliasMap
from groupflow.impl._trainer._config import Engine, TrainConfig
from groupflow.impl._trainer._domain_teachers import (
    DEFAULT_RECIPE,
    ENGINE_RECIPE,
    TeacherRecipe,
    domain_teacher,
)
from groupflow.impl._trainer._teacher_override import (
    parse_domain_value,
    parse_teacher_override,
    teacher_from_path,
)
from groupflow.impl.contract import Teacher
from groupflow.impl.engines import is_url
from groupflow.model.errors import ConfigError


@attrs.frozen
class DomainTeacher:
    """The physical teacher a domain is routed to, and what to call it (shared when two
    domains name the same checkpoint or URL). `teacher` is None for one served at a URL."""

    name: str
    teacher: Teacher | None


def local_teacher(teacher: DomainTeacher) -> Teacher:
    """The teacher itself, for a run that scores in this process."""
    if teacher.teacher is None:
        raise ConfigError(
            f"teacher {teacher.name!r} is served at a URL: a run of engine='torch' scores with "
            f"teachers in this process; use --engine vllm",
            field="teacher_url",
        )
    return teacher.teacher


def teacher_choices(
    config: TrainConfig, *, overrides: Sequence[str] = (), urls: Sequence[str] = ()
) -> tuple[dict[str, Path], dict[str, str]]:
    """The `--teacher DOMAIN=PATH` and `--teacher-url DOMAIN=URL` flags, checked (nothing is
    loaded): each domain's saved teacher, and each domain's server."""
    chosen: dict[str, Path] = {}
    for text in overrides:
        domain, path = parse_teacher_override(text)
        _check_domain(config, domain, f"--teacher {text}")
        if domain in chosen:
            raise ConfigError(
                f"--teacher {text}: domain {domain!r} has a --teacher already "
                f"({chosen[domain]}); give one",
                field="teacher",
            )
        chosen[domain] = path
    served: dict[str, str] = {}
    for text in urls:
        domain, url = parse_domain_value(
            text, flag="--teacher-url", what="URL", example="count=http://127.0.0.1:8000"
        )
        _check_domain(config, domain, f"--teacher-url {text}")
        if config.engine is not Engine.VLLM:
            raise ConfigError(
                f"--teacher-url {text}: a teacher at a URL is scored on an engine; add "
                f"--engine vllm",
                field="teacher_url",
            )
        if not is_url(url):
            raise ConfigError(
                f"--teacher-url {text}: {url!r} is not an http:// or https:// URL",
                field="teacher_url",
            )
        if domain in chosen:
            raise ConfigError(
                f"--teacher-url {text}: domain {domain!r} has a --teacher too; give one",
                field="teacher_url",
            )
        if domain in served:
            raise ConfigError(
                f"--teacher-url {text}: domain {domain!r} has a --teacher-url already "
                f"({served[domain]}); give one",
                field="teacher_url",
            )
        served[domain] = url
    return chosen, served


def provide_teachers(
    config: TrainConfig,
    *,
    overrides: Sequence[str] = (),
    urls: Sequence[str] = (),
    device: str = "auto",
    cache_dir: Path | None = None,
    say: Callable[[str], None] = lambda text: None,
    recipe: TeacherRecipe | None = None,
) -> dict[str, DomainTeacher]:
    """Each domain's teacher: a `--teacher DOMAIN=PATH` override (domains naming one path share
    that teacher), a `--teacher-url DOMAIN=URL` (engine `vllm`: a server the user runs), or
    the domain's own, trained on first use and cached (`domain_teacher`, by `recipe`: by
    default in the Llama architecture for an engine)."""
    chosen, served = teacher_choices(config, overrides=overrides, urls=urls)
    # the user's files first: one that does not load is refused before a teacher is trained
    loaded = {
        path: teacher_from_path(path, device=device) for path in dict.fromkeys(chosen.values())
    }
    if recipe is None:
        recipe = ENGINE_RECIPE if config.engine is Engine.VLLM else DEFAULT_RECIPE
    out = {}
    for domain in config.domains:
        if domain in served:
            out[domain] = DomainTeacher(served[domain], None)
        elif domain in chosen:
            out[domain] = DomainTeacher(str(chosen[domain]), loaded[chosen[domain]])
        else:
            teacher = domain_teacher(
                domain, cache_dir=cache_dir, device=device, on_progress=say, recipe=recipe
            )
            out[domain] = DomainTeacher(f"{domain}-teacher", teacher)
    return out


def _check_domain(config: TrainConfig, domain: str, flag: str) -> None:
    if domain not in config.domains:
        raise ConfigError(f"{flag}: this run's domains are {list(config.domains)}", field="teacher")


def routes_for(config: TrainConfig, teachers: Mapping[str, DomainTeacher]) -> AliasMap:
    """Each domain routed to its physical teacher's name."""
    missing = [d for d in config.domains if d not in teachers]
    if missing:
        raise ConfigError(f"no teacher for domains {missing}", field="teachers")
    return AliasMap.build(
        {d: d for d in config.domains}, {d: teachers[d].name for d in config.domains}
    )
