"""What `python -m lessonlib check` loads into every rank before the reader's script runs (lessonlib.check).

`_rank_main` calls `install()` when DDPCHECK_DIR is set (runfolder.CHECK_DIR_VAR). Nothing in the script
changes: the probe wraps a few of torch's functions and records what it sees, one JSON line per event,
in CHECK_DIR/rank-R.jsonl. It never adds a collective and never changes a result: the ranks' records are
compared after the run, by the check (lessonlib.check.findings), not by the ranks.

- every optimizer step (torch's global step hooks): a checksum of each parameter the optimizer updates,
  before the first step and after each (replicas that differ: finding 1), with the learning rate;
- every pass over a DataLoader: the root dataset's indices it drew (through Subset), its batches, the
  optimizer steps taken meanwhile, the batches it had handed out by the end of its first step, and for a
  shuffling DistributedSampler its epoch (finding 2);
- `torch.save` and `torch.load` of a file: the path, whether a state dict carries DDP's `module.` prefix,
  and where a loaded checkpoint's tensors were saved when no map_location was given (finding 3);
- every collective called through `torch.distributed`: its operation, shape and dtype, on entry and on
  return; and every backward after a DDP forward that synchronises (not under `no_sync`), which ends in
  DDP's all-reduce of the gradients inside torch's C++ (op "backward"); a watchdog thread ends the rank
  (exit STALL_EXIT) when one of them has waited longer than DDPCHECK_STALL seconds, after recording
  where (finding 4); those inside an enabled `Join` (uneven on purpose) are marked, and not compared;
- the process group: backend, world size, and each rank's device (finding 5).

Each record says where in the reader's code it was seen: the innermost frame that is not torch's, Python's
or lessonlib's.
"""

import atexit
import itertools
import json
import os
import sys
import threading
import time
import weakref

STALL_EXIT = 86  # a rank the watchdog ended: one collective waited longer than the stall bound
EVERY_STEP_UNTIL = 200  # steps checksummed one by one; after that, every STEP_STRIDE-th
STEP_STRIDE = 20
MAX_INDICES = 200_000  # indices kept per pass over a loader

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)


class Recorder:
    """One rank's records: a file opened for appending, one flushed line per record, thread-safe."""

    def __init__(self, folder, rank):
        self.path = os.path.join(folder, f"rank-{rank}.jsonl")
        self.file = open(self.path, "a", buffering=1)
        self.lock = threading.Lock()

    def __call__(self, t, /, **fields):
        line = json.dumps({"t": t, "time": time.time(), **fields}, default=str)
        with self.lock:
            self.file.write(line + "\n")


def where(frame=None):
    """'file:line' of the innermost frame of the reader's own code on this thread's stack (or from `frame`):
    the probe's own frames are lessonlib's, so they are passed over like torch's."""
    from lessonlib.view.tracebacks import is_library_path, short_paths

    f = frame if frame is not None else sys._getframe(1)
    innermost = None
    while f is not None:
        path = f.f_code.co_filename
        if innermost is None:
            innermost = f
        if not is_library_path(path) and not path.startswith("<"):
            return f"{_shown(path, short_paths)}:{f.f_lineno}"
        f = f.f_back
    return f"{_shown(innermost.f_code.co_filename, short_paths)}:{innermost.f_lineno}" if innermost else "?"


def _shown(path, short_paths):
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return short_paths(path)
    return rel if not rel.startswith("..") else short_paths(path)


