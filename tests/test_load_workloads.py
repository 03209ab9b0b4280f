"""Workloads: deterministic with a seed, and shaped as documented (reuse where there should be)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter

import pytest

from kvlab.errors import ConfigError
from kvlab.load.workloads import NAMES, create
from kvlab.tokenizer import Tokenizer

tok = Tokenizer()


def n_tokens(text: str) -> int:
    return len(tok.encode(text))


@pytest.mark.parametrize("name", [n for n in NAMES if n != "trace"])   # trace needs a file: test_open_loop.py
def test_same_seed_same_stream_other_seed_other_stream(name):
    a = create(name, seed=7).requests(20)
    b = create(name, seed=7).requests(20)
    c = create(name, seed=8).requests(20)
    assert a == b
    assert [r.messages for r in a] != [r.messages for r in c]


def test_shared_prefix_groups_share_their_system_prompt_only():
    w = create("shared-prefix", seed=1, params={"groups": 6, "prompts_per_group": 3, "system_tokens": 300,
                                                 "question_tokens": 20, "output_tokens": 8})
    reqs = w.requests(200)
    systems: dict[str, set[str]] = {}
    for r in reqs:
        assert r.messages[0]["role"] == "system" and r.messages[1]["role"] == "user"
        assert r.max_tokens == 8
        systems.setdefault(r.group, set()).add(r.messages[0]["content"])
    assert len(systems) == 6                                   # every group shows up
    assert all(len(s) == 1 for s in systems.values())          # one system prompt per group
    prompts = [next(iter(s)) for s in systems.values()]
    assert len(set(prompts)) == 6                              # and they differ between groups
    assert len({p.split()[0] + p.split()[1] for p in prompts}) > 1  # from the first tokens on
    assert all(280 <= n_tokens(p) <= 300 for p in prompts)
    questions = {(r.group, r.messages[1]["content"]) for r in reqs}
    assert len(questions) <= 6 * 3


def test_multi_turn_history_grows_and_extends_the_previous_turn():
    w = create("multi-turn", seed=2, params={"turns": 4})
    sessions = w.sessions()
    first, second = next(sessions), next(sessions)
    assert [r.turn for r in first] == [0, 1, 2, 3]
    for prev, cur in zip(first, first[1:]):
        assert cur.messages[: len(prev.messages)] == prev.messages   # the old conversation is the prefix
        assert len(cur.messages) == len(prev.messages) + 2           # + the answer and a new question
        assert cur.messages[-2]["role"] == "assistant" and cur.messages[-1]["role"] == "user"
    assert {r.group for r in first} != {r.group for r in second}
    assert first[0].messages[0] != second[0].messages[0]


def test_long_doc_qa_reuses_few_long_documents():
    w = create("long-doc-qa", seed=3, params={"documents": 3, "document_tokens": 1000})
    reqs = w.requests(40)
    docs = {r.messages[0]["content"].split("\n\nQuestion:")[0] for r in reqs}
    assert len(docs) == 3
    assert all(n_tokens(d) >= 900 for d in docs)


def test_random_has_no_reuse():
    reqs = create("random", seed=4, params={"prompt_tokens": 200}).requests(30)
    firsts = {" ".join(r.messages[0]["content"].split()[:8]) for r in reqs}
    assert len(firsts) == 30


def test_bad_parameters_and_names_are_errors():
    with pytest.raises(ConfigError, match="groupz"):
        create("shared-prefix", params={"groupz": 3})
    with pytest.raises(ConfigError, match="unknown workload"):
        create("nope")


def test_agentic_layers_system_tools_scratchpad_and_abandons_branches():
    w = create("agentic", seed=5, params={"agents": 3, "system_tokens": 200, "tool_tokens": 150,
                                          "steps": 8, "branch_probability": 0.3})
    sessions = list(itertools.islice(w.sessions(), 12))
    systems = {s[0].messages[0]["content"] for s in sessions}
    shared = {c.split("\n\nTools:\n")[0] for c in systems}
    assert len(shared) == 1 and 180 <= n_tokens(next(iter(shared))) <= 200   # one system prompt for all
    assert len(systems) == 3                                                   # one tool block per agent
    assert {s[0].group for s in sessions} == {"agent0", "agent1", "agent2"}
    branches = 0
    for s in sessions:
        assert [r.turn for r in s] == list(range(len(s)))
        extends = [any(later.messages[: len(r.messages)] == r.messages for later in s[i + 1:])
                   for i, r in enumerate(s)]
        main = [r for r, e in zip(s, extends) if e] + [s[-1]]
        abandoned = [r for r, e in zip(s[:-1], extends) if not e]   # no later step builds on it
        assert len(main) == 8
        for prev, cur in zip(main, main[1:]):   # each step adds one action and one observation
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert len(cur.messages) == len(prev.messages) + 2
            assert cur.messages[-2]["content"].startswith("Action:")
            assert cur.messages[-1]["content"].startswith("Observation:")
        for b in abandoned:     # a branch tried one step further from the main line
            assert any(b.messages[:-2] == m.messages for m in main)
        branches += len(abandoned)
    assert 0.15 < branches / (12 * 8) < 0.45


def test_long_context_prompts_near_the_limit_popular_and_new():
    w = create("long-context", seed=6, params={"contexts": 4, "context_tokens": 1500, "new_fraction": 0.2})
    reqs = w.requests(200)
    contexts: dict[str, set[str]] = {}
    for r in reqs:
        contexts.setdefault(r.group, set()).add(r.messages[0]["content"].split("\n\nQuestion:")[0])
    assert all(len(contexts[f"c{c}"]) == 1 for c in range(4) if f"c{c}" in contexts)
    assert len(contexts["new"]) == sum(r.group == "new" for r in reqs)        # every new one is unique
    assert 0.1 < len(contexts["new"]) / 200 < 0.3
    counts = Counter(r.group for r in reqs)
    assert counts["c0"] > 2 * counts["c3"]                                     # Zipf-like popularity
    assert all(1400 <= n_tokens(c) <= 1500 for c in contexts["c0"])


@pytest.mark.processes
def test_agentic_tool_calls_pause_later_steps_and_the_user_waits():
    """`tool_seconds`: every request after a session's first waits for its tool call (the session's
    KV sits idle meanwhile); the default stream has no pause, and the Locust user sleeps it."""
    plain = create("agentic", seed=3).session(0)
    paused = create("agentic", seed=3, params={"tool_seconds": 0.25}).session(0)
    assert all(r.pause_s == 0 for r in plain)
    assert [r.pause_s for r in paused] == [0.0] + [0.25] * (len(paused) - 1)
    assert [r.messages for r in paused] == [r.messages for r in plain]   # same stream otherwise
    # the user, in a process of its own (locust monkey-patches the interpreter at import)
    script = """
import locust  # first: it monkey-patches the interpreter
from kvlab.load import users
from kvlab.load.workloads import create
reqs = create("agentic", seed=3, params={"tool_seconds": 0.25}).session(0)[:3]
slept, sent = [], []
users.time.sleep = slept.append
users.FEED = type("Feed", (), {"next_session": lambda self: (0, reqs), "schedule": None})()
users.ChatUser.send = lambda self, f, req, session, step: sent.append((step, len(slept))) or type("R", (), {"status": 200})()
users.ChatUser.run_session(users.ChatUser.__new__(users.ChatUser))
print(sent, slept)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[(0, 0), (1, 1), (2, 2)] [0.25, 0.25]"   # each pause before its own request
