"""String-level rejection sampling (SLRS): the draft's text turned into a distribution over target tokens.

Based on Timor et al., ICML 2025 (arXiv:2502.05202), Algorithm 3 and its lemma on cost, read from
the paper. The draft model samples tokens in its own vocabulary; the text they spell is cut into
target tokens, and rejection sampling runs on those target tokens against psi, the distribution
over target tokens that the draft's sampling induces. kvlab's cut is longest match over the
target's token texts, a token being fixed once the text reaches `longest target token` bytes past
its start (`segment`): a deterministic, prefix-stable rule, so psi is exact (the paper leaves the
re-tokenisation to the target's tokenizer; any fixed rule keeps the method lossless, only
acceptance depends on it). The first `num_tokens` fixed target tokens are proposed. For rejection sampling to stay lossless the verifier needs, for every
proposed position i, the exact probability psi_i(t | t_<i) that this process proposes target
token t there given the tokens before it: the sum, over every sequence of draft tokens whose text
cuts into t_<i then t, of the draft's probability of that sequence, normalised
(`token_proposal`). Speculative rejection sampling against psi (kvlab/speculation/verifier.py) is then
lossless under sampling; greedy requests propose the draft's argmax chain (a point mass, exact
match) and compute no psi.

COST: the sum runs over every draft-token sequence consistent with the proposed text, one draft
forward pass per distinct prefix: exponential in the number of bytes spanned, i.e. in the draft
length times the longest target token (Timor et al.'s Lemma: the number of tokenisations of a
string grows exponentially with its length). It is practical for tiny vocabularies and short
tokens (tests, byte-level drafts), not for SmolLM2 -> Gemma 3 (tens of thousands of tokens, target
tokens of dozens of bytes). The draft is therefore capped twice, and refuses before any work: at
most MAX_TOKENS (4) drafted tokens per step, and `max_evaluations`, a bound on the draft forward
passes one step may need, computed at setup from the two vocabularies (`evaluation_bound`); a
pair beyond it is refused with an error pointing to `slem` / `tli`.

The draft model runs as a plain Hugging Face forward over whole contexts (no paged pool: the
enumeration asks for many short branches of one context, and this draft is a reference, not a
fast path). It proposes only tokens that stand for text; every byte a draft token holds must be a
one-byte target token (true of byte-level vocabularies and of the toys), so the cut never fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.speculation.drafts.base import DraftModel, Proposal
from kvlab.speculation.drafts.vocabulary import Bridge, Vocabulary, load_vocabulary
from kvlab.registry import DRAFTS
from kvlab.sampler import draw, probabilities

MAX_TOKENS = 4  # the most target tokens SLRS drafts per step (its cost is exponential in it)


def segment(data: bytes, target: Vocabulary, max_tokens: int) -> list[tuple[int, int]]:
    """Cut `data` into target tokens by longest match, keeping only tokens already fixed (the text
    runs at least `target.max_token_bytes` past their start) -> [(target id, bytes)], <= max_tokens."""
    longest, out, pos = target.max_token_bytes, [], 0
    while len(out) < max_tokens and pos + longest <= len(data):
        for n in range(longest, 0, -1):
            t = target.ids_of.get(data[pos:pos + n])
            if t is not None:
                out.append((t, n))
                pos += n
                break
        else:
            break
    return out


def token_proposal(next_probs, prefix: list[int], draft: Vocabulary, target: Vocabulary,
                   target_vocab: int) -> tuple[torch.Tensor, int]:
    """psi(. | prefix): the distribution of the next fixed target token after target tokens
    `prefix`, under the draft process -> ([target_vocab] float64, draft evaluations used).

    `next_probs(paths)`: for draft-token paths (tuples, continuing the draft's context), the draft's
    next-token distributions [len(paths), V_draft]. Enumerates every draft path whose text agrees
    with the prefix's text until it runs `longest target token` bytes past it."""
    want = b"".join(target.token_bytes[t] for t in prefix)
    need = len(want) + target.max_token_bytes
    psi = torch.zeros(target_vocab, dtype=torch.float64)
    frontier, evaluations = [((), b"", 1.0)], 0
    while frontier:
        probs = next_probs([path for path, _, _ in frontier]).double()  # [F, V_draft]
        evaluations += len(frontier)
        grown = []
        for (path, text, weight), q in zip(frontier, probs):
            for d in torch.nonzero(q).flatten().tolist():
                piece = draft.token_bytes[d]
                longer = text + piece
                overlap = min(len(longer), len(want))
                if longer[:overlap] != want[:overlap]:
                    continue
                w = weight * float(q[d])
                if len(longer) < need:
                    grown.append((path + (d,), longer, w))
                    continue
                cut = segment(longer, target, len(prefix) + 1)
                if len(cut) == len(prefix) + 1 and [t for t, _ in cut[:-1]] == list(prefix):
                    psi[cut[-1][0]] += w
        frontier = grown
    total = psi.sum()
    if total <= 0:
        raise RuntimeError("slrs: the proposed prefix has probability 0 under the draft (a bug)")
    return psi / total, evaluations


def evaluation_bound(draft: Vocabulary, target: Vocabulary, num_tokens: int) -> int:
    """Draft forward passes one sequence-step may need at most: the draft paths shorter than i
    target tokens' worth of bytes (i * longest target token), summed over positions i, plus the
    sampled chain itself."""
    lengths: dict[int, int] = {}
    for b in draft.token_bytes:
        if b:
            lengths[len(b)] = lengths.get(len(b), 0) + 1
    longest = target.max_token_bytes
    paths = [1] + [0] * (num_tokens * longest)  # paths[n]: draft token sequences spelling n bytes
    for n in range(1, len(paths)):
        paths[n] = sum(c * paths[n - k] for k, c in lengths.items() if k <= n)
    return sum(sum(paths[:i * longest]) for i in range(1, num_tokens + 1)) + (num_tokens + 1) * longest


@DRAFTS.register("slrs")
@dataclass
class SLRSDraft(DraftModel):
    """Draft text in any vocabulary, verified at string level by exact rejection sampling (capped)."""

    num_tokens: int = 2  # target tokens drafted per step, 1 .. MAX_TOKENS
    max_num_tokens: int = 4  # longest chain when adaptive, num_tokens .. MAX_TOKENS
    model: str = "smollm2-135m"  # draft model: packaged name, local folder, .gguf file or random:<shape>
    seed: int = 0  # weights seed of a random:<shape> draft
    tokenizer: str | None = None  # the draft's tokenizer: None = the draft model's own, or a toy name
    target_tokenizer: str | None = None  # the target's: None = the engine's, or a toy name
    max_evaluations: int = 1_000_000  # cap on the draft forward passes one sequence-step may need
    _model: object = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        longest = self.max_num_tokens if self.adaptive else self.num_tokens
        if longest > MAX_TOKENS:
            raise ValueError(f"draft slrs: at most {MAX_TOKENS} tokens per step (its cost is exponential in the draft "
                             f"length), got {'max_num_tokens' if self.adaptive else 'num_tokens'}={longest}; "
                             f"use slem or tli for longer drafts")
        if not isinstance(self.max_evaluations, int) or self.max_evaluations < 1:
            raise ValueError(f"draft slrs: max_evaluations must be an integer >= 1, got {self.max_evaluations!r}")

    def setup(self, engine) -> None:
        from kvlab.models import load_model

        cfg = engine.config
        loaded = load_model(self.model, dtype=getattr(torch, cfg.dtype), seed=self.seed)
        draft = self.tokenizer if self.tokenizer is not None else loaded.tokenizer
        target = self.target_tokenizer if self.target_tokenizer is not None else engine.tokenizer
        if draft is None or target is None:
            option = "tokenizer" if draft is None else "target_tokenizer"
            raise ValueError(f"draft slrs: the {'draft' if draft is None else 'target'} model has no tokenizer, and slrs "
                             f"compares tokens by their text; name one in draft_args {option!r} (a toy: toy-a, toy-b)")
        self._bridge = Bridge(load_vocabulary(draft, self.model), load_vocabulary(target, cfg.model))
        d, t = self._bridge.draft, self._bridge.target
        missing = sorted({bytes([c]) for b in d.token_bytes if b for c in b} - set(t.ids_of))
        if missing:
            raise ValueError(f"draft slrs: the target has no one-byte token for {missing[:5]}: the draft's text could "
                             f"not always be cut into target tokens; use slem or tli")
        k = self.max_num_tokens if self.adaptive else self.num_tokens
        bound = evaluation_bound(d, t, k)
        if bound > self.max_evaluations:
            raise ValueError(
                f"draft slrs: {self.model!r} drafting for {cfg.model!r} may need up to {float(bound):.3g} draft forward "
                f"passes per sequence and step (exponential in {k} drafted tokens x {t.max_token_bytes} bytes of the "
                f"longest target token, over {sum(1 for b in d.token_bytes if b)} draft tokens), beyond "
                f"max_evaluations={self.max_evaluations}; use slem or tli, or fewer num_tokens")
        self._model = loaded.model.to(cfg.device).eval()
        self._device = cfg.device
        self._target_vocab = engine.model_config.vocab_size
        size = self._model.config.vocab_size
        self._has_text = torch.zeros(size, dtype=torch.bool)  # [V_draft]
        self._has_text[[i for i, b in enumerate(d.token_bytes) if b is not None and i < size]] = True
        self.evaluations = 0

    def forget(self, seq_id: int) -> None:
        if self._model is not None:
            self._bridge.forget(seq_id)

    def num_tracked(self) -> int:
        return self._bridge.num_tracked() if self._model is not None else 0

    def propose(self, seqs, lengths, generators) -> list[Proposal]:
        """Every sequence's draft chain in lockstep (one batched forward per draft token), then psi
        for the sampled ones, one sequence at a time."""
        if self._model is None:
            raise RuntimeError("draft 'slrs' was not set up: the engine calls setup(engine) first")
        d, t = self._bridge.draft, self._bridge.target
        contexts = [self._bridge.to_draft(s.token_ids, s.seq_id) for s in seqs]
        paths, texts = [[] for _ in seqs], [b"" for _ in seqs]
        active = [i for i, c in enumerate(contexts) if c]  # a context of special tokens only: nothing to draft from
        while active:  # every draft token adds a byte: this ends
            active = [i for i in active if len(segment(texts[i], t, lengths[i])) < lengths[i]]
            if not active:
                break
            q = self._forward([contexts[i] + paths[i] for i in active], [seqs[i].params for i in active])
            self.evaluations += len(active)
            for row, i in enumerate(active):
                token = draw(q[row], seqs[i].params.greedy, generators[i])
                paths[i].append(token)
                texts[i] += d.token_bytes[token]
        out = []
        for seq, context, text, n in zip(seqs, contexts, texts, lengths):
            tokens = [tok for tok, _ in segment(text, t, n)]
            if seq.params.greedy or not tokens:
                out.append(Proposal(tokens))
                continue
            next_probs = self._cached_forward(context, seq.params)
            psi = [token_proposal(next_probs, tokens[:i], d, t, self._target_vocab)[0] for i in range(len(tokens))]
            out.append(Proposal(tokens, torch.stack(psi).float()))
        return out

    def _cached_forward(self, context: list[int], params):
        """next_probs(paths) for `token_proposal`: the draft's distributions after context + path,
        each distinct path computed once."""
        cache: dict[tuple, torch.Tensor] = {}

        def next_probs(paths: list[tuple]) -> torch.Tensor:
            todo = [p for p in dict.fromkeys(paths) if p not in cache]
            for start in range(0, len(todo), 256):
                chunk = todo[start:start + 256]
                for p, row in zip(chunk, self._forward([context + list(p) for p in chunk], [params] * len(chunk))):
                    cache[p] = row
            self.evaluations += len(todo)
            return torch.stack([cache[p] for p in paths])  # [len(paths), V_draft]

        return next_probs

    @torch.no_grad()
    def _forward(self, contexts: list[list[int]], params: list) -> torch.Tensor:
        """Next-token distributions after each context [N, V_draft] (right-padded, one pass), over
        tokens that stand for text, with the request's temperature / top-k / top-p."""
        width = max(len(c) for c in contexts)
        ids = torch.zeros(len(contexts), width, dtype=torch.long)
        mask = torch.zeros(len(contexts), width, dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, :len(c)] = torch.tensor(c, dtype=torch.long)
            mask[i, :len(c)] = 1
        logits = self._model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device)).logits
        last = logits[torch.arange(len(contexts)), torch.tensor([len(c) - 1 for c in contexts])].float().cpu()
        last = last.masked_fill(~self._has_text, float("-inf"))  # [N, V_draft]
        return probabilities(last, params)
