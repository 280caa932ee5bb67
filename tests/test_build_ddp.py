"""Chapter 15's hand-built DDPs (NaiveDDP, OverlappedDDP, BucketedDDP): what their lessons do not check.

The lessons (run at 1 to 4 ranks by tests/test_lessons.py) compare each class with one process and with
torch's DistributedDataParallel on TiedNet (Linear weights tied, a frozen layer, BatchNorm normalizing
with its running statistics), and lessons/15_exercise_ddp.py's self-test rejects the wrong answers.
Here, real processes and real gloo at 1 and 3 ranks, on another model: a language model's tie (an
Embedding and the output head share one weight, registered first, its gradient ready last), a frozen
layer and BatchNorm, both ways:
- BatchNorm on running statistics: every class equals one process and torch's DDP (gradients at every
  step, weights and buffers after, TOL float64);
- BatchNorm on batch statistics (running statistics updated by each rank's own rows): no longer one
  process, but every class equals torch's DDP with broadcast_buffers=False (which broadcasts no buffer,
  not even at construction: it gets the same seed on every rank), buffers included. torch's default
  broadcasts rank 0's buffers again before every forward: the same gradients, and on every rank but 0
  other running statistics at the end (asserted);
- like torch's DDP, each wrapper's parameters() are the model's and its state_dict() has DDP's keys;
- accumulation over K micro-batches, all but the last backward() inside no_sync() (NaiveDDP also without),
  with torch.device("meta") as the default device: every class equals one process and torch's DDP with
  no_sync; a second backward() outside no_sync() before finish_gradient_synchronization() is refused at
  once, naming the parameter, and the same wrapper then trains right; NaiveDDP and BucketedDDP name a
  parameter that got no gradient, at once, not after a timeout.
And, with no process: each class loads from its lesson without running main() and has the interface the
chapter names; assign_buckets' rule on synthetic tensors.
"""

import inspect

import pytest

import lessonlib
from rankfork import run_ranks


@pytest.mark.unit
def test_each_class_loads_from_its_lesson_with_the_chapters_interface():
    import torch
    import torch.distributed as dist

    naive, overlap, bucketed = (lessonlib.load_lesson(f"15_{s}_ddp") for s in ("naive", "overlap", "bucketed"))
    assert not dist.is_initialized(), "loading a lesson must not run its main()"
    for cls, args in [
        (naive.NaiveDDP, ["module"]),
        (overlap.OverlappedDDP, ["module"]),
        (bucketed.BucketedDDP, ["module", "bucket_size_mb"]),
    ]:
        assert issubclass(cls, torch.nn.Module) and list(inspect.signature(cls).parameters) == args, cls
        assert callable(cls.finish_gradient_synchronization), cls
    assert callable(bucketed.BucketedDDP.on_train_batch_start)


@pytest.mark.unit
def test_assign_buckets_goes_backwards_and_never_passes_the_cap():
    import torch

    assign = lessonlib.load_lesson("15_bucketed_ddp").assign_buckets
    p = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 1, 4, 1, 10)]  # float32: 16, 4, 16, 4, 40 bytes
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    named = lambda buckets: [[[id(x) for x in p].index(id(q)) for q in b] for b in buckets]  # noqa: E731
    assert named(assign(p + [frozen], 20)) == [[4], [3, 2], [1, 0]]  # 40 B alone; frozen left out
    assert named(assign(p, 24)) == [[4], [3, 2, 1], [0]]  # 4 + 16 + 4 = 24 fits exactly
    assert named(assign(p, 1)) == [[4], [3], [2], [1], [0]]  # a cap under every tensor: one bucket each
    assert named(assign(p, 1000)) == [[4, 3, 2, 1, 0]]
    mixed = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)), *p[:2]]
    assert [[q.dtype for q in b] for b in assign(mixed, 1000)] == [[torch.float32] * 2, [torch.float64]]


