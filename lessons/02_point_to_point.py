"""torchrun --nproc_per_node=2 lessons/02_point_to_point.py

send/recv and isend/irecv between two ranks: what blocks, measured, then a token passed around a ring.

Ranks 0 and 1 time each call while the peer deliberately shows up --delay seconds late, and check
the order of events with timestamps (one clock: one machine):
  recv  returns only after the sender has called send;
  send  (on gloo) returns only after the receiver has posted its recv, whatever the message size;
  isend/irecv return at once with a Work handle; its wait() blocks until the transfer is done.
Then every rank passes its rank number to the next one in a ring, in each way --ring lists:
  isend, batch (batch_isend_irecv), even-odd (blocking calls in a safe order): the default, all three;
  blocking (every rank sends first: on gloo each send waits for a recv nobody has posted, a deadlock
  that the process-group timeout, --pg-timeout, turns into an error).
"""

import argparse
import time

import torch
import torch.distributed as dist

import lessonlib

SIZES = [1, 1_000_000]  # elements: 4 bytes and 4 MB of float32
RING_WAYS = ["isend", "batch", "even-odd", "blocking"]


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# [start: blocking]
def transfer(ctx, x, late_rank, delay, pair):
    """Rank 0 sends x to rank 1, and `late_rank` shows up `delay` s late. Returns when this rank
    called send or recv, and when the call returned."""
    dist.barrier(group=pair)
    if ctx.rank == late_rank:
        time.sleep(delay)
    called = time.time()
    if ctx.rank == 0:
        dist.send(x, dst=1)
    else:
        dist.recv(x, src=0)
    return {"called": called, "returned": time.time()}


def late_peer(ctx, numel, delay, pair):
    """Time send while the receiver is late, and recv while the sender is late; check the order."""
    x = torch.ones(numel, device=ctx.device)
    mine = {"receiver late": transfer(ctx, x, 1, delay, pair), "sender late": transfer(ctx, x, 0, delay, pair)}
    both = [None, None]
    dist.all_gather_object(both, mine, group=pair)  # one clock: both ranks are on this machine
    sender, receiver = both
    case = "sender late"
    assert receiver[case]["returned"] >= sender[case]["called"], "recv returned before the data was sent"
    case = "receiver late"
    if ctx.backend == "gloo":  # the claim under test: a gloo send waits for the matching recv
        assert sender[case]["returned"] >= receiver[case]["called"], f"{numel} elements: send returned first"
    timed = mine["receiver late" if ctx.rank == 0 else "sender late"]  # this rank's call with the peer late
    return {"numel": numel, "send_s" if ctx.rank == 0 else "recv_s": timed["returned"] - timed["called"]}


# [end: blocking]


# [start: nonblocking]
def late_peer_async(ctx, pair):
    """isend/irecv return at once; the Work they return says whether the transfer is done."""
    x = torch.full((4,), float(ctx.rank), device=ctx.device)
    if ctx.rank == 0:
        work, call_s = timed(lambda: dist.isend(x, dst=1))
        done_at_once = work.is_completed()
        dist.barrier(group=pair)  # only now does rank 1 post its irecv
    else:
        dist.barrier(group=pair)
        work, call_s = timed(lambda: dist.irecv(x, src=0))
        done_at_once = work.is_completed()
    _, wait_s = timed(work.wait)
    assert work.is_completed(), f"rank {ctx.rank}: Work not completed after wait()"
    assert torch.all(x == 0), f"rank {ctx.rank}: after wait() the data is {x.tolist()}"
    if ctx.rank == 0 and ctx.backend == "gloo":  # no recv was posted yet: the send cannot be done
        assert not done_at_once, "isend completed before the receiver posted its recv"
    return {
        "call": "isend" if ctx.rank == 0 else "irecv",
        "call_s": call_s,
        "completed right after the call": done_at_once,
        "wait_s": wait_s,
    }


# [end: nonblocking]


# [start: ring]
def pass_token(ctx, how):
    """Send this rank's number to the next rank; receive the previous rank's number."""
    n, r = ctx.world_size, ctx.rank
    nxt, prev = (r + 1) % n, (r - 1) % n
    out, got = torch.tensor([r], device=ctx.device), torch.tensor([-1], device=ctx.device)
    if how == "blocking":  # every rank sends first: each waits for a recv that is never posted
        dist.send(out, dst=nxt)
        dist.recv(got, src=prev)
    elif how == "even-odd":  # even ranks send first, odd ranks receive first: a chain, not a cycle
        if r % 2 == 0:
            dist.send(out, dst=nxt)
            dist.recv(got, src=prev)
        else:
            dist.recv(got, src=prev)
            dist.send(out, dst=nxt)
    elif how == "isend":
        work = dist.isend(out, dst=nxt)  # start the send, and do not wait for it yet
        dist.recv(got, src=prev)
        work.wait()
    else:  # "batch": both posted together; the form NCCL needs to run them as one group
        ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, got, prev)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    assert got.item() == prev, f"rank {r}: got token {got.item()}, expected {prev}"
    return got.item()


# [end: ring]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--delay", type=float, default=0.5, help="seconds the peer arrives late")
    parser.add_argument(
        "--ring",
        type=lessonlib.comma_list(choices=RING_WAYS),
        default="isend,batch,even-odd",
        help=f"comma-separated ways to pass the token: {', '.join(RING_WAYS)}",
    )
    parser.add_argument("--pg-timeout", type=float, default=None, help="process-group timeout, seconds")
    args = parser.parse_args()
    if args.delay <= 0:
        parser.error("--delay must be positive")

    ctx = lessonlib.setup(timeout=args.pg_timeout)
    if ctx.world_size == 1:
        print("world size 1: point-to-point needs a peer, so nothing is sent; run with 2 or more ranks")
        lessonlib.teardown()
        return

    pair = dist.new_group([0, 1], backend="gloo", timeout=ctx.timeout)  # every rank calls new_group
    if ctx.rank < 2:  # the timing demos use ranks 0 and 1; the others go straight to the ring
        for numel in SIZES:
            row = lessonlib.report("blocking", late_peer(ctx, numel, args.delay, pair))
            key = "send_s" if ctx.rank == 0 else "recv_s"
            print(f"{numel:>9} elements: {key[:4]} took {row[key]:.3f} s with the peer {args.delay} s late")
        row = lessonlib.report("nonblocking", late_peer_async(ctx, pair))
        print(
            f"{row['call']} returned in {row['call_s'] * 1e3:.2f} ms, completed at once: "
            f"{row['completed right after the call']}, wait() took {row['wait_s']:.3f} s"
        )

    dist.barrier()  # everyone starts the ring together
    for how in args.ring:
        got = pass_token(ctx, how)
        lessonlib.report("ring", {"how": how, "got": got})
        print(f"ring ({how}): received token {got} from rank {(ctx.rank - 1) % ctx.world_size}")
    lessonlib.teardown()


if __name__ == "__main__":
    main()
