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
from kvlab.gateway.scheduler.base import Picker
from kvlab.gateway.scheduler.max_score import MaxScore
from kvlab.gateway.scheduler.random_choice import RandomChoice
from kvlab.gateway.scheduler.registry import plugin


class PickerParams(Strict, frozen=True, rename="camel"):
    max_num_of_endpoints: Annotated[int, msgspec.Meta(ge=1)] = 1


class _OneEndpoint(Picker):
    """An upstream picker's parameters: `maxNumOfEndpoints` must be 1 (kvlab picks one endpoint)."""

    @classmethod
    def from_epp(cls, parameters: dict[str, Any], rng: random.Random) -> Self:
        p = convert(parameters, PickerParams, f"plugin {cls.name} parameters")
        if p.max_num_of_endpoints != 1:
            raise ConfigError(f"plugin {cls.name}: kvlab picks one endpoint "
                              f"(maxNumOfEndpoints 1, got {p.max_num_of_endpoints})")
        return cls(rng)


@plugin
class MaxScorePicker(_OneEndpoint, MaxScore):
    name = "max-score-picker"


@plugin
class RandomPicker(_OneEndpoint, RandomChoice):
    name = "random-picker"
