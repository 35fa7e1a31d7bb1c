"""Start-up: process start -> first token of one request, on the 0.6B config with CUDA graphs on.

Run as a fresh process (the first one on a machine is the cold case: nothing in the OS file cache,
no Triton kernel cache). ``PAGEDLLM_PROCESS_T0`` (seconds since the epoch, e.g. ``date +%s.%N``
taken by the shell just before ``python3``) makes the figure include interpreter start-up.
``PAGEDLLM_STARTUP_COMPILE_STATS=1`` also reports how many Triton kernels were compiled (not found
in the kernel cache), the seconds spent compiling them, and which ones compiled on the main thread
(outside the parallel dry pass).
"""

import logging
import os
import time

T0 = float(os.environ.get("PAGEDLLM_PROCESS_T0", time.time()))
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)7.0f ms %(message)s")

from pagedllm import LLM, SamplingParams  # noqa: E402

compile_stats = {"n": 0, "s": 0.0, "slow": []}
if os.environ.get("PAGEDLLM_STARTUP_COMPILE_STATS") == "1":
    from triton.runtime.jit import JITFunction  # noqa: E402

    _do_compile = JITFunction._do_compile

    def _timed_compile(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return _do_compile(self, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - t
            compile_stats["n"] += 1
            compile_stats["s"] += seconds
            if seconds > 0.05:  # compiled on this thread (a submission to the parallel pool is faster)
                compile_stats["slow"].append(f"{self.__name__} {seconds:.2f} s")

    JITFunction._do_compile = _timed_compile

t_import = time.time()
llm = LLM("benchmarks/configs/qwen3-0.6b", load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
t_engine = time.time()
out = llm.generate([{"prompt_token_ids": list(range(100, 612))}], SamplingParams(max_tokens=1, detokenize=False),
                   use_tqdm=False)
t_first = time.time()
assert len(out[0].outputs[0].token_ids) == 1
print(f"start-up: imports {t_import - T0:.1f} s, engine {t_engine - t_import:.1f} s, first token "
      f"{t_first - t_engine:.2f} s -> process start to first token {t_first - T0:.1f} s")
if compile_stats["n"]:
    print(f"Triton: {compile_stats['n']} kernel variants compiled or loaded from the cache in {compile_stats['s']:.1f} s")
    print("  on the main thread, > 0.05 s each: " + (", ".join(compile_stats["slow"]) or "none"))
