"""Where the Ray teacher worker group and the TransferQueue store run: a Ray session, started
on this machine or joined on an existing cluster.

Ray is an optional extra (`pip install 'groupflow[ray]'`): it is imported when a session is
opened, never when this module is. A local session is sized by the caller (`num_cpus`), starts
no dashboard and keeps every address on 127.0.0.1; it is shut down by whoever started it. A
session that joins a cluster (`address=`) leaves the cluster alone when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import attrs

from groupflow.model.errors import ConfigError, Unavailable

log = logging.getLogger("groupflow.ray")

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to "0" before Ray is imported, Ray takes 127.0.0.1 as this node's address (Ray reads
it once, when it is imported)."""
QUIET_ENV = {"RAY_AUTH_MODE": "disabled", "TQ_NUM_THREADS": "1"}
"""Set (unless already set) for a local session: no token warning from Ray, and no warning
per TransferQueue call about torch's thread count."""


def keep_ray_local() -> bool:
    """Tell Ray, before it is imported, to keep a local Ray on 127.0.0.1 and to stay quiet
    (what is set already is kept). Returns False when Ray was imported already: then it is too
    late for the address, and `ray_session` warns."""
    if "ray" in sys.modules:
        return False
    os.environ.setdefault(LOOPBACK_ENV, "0")
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    return True


def import_ray(*, local: bool = False) -> ModuleType:
    """The `ray` module, or `Unavailable` naming the extra to install. With `local`, Ray is
    first told to keep to 127.0.0.1 and to stay quiet (`keep_ray_local`)."""
    if local:
        keep_ray_local()
    try:
        import ray
    except ImportError as exc:
        raise Unavailable(
            "Ray is not installed: pip install 'groupflow[ray]' (the teacher worker group) "
            "or 'groupflow[tq]' (the TransferQueue store)"
        ) from exc
    module: ModuleType = ray  # typed the same whether or not mypy sees Ray installed
    return module


def _positive_or_none(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"RaySettings.{attribute.name} must be an int >= 0 or None, got {value!r}",
            field=attribute.name,
            config="RaySettings",
        )


@attrs.frozen
class RaySettings:
    """How groupflow reaches Ray.

    `address=None` starts Ray on this machine (or uses the one this process already runs);
    `address="auto"` joins the cluster this machine is a node of (`ray start` ran here);
    `address="ray://head:10001"` joins a remote cluster through the Ray Client. Every node must
    have groupflow and the teachers' packages installed (the actors import them)."""

    address: str | None = None
    num_cpus: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Logical CPUs of a local Ray (None: as many as the machine has). Size it for what runs
    there: each teacher actor's `num_cpus_per_actor`, and a TransferQueue store's controller
    and storage units (one CPU each)."""
    num_gpus: int | None = attrs.field(default=None, validator=_positive_or_none)
    """GPUs of a local Ray (None: those Ray finds)."""
    namespace: str = "groupflow"

    def __attrs_post_init__(self) -> None:
        if self.address is not None and (self.num_cpus is not None or self.num_gpus is not None):
            raise ConfigError(
                f"RaySettings: num_cpus={self.num_cpus} and num_gpus={self.num_gpus} size a "
                f"local Ray; a cluster (address={self.address!r}) has the resources it has",
                field="num_cpus",
                config="RaySettings",
            )


@attrs.frozen
class RaySession:
    """What `ray_session` opened: whether it started Ray (and so shuts it down), and where."""

    started: bool
    address: str
    """The address of the Ray it uses (the GCS address of a local Ray)."""
    resources: dict[str, float]


@contextlib.contextmanager
def ray_session(settings: RaySettings | None = None) -> Iterator[RaySession]:
    """A Ray session for the length of the block: the one this process already has, else a
    new local Ray (no dashboard, bound to 127.0.0.1) or the cluster at `settings.address`.
    Ray is shut down at the end only if this call started or joined it."""
    settings = settings or RaySettings()
    ray = import_ray(local=settings.address is None)
    if ray.is_initialized():
        yield _describe(ray, started=False)
        return
    kwargs: dict[str, Any] = {
        "namespace": settings.namespace,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    if settings.address is None:
        # "local": a new Ray of this process's own, never a cluster this machine ran before
        # (Ray would join the one `RAY_ADDRESS` or its file of the last cluster names, dead
        # or alive, and refuse the sizes given)
        kwargs.update(
            address="local",
            num_cpus=settings.num_cpus,
            num_gpus=settings.num_gpus,
            include_dashboard=False,
        )
        if os.environ.get(LOOPBACK_ENV) != "0":
            log.warning(
                "Ray was imported before groupflow could keep it on 127.0.0.1: set %s=0 "
                "before importing ray to keep a local Ray off the network",
                LOOPBACK_ENV,
            )
    else:
        kwargs["address"] = settings.address
    ray.init(**kwargs)
    try:
        yield _describe(ray, started=True)
    finally:
        ray.shutdown()


def _describe(ray: ModuleType, *, started: bool) -> RaySession:
    context = ray.get_runtime_context()
    address = str(getattr(context, "gcs_address", "") or "")
    resources = {k: float(v) for k, v in ray.cluster_resources().items()}
    return RaySession(started=started, address=address, resources=resources)
