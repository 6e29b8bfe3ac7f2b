"""The engine loop: schedule -> run -> sample -> append, detokenize, stop -> commit, free.

``LLMEngine`` is synchronous and single-threaded; ``AsyncEngine`` runs it in
its own thread. Where a token is born: ``step``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from engine.api.errors import RequestError
from engine.api.request import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from engine.api.request_limits import RequestLimits
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core.detokenizer import IncrementalDetokenizer, check_stop_token
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.speculation import make_speculator
from engine.core.step import ModelRunner, StepBatch
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.vision.config import image_token_id, vision_config
from engine.sample.sampler import Sampler, SeqHistory, make_generator
from engine.spec_decode.proposer import Proposer
from engine.structured_output.backend import GrammarBackend, GrammarJob, TokenMaskProvider
from engine.structured_output.xgrammar_backend import GrammarLimits, StructuredOutputManager
from kvstore.manager import KVManager
from kvstore.stats import KVStats

logger = logging.getLogger(__name__)

# With nothing to run but grammars compiling, a step waits this long for one of them
# (rather than spinning), so a new request or an abort still waits at most this.
GRAMMAR_POLL_S = 0.005


@dataclass(slots=True)
class EngineCounters:
    """Cumulative counters for metrics (names are documented in docs/design/engine.md)."""

    steps: int = 0
    requests_added: int = 0
    requests_finished: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # choices, by finish reason
    prefill_rows: int = 0  # encoder rows of prefill chunks (replayed rows included)
    decode_rows: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    prompt_cache_hit_tokens: int = 0
    replay_tokens: int = 0
    step_seconds: float = 0.0  # wall time inside ``step``
    execute_seconds: float = 0.0  # of which inside ``runner.execute``
    # Speculative decoding (vLLM's spec_decode_* metrics): verified drafts, their
    # tokens, the accepted ones, and accepted by draft position (index j: drafts
    # whose position j was accepted).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineStats:
    """A snapshot for ``/metrics`` and ``stats()``."""

    running: int
    waiting: int
    preemptions: int
    kv: KVStats
    counters: EngineCounters


@dataclass(slots=True)
class _Choice:
    """Per-sequence output state; ``pending_*`` is what the next output carries."""

    seq: Sequence
    detok: IncrementalDetokenizer | None
    generator: torch.Generator | None
    grammar: TokenMaskProvider | None = None  # the sequence's parse state under a spec
    pending_text: str = ""
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    reported_finish: bool = False


@dataclass(slots=True)
class _RequestState:
    request: Request
    choices: list[_Choice]
    prompt_scores_reported: bool = False

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.choices)


class LLMEngine:
    """Continuous batching over one model runner and one KV manager (bookkeeping only:
    the runner owns the KV bytes)."""

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        kv: KVManager,
        *,
        model_config: ModelConfig,
        vocab_size: int | None = None,
        max_position_embeddings: int | None = None,
        tokenizer: Tokenizer | None = None,
        eos_token_id: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        encoder_only: bool = False,
        grammars: GrammarBackend | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        # Special tokens, vocabulary and context come from the model's config; tests
        # with a model-free runner may narrow the vocabulary or the context.
        eos_token_id = model_config.eos_token_id if eos_token_id is None else eos_token_id
        vocab_size = vocab_size or model_config.vocab_size
        max_position_embeddings = max_position_embeddings or model_config.max_position_embeddings
        self.config = config
        # A prefill worker's model has no decoder layers: only prefill-only requests run.
        self.encoder_only = encoder_only
        self.runner = runner
        self.kv = kv
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.max_model_len = config.max_model_len or max_position_embeddings
        # Images only for a model with a vision tower: its placeholder id and settings.
        self.vision = vision_config(model_config)
        self.image_token_id = image_token_id(model_config) if self.vision else None
        self.replay_tokens = config.replay_window(model_config.sliding_window)

        def release(seq: Sequence) -> None:
            runner.release(seq)
            if self.speculator is not None:
                self.speculator.release(seq)

        self.scheduler = Scheduler(config, kv, model_config, self.replay_tokens, release, clock)
        self.sampler = Sampler(eos_token_id)
        # Structured output: specs compile in the backend's threads, with this engine's
        # tokenizer; a request waits (unscheduled) in ``_awaiting`` until its grammar is.
        if grammars is None and tokenizer is not None:
            grammars = StructuredOutputManager(
                tokenizer,
                vocab_size,
                1 if eos_token_id is None else eos_token_id,
                GrammarLimits(
                    config.grammar_timeout_s,
                    config.grammar_cache_bytes,
                    config.grammar_workers,
                    config.max_grammar_bytes,
                ),
            )
        self.grammars = grammars
        self._awaiting: dict[str, GrammarJob] = {}
        self.counters = EngineCounters()
        # Speculative decoding (engine/core/speculation.py); None: off.
        self.speculator = make_speculator(
            config.speculative(),
            proposer,
            runner,
            self.scheduler,
            model_config,
            self.max_model_len,
            self.counters,
        )
        self._clock = clock
        self._requests: dict[str, _RequestState] = {}
        self._seq_ids = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        # Called once per step between scheduling and the model: an engine core in its
        # own process reports queue lengths here, before a long forward.
        self.on_scheduled: Callable[[], None] | None = None

    # ------------------------------------------------------------ requests
    def validate(self, request: Request) -> None:
        """Raise ``RequestError`` if ``request`` can never run; reads configuration only."""
        self.limits().validate(request)

    def limits(self) -> RequestLimits:
        """The numbers ``validate`` checks against (what a core process sends its client)."""
        return RequestLimits(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            page_tokens=self.kv.page_tokens,
            num_pages=self.kv.num_pages,
            has_tokenizer=self.tokenizer is not None,
            encoder_only=self.encoder_only,
            image_token_id=self.image_token_id,
            image_patch_size=self.vision.patch_size if self.vision else None,
            image_downsample_ratio=self.vision.downsample_ratio if self.vision else None,
        )

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.validate(request)
        params = request.sampling_params
        if request.prefill_only:
            self._add_prefill_only(request)
            return
        choices = []
        for index in range(params.n):
            seq = self._sequence(request, request.prompt_token_ids, index)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                    min_tokens=params.min_tokens,
                )
            generator = make_generator(params, index, self.config.device)
            choices.append(_Choice(seq, detok, generator))
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("SamplingParams.structured: structured output needs a tokenizer")
            self._awaiting[request.request_id] = self.grammars.submit(params.structured)
        self._requests[request.request_id] = _RequestState(request, choices)
        self.counters.requests_added += 1
        if params.structured is not None:
            return
        for choice in choices:
            self.scheduler.add(choice.seq)

    def _admit_grammars(self) -> None:
        """Schedule the requests whose grammar is compiled, each choice with a matcher of
        its own, and say so with an output that carries no text (the server answers only
        then, so a grammar that fails is still an error status, not a broken stream); end
        those whose grammar failed or is late."""
        now = self._clock()
        for rid, job in list(self._awaiting.items()):
            state = self._requests[rid]
            try:
                if not job.ready(now):
                    continue
                matchers = [job.matcher() for _ in state.choices]
            except Exception as exc:  # GrammarError: the request's own schema or prefix
                self._pending_outputs.append(self._fail(rid, exc))
                continue
            del self._awaiting[rid]
            for choice, matcher in zip(state.choices, matchers, strict=True):
                choice.grammar = matcher
                self.scheduler.add(choice.seq)
            self._pending_outputs.append(self._output(state))

    def _wait_for_grammars(self) -> None:
        """Nothing else to run: wait a little for the oldest grammar still compiling."""
        job = next(iter(self._awaiting.values()))
        job.wait(GRAMMAR_POLL_S)

    def _end_sequence(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler (one still waiting for its grammar was
        never handed to it)."""
        if seq.request_id in self._awaiting:
            seq.status = SequenceStatus.FINISHED
        else:
            self.scheduler.finish(seq)

    def _sequence(
        self, request: Request, prompt: list[int], index: int, prefill_only: bool = False
    ) -> Sequence:
        return Sequence(
            seq_id=next(self._seq_ids),
            request_id=request.request_id,
            token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            salt=request.cache_salt,
            priority=request.priority,
            arrival=request.arrival_time,
            index=index,
            prefill_only=prefill_only,
            # A prefill-only prompt is cut to full pages: a span past the cut is not
            # in it, one across the cut only in part (the runner takes its rows so far).
            images=tuple(i for i in request.images if i.offset < len(prompt)),
            # One choice scores the prompt for all of them.
            prompt_logprobs=request.sampling_params.prompt_logprobs if index == 0 else None,
        )

    def _add_prefill_only(self, request: Request) -> None:
        """One sequence over the prompt's full pages: the partial last page is the
        decode side's to compute (only full pages are ever handed over)."""
        pt = self.kv.page_tokens
        full = len(request.prompt_token_ids) // pt * pt
        seq = self._sequence(request, request.prompt_token_ids[:full], 0, prefill_only=True)
        state = _RequestState(request, [_Choice(seq, None, None)])
        self._requests[request.request_id] = state
        self.counters.requests_added += 1
        if full == 0:  # nothing to hand over
            self._pending_outputs.append(self._finish_prefill(seq, []))
            return
        self.scheduler.add(seq)

    def _finish_prefill(self, seq: Sequence, published: list[bytes]) -> RequestOutput:
        """End a prefill-only request; its output carries the page chain to wait for."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "stop"
        seq.finished = self._clock()
        state = self._requests.pop(seq.request_id)
        out = self._output(state)
        out.published_pages = published
        self._count_finished(state)
        return out

    def abort(self, request_id: str, *, report: bool = True) -> bool:
        """Finish every choice of ``request_id`` now, freeing its pages; False if unknown.

        With ``report``, the final output (finish reason ``abort``) comes with
        the next ``step``; without, nobody is listening and none is made.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        now = self._clock()
        for choice in state.choices:
            seq = choice.seq
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING and not seq.in_prefill:
                self._commit(seq)  # its written KV stays useful to the prefix cache
            self._end_sequence(seq)
            seq.finish_reason = "abort"
            seq.finished = now
            choice.pending_text = ""  # held-back text is dropped with the request
        job = self._awaiting.pop(request_id, None)
        if job is not None:
            job.cancel()
        if report:
            self._pending_outputs.append(self._output(state))
        self._count_finished(state)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self._awaiting:
            self._admit_grammars()
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        if self.on_scheduled is not None:
            self.on_scheduled()
        if not batch:
            if self._awaiting and not outputs:
                self._wait_for_grammars()
            return outputs
        if self.speculator is not None and batch.decodes:
            self.speculator.draft(batch, self._max_tokens)
        t0 = time.perf_counter()
        logits = self.runner.execute(batch)
        self.counters.execute_seconds += time.perf_counter() - t0
        if batch.drafts:  # off the token lists again: what is kept is sampled below
            for seq in batch.decodes:
                if k := batch.num_drafts(seq):
                    del seq.token_ids[-k:]
        take = getattr(self.runner, "take_prompt_logprobs", None)
        if take is not None:
            prefilled = {c.seq.seq_id: c.seq for c in batch.prefills}
            for seq_id, scores in take().items():
                prefilled[seq_id].prompt_scores.extend(scores)
        for chunk in batch.prefills:
            if chunk.last and chunk.seq.scores_prompt:
                chunk.seq.prompt_scored = True

        for chunk in batch.prefills:
            chunk.seq.num_computed = chunk.end
        for seq in batch.decodes:
            # (Drafts are off the list already: a verify step's kept rows are known
            # after sampling; until then only the row before its drafts counts.)
            seq.num_computed = seq.num_tokens
        for seq in batch.prefilled():
            self._commit(seq)
            published = self.kv.publish(seq.seq_id)
            self.scheduler.finish(seq)
            outputs.append(self._finish_prefill(seq, published))
        sampled = batch.sampled()
        failures = self._sample_and_append(sampled, logits, batch.drafts) if sampled else {}
        if self.speculator is not None:
            self.speculator.keep_hidden(batch)
        touched: dict[str, _RequestState] = {}
        for seq in sampled:
            if seq.request_id in failures:
                continue
            self._commit(seq)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched[seq.request_id] = self._requests[seq.request_id]
        for state in touched.values():
            outputs.append(self._output(state))
            if state.finished:
                del self._requests[state.request.request_id]
                self._count_finished(state)
        for rid, error in failures.items():
            outputs.append(self._fail(rid, error))
        self._count_step(batch)
        self.counters.step_seconds += time.perf_counter() - started
        return outputs

    def _fail(self, request_id: str, error: BaseException) -> RequestOutput:
        """End every choice of a request whose own state failed (its grammar, stop
        handling or detokenizer raised): finish reason ``error``, pages freed,
        the final output carrying ``error``. Other requests are not touched."""
        if not isinstance(error, RequestError):
            logger.error("request %s failed; the engine goes on", request_id, exc_info=error)
        state = self._requests.pop(request_id)
        now = self._clock()
        for choice in state.choices:
            seq = choice.seq
            if not seq.is_finished:
                self._end_sequence(seq)
            seq.finish_reason = "error"
            seq.finished = now
            choice.pending_text = ""
        self._awaiting.pop(request_id, None)
        out = self._output(state)
        out.error = error
        self._count_finished(state)
        return out

    def _sample_and_append(
        self,
        seqs: list[Sequence],
        logits: dict[int, torch.Tensor],
        drafts: dict[int, list[int]],
    ) -> dict[str, BaseException]:
        """Sample and append each sequence's tokens; returns the requests that failed
        (by request id), whose sequences the caller must not commit or report.

        A plain sequence gets one token. A sequence verifying drafts samples its rows
        in order, row ``j`` exactly as a plain step would after the tokens appended so
        far (its penalties' history and its grammar as of draft ``j - 1``), and goes on
        while the sample equals draft ``j`` and nothing stopped it: one sample per
        committed token, so seeded streams equal the plain ones
        (engine/spec_decode/proposer.py). Rejected drafts never reach the grammar.
        """
        choices = [self._choice(s) for s in seqs]
        params = [self._requests[s.request_id].request.sampling_params for s in seqs]
        failures: dict[str, BaseException] = {}
        accepted = [0] * len(seqs)
        active = list(range(len(seqs)))
        row = 0  # of each verify chunk's logits
        now = self._clock()
        while active:
            rows = [logits[seqs[i].seq_id] for i in active]
            out = self.sampler.sample(
                torch.stack([r[row] if r.dim() == 2 else r for r in rows]),
                [params[i] for i in active],
                [SeqHistory(seqs[i].prompt_view, seqs[i].output_view) for i in active],
                [choices[i].generator for i in active],
                [choices[i].grammar for i in active],
            )
            tokens = out.token_ids.tolist()
            chosen = out.logprobs.tolist() if out.logprobs is not None else []
            for r, exc in out.errors.items():
                failures.setdefault(seqs[active[r]].request_id, exc)
            going_on = []
            for r, i in enumerate(active):
                seq, p = seqs[i], params[i]
                if seq.request_id in failures:
                    continue
                logprob = None
                if p.logprobs is not None:
                    top = out.top_logprobs[r] if out.top_logprobs is not None else []
                    logprob = TokenLogprob(tokens[r], chosen[r], top)
                try:
                    self._append(choices[i], p, tokens[r], logprob, now)
                except Exception as exc:  # this request's grammar / stop handling
                    failures[seq.request_id] = exc
                    continue
                self.counters.generation_tokens += 1
                drafted = drafts.get(seq.seq_id, [])
                if row < len(drafted) and tokens[r] == drafted[row] and not seq.finish_reason:
                    accepted[i] += 1
                    going_on.append(i)
            active, row = going_on, row + 1
        for i, seq in enumerate(seqs):
            draft = drafts.get(seq.seq_id)
            if draft is None or seq.request_id in failures:
                continue
            assert self.speculator is not None
            self.speculator.count(len(draft), accepted[i])
            # Rows run and kept: the last token before the drafts and the accepted
            # drafts; the token sampled last runs next step, as after a plain decode.
            seq.num_computed = seq.num_tokens - 1
        return failures

    def _max_tokens(self, seq: Sequence) -> int:
        return self._requests[seq.request_id].request.sampling_params.max_tokens

    def _append(
        self,
        choice: _Choice,
        params: SamplingParams,
        token: int,
        logprob: TokenLogprob | None,
        now: float,
    ) -> None:
        """One sampled token: record it, stream its text, decide whether the choice ends."""
        seq = choice.seq
        seq.token_ids.append(token)
        if seq.first_token is None:
            seq.first_token = now
        seq.last_token = now
        choice.pending_ids.append(token)
        if logprob is not None:
            choice.pending_logprobs.append(logprob)
        if choice.grammar is not None:
            choice.grammar.accept(token)

        reason = check_stop_token(token, params, self.eos_token_id)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, token
        elif choice.detok is not None:
            # A stop token's own text never reaches the output.
            delta = choice.detok.push(token)
            choice.pending_text += delta.text
            if delta.stopped:
                seq.finish_reason, seq.stop_reason = "stop", delta.stop_reason
        if seq.finish_reason is None:
            if choice.grammar is not None and choice.grammar.is_terminated():
                seq.finish_reason = "stop"
            elif (
                seq.num_output_tokens >= params.max_tokens
                or seq.num_tokens >= self.max_model_len
                # The next decode would need more pages than the whole pool.
                or self.scheduler.pages_needed(seq.num_tokens) > self.kv.num_pages
            ):
                seq.finish_reason = "length"
        if seq.finish_reason is not None and choice.detok is not None:
            choice.pending_text += choice.detok.flush()

    def _commit(self, seq: Sequence) -> None:
        """Cache the sequence's newly full pages (rows whose KV the runner wrote)."""
        self.kv.commit_full_pages(seq.seq_id, seq.computed_view, seq.salt, spans=seq.span_keys)

    # ------------------------------------------------------------ outputs
    def _choice(self, seq: Sequence) -> _Choice:
        return self._requests[seq.request_id].choices[seq.index]

    def _output(self, state: _RequestState) -> RequestOutput:
        wants_logprobs = state.request.sampling_params.logprobs is not None
        outputs = []
        for c in state.choices:
            finishing = c.seq.finish_reason is not None and not c.reported_finish
            if not (c.pending_ids or c.pending_text or finishing):
                continue
            outputs.append(
                CompletionOutput(
                    index=c.seq.index,
                    text=c.pending_text,
                    token_ids=c.pending_ids,
                    logprobs=c.pending_logprobs if wants_logprobs else None,
                    finish_reason=c.seq.finish_reason,
                    stop_reason=c.seq.stop_reason,
                )
            )
            c.pending_text, c.pending_ids, c.pending_logprobs = "", [], []
            c.reported_finish = c.reported_finish or finishing
        return RequestOutput(
            request_id=state.request.request_id,
            outputs=outputs,
            finished=state.finished,
            usage=self._usage(state),
            metrics=self._metrics(state),
            prompt_logprobs=self._prompt_logprobs(state),
        )

    @staticmethod
    def _prompt_logprobs(state: _RequestState) -> list[TokenLogprob] | None:
        """The prompt's scores, once: in the first output after the prefill scored them."""
        seq = state.choices[0].seq
        if not seq.prompt_scored or state.prompt_scores_reported:
            return None
        state.prompt_scores_reported = True
        return seq.prompt_scores

    @staticmethod
    def _usage(state: _RequestState) -> Usage:
        seqs = [c.seq for c in state.choices]
        prompt = len(state.request.prompt_token_ids)
        hit = seqs[0].prompt_hit_tokens
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=sum(s.num_output_tokens for s in seqs),
            prompt_cache_hit_tokens=hit,
            prompt_cache_miss_tokens=prompt - hit,
            prompt_device_hit_tokens=seqs[0].prompt_device_hit_tokens,
            prompt_ssd_hit_tokens=seqs[0].prompt_ssd_hit_tokens,
            replay_tokens=sum(s.replay_tokens for s in seqs),
        )

    @staticmethod
    def _metrics(state: _RequestState) -> RequestMetrics:
        seqs = [c.seq for c in state.choices]

        def first(values: list[float | None]) -> float | None:
            present = [v for v in values if v is not None]
            return min(present) if present else None

        last_tokens = [s.last_token for s in seqs if s.last_token is not None]
        return RequestMetrics(
            arrival_time=state.request.arrival_time,
            first_scheduled_time=first([s.first_scheduled for s in seqs]),
            first_token_time=first([s.first_token for s in seqs]),
            last_token_time=max(last_tokens) if last_tokens else None,
            finished_time=max(s.finished or 0.0 for s in seqs) if state.finished else None,
            num_preemptions=sum(s.num_preemptions for s in seqs),
        )

    # ------------------------------------------------------------ counters
    def _count_step(self, batch: StepBatch) -> None:
        c = self.counters
        c.steps += 1
        c.decode_rows += len(batch.decodes) + sum(len(d) for d in batch.drafts.values())
        c.prefill_rows += sum(chunk.num_tokens for chunk in batch.prefills)

    def _count_finished(self, state: _RequestState) -> None:
        c = self.counters
        usage = self._usage(state)
        c.prompt_tokens += usage.prompt_tokens
        c.prompt_cache_hit_tokens += usage.prompt_cache_hit_tokens
        c.replay_tokens += usage.replay_tokens
        c.requests_finished += 1
        for choice in state.choices:
            reason = choice.seq.finish_reason or "abort"
            c.finished[reason] = c.finished.get(reason, 0) + 1

    def queue_lengths(self) -> tuple[int, int]:
        """(running, waiting) sequences now; safe to read from another thread while a
        step runs (two length reads), unlike ``stats``."""
        return len(self.scheduler.running), len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions,
            kv=self.kv.stats(),
            counters=dataclasses.replace(self.counters, finished=dict(self.counters.finished)),
        )

    def close(self) -> None:
        """Flush the SSD tier's write-behind and stop its threads (and a parallel
        runner's workers)."""
        close = getattr(self.runner, "close", None)
        if close is not None:  # first: it writes the pages its workers still hold
            close()
        self.kv.close()
        if self.grammars is not None:
            self.grammars.close()
