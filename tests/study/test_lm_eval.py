"""kvlab as lm-eval's `kvlab` model, on random:llama-tiny: model_args routing and errors, the three request
kinds against kvlab's own API, the offline task data, the Hydra task's metric names. The parity with
lm-eval's `hf` backend on real weights is tests/study/test_lm_eval_parity.py."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is an extra: pip install -e .[lm_eval]")

import kvlab.study.lm_eval  # noqa: E402  (registers the model)
from kvlab import LLM, SamplingParams  # noqa: E402
from kvlab.study.lm_eval import KvlabLM, args  # noqa: E402
from kvlab.study.lm_eval.args import ModelArgsError, split_model_args  # noqa: E402
from kvlab.study.lm_eval.generation import cut_at_stop, parse_gen_kwargs  # noqa: E402
from kvlab.study.lm_eval.model import rolling_windows  # noqa: E402

TINY = dict(pretrained="random:llama-tiny", block_size=8, kv_cache_memory="4MiB", max_model_len=129)


class Req:
    """The part of lm-eval's Instance the model reads."""

    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def lm():
    return KvlabLM(**TINY)


# -- model_args ----------------------------------------------------------------------------------

def test_importing_registers_the_kvlab_model():
    from lm_eval.api.registry import get_model

    assert get_model("kvlab") is KvlabLM


def test_flat_keys_go_to_the_chosen_plugins_section():
    engine, harness = split_model_args({"pretrained": "smollm2-135m", "policy": "snapkv", "compression_ratio": 0.5,
                                        "quant": "int4", "group_size": 32, "draft": None, "block_size": 16,
                                        "kv_cache_memory": "1GiB", "batch_size": 8})
    assert engine == {"model": "smollm2-135m", "policy": "snapkv", "policy_args": {"compression_ratio": 0.5},
                      "quant": "int4", "quant_args": {"group_size": 32}, "draft": None, "block_size": 16,
                      "kv_cache_memory": "1GiB"}
    assert harness["batch_size"] == 8


def test_nested_and_dotted_spellings():
    engine, _ = split_model_args({"policy": "snapkv", "policy_args": "{'budget': 64, 'window_size': 8}",
                                  "draft": "ngram", "draft.num_tokens": 3, "quant_args": {}})
    assert engine["policy_args"] == {"budget": 64, "window_size": 8}
    assert engine["draft_args"] == {"num_tokens": 3}
    engine, _ = split_model_args({"policy": "snapkv", "policy_args": '{"budget": 64}', "policy_args.window_size": 4})
    assert engine["policy_args"] == {"budget": 64, "window_size": 4}


def test_unknown_key_names_the_valid_ones():
    with pytest.raises(ModelArgsError) as err:
        split_model_args({"policy": "snapkv", "budgett": 64})
    text = str(err.value)
    assert "'budgett'" in text and "kv_cache_memory" in text and "batch_size" in text
    assert "policy 'snapkv': budget, compression_ratio" in text and "window_size" in text


def test_bad_plugin_values_name_their_path():
    with pytest.raises(ModelArgsError, match=r"policy_args.budgett: unknown parameter of policy 'snapkv'"):
        split_model_args({"policy": "snapkv", "policy.budgett": 3})
    with pytest.raises(ModelArgsError, match="compression_ratio must be in"):
        split_model_args({"policy": "snapkv", "compression_ratio": 2.0})
    with pytest.raises(ModelArgsError, match="quant_args.residual: expected int"):
        split_model_args({"quant": "int4", "residual": "x"})
    with pytest.raises(ModelArgsError, match="unknown policy 'nope'"):
        split_model_args({"policy": "nope", "budget": 3})
    with pytest.raises(ModelArgsError, match="no draft chosen"):
        split_model_args({"draft.num_tokens": 3})
    with pytest.raises(ModelArgsError, match="expected a mapping"):
        split_model_args({"policy": "snapkv", "policy_args": "budget:3"})


def test_a_key_two_chosen_plugins_take_asks_for_the_dotted_spelling(monkeypatch):
    # no two built-ins share a flat parameter name outside EngineConfig, so give two plugins one
    monkeypatch.setattr(args, "plugin_fields", lambda section, name: {"shared": (int, 0)}
                        if section in ("policy_args", "quant_args") else {})
    with pytest.raises(ModelArgsError, match=r"several chosen plugins.*policy.shared=3 or quant.shared=3"):
        split_model_args({"policy": "snapkv", "quant": "int4", "shared": 3})


