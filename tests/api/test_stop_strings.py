"""Stop strings (vLLM's `stop`): matched on the detokenised output, across token boundaries.

Pure-Python checks of the incremental detokeniser and the matcher (a byte-level toy tokenizer, where
a character's UTF-8 bytes span tokens), then the engine on the tiny random Llama given a toy
tokenizer (every token decodes to two letters, so a stop string can end inside a token), with
speculative decoding and with n > 1, and SmolLM2's real tokenizer (`model`).
"""

from __future__ import annotations

import random

import pytest

from kvlab import LLM, SamplingParams
from kvlab.models import load_model
from kvlab.stop_strings import IncrementalDetokenizer, StopStrings, find_stop


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: token t is byte t."""
    return bytes(ids).decode("utf-8", errors="replace")


# -- the detokeniser and the matcher ---------------------------------------------------------
def test_a_character_split_over_tokens_is_released_whole_by_the_token_that_completes_it():
    d = IncrementalDetokenizer(byte_decode)
    ids = list("aé😀b".encode())  # 1 + 2 + 4 + 1 bytes
    released = [d.append(t) for t in ids]
    assert released == [1, 0, 1, 0, 0, 0, 1, 1]
    assert d.text == "aé😀b"


def test_incremental_text_equals_the_full_decode_on_random_bytes():
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(128), rng.randrange(256)]) for _ in range(rng.randrange(1, 40))]
        d = IncrementalDetokenizer(byte_decode)
        for t in ids:
            d.append(t)
        full = byte_decode(ids)
        assert full.startswith(d.text) and set(full[len(d.text):]) <= {"\ufffd"}


@pytest.mark.parametrize("include, text", [(False, "one, two"), (True, "one, two\n\n")])
def test_a_stop_string_spanning_tokens_is_found_and_the_text_cut(include, text):
    stops = StopStrings(byte_decode, ["\n\n", "three"], include)
    ids = list(b"one, two\n\nthree")
    done = next(i for i, t in enumerate(ids) if stops.append(t))
    assert done == len("one, two\n\n") - 1  # the second newline completes the match
    assert (stops.matched, stops.text) == ("\n\n", text)


def test_the_earliest_stop_string_wins_when_one_token_completes_several():
    assert find_stop("xxabcd", 2, ["cd", "bcd", "abcd"]) == ("abcd", 2)
    assert find_stop("ab" + "cd", 2, ["zz"]) is None
    assert find_stop("abcd", 1, ["bc"]) is None  # ended before the new characters: found earlier, or never


def test_a_fork_primed_with_its_inherited_output_matches_only_new_text():
    stops = StopStrings(byte_decode, ["ab"])
    stops.prime(list(b"xxab"))  # an earlier "ab" is the parent's, already past
    assert not stops.append(ord("a")) and stops.append(ord("b")) and stops.text == "xxab"


def test_a_multibyte_stop_string_is_found_when_its_last_byte_arrives():
    stops = StopStrings(byte_decode, ["é!"])
    ids = list("café!".encode())
    done = [stops.append(t) for t in ids]
    assert done == [False] * (len(ids) - 1) + [True] and stops.text == "caf"


@pytest.mark.parametrize("stop, message", [
    (3, "stop must be a string or a list of strings, got 3"),
    ([""], "stop strings must be non-empty strings, got ''"),
    (["a", 5], "stop strings must be non-empty strings, got 5"),
    (b"\n", "stop must be a string or a list of strings"),
])
def test_bad_stop_strings_are_refused_when_the_params_are_built(stop, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(stop=stop)


def test_stop_takes_a_string_or_a_list_as_vllm_does():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    with pytest.raises(ValueError, match="include_stop_str_in_output must be True or False"):
        SamplingParams(stop="a", include_stop_str_in_output="yes")


# -- the engine, with a toy tokenizer ---------------------------------------------------------
LETTERS = "abcdefghijklmnopqrstuvwxyz"


class TwoLetters:
    """Token t decodes to two letters, so text position 2k + 1 is the second letter of token k."""

    eos_token_id = None
    bos_token_id = None

    @staticmethod
    def piece(t: int) -> str:
        return LETTERS[t % 26] + LETTERS[(t // 26) % 26]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.piece(t) for t in ids)


def tiny(**kwargs) -> LLM:
    loaded = load_model("random:llama-tiny")
    loaded.tokenizer = TwoLetters()
    return LLM("random:llama-tiny", loaded=loaded, kv_cache_memory="2MiB", block_size=4, **kwargs)


PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


def expected(tokens: list[int], stop: str, include: bool = False) -> tuple[list[int], str]:
    """What a stop string must leave of an unstopped run: tokens up to the one completing its first
    occurrence, text up to (or through) it."""
    text = TwoLetters().decode(tokens)
    i = text.index(stop)
    last = (i + len(stop) - 1) // 2
    return tokens[:last + 1], text[:i + len(stop)] if include else text[:i]


def spanning_stop(tokens: list[int], k: int = 4) -> str:
    """Three characters: the second letter of token k and both of token k + 1 (spans a boundary)."""
    return TwoLetters().decode(tokens)[2 * k + 1:2 * k + 4]


@pytest.fixture(scope="module")
def plain():
    llm = tiny()
    return llm, llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))


@pytest.mark.parametrize("include", [False, True])
def test_engine_stops_at_the_token_completing_the_stop_string(plain, include):
    llm, base = plain
    stops = [spanning_stop(o.token_ids) for o in base]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, stop=[s], include_stop_str_in_output=include)
              for s in stops]
    outs = llm.generate(PROMPTS, params)
    for out, ref, stop in zip(outs, base, stops):
        tokens, text = expected(ref.token_ids, stop, include)
        assert (out.token_ids, out.text) == (tokens, text)
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert len(out.token_ids) < len(ref.token_ids)
    assert not llm.engine.has_unfinished()


def test_a_stop_string_never_generated_leaves_the_run_as_it_was(plain):
    llm, base = plain
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True, stop=["#"]))
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs] == \
        [(o.token_ids, o.text, "length", None) for o in base]


def test_a_stop_token_reports_its_id_as_the_stop_reason(plain):
    llm, base = plain
    token = base[0].token_ids[3]
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[token]))[0]
    first = base[0].token_ids.index(token)
    assert out.token_ids == base[0].token_ids[:first + 1] and (out.finish_reason, out.stop_reason) == ("stop", token)


def test_speculative_runs_stop_at_the_first_token_completing_a_match(plain, monkeypatch):
    """A draft equal to the target (same random weights) has every token accepted: verified runs of
    several tokens are appended per step, and the stop lands inside one of them. (The draft loads
    without the toy tokenizer: the vocabulary check, which compares tokenizers, is skipped.)"""
    from kvlab.speculation.drafts.model import ModelDraft

    monkeypatch.setattr(ModelDraft, "_check_vocabulary", lambda self, loaded, engine: None)
    _, base = plain
    llm = tiny(draft="model", draft_args={"model": "random:llama-tiny", "num_tokens": 4})
    stops = [spanning_stop(o.token_ids, k) for o, k in zip(base, (6, 9))]
    outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=16, ignore_eos=True, stop=[s]) for s in stops])
    assert llm.stats()["spec_accepted_tokens"] > 0
    for out, ref, stop in zip(outs, base, stops):
        assert (out.token_ids, out.text, out.stop_reason) == (*expected(ref.token_ids, stop), stop)


def test_every_sample_of_n_stops_on_its_own_text():
    llm = tiny()
    params = dict(max_tokens=16, ignore_eos=True, temperature=1.0, seed=11, n=3)
    free = llm.generate(PROMPTS[0], SamplingParams(**params))[0]
    stops = [spanning_stop(o.token_ids, k) for o, k in zip(free.outputs, (3, 5, 7))]  # one per sample
    stopped = llm.generate(PROMPTS[0], SamplingParams(**params, stop=stops))[0]
    assert [o.index for o in stopped.outputs] == [0, 1, 2]
    for out, ref in zip(stopped.outputs, free.outputs):
        i, stop = min((ref.text.index(s), s) for s in stops if s in ref.text)  # the first any sample's stop
        assert (out.text, out.stop_reason, out.finish_reason) == (ref.text[:i], stop, "stop")
        assert out.token_ids == ref.token_ids[:(i + len(stop) - 1) // 2 + 1]


def first_completed(text: str, stops: list[str], after: int) -> tuple[int, str]:
    """(start, stop) of the occurrence a matcher primed with text[:after] finds first: the one whose
    completing token (two letters a token) comes first, then the one that starts first."""
    found = [((i + len(s) - 1) // 2, i, s) for s in stops for i in range(len(text)) if text.startswith(s, i)
             and i + len(s) > after]
    _, i, s = min(found)
    return i, s


def test_a_fork_matches_only_the_text_it_generates(plain):
    """engine.fork with stop strings: the child's matcher is primed with the output it inherits (never
    searched), so a stop string in that output does not stop it; one in its own text does."""
    llm, base = plain
    engine, ref = llm.engine, base[0]
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=16, ignore_eos=True))
    parent = next(s for s in engine.scheduler.running + list(engine.scheduler.waiting) if s.seq_id == rid)
    while parent.num_output_tokens < 6:
        engine.step()
    inherited = TwoLetters().decode(ref.token_ids[:6])
    stops = [inherited[1:4], spanning_stop(ref.token_ids, 9)]  # one in the inherited text, one after
    child = engine.fork(rid, SamplingParams(max_tokens=16, ignore_eos=True, stop=stops))
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    text = TwoLetters().decode(ref.token_ids)
    i, stop = first_completed(text, stops, len(inherited))
    assert (done[child].text, done[child].stop_reason) == (text[:i], stop)
    assert done[child].token_ids == ref.token_ids[:(i + len(stop) - 1) // 2 + 1]
    assert done[rid].token_ids == ref.token_ids


def test_stop_strings_without_a_tokenizer_are_refused_when_the_request_is_made():
    llm = LLM("random:llama-tiny", kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match=r"prompt 0: stop strings \['\\n'\] are matched on the detokenised "
                                         r"output, and this model has no tokenizer \(random weights\)"):
        llm.generate([[3, 4]], SamplingParams(stop="\n"))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.engine.add_request([3, 4], SamplingParams(stop="\n"))
    assert not llm.engine.has_unfinished()


# -- SmolLM2's tokenizer -----------------------------------------------------------------------
@pytest.mark.model
def test_smollm2_stop_string_spanning_two_tokens(fresh_model):
    llm = LLM("smollm2-135m", loaded=fresh_model("smollm2-135m"), kv_cache_memory="16MiB")
    tok = llm.tokenizer
    prompt = "The capital of France is Paris. The capital of Germany is"
    base = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    pieces = [tok.decode([t]) for t in base.token_ids]
    k = next(i for i in range(1, len(pieces) - 1) if pieces[i].strip() and len(pieces[i + 1].strip()) > 1)
    stop = pieces[k][-1] + pieces[k + 1][:2]  # the last character of token k, the first two of token k + 1
    cut, kept = llm.generate([prompt] * 2, [SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop],
                                                           include_stop_str_in_output=include)
                                            for include in (False, True)])
    i = base.text.index(stop)
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (base.text[:i], "stop", stop)
    assert kept.text == base.text[:i + len(stop)]
    completing = next(n for n in range(1, len(base.token_ids) + 1) if stop in tok.decode(base.token_ids[:n]))
    assert cut.token_ids == kept.token_ids == base.token_ids[:completing] and completing < len(base.token_ids)