RANKS = '''
import contextlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
import lessonlib
from lessonlib.training import gather, max_gap, my_rows

VOCAB, HIDDEN, ROWS, LR, TOL = 11, 6, 5, 0.1, 1e-12



naive, overlap, bucketed = (lessonlib.load_lesson(f"15_{s}_ddp") for s in ("naive", "overlap", "bucketed"))


class LMNet(torch.nn.Module):
    """emb -> norm -> frozen -> head, head.weight IS emb.weight; batch statistics if batch_stats."""

    def __init__(self, seed, batch_stats):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.norm = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.BatchNorm1d(HIDDEN)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN).requires_grad_(False)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            for t in (self.norm.weight, self.norm.bias, self.norm.running_mean):
                t.normal_()
            self.norm.running_var.uniform_(0.5, 2.0)
        self.batch_stats = batch_stats
        self.double().train()

    def train(self, mode=True):
        super().train(mode)
        self.norm.train(mode and self.batch_stats)
        return self

    def forward(self, tokens):
        return self.head(torch.tanh(self.frozen(self.norm(self.emb(tokens)))))


def batch(step, n, rank=None):
    g = torch.Generator().manual_seed(step)
    tokens, targets = torch.randint(VOCAB, (ROWS * n,), generator=g), torch.randint(VOCAB, (ROWS * n,), generator=g)
    mine = slice(None) if rank is None else my_rows([ROWS] * n, rank)
    return tokens[mine], targets[mine]


def train(net, n, rank=None, steps=3):
    grads = []
    for step in range(steps):
        if hasattr(net, "on_train_batch_start"):
            net.on_train_batch_start()
        net.zero_grad()
        tokens, targets = batch(step, n, rank)
        F.cross_entropy(net(tokens), targets).backward()
        if hasattr(net, "finish_gradient_synchronization"):
            net.finish_gradient_synchronization()
        model = getattr(net, "module", net)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return torch.stack(grads), naive.state(model)


WRAPPERS = {
    "NaiveDDP": naive.NaiveDDP,
    "OverlappedDDP": overlap.OverlappedDDP,
    "BucketedDDP, a bucket per tensor": lambda m: bucketed.BucketedDDP(m, 1e-6),
    "BucketedDDP, one bucket": lambda m: bucketed.BucketedDDP(m, 25),
}

ctx = lessonlib.setup(device="cpu", timeout=30)
n, rank = ctx.world_size, ctx.rank
for batch_stats in (False, True):
    # With batch statistics, torch's DDP to compare with is the one that never broadcasts buffers: built from
    # the same seed on every rank, so that its buffers start as ours do after our one broadcast.
    theirs = DDP(LMNet(0, True), broadcast_buffers=False) if batch_stats else DDP(LMNet(rank, False))
    keys = list(theirs.state_dict())
    want = {"torch DDP": train(theirs, n, rank)}
    if not batch_stats:
        want["one process"] = train(LMNet(0, batch_stats), n)
    for name, wrap in WRAPPERS.items():
        model = LMNet(rank, batch_stats)
        ddp = wrap(model)
        assert list(map(id, ddp.parameters())) == list(map(id, model.parameters())), name
        assert list(ddp.state_dict()) == keys, f"{name}: {list(ddp.state_dict())}"
        got = train(ddp, n, rank)
        for other, expected in want.items():
            gap = max(max_gap(got[0], expected[0]), max_gap(got[1], expected[1]))
            assert gap < TOL, f"rank {rank}: {name}, batch_stats={batch_stats}: {gap:.1e} from {other}"
    if batch_stats:  # torch's default broadcasts rank 0's buffers before every forward; ours once
        grads, after = train(DDP(LMNet(rank, True)), n, rank)
        assert max_gap(grads, got[0]) < TOL, f"rank {rank}: the buffers changed the gradients"
        assert (max_gap(after, got[1]) < TOL) == (rank == 0), f"rank {rank}: buffers {max_gap(after, got[1])}"
        print(f"rank {rank}: batch statistics: equal to DDP(broadcast_buffers=False)")

# Accumulation, chapter 6's way: K micro-batches, all but the last backward() inside no_sync(), then one finish,
# with torch.device("meta") as the default while the wrapper is built and finishes: what it made without device=
# would land there and gloo refuse it.
# accumulate() never calls BucketedDDP's on_train_batch_start(): finish_gradient_synchronization() resets the counts.
K = 3


def accumulate(net, n, rank=None, steps=2, sync=True):
    """`steps` SGD steps of K micro-batches each (every rank's rows when rank is None): grads and the state."""
    grads = []
    for step in range(steps):
        net.zero_grad()
        data = [batch(K * step + k, n, rank) for k in range(K)]
        for k, (tokens, targets) in enumerate(data):
            with net.no_sync() if sync and k < K - 1 and hasattr(net, "no_sync") else contextlib.nullcontext():
                F.cross_entropy(net(tokens), targets).backward()
        if hasattr(net, "finish_gradient_synchronization"):
            with torch.device("meta"):  # torch's own float64 backward is not meta-default safe: the wrapper's part only
                net.finish_gradient_synchronization()
        model = getattr(net, "module", net)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad if p.grad is not None else 0
    return torch.stack(grads), naive.state(model)


want = {"one process": accumulate(LMNet(0, False), n), "torch DDP": accumulate(DDP(LMNet(rank, False)), n, rank)}
cases = {name: (wrap, True) for name, wrap in WRAPPERS.items()}
cases["NaiveDDP without no_sync"] = (naive.NaiveDDP, False)  # it sends only in finish: the sum of K is right
for name, (wrap, sync) in cases.items():
    model = LMNet(rank, False)
    with torch.device("meta"):
        ddp = wrap(model)
    got = accumulate(ddp, n, rank, sync=sync)
    for other, expected in want.items():
        gap = max(max_gap(got[0], expected[0]), max_gap(got[1], expected[1]))
        assert gap < TOL, f"rank {rank}: {name}, {K} micro-batches: {gap:.1e} from {other}"

# Two backward()s outside no_sync() before one finish: refused at once, the parameter named, nothing left in flight.
for name, wrap in list(WRAPPERS.items())[1:]:
    ddp = wrap(LMNet(rank, False))
    try:
        accumulate(ddp, n, rank, steps=1, sync=False)
        raise AssertionError(f"{name}: a second backward() before finish went through")
    except RuntimeError as e:
        assert "head.weight got a second gradient" not in str(e), e  # the tie is registered as emb.weight
        assert "got a second gradient" in str(e) and "no_sync" in str(e), e
        assert any(f"{k} got a second" in str(e) for k, _ in ddp.module.named_parameters()), e
    got = accumulate(ddp, n, rank)  # the same wrapper again, from where it was: nothing was left in flight
    gap = max(max_gap(got[0], want["one process"][0]), max_gap(got[1], want["one process"][1]))
    assert gap < TOL, f"rank {rank}: {name} after the refusal: {gap:.1e} from one process"

# A trainable parameter the forward does not use: named, at once, before any collective of the step.
for name, wrap in [("NaiveDDP", naive.NaiveDDP), ("BucketedDDP", WRAPPERS["BucketedDDP, one bucket"])]:
    ddp = wrap(LMNet(rank, False))
    ddp.zero_grad()
    tokens, _ = batch(0, n, rank)
    ddp.module.frozen(ddp.module.emb(tokens)).sum().backward()  # norm's weight and bias get no gradient
    try:
        ddp.finish_gradient_synchronization()
        raise AssertionError(f"{name}: a step with parameters left out went through")
    except RuntimeError as e:
        assert "norm.weight, norm.bias got no gradient" in str(e), e
print(f"rank {rank}: every check held at world size {n}")
lessonlib.teardown()
'''


@pytest.mark.parametrize("world_size", [1, 3], ids=lambda n: f"np{n}")
def test_the_classes_on_a_language_models_tie(world_size, tmp_path):
    script = tmp_path / "lm_tie.py"
    script.write_text(RANKS)
    run = run_ranks(script, world_size, tmp_path, plain=world_size == 1)
    assert run.ok, run.describe_failure()
    assert all(f"every check held at world size {world_size}" in r.stdout for r in run.ranks), run.ranks[0].stdout
