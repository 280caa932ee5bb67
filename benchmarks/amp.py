"""python benchmarks/amp.py [--runs 7] [--sizes 128x32,256x1024,1024x256] [--threads 1]

Chapter 8's measurements as ratios: autocast over float32, for time and for saved-tensor memory.

Runs lessons/08_speed_memory.py once, as one rank (lessonlib.launch, nproc=1), with --runs interleaved
rounds: in each round every mode (float32, bfloat16 autocast, float16 autocast) times one sample of at
least 20 ms of forward and backward steps, so that drift in the machine's load hits all modes alike;
the median per mode is then taken. For every --sizes WIDTHxBATCH (a 4-layer MLP) it prints
  time      median ms per step, autocast / float32
  memory    bytes autograd saves for backward, autocast / float32: activations alone, and activations
            plus autocast's low-precision weight copies (deterministic; parameters not counted)
and, when a GPU is present, the same time ratio and the bytes held after forward and the peak on CUDA
(else a line saying it was skipped). The CPU runs --threads threads (default 1: on a machine whose
cores are busy, more threads than free cores make every mode wait on the slowest). No threshold:
this reports, it does not pass or fail. Wall-clock time depends on the CPU's flags (printed) and on
its load: compare ratios, not milliseconds.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import lessonlib  # noqa: E402
from lessonlib import ROOT  # noqa: E402

SCRIPT = ROOT / "lessons" / "08_speed_memory.py"
RUN_TIMEOUT = 600  # seconds; float16 on a CPU without native float16 matmuls is slow at large sizes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--runs", type=int, default=7, help="interleaved rounds per size (at least 5)")
    parser.add_argument("--sizes", default="128x32,256x1024,1024x256", help="WIDTHxBATCH,...")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads (OMP_NUM_THREADS); 0 leaves it to torch (every core, slow if they are busy)",
    )
    parser.add_argument("--cuda-size", default="4096x16384", help="WIDTHxBATCH on the GPU, if any")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be at least 5: a median of fewer runs is mostly noise")

    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads > 0 else {}
    run = lessonlib.launch(
        SCRIPT,
        nproc=1,
        timeout=RUN_TIMEOUT,
        show="none",
        env=env,
        args=["--sizes", args.sizes, "--runs", str(args.runs), "--cuda-size", args.cuda_size],
    )
    run.raise_for_status()
    cpu = run.reports_by_rank("cpu")[0][0]
    flags = cpu["flags"] if isinstance(cpu["flags"], str) else " ".join(f for f, on in cpu["flags"].items() if on)
    print(f"CPU: capability {cpu['capability']}, {cpu['threads']} thread(s), flags: {flags or 'none of interest'}")
    memory = {(m["width"], m["batch"]): m["bytes"] for m in run.reports_by_rank("memory")[0]}
    print(f"{'size':>10}  {'mode':<9}{'ms/step':>9}{'time ratio':>12}{'act. ratio':>12}{'+copies ratio':>15}")
    for t in run.reports_by_rank("time")[0]:
        if "skipped" in t:
            print(f"{'cuda':>10}  skipped: {t['skipped']}")
            continue
        where = f"{t['width']}x{t['batch']}" + (" cuda" if t["device"] == "cuda" else "")
        for mode, ms in t["ms"].items():
            line = f"{where:>10}  {mode:<9}{ms:>9.2f}{ms / t['ms']['float32']:>12.3f}"
            if t["device"] == "cpu":
                b, b32 = memory[t["width"], t["batch"]][mode], memory[t["width"], t["batch"]]["float32"]
                line += f"{b['activation'] / b32['activation']:>12.3f}"
                line += f"{(b['activation'] + b['weight copy']) / b32['activation']:>15.3f}"
            else:
                held, peak = t["held after forward"], t["peak"]
                line += (
                    f"   held {held[mode] / 2**20:.0f} MiB ({held[mode] / held['float32']:.3f}), "
                    f"peak {peak[mode] / 2**20:.0f} MiB ({peak[mode] / peak['float32']:.3f})"
                )
            print(line)
    if "gpu" in (last := run.reports_by_rank("time")[0][-1]):
        print(f"GPU: {last['gpu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
