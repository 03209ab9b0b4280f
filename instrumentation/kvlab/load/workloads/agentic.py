"""agentic: tool-using agents whose scratchpad grows every step, with abandoned branches.

Every agent shares one system prompt (the framework's instructions), then carries its own tool
block (the tools it may call), then a task. Each step resends everything so far plus the
scratchpad: the agent's thought/action (assistant) and the tool's observation (user). Now and then
the agent tries a branch that is abandoned: that request is sent, and the next step continues
from the scratchpad *without* it, so the branch's blocks are a dead end a cache keeps for nothing.
Reuse therefore comes in three layers: the shared system prompt (all sessions), the tool block
(sessions of one agent), the scratchpad (the steps of one session).

Two switches give the prompt the typed structure lab 09 (docs/semantic-kv.md) needs, off by default
so earlier results replay unchanged: `tools_message` sends the tool block as a second system
message (a template-independent place a gateway can tell apart from the system prompt: the tiny
model's template does not render the `tools` field), `hint_branches` marks each branch request
with the client hint `x-kvlab-kv-hint: branch` (its reasoning is explored, then abandoned).
`tool_seconds` makes the user wait for a tool call before each later step: meanwhile the
session's KV sits idle in the replica's free queue, where a retention policy decides its fate.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from functools import cached_property

from kvlab.load.workloads.base import Params, Workload, WorkloadRequest, text


class AgenticParams(Params, frozen=True):
    agents: int = 4
    system_tokens: int = 600
    tool_tokens: int = 500
    task_tokens: int = 80
    steps: int = 6
    step_tokens: int = 60          # the agent's thought and action, kept in the scratchpad
    observation_tokens: int = 120  # the tool's answer, kept in the scratchpad
    branch_probability: float = 0.2
    output_tokens: int = 32
    tools_message: bool = False    # the tool block as its own system message, not appended to the prompt
    hint_branches: bool = False    # branch requests carry the hint `branch`
    tool_seconds: float = 0.0      # the tool call before each later step: the session's KV sits idle meanwhile


class Agentic(Workload[AgenticParams]):
    name = "agentic"
    Params = AgenticParams

    @cached_property
    def _system(self) -> str:
        return text(self.rng("system"), self.params.system_tokens)

    def session(self, i: int) -> list[WorkloadRequest]:
        p = self.params
        rng = self.rng("session", i)
        agent = rng.randrange(p.agents)
        tools = "Tools:\n" + self.texts("tools", p.agents, p.tool_tokens)[agent]
        head = ([{"role": "system", "content": self._system}, {"role": "system", "content": tools}]
                if p.tools_message else [{"role": "system", "content": f"{self._system}\n\n{tools}"}])
        messages = [*head, {"role": "user", "content": "Task: " + text(rng, p.task_tokens) + "."}]
        out: list[WorkloadRequest] = []

        def step() -> list[dict[str, str]]:
            return [{"role": "assistant", "content": "Action: " + text(rng, p.step_tokens) + "."},
                    {"role": "user", "content": "Observation: " + text(rng, p.observation_tokens) + "."}]

        for k in range(p.steps):
            out.append(WorkloadRequest(messages=messages, max_tokens=p.output_tokens, group=f"agent{agent}", turn=len(out),
                                       pause_s=p.tool_seconds if k else 0.0))
            if k < p.steps - 1 and rng.random() < p.branch_probability:   # tried, abandoned: the next step goes without it
                out.append(WorkloadRequest(messages=[*messages, *step()], max_tokens=p.output_tokens,
                                   group=f"agent{agent}", turn=len(out),
                                   hint="branch" if p.hint_branches else None, pause_s=p.tool_seconds))
            messages = [*messages, *step()]
        return out

    def sessions(self) -> Iterator[list[WorkloadRequest]]:
        for i in itertools.count():
            yield self.session(i)
