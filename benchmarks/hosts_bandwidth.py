"""python benchmarks/hosts_bandwidth.py [--rates 50,200,1000] [--hosts 2] [--sizes 1,4,16] [--threads 1]

Chapter 16's all-reduce on lessonlib.Hosts links limited by tc, as ratios to the rate each link was given.

One network of --hosts hosts (2 to 4, one rank each) is made once; for each of --rates (Mbit/s) every host's
link is set to that rate (Hosts.set_rate: tc tbf on both ends of its cable) and lessons/16_bandwidth.py is
launched on them, timing an all-reduce of each of --sizes MiB of float32 (best of --repeats, each the slowest
rank's time), then DDP steps without a hook (4 MiB of gradients; median of 3). A ring all-reduce of S bytes
over N hosts puts 2(N-1)/N * S bytes on each host's link each way (the "bus" bytes), so per rate it prints:
  busbw     the bus bytes over the best time at the largest size, in Mbit/s, and as a ratio to the rate:
            how much of the link the all-reduce gets (1.0: all of it);
  ceiling   the bus bytes over what rank 0's interface really sent meanwhile (headers included): the most
            of the rate the data can get, which busbw / rate should approach from below;
  alpha, B  a least-squares fit of t = alpha + bus bytes / B over the sizes: the fixed cost per all-reduce,
            in ms, and the bandwidth the times grow with, as a ratio to the rate. tbf lets a burst (64 KiB,
            or 1 ms of traffic at high rates) through at full speed, which pulls alpha down by about burst/rate;
  DDP/AR    the no-hook DDP step over the all-reduce of its 4 MiB alone (when 4 is among --sizes): about 1
            when the link is the limit. --threads 0 gives each rank torch's default of one intra-op thread per
            core; on a machine with few cores, busy with other work, that made it up to 2 (chapter 16).
No threshold: this reports, it does not pass or fail. Needs what lessonlib.Hosts needs (Linux, iproute2, root);
without it, it says why and exits with status 77, the "skipped" of Automake's test harness, so that a
machine that cannot make hosts neither fails `make bench` nor passes for a run that measured nothing.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lessonlib, installed or not

import lessonlib  # noqa: E402
from lessonlib import ROOT  # noqa: E402
from lessonlib.cluster.hosts import MAX_HOSTS, MAX_RATE, MIN_HOSTS, MIN_RATE, unavailable  # noqa: E402

SKIPPED = 77  # exit status: nothing measured, and why is on stderr
LESSON = ROOT / "lessons/16_bandwidth.py"
DDP_BYTES = 4 * 2**20  # the lesson's one timed DDP model (4 MiB), all-reduced at each of its 2 + 3 steps
DDP_STEPS = 5


def bus_bytes(size, n):
    """Bytes a ring all-reduce of `size` bytes over `n` ranks sends on each rank's link, each way."""
    return size * 2 * (n - 1) / n


def seconds_at(rate, n, sizes, repeats):
    """What the launch should take at `rate` Mbit/s: every byte it sends through the limit, nothing else."""
    wire = sum(bus_bytes(s, n) for s in sizes) * repeats + bus_bytes(DDP_BYTES, n) * DDP_STEPS
    return wire * 8 / (rate * 1e6)


def fit(points):
    """Least squares of t = alpha + x / B over (x bytes, t seconds): (alpha in seconds, B in bytes/s)."""
    slope, intercept = statistics.linear_regression([x for x, _ in points], [t for _, t in points])
    return intercept, 1 / slope


def measure(net, rate, sizes, repeats, threads):
    """Set every link of `net` to `rate` Mbit/s, run the lesson on it: ({bytes: best seconds}, bytes sent per
    byte of payload by rank 0's interface, the median no-hook DDP step in seconds)."""
    for host in net:
        net.set_rate(host, rate)
    expected = seconds_at(rate, len(net), [s * 2**20 for s in sizes], repeats)
    largest = bus_bytes(max(sizes) * 2**20, len(net)) * 8 / (rate * 1e6)  # one all-reduce, the longest wait
    run = lessonlib.launch(
        LESSON,
        nproc=1,
        hosts=net,
        timeout=120 + 3 * expected,
        show="none",
        args=[
            *("--sizes", ",".join(f"{s:g}" for s in sizes), "--repeats", str(repeats)),
            *("--hooks", "none", "--steps", str(DDP_STEPS - 2), "--pg-timeout", f"{max(60, 5 * largest):.0f}"),
            *("--threads", str(threads)),
        ],
    ).raise_for_status()
    times = dict(run.reports("allreduce"))[0]  # every rank reports the same: the slowest rank's times
    wire = dict(run.reports("wire"))[0]
    step = dict(run.reports("compress"))[0]["none"]["step"]
    return {int(nbytes): min(seconds) for nbytes, seconds in times.items()}, wire["sent"] / wire["payload"], step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument(
        "--rates",
        type=lessonlib.comma_list(int, low=MIN_RATE, high=MAX_RATE),
        default="50,200,1000",
        help=f"link rates in Mbit/s, each within {MIN_RATE}..{MAX_RATE}",
    )
    parser.add_argument("--hosts", type=int, default=2, help=f"hosts, one rank each, {MIN_HOSTS}..{MAX_HOSTS}")
    parser.add_argument(
        "--sizes",
        type=lessonlib.comma_list(float, low=0.001, high=256),
        default="1,4,16",
        help="all-reduced MiB, at least two sizes (the fit)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank; 0: torch's default")
    args = parser.parse_args()
    if not MIN_HOSTS <= args.hosts <= MAX_HOSTS:
        parser.error(f"--hosts must be within {MIN_HOSTS}..{MAX_HOSTS}")
    if len(set(args.sizes)) < 2 or args.repeats < 1 or args.threads < 0:
        parser.error("need two different --sizes at least, --repeats >= 1 and --threads >= 0")
    if reason := unavailable():
        print(f"skipped: {reason}", file=sys.stderr)
        return SKIPPED

    n, big = args.hosts, max(args.sizes)
    print(f"{n} hosts, one rank each; all-reduce of {', '.join(f'{s:g}' for s in args.sizes)} MiB float32")
    head = (
        f"{'rate (Mbit/s)':>13}  {f'busbw at {big:g} MiB':>18}  {'/ rate':>7}  {'ceiling':>7}  {'alpha (ms)':>10}  "
        f"{'B / rate':>8}  {'DDP/AR':>6}"
    )
    print(head)
    started = time.monotonic()
    with lessonlib.Hosts(n, rates=args.rates[0]) as net:
        for rate in args.rates:
            best, wire, step = measure(net, rate, args.sizes, args.repeats, args.threads)
            biggest = max(best)
            busbw = bus_bytes(biggest, n) * 8 / best[biggest] / 1e6
            alpha, bandwidth = fit([(bus_bytes(size, n), t) for size, t in best.items()])
            ddp = f"{step / best[DDP_BYTES]:.2f}" if DDP_BYTES in best else "-"
            print(
                f"{rate:>13}  {busbw:>18.1f}  {busbw / rate:>7.3f}  {1 / wire:>7.3f}  {alpha * 1e3:>10.1f}  "
                f"{bandwidth * 8 / 1e6 / rate:>8.3f}  {ddp:>6}"
            )
    print(f"({time.monotonic() - started:.0f} s; 1.000 would be the whole link, tc's limit exactly)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
