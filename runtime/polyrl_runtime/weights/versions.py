"""The coordinator's record of which version each policy published and each engine holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from polyrl_runtime.weights.api import VersionError, WeightManifest


@dataclass
class _PolicyVersions:
    latest: WeightManifest | None = None
    engines: dict[str, int] = field(default_factory=dict)


class VersionRegistry:
    """Per policy: the latest manifest (what a late joiner catches up to) and every engine's version.

    Versions are monotone per policy; an engine is `ready` for work only at the latest version, so a
    scaled-out engine gets no episodes until it has caught up.
    """

    def __init__(self) -> None:
        self._policies: dict[str, _PolicyVersions] = {}

    def _versions_of(self, policy: str) -> _PolicyVersions:
        return self._policies.setdefault(policy, _PolicyVersions())

    def publish(self, manifest: WeightManifest) -> None:
        p = self._versions_of(manifest.policy)
        if p.latest is not None and manifest.version < p.latest.version:
            raise VersionError(
                f"{manifest.policy}: version {manifest.version} is older than published {p.latest.version}"
            )
        p.latest = manifest

    def latest(self, policy: str) -> WeightManifest | None:
        return self._versions_of(policy).latest

    def latest_version(self, policy: str) -> int:
        m = self._versions_of(policy).latest
        return -1 if m is None else m.version

    def record(self, policy: str, engine: str, version: int) -> None:
        engines = self._versions_of(policy).engines
        if version < engines.get(engine, -1):
            raise VersionError(f"{policy}/{engine}: version {version} < recorded {engines[engine]}")
        engines[engine] = version

    def join(self, policy: str, engine: str) -> None:
        """Register an engine (at version -1) so it counts as lagging until it has caught up."""
        self._versions_of(policy).engines.setdefault(engine, -1)

    def forget(self, policy: str, engine: str) -> None:
        self._versions_of(policy).engines.pop(engine, None)

    def engine_version(self, policy: str, engine: str) -> int:
        return self._versions_of(policy).engines.get(engine, -1)

    def engines(self, policy: str) -> dict[str, int]:
        return dict(self._versions_of(policy).engines)

    def ready(self, policy: str, engine: str) -> bool:
        return engine in self._versions_of(policy).engines and self.engine_version(
            policy, engine
        ) == self.latest_version(policy)

    def lagging(self, policy: str) -> list[str]:
        latest = self.latest_version(policy)
        return sorted(e for e, v in self._versions_of(policy).engines.items() if v < latest)
