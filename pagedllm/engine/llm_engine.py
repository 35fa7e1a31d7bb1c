"""LLMEngine: the synchronous engine API (vLLM-compatible).

add_request -> tokenization + validation -> Request(s) into the EngineCore; step() runs one
engine iteration and returns RequestOutputs; abort_request frees the request at once and its
final output (finish_reason "abort") is returned by the next step().

Observability (``EngineConfig.observability_config``): with stats on (``disable_log_stats=False``)
the engine records every step into an ``EngineMetrics`` (``get_metrics()``) and logs vLLM's
periodic stats line, unless a front end (``EngineLoop``) takes the step reports over
(``report_steps``); with ``otlp_traces_endpoint`` every finished request becomes a span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pagedllm.config import EngineArgs, EngineConfig, ModelConfig
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.config_builder import create_engine_config
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.engine_loop import StepReport
from pagedllm.engine.input_processor import tokenize_prompt, validate_prompt
from pagedllm.engine.metrics import EngineMetrics
from pagedllm.engine.metrics_reader import Metric
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest, RequestState
from pagedllm.engine.pooling import POOLING_PLACEHOLDER_PARAMS, PoolingRequests, validate_pooling_prompt
from pagedllm.lora.peft_config import read_adapter_spec
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import PoolingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm")


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None) -> None:
        from pagedllm.loader import load_tokenizer

        dp = config.parallel_config.data_parallel_size
        if dp > 1:
            raise ValueError(f"data_parallel_size ({dp}) needs one engine core per replica: serve it with pagedllm "
                             "serve --data-parallel-size or AsyncLLMEngine; LLM and LLMEngine drive one core (for "
                             "offline data parallel run one LLM per process, as with vLLM)")
        self.config = config
        self.model_config = config.model_config
        mc = config.model_config
        if tokenizer is None and not mc.skip_tokenizer_init:
            tokenizer = load_tokenizer(mc.source, mc.tokenizer)
        self.tokenizer = tokenizer  # None with skip_tokenizer_init: prompts must be token ids
        self.output_processor = OutputProcessor(self.tokenizer)
        # runner "pooling": every request is a pooling request, tracked here instead (engine/pooling.py).
        self.pooling_requests = PoolingRequests() if mc.runner == "pooling" else None
        # Stop strings are decided in the scheduler's update, by the output processor's detokenizers.
        self.engine_core = EngineCore(config, stop_checker=self.output_processor.check_stop_strings,
                                      tokenizer=self.tokenizer)
        self._pending_abort_outputs: list[RequestOutput | PoolingRequestOutput] = []
        self._lora_paths: dict[int, str] = {}  # lora_int_id -> its checked adapter folder
        self.eos_token_id = self._eos_token_id()
        self.stat_logger: EngineMetrics | None = None
        if config.log_stats:
            self.stat_logger = EngineMetrics(mc.served_model_name)
            self.output_processor.record_step_tokens()
        self.tracer = None
        # request id -> (its params, its trace headers) of the requests to trace when they finish.
        self._traced: dict[str, tuple[SamplingParams, Mapping[str, str] | None]] = {}
        endpoint = config.observability_config.otlp_traces_endpoint
        if endpoint is not None:
            from pagedllm.tracing import RequestTracer

            self.tracer = RequestTracer(endpoint, mc.served_model_name)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: str = "ENGINE_CONTEXT") -> LLMEngine:
        """``usage_context`` (vLLM's): "LLM_CLASS", "OPENAI_API_SERVER" or "ENGINE_CONTEXT"; it
        only picks the default ``max_num_batched_tokens`` (``config_builder``)."""
        t0 = time.perf_counter()
        config = create_engine_config(engine_args, usage_context)
        logger.info("engine config (model %s) resolved in %.1f s", config.model_config.served_model_name,
                    time.perf_counter() - t0)
        return cls(config)

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return eos

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_tokenizer(self):
        return self.tokenizer

    def get_engine_config(self) -> EngineConfig:
        return self.config

    def get_scheduler_stats(self) -> SchedulerStats:
        """Queue lengths, KV-cache usage and the cumulative prefix-cache and preemption counts."""
        return self.engine_core.scheduler.stats()

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics (vLLM's ``get_metrics``): Counter / Gauge / Histogram objects named
        ``pagedllm:...`` as the server's ``/metrics``. Needs stats (``disable_log_stats=False``)."""
        if self.stat_logger is None:
            raise RuntimeError("get_metrics() needs stats, which are off: create the engine with "
                               "disable_log_stats=False (LLM(...) turns them off by default, as vLLM)")
        return self.stat_logger.snapshot()

    def report_steps(self) -> None:
        """A front end (``EngineLoop``) takes the stats over: it gets ``step_report`` of every step
        and records and logs them itself; this engine keeps no metrics of its own from now on."""
        self.stat_logger = None
        self.output_processor.record_step_tokens()

    def step_report(self, outputs: list[RequestOutput]) -> StepReport:
        """What the step that returned ``outputs`` did, for ``EngineMetrics.on_step``."""
        grammars = self.engine_core.structured_output
        return StepReport(outputs, self.get_scheduler_stats(), self.output_processor.take_step_tokens(),
                          self.output_processor.step_time, grammars.stats() if grammars is not None else None)

    def shutdown(self) -> None:
        if self.tracer is not None:
            self.tracer.shutdown()  # export the spans still queued
        self.engine_core.shutdown()

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if self.output_processor.has_request(request_id) or (
                self.pooling_requests is not None and self.pooling_requests.has_request(request_id)):
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        self._check_params_type(params)
        if lora_request is not None:
            self.check_lora_request(lora_request)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        if trace_headers is not None:
            self._check_trace_headers(trace_headers)
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("lora_request is not supported for pooling requests (adapters serve generation)")
            self._add_pooling_request(request_id, prompt, params, arrival_time, tokenization_kwargs, priority)
            return
        self._check_logprobs(params)
        if self.tokenizer is None and (params.stop or params.bad_words):
            raise ValueError("stop strings and bad_words need a tokenizer (the engine was started with skip_tokenizer_init)")
        if params.structured_outputs is not None:
            self.engine_core.prepare_structured_outputs(params.structured_outputs)
        prompt_text, prompt_ids = tokenize_prompt(prompt, self.tokenizer, tokenization_kwargs)
        params = params.clone()  # the engine fills private fields; the caller's object stays as given
        max_tokens = validate_prompt(prompt_ids, params, self.model_config.vocab_size, self.model_config.max_model_len)
        params._eos_token_id = self.eos_token_id
        if params.bad_words:
            params._bad_words_token_ids = self._bad_words_ids(params.bad_words)
        arrival = time.time() if arrival_time is None else arrival_time
        num_seqs = params.best_of or params.n
        child_ids = [request_id] if num_seqs == 1 else [f"{i}_{request_id}" for i in range(num_seqs)]
        parent = ParentRequest(request_id, params, child_ids, params.n) if num_seqs > 1 else None
        requests = []
        for index, child_id in enumerate(child_ids):
            child_params = params if num_seqs == 1 else self._child_params(params, index)
            request = Request(child_id, prompt_ids, child_params, self.eos_token_id, arrival, priority, max_tokens,
                              lora_request=lora_request)
            state = RequestState(child_id, parent.request_id if parent else None, index, prompt_text, prompt_ids,
                                 child_params, self.tokenizer, params.output_kind,
                                 hide_logprobs=params.logprobs is None, request=request)
            self.output_processor.add_request(state, parent)
            requests.append(request)
        # n / best_of > 1: the scheduler holds the siblings back until the first has the prompt's KV.
        self.engine_core.add_request(requests[0], requests[1:])
        if self.stat_logger is not None:
            self.stat_logger.on_request_added(request_id, arrival)
        if self.tracer is not None:
            self._traced[request_id] = (params, trace_headers)

    def check_lora_request(self, lora_request: Any) -> None:
        """Refuse a ``lora_request`` the engine cannot run (``ValueError`` / ``TypeError`` naming the
        field): LoRA off, not a ``LoRARequest``, an id already naming another folder, or an adapter
        folder that ``lora.peft_config`` refuses (rank, targets, shapes). A folder is checked once."""
        if self.config.lora_config is None:
            raise ValueError("lora_request needs LoRA, which is off: start the engine with enable_lora=True "
                             "(--enable-lora)")
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        known = self._lora_paths.get(lora_request.lora_int_id)
        if known == lora_request.lora_path:
            return
        if known is not None:
            raise ValueError(f"lora_request: lora_int_id {lora_request.lora_int_id} already names the adapter at "
                             f"{known!r}, not {lora_request.lora_path!r}: give each adapter its own id")
        read_adapter_spec(lora_request.lora_path, self.config.lora_config.max_lora_rank,
                          self.model_config.hf_config)
        self._lora_paths[lora_request.lora_int_id] = lora_request.lora_path

    def _check_params_type(self, params: Any) -> None:
        """SamplingParams on a generation runner, PoolingParams on a pooling runner (TypeError
        naming ``params`` otherwise)."""
        pooling = self.pooling_requests is not None
        expected = PoolingParams if pooling else SamplingParams
        if not isinstance(params, expected):
            what = "a pooling model (runner='pooling')" if pooling else "a generation model (runner='generate')"
            raise TypeError(f"params must be {expected.__name__} for {what}, got {type(params).__name__}")

    def _add_pooling_request(self, request_id: str, prompt: Any, params: PoolingParams, arrival_time: float | None,
                             tokenization_kwargs: dict[str, Any] | None, priority: int) -> None:
        """Queue a pooling request (``engine/pooling.py``): prefill only, no sampler."""
        mc = self.model_config
        params = mc.pooler_config.resolve(params, mc.served_model_name)
        _, prompt_ids = tokenize_prompt(prompt, self.tokenizer, tokenization_kwargs)
        validate_pooling_prompt(prompt_ids, mc.vocab_size, mc.max_model_len)
        arrival = time.time() if arrival_time is None else arrival_time
        request = Request(request_id, prompt_ids, POOLING_PLACEHOLDER_PARAMS, None, arrival, priority, 1,
                          pooling_params=params)
        self.pooling_requests.add(request_id, prompt_ids)
        self.engine_core.add_request(request)
        if self.stat_logger is not None:
            self.stat_logger.on_request_added(request_id, arrival)

    def _check_trace_headers(self, trace_headers: Any) -> None:
        if self.tracer is None:
            raise ValueError("trace_headers need tracing, which is off: start the engine with "
                             "otlp_traces_endpoint (--otlp-traces-endpoint) to export request spans")
        if not isinstance(trace_headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in trace_headers.items()
        ):
            raise TypeError(f"trace_headers must be a mapping of header names to strings, got {trace_headers!r}")

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        child = params.clone()
        child.n, child.best_of = 1, None
        if params.seed is not None:
            child.seed = params.seed + index
        if params.best_of is not None and params.best_of > params.n and child.logprobs is None:
            child.logprobs = 0  # best_of ranks sequences by cumulative logprob (hidden from the user)
        if index > 0:
            child.prompt_logprobs = None  # reported once, from the first sequence
        return child

    def _check_logprobs(self, params: SamplingParams) -> None:
        limit = self.config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and v > limit:
                raise ValueError(f"{name} must be <= max_logprobs ({limit}), got {v}")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Token sequences to ban, as vLLM: each word without leading space, plus its
        leading-space form when that is a different first token of the same length (the word
        in the middle of a text)."""
        ids: list[list[int]] = []
        for w in words:
            bare = self.tokenizer.encode(w.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
            if bare:
                ids.append(bare)
            if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
                ids.append(spaced)
        return ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests now (blocks freed at once); unknown or finished ids are ignored. Their
        final outputs, with finish_reason "abort", come from the next step()."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.pooling_requests is not None:
            live = [r for r in ids if self.pooling_requests.has_request(r)]
            self.engine_core.abort_requests(live)
            self._pending_abort_outputs.extend(self.pooling_requests.finish_aborted(live))
            return
        live = [r for r in ids if self.output_processor.has_request(r)]
        seq_ids = [c for r in live for c in self.output_processor.child_ids(r)]
        self.engine_core.abort_requests(seq_ids)
        self._pending_abort_outputs.extend(self.output_processor.finish_aborted(live))

    # -- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput] | list[PoolingRequestOutput]:
        outputs, self._pending_abort_outputs = self._pending_abort_outputs, []
        if self.engine_core.has_unfinished_requests():
            processor = self.output_processor if self.pooling_requests is None else self.pooling_requests
            outputs.extend(processor.process_outputs(self.engine_core.step()))
        if self.tracer is not None:
            self._trace_finished(outputs)
        if self.stat_logger is not None:
            self.stat_logger.on_step(self.step_report(outputs))
            self.stat_logger.maybe_log()
        return outputs

    def _trace_finished(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished and out.request_id in self._traced:
                params, trace_headers = self._traced.pop(out.request_id)
                self.tracer.trace_request(out, params, trace_headers)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending_abort_outputs) or self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.get_num_unfinished_requests()
