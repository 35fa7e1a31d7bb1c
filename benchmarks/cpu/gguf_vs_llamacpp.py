"""Batch-1 decode and offline throughput on the CPU: pagedllm with the GGUF kept packed (float
activations, the default, and int8 activations), pagedllm on the dequantized float weights, and
llama.cpp (llama-cpp-python) on the same GGUF file and threads.

    python benchmarks/cpu/gguf_vs_llamacpp.py [--rounds 2] [--threads N] [--output-json PATH]

Every measurement runs in its own process (so each gets its own peak resident memory, from
``wait4``), in alternating order over ``--rounds`` rounds: on a shared machine compare the ratios
within one run, and the best of the rounds. pagedllm runs its own CLI:
``bench latency --batch-size 1 --input-len 128 --output-len 128`` (decode step: (time for 128
tokens - time for 1) / 127, best of 2) and the README's ``bench throughput --num-requests 64
--input-len 32 256 --output-len 32 256``. llama.cpp decodes the same way: a 128-token random
prompt, then greedy tokens without stopping at EOS.

llama.cpp comes from PyPI on first use, into ``--llama-dir`` (``--llama``): ``cffi`` (the default)
unpacks the prebuilt CPU library of the ``llama-cpp-cffi`` wheel (no build: seconds; its library
wants two symbols of a newer libstdc++ than Debian 12's, which a two-function shim compiled here
with ``c++`` provides through ``LD_PRELOAD``); ``python`` builds ``llama-cpp-python`` from source
(PyPI has no binary wheel of it for Linux: a C++ build of 10-30 minutes on 2 cores, bounded by
``--install-timeout``). When neither works the script says why and measures pagedllm alone. Not
part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LLAMA_DIR = Path.home() / ".cache" / "pagedllm" / "llama-cpp-python"
LATENCY = ["bench", "latency", "--batch-size", "1", "--input-len", "128", "--output-len", "128",
           "--extra-batch-sizes", "--repeats", "2"]
THROUGHPUT = ["bench", "throughput", "--num-requests", "64", "--input-len", "32", "256", "--output-len", "32", "256"]
# name -> (CLI arguments, environment): the packed GGUF with float activations (the default: exact),
# with int8 activations (llama.cpp's scheme, opt-in), and the dequantized float32 weights.
ENGINES = {"pagedllm-gguf": ([], {}),
           "pagedllm-gguf-int8-act": ([], {"PAGEDLLM_GGUF_INT8_ACTIVATIONS": "1"}),
           "pagedllm-float": (["--load-format", "gguf_dequantized"], {})}


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[int, float, str]:
    """Run ``cmd``; returns (exit status, its peak resident memory in MiB, its output)."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        print(output[-3000:], file=sys.stderr)
    return proc.returncode, usage.ru_maxrss / 1024, output


def pagedllm_run(kind: str, engine: str, env: dict[str, str]) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        extra_args, extra_env = ENGINES[engine]
        args = (LATENCY if kind == "latency" else THROUGHPUT) + extra_args + ["--output-json", str(out)]
        rc, rss, _ = run_measured([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], {**env, **extra_env})
        if rc != 0 or not out.exists():
            return None
        result = json.loads(out.read_text())
    if kind == "latency":
        step = result["runs"][0]["decode_step_ms"]
        return {"decode_ms": step, "tok_per_s": 1e3 / step, "peak_rss_mib": rss}
    return {"tok_per_s": result["output_tokens_per_s"], "seconds": result["seconds"], "peak_rss_mib": rss}


def ensure_llama_cpp(llama_dir: Path, timeout: float) -> str | None:
    """Make ``llama_cpp`` importable (pip install into ``llama_dir`` if needed); None, or why not."""
    sys.path.insert(0, str(llama_dir))
    try:
        import llama_cpp  # noqa: F401

        return None
    except ImportError:
        pass
    print(f"building llama-cpp-python into {llama_dir} (at most {timeout:.0f} s) ...", flush=True)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--target", str(llama_dir),
                               "llama-cpp-python", "diskcache"], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"building llama-cpp-python took longer than {timeout:.0f} s"
    if proc.returncode != 0:
        return f"pip install llama-cpp-python failed: {proc.stderr.strip()[-500:]}"
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama_cpp does not import after the build: {e}"
    return None


CFFI_SO_GLOB = "_llama_cpp_cpu.*.so"
# The two libstdc++ symbols newer than GCC 12 that the llama-cpp-cffi CPU library calls.
SHIM_SOURCE = """#include <exception>
#include <ios>
extern "C" void __cxa_call_terminate(void *) noexcept { std::terminate(); }
namespace std { void ios_base_library_init() { static ios_base::Init init; } }
"""