def test_engine_options_reach_the_engine(lm):
    c = lm.llm.config
    assert (c.model, c.block_size, c.kv_cache_memory, c.max_model_len) == ("random:llama-tiny", 8, 4 << 20, 129)
    assert lm.max_length == 128
    snap = KvlabLM(**TINY, policy="snapkv", compression_ratio=0.5)
    assert snap.llm.config.policy == "snapkv" and snap.llm.config.policy_args == {"compression_ratio": 0.5}
    assert type(snap.engine.policy).__name__ == "SnapKV" and snap.engine.policy.compression_ratio == 0.5


def test_a_bad_engine_option_fails_before_running():
    with pytest.raises(ValueError, match="block_size"):
        KvlabLM(**{**TINY, "block_size": 24})


def test_cli_options_join_the_model_args():
    made = KvlabLM.create_from_arg_string("pretrained=random:llama-tiny,kv_cache_memory=4MiB,policy_args={'budget':"
                                          " 16,'window_size': 4},policy=snapkv",
                                          {"batch_size": 5, "max_batch_size": 64, "device": "cpu"})
    assert made.batch_size == 5 and made.llm.config.policy_args == {"budget": 16, "window_size": 4}
    assert KvlabLM.create_from_arg_obj({**TINY}, {"batch_size": "auto"}).batch_size == 64


# -- loglikelihood --------------------------------------------------------------------------------

def greedy_tokens(llm: LLM, prompt: list[int], n: int) -> list[int]:
    return llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids


def test_loglikelihood_is_the_engines_score_and_is_greedy_its_argmax(lm):
    ctx = [5, 17, 33, 2, 90, 14, 61, 7] * 3
    greedy = greedy_tokens(lm.llm, ctx, 4)
    other = greedy[:2] + [(greedy[2] + 1) % 256] + greedy[3:]
    reqs = [(("a", "b"), ctx, greedy), (("a", "c"), ctx, other), (("d", "e"), ctx[:5], [9])]
    out = lm._loglikelihood_tokens(reqs)
    direct = lm.llm.score([r[1] for r in reqs], [r[2] for r in reqs])
    assert [o[0] for o in out] == pytest.approx([sum(d.logprobs) for d in direct], abs=1e-5)
    assert [o[1] for o in out][:2] == [True, False]


def test_is_greedy_holds_few_distributions_at_once(lm, monkeypatch):
    calls = []
    score = lm.llm.score
    monkeypatch.setattr(lm.llm, "score", lambda c, t, **kw: calls.append(len(c)) or score(c, t, **kw))
    monkeypatch.setattr(lm, "dists_memory", 3 * 4 * 256 * 2)  # two continuations of 3 tokens
    lm._loglikelihood_tokens([(None, [1, 2, 3], [4, 5, 6])] * 5)
    assert calls == [2, 2, 1]


def test_too_long_a_request_is_truncated_from_the_left_as_hf_does(lm, caplog):
    ctx, cont = list(range(1, 200)), [3, 4, 5]
    with caplog.at_level(logging.WARNING, logger="kvlab.study.lm_eval"):
        (logprob, _), = lm._loglikelihood_tokens([(None, ctx, cont)])
    assert "truncating 73 tokens from the left" in caplog.text  # 202 tokens, max_length + 1 = 129 kept
    kept = (ctx + cont)[-129:]
    assert logprob == pytest.approx(sum(lm.llm.score([kept[:-3]], [cont])[0].logprobs), abs=1e-5)
    with pytest.raises(ValueError, match="continuation of 129 tokens does not fit max_length=128"):
        lm._loglikelihood_tokens([(None, [1], list(range(129)))])


