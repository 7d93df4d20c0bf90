"""The multi-turn conversation workload shared by the benchmarks (kvlab/study/workloads/conversations.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlab.study.workloads.conversations import Conversations


def answer(tag: str) -> SimpleNamespace:
    return SimpleNamespace(token_ids=[1000 + len(tag), 2000])


def drive(work: Conversations) -> list[str]:
    """Play `replay`'s part: answer each request in arrival order, queue its follow-ups."""
    queue, order = list(work.first()), []
    while queue:
        req = queue.pop(0)
        order.append(req.tag)
        queue += work.follow_up(req, answer(req.tag), 0.0)
    return order


def test_round_robin_visits_every_conversation_before_the_next_turn():
    work = Conversations(list(range(500)), conversations=3, turns=2, user_len=4, max_tokens=2, context_len=16,
                         schedule="round_robin")
    assert drive(work) == ["conv0/turn0", "conv1/turn0", "conv2/turn0", "conv0/turn1", "conv1/turn1", "conv2/turn1"]
    first, second = work.prompts["conv1/turn0"], work.prompts["conv1/turn1"]
    assert len(first) == 16 + 4  # the shared-context document, then the first message
    assert second == first + work.answers["conv1/turn0"] + work.messages[1, 1]  # history, answer, new message


def test_concurrent_conversations_start_together_and_follow_their_own_answers():
    work = Conversations(list(range(500)), conversations=2, turns=3, user_len=5, max_tokens=2)
    assert [r.tag for r in work.first()] == ["conv0/turn0", "conv1/turn0"]
    drive(work)
    assert work.prompts["conv0/turn2"] == (work.messages[0, 0] + work.answers["conv0/turn0"] + work.messages[0, 1]
                                           + work.answers["conv0/turn1"] + work.messages[0, 2])
    again = Conversations(list(range(500)), conversations=2, turns=3, user_len=5, max_tokens=2)
    assert again.messages == work.messages  # the same text for every variant of a benchmark


def test_bad_workloads_are_refused():
    with pytest.raises(ValueError, match="schedule"):
        Conversations(list(range(50)), 1, 1, 4, 1, schedule="random")
    with pytest.raises(ValueError, match="fewer than a cut"):
        Conversations(list(range(50)), 1, 1, 4, 1, context_len=100)