def ensure_llama_cffi(llama_dir: Path, timeout: float) -> tuple[str | None, dict[str, str]]:
    """The ``llama-cpp-cffi`` wheel's CPU library unpacked into ``llama_dir`` (with the libstdc++ shim
    where the system's lacks its symbols): (None, the worker's extra environment), or (why not, {})."""
    import zipfile

    llama_dir.mkdir(parents=True, exist_ok=True)
    libs = sorted(llama_dir.glob(CFFI_SO_GLOB))
    if not libs:
        wheels = llama_dir / "wheels"
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "llama-cpp-cffi", "--only-binary", ":all:",
                                   "--no-deps", "-d", str(wheels)], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"downloading llama-cpp-cffi took longer than {timeout:.0f} s", {}
        found = sorted(wheels.glob("llama_cpp_cffi-*.whl"))
        if proc.returncode != 0 or not found:
            return f"pip download llama-cpp-cffi failed: {proc.stderr.strip()[-500:]}", {}
        with zipfile.ZipFile(found[-1]) as wheel:
            for name in wheel.namelist():
                if Path(name).match(f"llama/{CFFI_SO_GLOB}"):
                    (llama_dir / Path(name).name).write_bytes(wheel.read(name))
        libs = sorted(llama_dir.glob(CFFI_SO_GLOB))
        if not libs:
            return "the llama-cpp-cffi wheel holds no CPU library", {}
    env = {"PAGEDLLM_LLAMA_CFFI": str(libs[-1])}
    probe = [sys.executable, str(Path(__file__).resolve()), "--llama-probe", str(libs[-1])]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        shim = llama_dir / "libstdcxx_shim.so"
        source = llama_dir / "libstdcxx_shim.cpp"
        source.write_text(SHIM_SOURCE)
        build = subprocess.run(["c++", "-O2", "-shared", "-fPIC", str(source), "-o", str(shim)], capture_output=True,
                               text=True)
        if build.returncode != 0:
            return f"building the libstdc++ shim failed: {build.stderr.strip()[-300:]}", {}
        env["LD_PRELOAD"] = str(shim)
        if subprocess.run(probe, capture_output=True, env=dict(os.environ, **env)).returncode != 0:
            return "the llama-cpp-cffi CPU library does not load here, even with the shim", {}
    return None, env


def load_cffi(path: str):
    """The llama-cpp-cffi CPU library at ``path``: its cffi ``(lib, ffi)``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.lib, module.ffi


def llama_cffi_worker(library: str, model: str, threads: int, input_len: int, output_len: int) -> None:
    """In a child process: llama.cpp's batch-1 decode step through the llama-cpp-cffi library (the C
    API: one llama_decode per token after a prompt of ``input_len``), printed as JSON."""
    lib, ffi = load_cffi(library)
    quiet = ffi.callback("ggml_log_callback", lambda level, text, data: None)  # NULL would mean stderr
    lib.llama_log_set(quiet, ffi.NULL)
    lib.llama_backend_init()
    llama_model = lib.llama_model_load_from_file(model.encode(), lib.llama_model_default_params())
    rng = random.Random(0)

    def timed(n: int) -> float:
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch = input_len + output_len + 8, 512
        params.n_threads = params.n_threads_batch = threads
        ctx = lib.llama_init_from_model(llama_model, params)  # a fresh context: an empty KV cache
        prompt = ffi.new("llama_token[]", [rng.randrange(0, 10000) for _ in range(input_len)])
        one = ffi.new("llama_token[1]")
        t0 = time.perf_counter()
        if lib.llama_decode(ctx, lib.llama_batch_get_one(prompt, input_len)) != 0:
            raise RuntimeError("llama_decode failed on the prompt")
        for i in range(n - 1):  # the first token comes from the prompt's logits
            one[0] = 1000 + i
            if lib.llama_decode(ctx, lib.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("llama_decode failed")
        elapsed = time.perf_counter() - t0
        lib.llama_free(ctx)
        return elapsed

    timed(2)
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(output_len) for _ in range(2))
    step = (tn - t1) / (output_len - 1)
    print(json.dumps({"decode_ms": step * 1e3, "tok_per_s": 1 / step, "llama": "llama-cpp-cffi"}))


def llama_worker(model: str, threads: int, input_len: int, output_len: int) -> None:
    """In a child process: llama.cpp's batch-1 decode step, printed as JSON."""
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=input_len + output_len + 8,
                n_batch=512, verbose=False)
    rng = random.Random(0)

    def timed(n: int) -> float:
        prompt = [rng.randrange(0, 10000) for _ in range(input_len)]
        t0 = time.perf_counter()
        for i, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True)):
            if i + 1 == n:
                break
        return time.perf_counter() - t0

    timed(2)
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(output_len) for _ in range(2))
    step = (tn - t1) / (output_len - 1)
    print(json.dumps({"decode_ms": step * 1e3, "tok_per_s": 1 / step}))


