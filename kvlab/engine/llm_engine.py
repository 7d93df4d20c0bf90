"""The engine: requests in, a step at a time, finished requests out.

    step() = schedule -> run the model once on the packed batch -> sample -> postprocess

The components are made by `kvlab.engine.build.build` (plugins checked, model, page pool,
scheduler, runner, compressor, speculator); the engine holds them, runs the step loop and answers
the request API.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time

import torch

from kvlab.engine.build import build
from kvlab.engine.calibrate import calibrate_compute
from kvlab.engine.capabilities import check
from kvlab.engine.lifecycle import Lifecycle
from kvlab.engine_config import EngineConfig
from kvlab.metrics import Metrics, tokens_per_page
from kvlab.models import LoadedModel
from kvlab.outputs import CompletionOutput, RequestOutput, ScoreOutput
from kvlab.cache.kept_turns import KeptTurnStats
from kvlab.cache.prefix_cache import PrefixStats
from kvlab.cache.tiers.places import TierStats
from kvlab.sampler import SamplingError, request_generator, sample
from kvlab.sampling_params import SamplingParams, as_sampling_params
from kvlab.sequence import Sequence
from kvlab.stop_strings import StopStrings


def as_token_ids(ids) -> list[int]:
    """Token ids from a list, tuple, 1-D tensor or numpy array of integers; anything else is an error."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"expected token ids, got a string {ids!r}: encode it with the tokenizer first")
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # torch tensor, numpy array
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"token ids must be one-dimensional, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    try:
        ids = list(ids)
    except TypeError:
        raise TypeError(f"expected a sequence of token ids, got {type(ids).__name__}") from None
    for t in ids:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(f"token ids must be integers, got {t!r}")
    return [int(t) for t in ids]


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        parts = build(config, loaded)  # every component, made once (kvlab/engine/build.py)
        # the engine holds them under the names of Parts: policy, quant, draft, capabilities, model,
        # tokenizer, model_config, max_model_len, bos/eos ids, bytes_per_block, block_manager, cache, kv,
        # scheduler, runner, compressor, private_pools, speculator
        for f in dataclasses.fields(parts):
            setattr(self, f.name, getattr(parts, f.name))
        self.metrics = self._new_metrics()
        self._next_id = 0
        self._generators: dict[int, torch.Generator] = {}
        self._return_dists: set[int] = set()
        self._samples: dict[int, tuple[int, int]] = {}  # parallel sampling: seq id -> (group id, sample index)
        self._groups: dict[int, list[int]] = {}  # group id (the first sample's id) -> ids of its unfinished samples
        self.lifecycle = Lifecycle()  # who keeps per-sequence state hears of each sequence's end (lifecycle.py)
        for subscriber in (self, self.compressor, self.speculator):
            self.lifecycle.subscribe(subscriber)
        calibrate_compute(self)  # a placement's start-up recompute rate (kvlab/engine/calibrate.py)

    def _new_metrics(self) -> Metrics:
        bm = self.block_manager
        # waste is measured on the full-attention groups' pages (those that grow with the sequence)
        return Metrics(pool_slots=bm.num_blocks * bm.block_size, num_blocks=bm.num_blocks)

    # -- requests ------------------------------------------------------------
    def check_params(self, params) -> SamplingParams:
        """`params` if this engine can run them; else an error naming what cannot run (before any step)."""
        params = as_sampling_params(params)
        if params.n > 1:
            check(dataclasses.replace(self.capabilities, samples=params.n), "request")
        vocab = self.model_config.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise ValueError(f"stop_token_ids has {outside[0]}, outside the vocabulary [0, {vocab}): it can never "
                             f"be generated")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {list(params.stop)!r} are matched on the detokenised output, and this "
                             f"model has no tokenizer (random weights): use stop_token_ids")
        return params

    def make_sequence(self, prompt_token_ids, params: SamplingParams, arrival_time: float | None = None,
                      score_from: int | None = None) -> Sequence:
        """Validate a request and build its sequence, without queueing it.

        `prompt_token_ids`: a list, tuple, 1-D tensor or numpy array of integer ids. `arrival_time`:
        a `time.perf_counter()` reading (the engine's clock), default now. Scoring requests pass
        context + continuation as the prompt and the context length as `score_from`.
        """
        params = self.check_params(params)
        ids = as_token_ids(prompt_token_ids)
        if not ids:
            raise ValueError("empty prompt: a request needs at least one token")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if score_from is None and len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not fit the model's context of {self.max_model_len} tokens "
                f"(it must leave room for at least one new token)"
            )
        if score_from is not None and len(ids) > self.max_model_len:
            raise ValueError(f"context + continuation of {len(ids)} tokens does not fit the model's context of "
                             f"{self.max_model_len} tokens")
        now = time.perf_counter()
        if arrival_time is None:
            arrival_time = now
        elif not isinstance(arrival_time, numbers.Real) or isinstance(arrival_time, bool) \
                or not math.isfinite(arrival_time):
            raise ValueError(f"arrival_time must be a number (a time.perf_counter() reading), got {arrival_time!r}")
        elif arrival_time > now + 1.0:
            raise ValueError(f"arrival_time {arrival_time} is in the future of time.perf_counter() ({now:.3f}): "
                             f"the engine's clock is time.perf_counter(), not time.time()")
        prompt_len = len(ids) if score_from is None else score_from
        max_len = len(ids) if score_from is not None else min(prompt_len + params.max_tokens, self.max_model_len)
        seq_id, self._next_id = self._next_id, self._next_id + 1
        seq = Sequence(seq_id, ids, params, max_len, float(arrival_time), score_from)
        error = self.block_manager.capacity_error(seq)
        if error:
            raise ValueError(error)
        return seq

    def make_scoring_sequence(self, context_ids, continuation_ids) -> Sequence:
        """A teacher-forced scoring request; an empty context is scored from the model's BOS token."""
        ctx, cont = as_token_ids(context_ids), as_token_ids(continuation_ids)
        if not cont:
            raise ValueError("the continuation is empty: there is nothing to score")
        if not ctx:
            if self.bos_token_id is None:
                raise ValueError("the context is empty and the model has no BOS token to score the first "
                                 "continuation token from: give at least one context token")
            ctx = [self.bos_token_id]
        return self.make_sequence(ctx + cont, SamplingParams(max_tokens=1), score_from=len(ctx))

    def add_sequence(self, seq: Sequence, return_dists: bool = False) -> int:
        if not seq.params.greedy:
            self._generators[seq.seq_id] = request_generator(self.config.seed, seq.seq_id, seq.params.seed)
        if return_dists:
            self._return_dists.add(seq.seq_id)
        self.metrics.begin()
        self.scheduler.add(seq)
        if self.kv.places is not None:  # a returning conversation's pages on disk start coming back now
            self.block_manager.prefetch(seq)
        return seq.seq_id

    def add_request(self, prompt_token_ids, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queue a generation request; raises ValueError (naming the problem) if it can never run.

        `arrival_time` is a `time.perf_counter()` reading (default: now); TTFT counts from it.
        """
        params = SamplingParams() if params is None else params
        return self.add_sequence(self.make_sequence(prompt_token_ids, params, arrival_time))

    def fork(self, request_id: int, params: SamplingParams | None = None) -> int:
        """A new request continuing a running generation request from where it is: it shares every
        page the parent holds (copy-on-write on the first write into a shared page) and samples with
        `params` (default: the parent's). The basis of parallel sampling and beam-style search."""
        parent = next((s for s in self.scheduler.running if s.seq_id == request_id), None)
        if parent is None or parent.is_scoring or parent.num_uncomputed_tokens != 1:
            raise ValueError(f"request {request_id} is not a running generation request between decode steps")
        params = params or parent.params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        child = Sequence(seq_id, parent.token_ids, params, min(parent.num_prompt_tokens + params.max_tokens,
                                                                self.max_model_len), parent.arrival_time)
        child.num_prompt_tokens, child.first_token_time = parent.num_prompt_tokens, parent.first_token_time
        self.block_manager.fork(parent, child)
        if self.compressor:
            self.compressor.fork(parent, child)
        self.scheduler.admit_forked(child, parent.num_computed_tokens)
        if not params.greedy:
            self._generators[seq_id] = request_generator(self.config.seed, seq_id, params.seed)
        return seq_id

    def abort(self, request_id: int) -> bool:
        """Stop an unfinished request (with every unfinished sample of it, for n > 1) and free its pages;
        False if it is unknown or already finished."""
        others = [i for i in self._groups.pop(request_id, []) if i != request_id]
        aborted = [i for i in others if self._abort_one(i)]
        return self._abort_one(request_id) or bool(aborted)

    def _abort_one(self, request_id: int) -> bool:
        group, _ = self._samples.pop(request_id, (None, 0))
        if request_id in self._groups.get(group, ()):
            self._groups[group].remove(request_id)
            if not self._groups[group]:
                del self._groups[group]
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        seq.finish_time = time.perf_counter()
        self.lifecycle.emit("aborted", [seq])
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # -- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput | ScoreOutput]:
        """Run one engine step; returns the outputs of the requests that finished in it.

        If a stage fails (scheduling, the model, the sampler, verification, advancing, compression), the
        step's sequences give their pages back and wait to be recomputed from their tokens, as if the step
        had never run (the tokens it sampled are not appended, the samples it spawned are dropped), so
        the engine stays usable; the exception propagates (abort the requests that caused it, or they
        fail again).
        """
        t0 = time.perf_counter()
        self.cache.release_unheld()  # rows of pages sealed last step go back before this step is scheduled
        streams = self._stream_states(self.scheduler.running)  # drafts and samples draw from them this step
        if self.speculator:
            self.speculator.propose(self.scheduler.running, self._generators)
        batch = self._schedule(streams)
        if not batch.seqs:
            if self.scheduler.waiting and not self.scheduler.running:  # a capacity bug: add_request admitted it
                seq = self.scheduler.waiting[0]
                raise RuntimeError(f"request {seq.seq_id} cannot be scheduled in an empty pool: "
                                   f"{self.block_manager.lone_need(seq)}")
            return []
        due = rows = None
        if self.compressor:
            due = [self.compressor.due(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
            rows = [self.compressor.query_rows(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
        drows = self.speculator.query_rows(batch.seqs, batch.num_new_tokens) if self.speculator else None
        asked = [max(a, b) for a, b in zip(rows or [0] * len(batch.seqs), drows)] if drows else rows
        spawned: list[tuple[Sequence, SamplingParams, list[Sequence]]] = []
        try:
            t_run = time.perf_counter()
            out = self.runner.run(batch, asked if asked and any(asked) else None,
                                  stats=bool(self.compressor) and self.policy.needs_attention_stats)
            if self.kv.places is not None:  # the cost model's recompute rate (kvlab.cache.tiers.placement)
                self.kv.places.observe_compute(batch.num_tokens, time.perf_counter() - t_run)
            spawned = self._spawn_samples(out)
            tokens = self._sample(out)
            verified, rejected = self.speculator.verify(out, self._generators) if self.speculator else ([], None)
            if drows:  # the draft reads the target's queries of its committed tokens; the policy its own rows
                self.speculator.observe(batch.seqs, batch.num_new_tokens, drows, out.queries)
                out.queries = own_rows(out.queries, rows) if rows and any(rows) else {}
            self._commit(batch, out, spawned, due, rejected)
        except BaseException:
            self._roll_back(batch, spawned, streams)
            raise
        finished = self._postprocess(out, tokens, verified)
        for seq in self.scheduler.running:
            self.block_manager.release_out_of_window(seq)
        outputs = [self.make_output(seq) for seq in finished]
        self.metrics.add_busy(time.perf_counter() - t0)
        return outputs

    def make_output(self, seq: Sequence) -> RequestOutput | ScoreOutput:
        if seq.is_scoring:
            dists = torch.stack(seq.dists) if seq.dists else None
            return ScoreOutput(seq.seq_id, seq.logprobs, dists, seq.num_preemptions)
        group, index = self._samples.pop(seq.seq_id, (seq.seq_id, 0))
        if group in self._groups:
            self._groups[group].remove(seq.seq_id)
            if not self._groups[group]:
                del self._groups[group]
        stops = seq.stop_strings
        if stops is not None and stops.matched is not None:  # the text cut at the stop string
            text, stop_reason = stops.text, stops.matched
        else:
            tok = self.tokenizer
            text = tok.decode(seq.output_token_ids, skip_special_tokens=True) if tok is not None else None
            stop_reason = self._stop_token(seq)
        completion = CompletionOutput(index, text, seq.output_token_ids, seq.finish_reason, stop_reason, seq.tpot,
                                      seq.num_preemptions)
        return RequestOutput(seq.seq_id, seq.token_ids[: seq.num_prompt_tokens], [completion], seq.ttft, group)

    def _schedule(self, streams: dict[int, torch.Tensor]):
        """The step's batch. Preempted sequences lose their compressor state (a recompute rebuilds it); if
        scheduling raises (the scheduler then put back what it had scheduled), the streams are put back."""
        try:
            batch = self.scheduler.schedule()
            while not batch.seqs and self.kv.places is not None and self.kv.places.in_flight():
                self.kv.places.wait()  # only requests waiting on tier reads: block until one arrives
                batch = self.scheduler.schedule()
        except BaseException:
            self._restore_streams(streams)
            self.lifecycle.emit("dropped", self.scheduler.waiting)
            raise
        self.lifecycle.emit("dropped", batch.preempted)
        streams.update(self._stream_states([s for s in batch.seqs if s.seq_id not in streams]))
        return batch

    def _commit(self, batch, out, spawned: list[tuple[Sequence, SamplingParams, list[Sequence]]],
                due: list[bool] | None, rejected: dict[int, int] | None) -> None:
        """The forward pass ran: advance the batch's token progress, compress the sequences due, then
        fork the new samples from what the policy kept."""
        if self.cache.sparse_read is not None:  # the accepted drafts' keys enter the page summaries
            kept = self.speculator.kept_rows if self.speculator else None  # a token tree's accepted path
            self.cache.sparse_read.accept(rejected or {}, kept)
        self.scheduler.advance(batch, rejected)
        self._record_step(batch.num_preempted)  # before compression: the step's peak of pages held
        if self.compressor:
            kept = self.speculator.kept_rows if self.speculator else None  # the rows each verify step kept
            self.compressor.after_step(batch.seqs, batch.num_new_tokens, due, out.queries, out.stats, kept)
        self._admit_samples(spawned)

    def _stream_states(self, seqs) -> dict[int, torch.Tensor]:
        """The random streams of the sampled requests among `seqs`, as they are now (a failed step gives
        them back: a retried step draws what the step would have drawn)."""
        return {s.seq_id: self._generators[s.seq_id].get_state() for s in seqs if s.seq_id in self._generators}

    def _roll_back(self, batch, spawned: list[tuple[Sequence, SamplingParams, list[Sequence]]],
                   streams: dict[int, torch.Tensor]) -> None:
        """A stage of the step failed: drop the samples it spawned (their request spawns them again when it
        samples its first token) and put every sequence of the batch back in the queue, its pages freed,
        its compressor state dropped and its random stream as it was, to be recomputed from its tokens
        (none of this step's is kept)."""
        self._restore_streams(streams)
        for parent, params, children in spawned:
            parent.params = params
            self._groups.pop(parent.seq_id, None)
            self._samples.pop(parent.seq_id, None)
            for child in children:
                self._samples.pop(child.seq_id, None)
                self.scheduler.abort(child.seq_id)  # if it was admitted: its pages go back
            self.lifecycle.emit("aborted", children)
        self.scheduler.unschedule(batch)
        self.lifecycle.emit("dropped", batch.seqs)

    def _restore_streams(self, streams: dict[int, torch.Tensor]) -> None:
        for seq_id, state in streams.items():
            if seq_id in self._generators:
                self._generators[seq_id].set_state(state)

    def on_sequence(self, event: str, seq: Sequence) -> None:
        """The engine's own per-sequence state (random streams, return_dists, waste history) on `event`."""
        if event in ("finished", "aborted"):
            self._generators.pop(seq.seq_id, None)
            self._return_dists.discard(seq.seq_id)
        if event == "aborted":
            self.metrics.discard(seq.seq_id)

    def num_tracked(self) -> int:
        return len(self._generators.keys() | self._return_dists)

    # -- parallel sampling ---------------------------------------------------
    def _spawn_samples(self, out) -> list[tuple[Sequence, SamplingParams, list[Sequence]]]:
        """Requests with n > 1 sampling their first token now: n - 1 more samples of the same prompt,
        each drawing from the same logits row with its own generator (`SamplingParams.for_sample`)."""
        spawned = []
        for seq, row in list(out.sample_rows):
            params = seq.params
            if params.n == 1 or seq.num_output_tokens:
                continue
            children = []
            for i in range(1, params.n):
                seq_id, self._next_id = self._next_id, self._next_id + 1
                child = Sequence(seq_id, seq.token_ids, params.for_sample(i), seq.max_len, seq.arrival_time)
                if not child.params.greedy:
                    self._generators[seq_id] = request_generator(self.config.seed, seq_id, child.params.seed)
                out.sample_rows.append((child, row))
                children.append(child)
            spawned.append((seq, params, children))
        return spawned

    def _admit_samples(self, spawned: list[tuple[Sequence, SamplingParams, list[Sequence]]]) -> None:
        """The step ran and its prompt was compressed: the new samples share every page of their first
        sample as the policy left them (copy-on-write) and start from its compressor state, so each goes
        on as a separate request with its seed would."""
        for parent, params, children in spawned:
            parent.params = params.for_sample(0)
            self._groups[parent.seq_id] = [parent.seq_id] + [c.seq_id for c in children]
            for i, seq in enumerate([parent, *children]):
                self._samples[seq.seq_id] = (parent.seq_id, i)
            for child in children:
                if not self.block_manager.can_fork(parent):  # an allocator that copies, and no room now
                    self.scheduler.defer(child)
                    continue
                if self.compressor:
                    self.compressor.fork(parent, child)
                self.block_manager.fork(parent, child)
                self.scheduler.admit_forked(child, parent.num_computed_tokens)

    def _sample(self, out) -> list[int]:
        """One token per sampling row (nothing is appended yet: a failure here leaves every sequence as it was)."""
        if not out.sample_rows:
            return []
        rows = torch.tensor([r for _, r in out.sample_rows])
        seqs = [s for s, _ in out.sample_rows]
        try:
            return sample(out.logits[rows], [s.params for s in seqs], [self._generators.get(s.seq_id) for s in seqs])
        except SamplingError as exc:
            seq = seqs[exc.row]
            raise RuntimeError(f"request {seq.seq_id}: sampling failed ({exc.cause}); the step was undone and the "
                               f"request fails again if retried: abort it (engine.abort({seq.seq_id}))") from exc

    def _postprocess(self, out, tokens: list[int], verified: list[tuple[Sequence, list[int]]] = ()) -> list[Sequence]:
        """Append each sequence's new tokens (one, or a verified speculative run) one by one: a stop
        inside a run drops the tokens after it."""
        now = time.perf_counter()
        finished: list[Sequence] = []
        for seq, run in [(seq, [token]) for (seq, _), token in zip(out.sample_rows, tokens)] + list(verified):
            for token in run:
                seq.token_ids.append(token)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                reason = self._stop_reason(seq, token)
                if reason:
                    finished.append(self._finish(seq, reason, now))
                    break
            else:
                if len(run) > 1:  # a verified run: the pages its accepted drafts filled are findable now
                    self.block_manager.commit(seq)
        for seq, rows, targets in out.score_rows:
            # a scoring sequence's rows are consecutive (ModelRunner.prepare): a view of the step's logits, not a
            # copy (a rolling window's 512 rows of Gemma 3's 262k vocabulary are 537 MB)
            logp = torch.log_softmax(out.logits[rows[0] : rows[-1] + 1], dim=-1)  # [r, V]
            seq.logprobs.extend(logp.gather(1, torch.tensor(targets)[:, None])[:, 0].tolist())
            if seq.seq_id in self._return_dists:
                seq.dists.extend(logp)
            if seq.is_fully_scored:
                finished.append(self._finish(seq, "scored", now))
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` finishes with `token` (just appended), checked in vLLM's order: EOS, a stop token, a
        stop string the token completed, then the length limits; None to go on."""
        if token in seq.params.stop_token_ids or (token in self.eos_token_ids and not seq.params.ignore_eos):
            return "stop"
        if seq.params.stop and self._stop_strings(seq).append(token):
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _stop_strings(self, seq: Sequence) -> StopStrings:
        """The sequence's stop-string matcher, made at its first generated token (a fork's at its first
        own token, primed with the output it inherited)."""
        if seq.stop_strings is None:
            tok = self.tokenizer
            seq.stop_strings = StopStrings(lambda ids: tok.decode(ids, skip_special_tokens=True), seq.params.stop,
                                           seq.params.include_stop_str_in_output)
            seq.stop_strings.prime(seq.output_token_ids[:-1])
        return seq.stop_strings

    def _stop_token(self, seq: Sequence) -> int | None:
        """The stop token that finished `seq` (vLLM's stop_reason), None if EOS or anything else did."""
        last = seq.output_token_ids[-1] if seq.num_output_tokens else None
        if seq.finish_reason != "stop" or last not in seq.params.stop_token_ids:
            return None
        return None if last in self.eos_token_ids and not seq.params.ignore_eos else last

    def _finish(self, seq: Sequence, reason: str, now: float) -> Sequence:
        # the final length in the cache (the last sampled token is never written; evicted ones are gone)
        final = self.block_manager.cached_total(seq)
        if self.block_manager.kept_turns is not None:  # its compressed tables, kept for the next turn
            self.block_manager.keep_turn(seq, self.compressor.turn_state(seq) if self.compressor else None)
        self.scheduler.finish(seq, reason)
        seq.finish_time = now
        self.lifecycle.emit("finished", [seq])
        n_out = seq.num_output_tokens if not seq.is_scoring else 0
        self.metrics.record_finish(seq.seq_id, final, seq.num_prompt_tokens, n_out, seq.ttft, seq.tpot)
        return seq

    def _record_step(self, num_preempted: int) -> None:
        bm, running = self.block_manager, self.scheduler.running
        external = bm.external_fragmentation(self.scheduler.waiting[0]) if self.scheduler.waiting else 0
        self.metrics.record_step(bm.num_used_blocks(), [(s.seq_id, *bm.waste_view(s)) for s in running], external,
                                 num_preempted, bm.group_usage(running) if len(bm.groups) > 1 else None)

    # -- metrics -------------------------------------------------------------
    def stats(self) -> dict:
        """Throughput, latency, KV held (pages of the shared pool, in total and per kind of layer group; their
        bytes; their tokens: kvlab.metrics, "KV held"), waste, and the plugins' counters."""
        n_full = len(self.block_manager.full_groups)
        live = {s.seq_id: s.num_tokens * n_full for s in self.scheduler.running}
        summary = self.metrics.summary(live)
        page_tokens = tokens_per_page(self.block_manager.groups, self.block_manager.block_size,
                                      self.model_config.num_key_value_heads)
        for key in ("peak", "mean"):  # pages held, in bytes (scales included) and tokens (kvlab.metrics: "KV held")
            summary[f"kv_bytes_{key}"] = summary[f"kv_blocks_{key}"] * self.bytes_per_block
            summary[f"kv_tokens_{key}"] = summary[f"kv_blocks_{key}"] * page_tokens
        if self.compressor:
            summary.update(self.compressor.stats())
            summary["policy_bytes_freed"] = summary["policy_pages_freed"] * self.bytes_per_block
        summary["cow_copies"] = self.block_manager.num_cow_copies
        if self.cache.area is not None:  # pages sealed before their tokens left the residual window (0 in the engine)
            summary["residual_early_seals"] = self.cache.area.early_seals
        pc = self.block_manager.prefix_cache
        if pc is not None:
            st = pc.stats
            summary.update(prefix_hit_rate_tokens=st.hit_tokens / st.queried_tokens if st.queried_tokens else 0.0,
                           prefix_hit_rate_pages=st.hit_pages / st.queried_pages if st.queried_pages else 0.0,
                           prefix_hit_tokens=st.hit_tokens, prefix_queried_tokens=st.queried_tokens,
                           prefix_pages_saved=st.hit_pages, prefix_evictions=st.evictions,
                           prefix_cached_free_pages=pc.num_parked)
        turns = self.block_manager.kept_turns
        if turns is not None:  # kept compressed turns (EngineConfig.reuse_compressed)
            st = turns.stats
            summary.update(turn_reuse_hits=st.hits, turn_reuse_tokens=st.hit_tokens, turns_kept=st.kept,
                           turn_evictions=st.evictions, turns_held=len(turns),
                           turn_pages_held=self.block_manager.allocator.num_kept_only)
        if self.cache.sparse_read is not None:
            summary.update(self.cache.sparse_read.stats())
        if self.speculator:
            summary.update(self.speculator.stats(self.metrics.busy_s))
        if self.kv.places is not None:
            summary.update(self.tier_stats())
        return summary

    def tier_stats(self) -> dict:
        """The tiers below the pool: pages held per tier, demoted, restored (hits per tier), spilled, dropped,
        failed reads, reads started ahead (prefetched at add / fetched at scheduling), waits on reads, pages
        recomputed rather than restored, bytes moved, the time spent moving them and its rate."""
        places = self.kv.places
        st = places.stats
        out = dict(tier_pages_held=len(places), tier_demoted=st.demoted, tier_restored=st.restored,
                   tier_spilled=st.spilled, tier_dropped=st.dropped, tier_refused=st.refused,
                   tier_failed_reads=st.failed_reads, tier_bytes_moved=st.bytes_moved,
                   tier_move_seconds=st.move_seconds, tier_prefetched=st.prefetched, tier_fetched=st.fetched,
                   tier_waits=st.waits, tier_recomputed=st.recomputed,
                   tier_move_mb_per_s=st.bytes_moved / 2**20 / st.move_seconds if st.move_seconds else 0.0)
        for t, kind in enumerate(places.kinds):
            out[f"tier_{kind}_pages_held"] = places.held[t]
            out[f"tier_{kind}_hits"] = st.hits.get(kind, 0)
        return out

    def close(self) -> None:
        """Give back what outlives the engine's memory: the tiers below the pool are drained and closed (a disk
        tier's page files and folder removed). The engine stays usable, without tiers (evicted pages dropped again)."""
        self.kv.close_tiers()

    def reset_stats(self) -> None:
        self.metrics = self._new_metrics()
        self.block_manager.num_cow_copies = 0
        if self.block_manager.prefix_cache is not None:
            self.block_manager.prefix_cache.stats = PrefixStats()
        if self.compressor:
            self.compressor.reset_stats()
        if self.block_manager.kept_turns is not None:
            self.block_manager.kept_turns.stats = KeptTurnStats()
        if self.cache.sparse_read is not None:
            self.cache.sparse_read.reset_stats()
        if self.speculator:
            self.speculator.reset_stats()
        if self.kv.places is not None:
            self.kv.places.stats = TierStats()


def own_rows(queries: dict[int, list[torch.Tensor]], rows: list[int]) -> dict[int, list[torch.Tensor]]:
    """The last rows[i] of each sequence's recorded queries (layer -> per sequence [n_i, Hq, D]): what the cache
    policy asked for, where the draft asked for more."""
    return {layer: [q[len(q) - r:] for q, r in zip(qs, rows)] for layer, qs in queries.items()}
