"""kvlab/study/hf_assistant.py: the draft length, schedule and confidence stop it sets reach Hugging Face's
candidate generator (transformers reads them from the assistant's generation_config, not from generate()'s
keyword arguments), for a separate assistant model and for assistant_early_exit (the model itself)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
candidate_generator = pytest.importorskip("transformers.generation.candidate_generator")

from kvlab.study.hf_assistant import set_assistant_options  # noqa: E402


@pytest.fixture(scope="module")
def target():
    from kvlab.models import load_model

    torch.manual_seed(0)
    return load_model("random:llama-tiny").model.eval()


def drafted(monkeypatch, target, **assist) -> list[tuple[int, object]]:
    """(tokens drafted, the generator's settings) for each verification of one greedy 12-token generation."""
    seen = []
    original = candidate_generator.AssistedCandidateGenerator.get_candidates

    def recording(self, input_ids, **kwargs):
        ids, logits = original(self, input_ids, **kwargs)
        cfg = self.assistant_generation_config
        seen.append((ids.shape[1] - input_ids.shape[1],
                     (self.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold)))
        return ids, logits

    monkeypatch.setattr(candidate_generator.AssistedCandidateGenerator, "get_candidates", recording)
    x = torch.tensor([[5, 6, 7, 8] * 4])
    with torch.no_grad():
        target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                        pad_token_id=0, **assist)
    return seen


def test_options_reach_an_assistant_models_candidate_generator(monkeypatch, target):
    assistant = copy.deepcopy(target)  # the target's own weights: every drafted token is accepted
    set_assistant_options(assistant, 3, "constant", 0.0)
    seen = drafted(monkeypatch, target, assistant_model=assistant)
    assert seen and all(settings == (3, "constant", 0.0) for _, settings in seen)
    assert [n for n, _ in seen[:-1]] == [3] * (len(seen) - 1)  # 3 a verification (the last one: what is left)


def test_options_reach_the_early_exit_generator(monkeypatch, target):
    model = copy.deepcopy(target)  # assistant_early_exit's assistant is the model itself
    set_assistant_options(model, 3, "heuristic_transient", 0.0)
    seen = drafted(monkeypatch, model, assistant_early_exit=1)
    assert seen and all(settings[1:] == ("heuristic_transient", 0.0) for _, settings in seen)
    assert seen[0] == (3, (3, "heuristic_transient", 0.0))  # the first chain is g long, unstopped by confidence


def test_an_unknown_schedule_is_refused(target):
    with pytest.raises(ValueError, match="schedule"):
        set_assistant_options(copy.deepcopy(target), 3, "step")