def test_rolling_loglikelihood_scores_every_token_once_in_lm_evals_windows(lm):
    doc = "Paged attention keeps the cache in fixed-size blocks. " * 6  # 318 byte tokens: 3 windows of 128
    tokens = lm.tok_encode(doc)
    windows = rolling_windows(tokens, lm.prefix_token_id, lm.max_length)
    assert len(windows) == 3 and [t for _, c in windows for t in c] == tokens  # every token scored once
    assert windows[0] == ([lm.prefix_token_id], tokens[:128])  # max_length = max_model_len - 1 = 128 fed
    assert [len(c) + len(t) for c, t in windows] == [129] * 3  # the last window too has a full context
    (total,) = lm.loglikelihood_rolling([Req(doc)])
    direct = lm.llm.score([c for c, _ in windows], [t for _, t in windows])
    assert total == pytest.approx(sum(sum(d.logprobs) for d in direct), abs=1e-4)
    short = "a short document"
    (one,) = lm.loglikelihood_rolling([Req(short)])
    assert one == pytest.approx(sum(lm.llm.score([[lm.prefix_token_id]], [lm.tok_encode(short)])[0].logprobs),
                                abs=1e-5)


def test_a_policy_that_cannot_score_is_refused_clearly():
    quest = KvlabLM(**TINY, policy="quest", budget=16)
    with pytest.raises(ValueError, match="'quest' reads a subset of pages only while decoding"):
        quest._loglikelihood_tokens([(None, [1, 2], [3])])
    with pytest.raises(ValueError, match="never decode"):
        quest.loglikelihood_rolling([Req("text")])


# -- generate_until -------------------------------------------------------------------------------

def test_generate_until_is_the_engines_greedy_text_cut_at_the_first_stop(lm):
    prompt = "The cache holds "
    ids = lm.llm.generate([lm.tok_encode(prompt)], SamplingParams(max_tokens=12))[0].token_ids
    text = lm.tok_decode(ids)
    stop = text[3:5] if len(text) > 5 else None
    kwargs = {"until": [stop] if stop else [], "max_gen_toks": 12, "do_sample": False}
    (out,) = lm.generate_until([Req(prompt, kwargs)])
    assert out == (text.split(stop)[0] if stop else text)
    (four,) = lm.generate_until([Req(prompt, {"until": [], "max_gen_toks": 4})])
    assert four == lm.tok_decode(ids[:4])


def test_generate_until_groups_and_orders_requests(lm):
    reqs = [Req("abc", {"until": [], "max_gen_toks": n}) for n in (3, 5, 3)]
    outs = lm.generate_until(reqs)
    assert outs[0] == outs[2] and outs[1].startswith(outs[0])


def test_sampling_is_seeded_and_unknown_gen_kwargs_are_refused(lm):
    kw = {"until": [], "max_gen_toks": 6, "do_sample": True, "temperature": 1.0, "top_p": 0.9, "seed": 3}
    assert lm.generate_until([Req("xyz", kw)]) == lm.generate_until([Req("xyz", kw)])
    with pytest.raises(ValueError, match="'num_beams' is not supported"):
        lm.generate_until([Req("xyz", {"until": [], "num_beams": 4})])


def test_gen_kwargs_follow_lm_evals_normalisation():
    gen = parse_gen_kwargs({"until": "\n\n", "max_new_tokens": 7, "do_sample": False, "temperature": 0.7}, 256,
                           "<eos>")
    assert gen.until == ["\n\n", "<eos>"] and gen.max_gen_toks == 7 and gen.sampling == {"temperature": 0.0}
    assert cut_at_stop("an answer.\nmore", ["\n", "."]) == "an answer"
    assert cut_at_stop("keep all", ["", "zz"]) == "keep all"


def test_a_prompt_longer_than_the_room_left_is_truncated_from_the_left(lm, caplog):
    with caplog.at_level(logging.WARNING, logger="kvlab.study.lm_eval"):
        lm.generate_until([Req("x" * 300, {"until": [], "max_gen_toks": 8})])
    assert "prompt of 300 tokens exceeds the 120 that fit" in caplog.text
    with pytest.raises(ValueError, match="max_gen_toks=128 leaves no room"):
        lm.generate_until([Req("x", {"until": [], "max_gen_toks": 128})])


