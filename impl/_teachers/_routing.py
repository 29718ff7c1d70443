"""Routing a group to its physical teacher: agents map to aliases, aliases to checkpoints, and
aliases that name the same checkpoint share one physical teacher. `resolve_teacher` is pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import attrs

from groupflow.model import GroupView
from groupflow.model.errors import ConfigError, RoutingError


@attrs.frozen
class RoutingConfig:
    default_alias: str | None = None
    """The alias an agent no map names goes to; None: such an agent is an error."""


@attrs.frozen
class AliasMap:
    """Agents to aliases, aliases to checkpoints; built once. Aliases naming the same checkpoint
    share one physical teacher, named by that checkpoint."""

    agent_alias: Mapping[str, str]
    alias_checkpoint: Mapping[str, str]

    @classmethod
    def build(cls, agent_alias: Mapping[str, str], alias_checkpoint: Mapping[str, str]) -> AliasMap:
        missing = sorted(set(agent_alias.values()) - set(alias_checkpoint))
        if missing:
            raise ConfigError(
                f"aliases with no checkpoint: {missing}",
                field="alias_checkpoint",
                config="AliasMap",
            )
        return cls(dict(agent_alias), dict(alias_checkpoint))

    @property
    def physical_teachers(self) -> frozenset[str]:
        return frozenset(self.alias_checkpoint.values())


def resolve_teacher(record: GroupView, alias_map: AliasMap, cfg: RoutingConfig) -> str:
    """The physical teacher (its checkpoint) that scores `record`'s group. Pure."""
    agent = record.agent
    alias = alias_map.agent_alias.get(agent) if agent is not None else None
    if alias is None:
        if cfg.default_alias is None:
            raise RoutingError(
                f"group {record.group_id!r} has agent {agent!r}, which no teacher alias maps "
                f"(mapped agents: {sorted(alias_map.agent_alias)}); map it or set default_alias"
            )
        alias = cfg.default_alias
    if alias not in alias_map.alias_checkpoint:
        raise RoutingError(
            f"alias {alias!r} has no checkpoint (known: {sorted(alias_map.alias_checkpoint)})"
        )
    return alias_map.alias_checkpoint[alias]


def router(alias_map: AliasMap, cfg: RoutingConfig) -> Callable[[GroupView], str]:
    """`resolve_teacher` bound to one map and config, as the stage's `route`."""
    return lambda record: resolve_teacher(record, alias_map, cfg)


def teacher_by_agent(
    teachers: Mapping[str, str], *, default: str | None = None
) -> Callable[[GroupView], str]:
    """A router for the simple case: each agent names its physical teacher directly."""
    checkpoints = {t: t for t in teachers.values()}
    if default is not None:
        checkpoints[default] = default
    return router(AliasMap.build(teachers, checkpoints), RoutingConfig(default_alias=default))