class Probe:
    def __init__(self, folder, rank, stall):
        self.record = Recorder(folder, rank)
        self.rank = rank
        self.stall = stall
        self.steps = 0  # optimizer steps on this rank, all optimizers together
        self.optimizers = weakref.WeakKeyDictionary()  # optimizer -> its ordinal, its step count
        self.samplers = weakref.WeakKeyDictionary()  # DistributedSampler -> (ordinal, epochs seen)
        self.passes = {}  # dataset fingerprint -> passes so far
        self.open_passes = {}  # id(loader iterator) -> its pass, recorded when the iterator is collected
        self.starting = None  # the loader whose __iter__ runs now (its workers prefetch indices meanwhile)
        self.early = []  # indices drawn while it ran, before its iterator was known
        self.collectives = 0
        self.inside = None  # (number, op, entered at, thread id) of the blocking collective in progress
        self.flagged = set()
        self.numbers = itertools.count()  # the ordinals of optimizers and samplers, in order of first use
        self.ddp_sync = False  # the last DDP forward will all-reduce gradients in the next backward
        self.joining = 0  # inside an enabled Join: a rank out of inputs shadows the others' collectives

    # ----------------------------------------------------------------- optimizer steps (finding 1, 5)

    def sums(self, optimizer):
        """[(sum, sum of |x|), ...] of the optimizer's parameters, in order; None for a sharded one."""
        import torch

        values = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                t = p.detach()
                if _is_sharded(t):
                    values.append(None)
                    continue
                t = getattr(t, "_local_tensor", t)  # float64 sums, without a float64 copy of the parameter
                values.append(
                    torch.stack([t.sum(dtype=torch.float64), torch.linalg.vector_norm(t, 1, dtype=torch.float64)])
                )
        known = [v for v in values if v is not None]
        flat = torch.stack(known).cpu().tolist() if known else []
        it = iter(flat)
        return [next(it) if v is not None else None for v in values]

    def param_names(self, optimizer):
        """Each parameter's name in the largest module alive now that holds it (the outermost wrapper's,
        `module.0.weight`), found anew for each optimizer: a parameter freed since may have left its id to
        another. '#3 of shape [8]' for a tensor in no module."""
        import gc

        import torch

        params = [p for g in optimizer.param_groups for p in g["params"]]
        wanted, names = {id(p) for p in params}, {}
        modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
        for m in sorted(modules, key=lambda m: sum(1 for _ in m.parameters())):
            for name, p in m.named_parameters():
                if id(p) in wanted:
                    names[id(p)] = name  # the largest module last: its name wins
        return [names.get(id(p), f"#{i} of shape {list(p.shape)}") for i, p in enumerate(params)]

    def before_step(self, optimizer, args, kwargs):
        if optimizer in self.optimizers:
            return
        self.optimizers[optimizer] = [next(self.numbers), 0]  # not len(): a collected one leaves no gap
        params = [p for g in optimizer.param_groups for p in g["params"]]
        wrapped, inside = _wrappers()
        self.record(
            "optimizer",
            opt=self.optimizers[optimizer][0],
            kind=type(optimizer).__name__,
            lr=optimizer.param_groups[0].get("lr"),
            names=self.param_names(optimizer),
            device=str(params[0].device) if params else None,
            sharded=any(_is_sharded(p) for p in params),
            wrappers=wrapped,
            in_wrapper=bool(params) and all(id(p) in inside for p in params),
            sums=self.sums(optimizer),
            where=where(),
        )

    def after_step(self, optimizer, args, kwargs):
        entry = self.optimizers.get(optimizer)
        if entry is None:
            return
        entry[1] += 1
        self.steps += 1
        n = entry[1]
        for p in self.open_passes.values():
            p["steps"] += 1
            p.setdefault("per_step", p["yielded"])  # micro-batches of the pass's first step
        if n <= EVERY_STEP_UNTIL or n % STEP_STRIDE == 0:
            lr = optimizer.param_groups[0].get("lr")
            joined = {"join": True} if self.joining else {}  # replicas part inside Join, by design, until its end
            self.record("step", opt=entry[0], n=n, sums=self.sums(optimizer), lr=lr, where=where(), **joined)

    # ----------------------------------------------------------------- loaders and samplers (finding 2)

    def pass_starting(self, loader):
        """`iter(loader)` was called: indices drawn before its iterator is known are this pass's."""
        self.starting, self.early = loader, []

    def loader_pass(self, iterator, loader):
        """A new pass over `loader`, whose iterator `iterator` was just made (or reset: persistent workers)."""
        early, self.starting, self.early = self.early, None, []
        root, mapping = _root_of(loader.dataset)
        try:
            size = len(root)
        except TypeError:  # an IterableDataset has no indices to compare
            return
        fingerprint = f"{type(root).__name__}[{size}]"
        number = self.passes.get(fingerprint, 0)
        self.passes[fingerprint] = number + 1
        sampler = _sampler_of(loader)
        if _is_distributed(sampler) and getattr(sampler, "shuffle", False):
            self.sampler_pass(sampler)
        key = id(iterator)
        self.close_pass(key)  # persistent workers: the same iterator, reset for a new pass
        weakref.finalize(iterator, self.close_pass, key)
        self.open_passes[key] = {
            "dataset": fingerprint,
            "size": size,
            "pass": number,
            "sampler": type(sampler).__name__ if sampler is not None else None,
            "distributed": _is_distributed(sampler),
            "shuffle": bool(getattr(sampler, "shuffle", False)),
            "padding": _padding(sampler),
            "batch_size": loader.batch_size,
            "indices": [],
            "batches": 0,
            "yielded": 0,  # batches handed to the script (drawn ones include a worker's prefetch)
            "steps": 0,
            "map": mapping,
            "where": where(),
        }
        for index in early:
            self.drew(iterator, index)

    def drew(self, iterator, index):
        p = self.open_passes.get(id(iterator))
        if p is None:
            if self.starting is not None:
                self.early.append(index)
            return
        p["batches"] += 1
        batch = index if isinstance(index, (list, tuple)) else [index]
        if p["batches"] == 1:
            p["first_batch"] = len(batch)
        if len(p["indices"]) < MAX_INDICES:
            mapping = p["map"]
            for i in batch:
                if isinstance(i, int) or hasattr(i, "__index__"):
                    p["indices"].append(int(mapping(int(i))))

    def close_pass(self, key):
        p = self.open_passes.pop(key, None)
        if p is not None:
            p.pop("map")
            self.record("pass", **p)

    def close_passes(self):
        for key in list(self.open_passes):
            self.close_pass(key)

    def sampler_pass(self, sampler):
        """A loader's pass starts with a shuffling DistributedSampler: its epoch, and whether an earlier
        pass of a loader had the same (iterating the sampler itself, to log its order, is no pass)."""
        entry = self.samplers.get(sampler)
        if entry is None:
            entry = self.samplers[sampler] = [next(self.numbers), []]
        epoch = getattr(sampler, "epoch", None)
        if epoch in entry[1] and ("set_epoch", entry[0]) not in self.flagged:
            self.flagged.add(("set_epoch", entry[0]))
            self.record("same_epoch", sampler=entry[0], epoch=epoch, passes=len(entry[1]) + 1, where=where())
        entry[1].append(epoch)

    # ----------------------------------------------------------------- files (finding 3)

    def saved(self, obj, f):
        path = _path_of(f)
        if path is None:
            return
        self.record("save", path=os.path.realpath(path), prefixed=_module_prefixed(obj), where=where())

    def loaded(self, f, map_location, locations):
        path = _path_of(f)
        self.record(
            "load",
            path=os.path.realpath(path) if path else None,
            map_location=map_location is not None,
            locations=sorted(set(locations)),
            where=where(),
        )

    # ----------------------------------------------------------------- collectives (finding 4)

    def entered(self, op, args, kwargs):
        self.collectives += 1
        n = self.collectives
        tensor = _first_tensor(args, kwargs)
        blocking = not kwargs.get("async_op", False)
        fields = {"n": n, "op": op, "where": where(), "blocking": blocking, "group": _group_ranks(args, kwargs)}
        if self.joining:
            fields["join"] = True  # uneven on purpose: Join matches them up, and the check does not compare them
        if tensor is not None:
            fields.update(shape=list(tensor.shape), dtype=str(tensor.dtype).replace("torch.", ""))
        self.record("enter", **fields)
        if blocking and threading.current_thread() is threading.main_thread():
            self.inside = (n, op, time.monotonic(), fields["where"])
        return n

    def left(self, n, error=None):
        if self.inside is not None and self.inside[0] == n:
            self.inside = None
        if error is not None:
            self.record("collective_error", n=n, error=f"{type(error).__name__}: {error}"[:400])
        else:
            self.record("leave", n=n)

    def watch(self):
        """The watchdog: a blocking collective that waited longer than the stall bound ends the rank."""
        while True:
            time.sleep(0.25)
            inside = self.inside
            if inside is None:
                continue
            n, op, since, seen_at = inside
            waited = time.monotonic() - since
            if waited < self.stall:
                continue
            frame = sys._current_frames().get(threading.main_thread().ident)
            self.record("stall", n=n, op=op, seconds=round(waited, 1), where=where(frame) if frame else seen_at)
            self.finish()
            os._exit(STALL_EXIT)

    # ----------------------------------------------------------------- process group (finding 5)

    def group_ready(self, backend):
        import torch
        import torch.distributed as dist

        device = None
        if torch.cuda.is_available():
            device = f"cuda:{torch.cuda.current_device()}"
        self.record("group", backend=str(backend), world=dist.get_world_size(), rank=dist.get_rank(), cuda=device)

    def finish(self):
        self.close_passes()
        self.record("end", steps=self.steps, collectives=self.collectives)
        self.record.file.flush()