def test_chat_template_is_the_tokenizers_and_its_absence_is_an_error(lm, monkeypatch):
    with pytest.raises(ValueError, match="has no chat template"):
        lm.apply_chat_template([{"role": "user", "content": "hi"}])

    class Templated:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, history, **kwargs):
            return (history, kwargs)

    monkeypatch.setattr(lm, "tokenizer", Templated())
    history = [{"role": "user", "content": "hi"}]
    assert lm.apply_chat_template(history) == (history, {"tokenize": False, "add_generation_prompt": True,
                                                         "continue_final_message": False})
    assert lm.apply_chat_template(history, add_generation_prompt=False)[1]["continue_final_message"] is True


# -- offline task data and the Hydra task -----------------------------------------------------------

def test_lambada_passages_end_a_sentence_on_a_word():
    from kvlab.study.lm_eval.local_data import lambada_rows, passage

    text = "One two three four. Five six seven 1984. Eight nine ten eleven twelve."
    assert passage(text, 3, 9) == "One two three four"  # "1984" is no word; twelve is past 9 words
    assert passage(text, 3, 20) == "One two three four. Five six seven 1984. Eight nine ten eleven twelve"
    assert passage(text, 5, 6) is None
    pages = [" = A = \n " + " ".join(f"w{i} alpha ." for i in range(30)) + "\n"]
    rows = lambada_rows(pages, 5, 10, 40, seed=1)
    assert rows and all(r["text"].split()[-1] == "alpha" and len(r["text"].split()) <= 40 for r in rows)


def test_wikitext_documents_are_the_articles(tmp_path):
    from kvlab.study.lm_eval.local_data import wikitext2_documents

    (tmp_path / "w.raw").write_text(" \n = First = \n text one \n = = Sub = = \n more \n = Second = \n two \n")
    docs = wikitext2_documents(tmp_path, "w.raw")
    assert [d.splitlines()[0].strip() for d in docs] == ["= First =", "= Second ="] and "= = Sub = =" in docs[0]


def test_a_models_tokenizer_is_loaded_once_per_process(monkeypatch, tmp_path):
    """Every build of a task's data asks for the tokenizer by name (each simple_evaluate, each sweep job): it is
    loaded once (Gemma 3's took 17 s under load each time)."""
    import transformers

    import kvlab.models
    from kvlab.study.lm_eval import local_data

    loads = []
    monkeypatch.setattr(kvlab.models, "resolve", lambda name: tmp_path)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: loads.append(path) or object())
    local_data.model_tokenizer.cache_clear()
    try:
        first = local_data.model_tokenizer("some-model")
        assert local_data.model_tokenizer("some-model") is first and loads == [str(tmp_path)]
        local_data.model_tokenizer("other-model")
        assert len(loads) == 2
    finally:
        local_data.model_tokenizer.cache_clear()  # no stand-in tokenizer outlives the test


