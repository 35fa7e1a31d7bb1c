"""Where one batch-1 decode step of the embedded GGUF model goes on the CPU.

    python benchmarks/cpu/profile_decode.py [--output-len 64] [--top 25] [--cprofile]

Generates ``--output-len`` tokens after a 128-token random prompt twice (warm-up, then measured)
and prints: the wall and CPU time per decode step, torch.profiler's table of CPU ops by self time (the
native kernels show up under the ``record_function`` names of their callers), and with
``--cprofile`` the Python functions by cumulative time. The machine is shared: compare shares
within one run, not absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch

from pagedllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cprofile", action="store_true", help="profile Python functions instead of torch ops")
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch / OpenMP threads (1: the CPU time per step is the work, even on a busy machine)")
    ns = p.parse_args()
    llm = LLM(ns.model) if ns.model else LLM()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(128)]}

    def run(n: int) -> tuple[float, float]:
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0, time.process_time() - c0

    run(ns.output_len)
    (wall_n, cpu_n), (wall_1, cpu_1) = run(ns.output_len), run(1)
    wall, cpu = ((a - b) / (ns.output_len - 1) * 1e3 for a, b in ((wall_n, wall_1), (cpu_n, cpu_1)))
    print(f"decode step: {wall:.2f} ms wall ({1e3 / wall:.1f} tok/s), {cpu:.2f} ms CPU time, "
          f"torch threads {torch.get_num_threads()}")
    if ns.cprofile:
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        run(ns.output_len)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(ns.top)
        pstats.Stats(prof).sort_stats("tottime").print_stats(ns.top)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(ns.output_len)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ns.top))


if __name__ == "__main__":
    main()
