"""Locust load shape following a `kvlab.load.ramp.Ramp`: load it next to the kvlab locustfile,

    locust -f kvlab/load/locustfile.py,kvlab/load/ramp_shape.py --ramp '{"points": [[0,1],[30,12],[60,1]]}'

(`--ramp` or KVLAB_RAMP; `kvlab bench`/`kvlab lab` pass both when they run a ramp). Locust then
ignores --users/--spawn-rate/--run-time: the ramp decides, and the test stops at its last point.
"""

from __future__ import annotations

from typing import Any

from locust import LoadTestShape, events

from kvlab.load.ramp import Ramp

SPAWN_RATE = 100.0   # users started/stopped per second: each tick reaches the ramp's count at once


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]  # locust's event hooks are untyped
def _options(parser: Any) -> None:
    parser.add_argument("--ramp", default="", env_var="KVLAB_RAMP",
                        help='users over time as JSON {"points": [[seconds, users], ...]}')


class RampShape(LoadTestShape):
    _ramp: Ramp | None = None

    def ramp(self) -> Ramp:
        if self._ramp is None:
            assert self.runner is not None and self.runner.environment.parsed_options is not None
            self._ramp = Ramp.from_json(self.runner.environment.parsed_options.ramp)
        return self._ramp

    def tick(self) -> tuple[int, float] | None:
        users = self.ramp().users_at(self.get_run_time())  # type: ignore[no-untyped-call]  # locust
        return None if users is None else (users, SPAWN_RATE)