def test_hydra_task_metric_names_and_checks():
    from kvlab.study.tasks.lm_eval import LmEval, flat_metrics

    results = {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A", "exact_match,first_word": 1.0}}
    assert flat_metrics(results) == {"lm_eval/t/acc": 0.5, "lm_eval/t/exact_match/first_word": 1.0}
    assert LmEval(tasks="kvlab_niah").tasks == ["kvlab_niah"]
    with pytest.raises(ValueError, match="limit must be positive"):
        LmEval(limit=0)
    with pytest.raises(ValueError, match="non-empty list"):
        LmEval(tasks=[])


def test_the_task_folder_holds_every_documented_task():
    from lm_eval.tasks import TaskManager

    names = set(TaskManager(include_path=str(kvlab.study.lm_eval.TASKS_DIR), include_defaults=False).all_tasks)
    assert {"kvlab_wikitext2", "kvlab_lambada_wikitext", "kvlab_lambada_wikitext_gen", "kvlab_niah",
            "kvlab_ruler", "kvlab_local"} <= names


def test_lm_eval_metrics_reach_the_leaderboard_beside_the_costs():
    import pandas as pd

    from kvlab.study.analysis import better, leaderboard, score_columns

    runs = pd.DataFrame([{"policy.name": p, "model.name": "m", "policy.compression_ratio": r,
                          "task._target_": "kvlab.study.tasks.lm_eval.LmEval", "lm_eval/t/acc": acc,
                          "lm_eval/t/perplexity": ppl, "lm_eval/wall_s": 3.0, "workload/tokens_per_s": 10.0}
                         for p, r, acc, ppl in [("full", 0.0, 0.5, 9.0), ("snapkv", 0.5, 0.25, 12.0)]])
    board = leaderboard(runs)
    assert list(board["lm-eval t/acc"]) == [0.5, 0.25] and list(board["lm-eval t/perplexity"]) == [9.0, 12.0]
    assert "tokens/s" in board.columns and not any("wall_s" in c for c in board.columns)
    assert score_columns(board)[-2:] == ["lm-eval t/acc", "lm-eval t/perplexity"]
    assert (better("lm-eval t/acc"), better("lm-eval t/perplexity")) == ("max", "min")


def test_a_workload_sweep_in_the_same_study_merges_beside_the_lm_eval_columns():
    import pandas as pd

    from kvlab.study.analysis import leaderboard, merge_tasks

    lm = [{"policy.name": "snapkv", "model.name": "m", "policy.compression_ratio": r, "lm_eval/t/acc": a,
           "task._target_": "kvlab.study.tasks.lm_eval.LmEval"} for r, a in [(0.25, 0.5), (0.5, 0.4)]]
    timing = [{"policy.name": "snapkv", "model.name": "m", "policy.compression_ratio": r, "task._target_": None,
               "workload/tokens_per_s": s, "workload/kv_bytes_mean": 2.0**20} for r, s in [(0.25, 10.0), (0.5, 12.0)]]
    merged = merge_tasks(leaderboard(pd.DataFrame(lm + timing)))
    assert list(merged["lm-eval t/acc"]) == [0.5, 0.4] and list(merged["tokens/s"]) == [10.0, 12.0]
    assert list(merged["KV MiB held (mean)"]) == [1.0, 1.0]


def test_stop_strings_reach_the_engine_when_it_matches_them(lm, monkeypatch):
    from dataclasses import fields

    if "stop" not in {f.name for f in fields(SamplingParams)}:
        pytest.skip("this kvlab's SamplingParams has no stop strings: the text is cut alone")
    seen = []
    monkeypatch.setattr(lm.llm, "tokenizer", object())  # a model with a tokenizer: the engine gets the stops
    monkeypatch.setattr(lm.llm, "generate", lambda prompts, params: seen.append(params) or [])
    lm.generate_until([Req("abc", {"until": ["\n\n", ""], "max_gen_toks": 3})])
    assert seen[0].stop == ("\n\n", lm.tokenizer.decode([lm.eot_token_id], skip_special_tokens=False))


def test_the_ruler_task_scores_rulers_samples_through_lm_eval(lm, monkeypatch, tmp_path):
    """kvlab_ruler end to end through simple_evaluate: RULER's samples sized in SmolLM2's tokens, a model that
    answers with the expected outputs scores 1, one that answers nothing scores 0 (the model's text is patched:
    the tiny model's byte tokenizer cannot read SmolLM2-sized prompts; the engine's side is tested above)."""
    pytest.importorskip("long_context_eval", reason="RULER's generators (nvidia-long-context-eval) are not installed")
    from kvlab.study.lm_eval.parity import run_tasks

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    metadata = {"tokenizer": "smollm2-135m", "subtasks": ["niah_single_1", "vt"], "lengths": [512],
                "num_samples": 2}
    seen = []

    def oracle(requests):
        seen.extend(r.args for r in requests)
        return [answers[r.args[0]] for r in requests]

    rows = {}
    monkeypatch.setattr(lm, "generate_until", oracle)
    from kvlab.study.lm_eval.task_yamls import kvlab_data  # noqa: F401  (the YAML's functions, by module path)

    for name, row in ((r["input"], r) for r in kvlab_data.ruler(**metadata)["test"]):
        rows[name] = row
    answers = {text: " ".join(row["outputs"]) for text, row in rows.items()}
    out = run_tasks(lm, "kvlab", ["kvlab_ruler"], None, metadata)
    assert len(seen) == 4 and {a[1]["max_gen_toks"] for a in seen} == {128}
    assert {r["subtask"] for r in rows.values()} == {"niah_single_1", "vt"}
    assert out.results["kvlab_ruler"]["score,none"] == 1.0
    answers = dict.fromkeys(answers, "")
    assert run_tasks(lm, "kvlab", ["kvlab_ruler"], None, metadata).results["kvlab_ruler"]["score,none"] == 0.0