# ----------------------------------------------------------------- helpers


def _is_sharded(t):
    placements = getattr(t, "placements", None)
    return placements is not None and any(not p.is_replicate() for p in placements)


def _wrappers():
    """(names of the data-parallel wrappers alive now: DistributedDataParallel, FSDP modules; the ids of
    the parameters they hold). The garbage collector's objects are tested by their type alone: some are
    weak proxies (torch.compile makes them), and isinstance() on a dead one raises ReferenceError."""
    import gc

    import torch

    found, inside = set(), set()
    for o in gc.get_objects():
        if issubclass(type(o), torch.nn.Module):
            name = type(o).__name__
            if name == "DistributedDataParallel" or name.startswith("FSDP") or name == "FullyShardedDataParallel":
                found.add("FSDP" if "FSDP" in name or "FullySharded" in name else name)
                inside.update(id(p) for p in o.parameters())
    return sorted(found), inside


def _root_of(dataset):
    """(the dataset under any Subsets, a function from this dataset's index to the root's)."""
    from torch.utils.data import Subset

    steps = []
    while isinstance(dataset, Subset):
        steps.append(dataset.indices)
        dataset = dataset.dataset

    def mapping(i):
        for indices in steps:
            i = int(indices[i])
        return i

    return dataset, mapping


