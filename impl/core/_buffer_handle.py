"""The buffer as one actor sees it: `ReplayBuffer.as_actor(actor)`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import attrs

from groupflow.impl.core._slot import Selection
from groupflow.impl.core._store import Row
from groupflow.model import Actor, GroupState, GroupView

if TYPE_CHECKING:
    from groupflow.impl.core._buffer import ReplayBuffer


@attrs.frozen
class BufferHandle:
    """The buffer as one actor sees it: its changes fire as that actor (see `as_actor`).
    Reads go to `buffer` itself."""

    buffer: ReplayBuffer
    actor: Actor

    def reserve(
        self,
        *,
        target_step: int,
        ordinal: int | None = None,
        agent: str | None = None,
        group_id: str | None = None,
    ) -> str:
        return self.buffer.reserve(
            target_step=target_step,
            ordinal=ordinal,
            agent=agent,
            group_id=group_id,
            actor=self.actor,
        )

    async def commit(
        self,
        group_id: str,
        rows: Sequence[Row],
        *,
        start_weight_version: int,
        end_weight_version: int,
        defer_ready: bool = False,
    ) -> GroupView:
        return await self.buffer.commit(
            group_id,
            rows,
            start_weight_version=start_weight_version,
            end_weight_version=end_weight_version,
            defer_ready=defer_ready,
            actor=self.actor,
        )

    def take_for_scoring(self, group_ids: Iterable[str]) -> tuple[GroupView, ...]:
        return self.buffer.take_for_scoring(group_ids, actor=self.actor)

    async def mark_ready_many(
        self, group_ids: Iterable[str], fields: Iterable[str]
    ) -> tuple[GroupState, ...]:
        return await self.buffer.mark_ready_many(group_ids, fields, actor=self.actor)

    def retry(self, group_id: str) -> int:
        return self.buffer.retry(group_id, actor=self.actor)

    async def discard(self, group_id: str, *, then: Callable[[], object] | None = None) -> None:
        await self.buffer.discard(group_id, actor=self.actor, then=then)

    async def discard_many(
        self, group_ids: Iterable[str], *, then: Callable[[], object] | None = None
    ) -> None:
        await self.buffer.discard_many(group_ids, actor=self.actor, then=then)

    def select(self, *, step: int, weight_version: int) -> Selection:
        return self.buffer.select(step=step, weight_version=weight_version, actor=self.actor)
