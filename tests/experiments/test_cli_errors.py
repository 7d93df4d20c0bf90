"""`kvlab-run` turns every config mistake into one line, `config error: ...`, exit status 1, no traceback;
what can be known without the weights (the pool against one page, the format against the block size,
the device, the task's data) is refused before any model loads (issue 21, item 10)."""

from __future__ import annotations

import pytest
import torch

import kvlab.engine.build
import kvlab.models
from kvlab.__main__ import main
from kvlab.study.experiment import read_record

TINY = ["model=random-llama-tiny", "logger=none", "workload=none", "task=none", "progress=false"]

CASES = {  # the command line (after TINY) -> what the one line must say
    "kept compressed turns with a non-paged allocator": (
        ["policy=snapkv", "policy.compression_ratio=0.5", "engine.reuse_compressed=true", "engine.allocator=contiguous"],
        "reuse_compressed with allocator 'contiguous' is not supported"),
    "a pool smaller than one page": (["engine.kv_cache_memory=1KiB"], "engine.kv_cache_memory: 1024 bytes"),
    "a format that does not fit the block size": (["quant=int4", "engine.block_size=1"], "quant: int4"),
    "an absent device": (["engine.device=cuda"], "engine.device: "),
    "absent task data": (["task=niah", "task.haystack=/nonexistent"], "task.haystack: data not found: /nonexistent"),
}


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model (or building an LLM's weights) fails the test."""
    def refuse(*args, **kwargs):
        pytest.fail("a model was loaded before the config error was reported")

    monkeypatch.setattr(kvlab.engine.build, "load_model", refuse)
    monkeypatch.setattr(kvlab.models, "load_model", refuse)


def run_main(tmp_path, argv: list[str]) -> str:
    """kvlab-run in this process; returns the message it exits with (SystemExit must be raised: with a
    message, Python prints it as the one line on stderr and exits with status 1)."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, f"hydra.run.dir={tmp_path / 'run'}"])
    return exit_.value.code


@pytest.mark.parametrize("case", list(CASES))
def test_a_config_mistake_is_one_line_before_the_model_loads(case, tmp_path, capsys, no_model_load):
    if case == "an absent device" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: engine.device=cuda is not a mistake here")
    overrides, expected = CASES[case]
    message = run_main(tmp_path, [*TINY, *overrides])
    assert isinstance(message, str) and message.startswith("config error: ") and expected in message, message
    assert "\n" not in message
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "HYDRA_FULL_ERROR" not in out + err, out + err
    finish = read_record(tmp_path / "run" / "run.jsonl")["finish"]  # the failed run is recorded
    assert finish["status"] == "failed" and expected in finish["error"]

