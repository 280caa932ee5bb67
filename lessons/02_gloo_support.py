"""torchrun --nproc_per_node=2 lessons/02_gloo_support.py

Which collectives and reduce ops gloo supports, found by calling each one for real.

Every rank tries every op on int64, float32 and bfloat16 CPU tensors, checks the result of each call
that succeeds against a closed form, and records the error of each call that fails. The calls run in
a gloo group of their own (also when the default group is NCCL), replaced after every failure, so one
failure cannot spoil the next. The ranks must agree on every outcome (asserted).
lessons/02_gloo_workarounds.py does what gloo refuses another way.
"""

import argparse
import functools
import operator
import warnings

import torch
import torch.distributed as dist

import lessonlib

DTYPES = {"int64": torch.int64, "float32": torch.float32, "bfloat16": torch.bfloat16}
BITWISE = {"BAND": operator.and_, "BOR": operator.or_, "BXOR": operator.xor}


class Prober:
    """Calls each probe in a gloo group of all ranks and returns 'ok' or the first line of its error.

    A gloo group whose op failed may re-raise that error from its next call, so after a failure on
    any rank the group is replaced; after a success it is kept. The ranks agree on "anyone failed"
    through the default group first, so they create and destroy groups in step, and no rank tears a
    group down while another is still inside a call on it. (A fresh group for each of the 43 calls once failed
    in CI while connecting: every new gloo group is a full mesh of TCP connections, made anew.)
    """

    def __init__(self, ctx):
        self.ctx, self.group, self.groups_made, self.calls = ctx, None, 0, 0

    def __call__(self, fn):
        if self.group is None:
            self.group = dist.new_group(backend="gloo", timeout=self.ctx.timeout)  # gloo is what we examine
            self.groups_made += 1
        self.calls, error = self.calls + 1, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn(self.group)
            except Exception as e:  # noqa: BLE001 - recording what the backend says is the point
                error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"
        anyone_failed = torch.tensor([error is not None], dtype=torch.int32, device=self.ctx.device)
        dist.all_reduce(anyone_failed, op=dist.ReduceOp.MAX)  # on the default group, never the probed one
        if anyone_failed.item():
            dist.destroy_process_group(self.group)
            self.group = None
        if error is not None:
            return error
        future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        return "ok (FutureWarning: " + future[0][:90] + ")" if future else "ok"

    def close(self):
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def try_reduce_op(ctx, name, dtype, group):
    n, values = ctx.world_size, [r + 1 for r in range(ctx.world_size)]  # rank r holds r + 1
    x = torch.full((3,), ctx.rank + 1, dtype=dtype)
    if name == "PREMUL_SUM":  # NCCL's "multiply by a factor, then sum", used to pre-divide gradients
        dist.all_reduce(x, op=dist.ReduceOp.PREMUL_SUM(0.5), group=group)
        expected = 0.5 * sum(values)
    else:
        dist.all_reduce(x, op=getattr(dist.ReduceOp, name), group=group)
        expected = {
            "SUM": sum(values),
            "PRODUCT": functools.reduce(operator.mul, values),
            "MIN": min(values),
            "MAX": max(values),
            "AVG": sum(values) / n,
        }.get(name)
        if name in BITWISE:
            expected = functools.reduce(BITWISE[name], values)
    assert torch.all(x.double() == expected), f"rank {ctx.rank}: all_reduce {name} {dtype} gave {x.tolist()}"


def collective_calls(ctx):
    """One call per collective on float32, each taking the group to run in; results checked where cheap."""
    n, r = ctx.world_size, ctx.rank
    x = torch.full((n,), float(r))
    ranks = torch.arange(n, dtype=torch.float32)

    def expect(got, want, what):
        assert torch.equal(got, want), f"rank {r}: {what} gave {got.tolist()}, expected {want.tolist()}"

    def gathered(g):
        out = [torch.empty(n) for _ in range(n)]
        dist.all_gather(out, x, group=g)
        expect(torch.stack(out)[:, 0], ranks, "all_gather")

    def gathered_single(g):
        out = torch.empty(n * n)
        dist.all_gather_single(out, x, group=g)
        expect(out[::n], ranks, "all_gather_single")

    def transposed(g):
        out = torch.empty(n)
        dist.all_to_all_single(out, x.clone(), group=g)
        expect(out, ranks, "all_to_all_single")

    return {
        "broadcast": lambda g: dist.broadcast(x.clone(), src=0, group=g),
        "reduce": lambda g: dist.reduce(x.clone(), dst=0, group=g),
        "all_gather": gathered,
        "all_gather_single": gathered_single,
        "all_gather_into_tensor (old name)": lambda g: dist.all_gather_into_tensor(torch.empty(n * n), x, group=g),
        "gather": lambda g: dist.gather(x, [torch.empty(n) for _ in range(n)] if r == 0 else None, dst=0, group=g),
        "scatter": lambda g: dist.scatter(torch.empty(1), list(ranks.chunk(n)) if r == 0 else None, src=0, group=g),
        "reduce_scatter": lambda g: dist.reduce_scatter(torch.empty(1), list(ranks.chunk(n)), group=g),
        "reduce_scatter_single": lambda g: dist.reduce_scatter_single(torch.empty(1), ranks.clone(), group=g),
        "reduce_scatter_tensor (old name)": lambda g: dist.reduce_scatter_tensor(
            torch.empty(1), ranks.clone(), group=g
        ),
        "all_to_all": lambda g: dist.all_to_all([torch.empty(1) for _ in range(n)], list(x.chunk(n)), group=g),
        "all_to_all_single": transposed,
        "all_to_all_single, uneven splits": lambda g: dist.all_to_all_single(
            torch.empty(sum(range(1, n + 1))),
            torch.full((n * (r + 1),), float(r)),
            output_split_sizes=[k + 1 for k in range(n)],
            input_split_sizes=[r + 1] * n,
            group=g,
        ),
        "all_gather, tensors of different sizes": lambda g: dist.all_gather(
            [torch.empty(k + 1) for k in range(n)], torch.full((r + 1,), float(r)), group=g
        ),
        "barrier": lambda g: dist.barrier(group=g),
        "monitored_barrier": lambda g: dist.monitored_barrier(group=g),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.parse_args()
    ctx = lessonlib.setup()
    n, r = ctx.world_size, ctx.rank

    probe, table = Prober(ctx), []
    for name in ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR", "PREMUL_SUM"]:
        table.append(
            {"all_reduce op": name, **{d: probe(lambda g: try_reduce_op(ctx, name, t, g)) for d, t in DTYPES.items()}}  # noqa: B023
        )
    calls = [{"call": name, "float32": probe(fn)} for name, fn in collective_calls(ctx).items()]
    probe.close()

    # Ranks must agree on what worked; error texts may differ (each names its own tensor index).
    worked = [[v.startswith("ok") for v in row.values()] for row in table + calls]
    everyone = [None] * n
    dist.all_gather_object(everyone, worked)
    differ = [k for k, e in enumerate(everyone) if e != worked]
    assert not differ, f"rank {r}: ranks {differ} saw other outcomes than this rank"

    if ctx.is_main:
        for row in table + calls:
            print(" | ".join(f"{v}" for v in row.values()))
        print(f"gloo, {n} ranks: outcomes agree on every rank ({probe.calls} calls in {probe.groups_made} gloo groups)")
    lessonlib.report("reduce_ops", table)
    lessonlib.report("calls", calls)
    lessonlib.teardown()


if __name__ == "__main__":
    main()
