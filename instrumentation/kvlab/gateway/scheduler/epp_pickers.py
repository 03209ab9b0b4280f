"""GIE's pickers under their upstream names: `max-score-picker` (the highest total, ties broken
at random: kubernetes-sigs/gateway-api-inference-extension
`pkg/epp/scheduling/framework/plugins/picker/max_score_picker.go`, which shuffles before sorting)
and `random-picker` (`picker/random_picker.go`). `maxNumOfEndpoints` (default 1) is read and must
be 1: kvlab sends a request to one endpoint, the rest of the order is its fallback on a refused
connection."""

from __future__ import annotations

import random
from typing import Annotated, Any, Self

import msgspec

from kvlab.config import Strict, convert
from kvlab.errors import ConfigError
from kvlab.gateway.scheduler.max_score import MaxScore
from kvlab.gateway.scheduler.random_choice import RandomChoice
from kvlab.gateway.scheduler.registry import plugin


class PickerParams(Strict, frozen=True, rename="camel"):
    max_num_of_endpoints: Annotated[int, msgspec.Meta(ge=1)] = 1


def _params(name: str, parameters: dict[str, Any]) -> PickerParams:
    p = convert(parameters, PickerParams, f"plugin {name} parameters")
    if p.max_num_of_endpoints != 1:
        raise ConfigError(f"plugin {name}: kvlab picks one endpoint "
                          f"(maxNumOfEndpoints 1, got {p.max_num_of_endpoints})")
    return p


@plugin
class MaxScorePicker(MaxScore):
    name = "max-score-picker"

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        _params(cls.name, parameters)
        return cls(rng)


@plugin
class RandomPicker(RandomChoice):
    name = "random-picker"

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        _params(cls.name, parameters)
        return cls(rng)