def _sampler_of(loader):
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return inner if inner is not None else getattr(loader, "sampler", None)


def _is_distributed(sampler):
    from torch.utils.data import DistributedSampler

    return isinstance(sampler, DistributedSampler) or hasattr(sampler, "num_replicas")


def _padding(sampler):
    total, size = getattr(sampler, "total_size", None), None
    try:
        size = len(sampler.dataset)
    except (AttributeError, TypeError):
        pass
    return max(0, total - size) if isinstance(total, int) and isinstance(size, int) else 0


def _path_of(f):
    """The file's path: `f` itself, or an open file's name; None for a buffer (io.BytesIO)."""
    if isinstance(f, (str, bytes, os.PathLike)):
        return os.fsdecode(f)
    name = getattr(f, "name", None)
    return name if isinstance(name, str) and not name.startswith("<") else None


def _module_prefixed(obj, depth=0):
    """True when `obj` is, or holds, a state dict whose every key starts with 'module.'."""
    if not isinstance(obj, dict) or depth > 2 or not obj:
        return False
    keys = list(obj.keys())
    if all(isinstance(k, str) for k in keys) and all(k.startswith("module.") for k in keys):
        return True
    return any(_module_prefixed(v, depth + 1) for v in obj.values() if isinstance(v, dict))


def _group_ranks(args, kwargs):
    """The global ranks of the collective's group; None for the default (world) group."""
    import torch.distributed as dist

    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is None or group is dist.GroupMember.WORLD:
        return None
    try:
        return list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return None


