"""An llm-d / Gateway API Inference Extension `EndpointPickerConfig`, typed and parsed once.

The format is upstream's (kubernetes-sigs/gateway-api-inference-extension
`apix/config/v1alpha1/endpointpickerconfig_types.go`, and llm-d's `deploy/config/*.yaml`):
`plugins:` instantiates plug-ins by `type` (named by `name`, default the type) with free-form
`parameters`; `schedulingProfiles:` lists, per profile, the plug-ins it runs by `pluginRef` with a
scorer's `weight`. Each plug-in checks its own parameters when the scheduler is built
(`gateway/scheduler/epp.py`), so an unknown type or parameter is refused before anything runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

from kvlab.config import Strict, convert, read_yaml
from kvlab.errors import ConfigError


class PluginSpec(Strict, frozen=True):
    type: str
    name: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def ref(self) -> str:
        return self.name or self.type


class PluginRef(Strict, frozen=True, rename="camel"):
    plugin_ref: str
    weight: float | None = None        # scorers only; upstream's default is 1


class SchedulingProfile(Strict, frozen=True):
    name: str
    plugins: list[PluginRef]


class EndpointPickerConfig(Strict, frozen=True, rename="camel"):
    api_version: Literal["inference.networking.x-k8s.io/v1alpha1"]
    kind: Literal["EndpointPickerConfig"]
    plugins: list[PluginSpec]
    scheduling_profiles: list[SchedulingProfile]

    def __post_init__(self) -> None:
        refs = [p.ref for p in self.plugins]
        if len(set(refs)) != len(refs):
            raise ConfigError(f"EndpointPickerConfig: two plugins share a name ({', '.join(refs)})")
        if len(self.scheduling_profiles) != 1:
            raise ConfigError("EndpointPickerConfig: kvlab runs exactly one scheduling profile "
                              f"(got {len(self.scheduling_profiles)})")
        known = set(refs)
        for ref in self.scheduling_profiles[0].plugins:
            if ref.plugin_ref not in known:
                raise ConfigError(f"EndpointPickerConfig: profile {self.scheduling_profiles[0].name!r} refers to "
                                  f"plugin {ref.plugin_ref!r}, which `plugins:` does not define")


def read(path: str | Path) -> EndpointPickerConfig:
    """The file's config, or a ConfigError naming what is wrong."""
    data = read_yaml(Path(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected an EndpointPickerConfig mapping")
    return convert(data, EndpointPickerConfig, str(path))