def llama_run(threads: int, env: dict[str, str]) -> dict | None:
    rc, rss, output = run_measured([sys.executable, str(Path(__file__).resolve()), "--llama-worker", "--threads",
                                    str(threads)], env)
    if rc != 0:
        return None
    return {**json.loads(output.strip().splitlines()[-1]), "peak_rss_mib": rss}


def best(results: list[dict], key: str, larger: bool = True) -> dict | None:
    results = [r for r in results if r is not None]
    if not results:
        return None
    return max(results, key=lambda r: r[key]) if larger else min(results, key=lambda r: r[key])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="default: pagedllm's choice (usable CPUs)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-llama", action="store_true", help="measure pagedllm alone (no llama-cpp-python build)")
    p.add_argument("--llama-dir", type=Path, default=DEFAULT_LLAMA_DIR)
    p.add_argument("--llama", choices=["cffi", "python"], default="cffi",
                   help="llama.cpp from the llama-cpp-cffi wheel (prebuilt) or llama-cpp-python (built from source)")
    p.add_argument("--install-timeout", type=float, default=900)
    p.add_argument("--output-json", default=None)
    p.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--llama-probe", default=None, help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.llama_probe:  # does the library load (in this process's environment)?
        load_cffi(ns.llama_probe)
        return 0

    sys.path.insert(0, str(ROOT))
    from pagedllm.cpu_threads import intra_op_threads
    from pagedllm.loader import default_model_path

    threads = ns.threads or intra_op_threads(for_server=False)
    model = default_model_path()
    if ns.llama_worker:
        if os.environ.get("PAGEDLLM_LLAMA_CFFI"):
            llama_cffi_worker(os.environ["PAGEDLLM_LLAMA_CFFI"], model, threads, 128, 128)
        else:
            llama_worker(model, threads, 128, 128)
        return 0
    env = dict(os.environ, PAGEDLLM_CPU_THREADS=str(threads), OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PAGEDLLM_LOG_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ns.llama_dir), os.environ.get("PYTHONPATH", "")]))
    llama_env: dict[str, str] = {}  # the llama.cpp worker's own (the library, the shim)
    if ns.skip_llama:
        llama_missing = "--skip-llama"
    elif ns.llama == "cffi":
        llama_missing, llama_env = ensure_llama_cffi(ns.llama_dir / "cffi", ns.install_timeout)
    else:
        llama_missing = ensure_llama_cpp(ns.llama_dir, ns.install_timeout)
    if llama_missing:
        print(f"llama.cpp not measured: {llama_missing}")
    runs: dict[str, list] = {}
    for r in range(ns.rounds):
        order = list(ENGINES) + ([] if llama_missing else ["llama.cpp"])
        for name in order if r % 2 == 0 else order[::-1]:
            result = llama_run(threads, {**env, **llama_env}) if name == "llama.cpp" else pagedllm_run("latency", name, env)
            runs.setdefault(f"decode/{name}", []).append(result)
            print(f"round {r + 1} decode {name}: {result}", flush=True)
        if not ns.skip_throughput:
            for name in list(ENGINES) if r % 2 == 0 else list(ENGINES)[::-1]:
                result = pagedllm_run("throughput", name, env)
                runs.setdefault(f"throughput/{name}", []).append(result)
                print(f"round {r + 1} throughput {name}: {result}", flush=True)
    summary = {key: best(values, "tok_per_s") for key, values in runs.items()}
    print(f"\nmodel {Path(model).name}, {threads} threads, best of {ns.rounds} rounds")
    print(f"{'measurement':32} {'tok/s':>9} {'ms/token':>9} {'peak RSS MiB':>13}")
    for key, r in summary.items():
        if r is not None:
            ms = f"{r['decode_ms']:.2f}" if "decode_ms" in r else "-"
            print(f"{key:32} {r['tok_per_s']:9.1f} {ms:>9} {r['peak_rss_mib']:13.0f}")
    for kind, peer in (("decode", "llama.cpp"), ("decode", "pagedllm-float"), ("decode", "pagedllm-gguf-int8-act"),
                       ("throughput", "pagedllm-float"), ("throughput", "pagedllm-gguf-int8-act")):
        ours, theirs = summary.get(f"{kind}/pagedllm-gguf"), summary.get(f"{kind}/{peer}")
        if ours and theirs:
            print(f"{kind}: pagedllm-gguf / {peer} = {ours['tok_per_s'] / theirs['tok_per_s']:.2f}x")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps({"model": Path(model).name, "threads": threads, "runs": runs,
                                                    "best": summary, "llama_cpp_missing": llama_missing}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