def _first_tensor(args, kwargs):
    import torch

    for value in itertools.chain(args, kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


# ----------------------------------------------------------------- installation


def install(folder, rank, stall):
    """Wrap torch's functions for this rank, start the watchdog; before the script runs."""
    import torch
    import torch.distributed as dist
    import torch.optim.optimizer as optim
    from torch.utils.data.dataloader import DataLoader, _BaseDataLoaderIter

    probe = Probe(folder, rank, stall)
    # The instruments that lean on torch's private names are skipped, and said so, where torch lacks them.
    missing = [
        name
        for owner, name in (
            (optim, "register_optimizer_step_pre_hook"),
            (optim, "register_optimizer_step_post_hook"),
            (_BaseDataLoaderIter, "_next_index"),
        )
        if not hasattr(owner, name)
    ]
    if missing:
        probe.record("missing", names=missing, torch=torch.__version__)
    if not {"register_optimizer_step_pre_hook", "register_optimizer_step_post_hook"} & set(missing):
        optim.register_optimizer_step_pre_hook(probe.before_step)
        optim.register_optimizer_step_post_hook(probe.after_step)

    loader_iter = DataLoader.__iter__

    def __iter__(self):
        probe.pass_starting(self)
        iterator = loader_iter(self)
        probe.loader_pass(iterator, self)
        return iterator

    DataLoader.__iter__ = __iter__

    next_index = getattr(_BaseDataLoaderIter, "_next_index", None)

    def _next_index(self):
        index = next_index(self)
        probe.drew(self, index)
        return index

    if next_index is not None:
        _BaseDataLoaderIter._next_index = _next_index

    next_batch = _BaseDataLoaderIter.__next__

    def __next__(self):
        batch = next_batch(self)
        p = probe.open_passes.get(id(self))
        if p is not None:
            p["yielded"] += 1
        return batch

    _BaseDataLoaderIter.__next__ = __next__

    save, load = torch.save, torch.load

    def checked_save(obj, f, *args, **kwargs):
        probe.saved(obj, f)
        return save(obj, f, *args, **kwargs)

    def checked_load(f, map_location=None, *args, **kwargs):
        from torch.serialization import default_restore_location

        locations = []

        def note(storage, location):
            locations.append(location)
            return default_restore_location(storage, location)

        try:
            return load(f, note if map_location is None else map_location, *args, **kwargs)
        finally:
            probe.loaded(f, map_location, locations)

    torch.save, torch.load = checked_save, checked_load

    for op in COLLECTIVES:
        original = getattr(dist, op, None)
        if original is not None:
            setattr(dist, op, _collective(probe, op, original))

    from torch.nn.parallel import DistributedDataParallel

    ddp_forward = DistributedDataParallel.forward

    def forward(self, *args, **kwargs):
        # What DDP itself decides in forward: a backward of this output all-reduces the gradients.
        probe.ddp_sync = torch.is_grad_enabled() and bool(getattr(self, "require_backward_grad_sync", True))
        return ddp_forward(self, *args, **kwargs)

    DistributedDataParallel.forward = forward

    autograd_backward = torch.autograd.backward
    synchronising_backward = _collective(probe, "backward", autograd_backward)

    def backward(*args, **kwargs):
        if not probe.ddp_sync:
            return autograd_backward(*args, **kwargs)
        probe.ddp_sync = False
        return synchronising_backward(*args, **kwargs)

    torch.autograd.backward = backward

    from torch.distributed.algorithms.join import Join

    join_enter, join_exit = Join.__enter__, Join.__exit__

    def __enter__(self):
        probe.joining += bool(getattr(self, "_enable", True))
        return join_enter(self)

    def __exit__(self, *exc):
        try:
            return join_exit(self, *exc)
        finally:
            probe.joining -= bool(getattr(self, "_enable", True))

    Join.__enter__, Join.__exit__ = __enter__, __exit__

    init = dist.init_process_group

    def init_process_group(*args, **kwargs):
        result = init(*args, **kwargs)
        probe.group_ready(dist.get_backend())
        return result

    dist.init_process_group = init_process_group

    threading.Thread(target=probe.watch, name="lessonlib-check-watchdog", daemon=True).start()
    atexit.register(probe.finish)
    return probe


def _collective(probe, op, original):
    import functools

    @functools.wraps(original)
    def collective(*args, **kwargs):
        n = probe.entered(op, args, kwargs)
        try:
            result = original(*args, **kwargs)
        except BaseException as e:
            probe.left(n, e)
            raise
        probe.left(n)
        return result

    return collective
