"""What the ranks' records say about a run: the findings of `python -m lessonlib check` (lessonlib.check).

`findings(records, result)` compares what every rank recorded (lessonlib.check.probe) and returns the
findings, errors first. Each says what was seen, where in the reader's code, and the chapter section that
shows that mistake running (SECTIONS; a test checks that every section named here is a heading of that
chapter). Standard library only: no torch here.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

ERROR, WARNING, INFO = "error", "warning", "info"

# finding -> (chapter notebook, the section's heading as the chapter writes it)
SECTIONS = {
    "replicas-start": ("07_ddp_internals", "Construction: one broadcast, in place"),
    "replicas-step": ("12_debugging", "Slow, or silently wrong: a straggler, and replicas that drift apart"),
    "no-ddp": ("05_dp_vs_ddp", "DDP built by hand"),
    "set-epoch": ("03_samplers", "`set_epoch`: forget it and every epoch is the same"),
    "no-sampler": ("03_samplers", "The recipe, and three real runs"),
    "overlap": ("03_samplers", "A hand-written partitioner, measured"),
    "eval-overlap": ("03_samplers", "Evaluation: padding biases the metric, and uneven shards need care"),
    "same-file": ("10_checkpointing", "Writing: the module's state dict, from rank 0"),
    "module-prefix": ("07_ddp_internals", "`model.module` and checkpoints"),
    "map-location": ("10_checkpointing", "`map_location`"),
    "never-joined": ("12_debugging", "A rank that skips a collective"),
    "mismatch": ("12_debugging", "Collectives that do not match"),
    "uneven": ("12_debugging", "Uneven inputs"),
    "run": ("06_accumulation_and_lr", "Batch size and learning rate"),
    "needs-gpu": ("11_end_to_end", "Testing your own DDP code without GPUs"),
}

# finding -> what the check sees, for the table chapter 11 shows (one row per finding)
SEEN = {
    "replicas-start": "the parameters differ across ranks before the first optimizer step",
    "replicas-step": "the parameters differ across ranks after an optimizer step (checksums of every step)",
    "no-ddp": "the replicas differ and no DDP or FSDP wraps the model",
    "set-epoch": "a shuffling DistributedSampler starts a second pass with the same epoch",
    "no-sampler": "every rank draws the same samples of a training loader (no distributed sampler)",
    "overlap": "samples drawn by more than one rank in a training pass, beyond the sampler's padding",
    "eval-overlap": "the same, in a pass with no optimizer step (evaluation): a warning",
    "same-file": "several ranks write the same file with torch.save",
    "module-prefix": "a saved state dict whose every key starts with `module.`: a warning",
    "map-location": "torch.load, without map_location, of tensors saved on a GPU",
    "never-joined": "a collective some rank never calls (a watchdog stops the run after --stall seconds)",
    "mismatch": "the n-th collective differs across ranks in operation, shape or dtype",
    "uneven": "a rank in DDP's backward (its gradient all-reduce) that another rank never joins: uneven batches",
    "run": "what the run is: ranks, backend, devices, batch per rank and global, lr (always shown)",
    "needs-gpu": "a script that needs a GPU the machine lacks, said in one line",
}


def listing():
    """The findings the check looks for, one paragraph each: its name, what it sees, its chapter section."""
    return "\n".join(f"{code}: {SEEN[code]}\n    {Finding(ERROR, code, '').section}" for code in SEEN)


# Collectives whose tensor must have the same shape and dtype on every rank of the group.
SAME_SHAPE = {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}


@dataclass
class Finding:
    severity: str  # ERROR, WARNING or INFO
    code: str  # a key of SECTIONS
    message: str
    where: str = ""  # 'file:line' in the reader's code

    @property
    def section(self):
        chapter, title = SECTIONS[self.code]
        return f"chapter {int(chapter[:2])}, “{title}”"

    def line(self):
        """One line: `file:line: error: what was found [chapter N, “section”]`."""
        where = f"{self.where}: " if self.where else ""
        return f"{where}{self.severity}: {self.message} [{self.section}]"


def read_records(folder, world_size):
    """{rank: [record, ...]} from the probe's files in `folder` (a rank that wrote nothing: [])."""
    records = {}
    for rank in range(world_size):
        path = Path(folder) / f"rank-{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records[rank] = []
        for line in lines:
            try:
                records[rank].append(json.loads(line))
            except ValueError:  # a line cut short by a rank that was killed
                pass
    return records


def findings(records, result=None):
    """Every finding, errors first, then warnings, then what the run was (INFO)."""
    found = []
    ranks = sorted(records)
    if len(ranks) > 1:  # a collective out of step first: it can explain the others (gloo pairs mismatched calls)
        found += collectives(records, result)
        found += loaders(records)
        found += replicas(records)
    found += files(records)
    missing = sorted({n for recs in records.values() for r in recs if r["t"] == "missing" for n in r["names"]})
    if missing:
        found.append(Finding(WARNING, "run", f"not checked: this torch has no {', '.join(missing)}"))
    found += [f for f in [the_run(records)] if f is not None]
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    return sorted(found, key=lambda f: order[f.severity])


def _of(records, kind):
    return {rank: [r for r in recs if r["t"] == kind] for rank, recs in records.items()}


def _ranks(ranks):
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


# ----------------------------------------------------------------- 1. replicas


def _differs(a, names_a, b, names_b):
    """The name of the first parameter, in `a`'s order, whose checksums differ between the lists `a` and `b`
    (None: none). Parameters are matched by name, so a rank whose optimizer holds another part of the model
    (ZeroRedundancyOptimizer) is compared on what both hold; a tensor in no module ('#3 of shape [8]': a
    hand-made shard) is no replica and is not compared."""
    theirs = {n: x for n, x in zip(names_b, b) if not n.startswith("#")}
    for name, x in zip(names_a, a):
        y = theirs.get(name)
        if x is not None and y is not None and x != y:
            return name
    return None


def _all_differ(a, names_a, b, names_b):
    """Whether every parameter compared differs: what ranks training models of their own look like. Some
    equal and some not, without a wrapper, is a model sharded by hand (chapter 15's), not a mistake."""
    theirs = {n: x for n, x in zip(names_b, b) if not n.startswith("#")}
    pairs = [(x, theirs[n]) for n, x in zip(names_a, a) if n in theirs and x is not None and theirs[n] is not None]
    return bool(pairs) and all(x != y for x, y in pairs)


USUAL_CAUSES = (
    "the usual causes: a branch on the rank that changes the gradients or the update after DDP's all-reduce "
    "(a clip, a scale, a skipped step), or gradients synchronised by hand on some ranks only"
)
CHANGED_AFTER_DDP = (
    "the weights were changed on some ranks after DDP was built (DDP broadcasts rank 0's weights once, at "
    "construction: load a checkpoint before wrapping, or on every rank)"
)
NO_DDP = "no DistributedDataParallel or FSDP wraps the model: each rank trains a model of its own"


def replicas(records):
    starts, steps = _of(records, "optimizer"), _of(records, "step")
    found = []
    first = min(records)
    for mine in starts[first]:
        opt = mine["opt"]
        no_ddp = not mine.get("wrappers")
        if not no_ddp and not mine.get("in_wrapper", True):
            continue  # a model of this rank's own beside the DDP one (a reference, a probe): not a replica
        others = {r: next((o for o in starts[r] if o["opt"] == opt), None) for r in records if r != first}
        others = {r: o for r, o in others.items() if o is not None}
        finding = None
        for rank, other in others.items():
            name = _differs(mine["sums"], mine["names"], other["sums"], other["names"])
            if no_ddp and not _all_differ(mine["sums"], mine["names"], other["sums"], other["names"]):
                name = None
            if name is not None:
                finding = Finding(
                    ERROR,
                    "no-ddp" if no_ddp else "replicas-start",
                    f"replicas differ before the first optimizer step: parameter {name} on rank {first} and "
                    f"rank {rank}; {NO_DDP if no_ddp else CHANGED_AFTER_DDP}",
                    mine["where"],
                )
                break
        if finding is None:
            # Steps inside an enabled Join are left out: a rank out of inputs takes none while the others go on.
            at = {r: {s["n"]: s for s in steps[r] if s["opt"] == opt and not s.get("join")} for r in records}
            for n in sorted(at[first]):
                diverged = [
                    (r, _differs(at[first][n]["sums"], mine["names"], at[r][n]["sums"], other["names"]))
                    for r, other in others.items()
                    if n in at[r]
                    and (
                        not no_ddp or _all_differ(at[first][n]["sums"], mine["names"], at[r][n]["sums"], other["names"])
                    )
                ]
                diverged = [(r, name) for r, name in diverged if name is not None]
                if diverged:
                    rank, name = diverged[0]
                    finding = Finding(
                        ERROR,
                        "no-ddp" if no_ddp else "replicas-step",
                        f"replicas differ after optimizer step {n}: first parameter {name}, rank {first} and rank "
                        f"{rank}; {NO_DDP if no_ddp else USUAL_CAUSES}",
                        at[first][n]["where"],
                    )
                    break
        if finding is not None:
            found.append(finding)
    return found


# ----------------------------------------------------------------- 2. loaders and samplers


def loaders(records):
    found = []
    same = _of(records, "same_epoch")
    seen = {}
    for rank, recs in same.items():
        for r in recs:
            seen.setdefault((r["sampler"], r["where"]), (r, []))[1].append(rank)
    for (_, where), (r, ranks) in seen.items():
        found.append(
            Finding(
                ERROR,
                "set-epoch",
                f"a DistributedSampler gave pass {r['passes']} over its data the same order as an earlier pass "
                f"(its epoch stayed {r['epoch']} on {_ranks(ranks)}): call sampler.set_epoch(epoch) before "
                "each epoch",
                where,
            )
        )
    passes = _of(records, "pass")
    # A shuffling DistributedSampler made anew for each epoch, never told the epoch, repeats the order too:
    # two passes over one dataset, in the same order on a rank, when the sampler shuffles.
    if not seen:
        for rank, recs in passes.items():
            shuffled = [p for p in recs if p["distributed"] and p.get("shuffle") and p["steps"] > 0]
            repeat = next(
                (
                    b
                    for a, b in zip(shuffled, shuffled[1:])
                    if a["dataset"] == b["dataset"] and a["indices"] == b["indices"]
                ),
                None,
            )
            if repeat is not None:
                found.append(
                    Finding(
                        ERROR,
                        "set-epoch",
                        f"pass {repeat['pass'] + 1} over {repeat['dataset']} drew the same samples in the same order "
                        f"as the pass before it on rank {rank}, from a shuffling DistributedSampler: call "
                        "sampler.set_epoch(epoch) before each epoch",
                        repeat["where"],
                    )
                )
                break
    world = len(records)
    groups = {}
    for rank, recs in passes.items():
        for p in recs:
            groups.setdefault((p["dataset"], p["pass"]), {})[rank] = p
    reported = set()
    for (dataset, number), by_rank in sorted(groups.items(), key=lambda kv: kv[0][1]):
        if len(by_rank) < 2:
            continue
        sets = {r: set(p["indices"]) for r, p in by_rank.items()}
        union = set().union(*sets.values())
        repeated = sum(len(s) for s in sets.values()) - len(union)
        any_p = next(iter(by_rank.values()))
        distributed = any(p["distributed"] for p in by_rank.values())
        allowed = max(p["padding"] for p in by_rank.values()) if distributed else world - 1
        if repeated <= allowed:
            continue
        training = any(p["steps"] > 0 for p in by_rank.values())
        key = (dataset, training)
        if key in reported:
            continue
        reported.add(key)
        identical = len({frozenset(s) for s in sets.values()}) == 1
        size = any_p["size"]
        if identical and not distributed:
            what = (
                f"every rank drew the same {len(union)} of the {size} samples of {dataset} in pass {number + 1}: "
                f"the loader has no DistributedSampler (sampler {any_p['sampler']}), so "
                + (
                    "each rank trains on the whole dataset and every sample counts once per rank"
                    if training
                    else "each rank evaluates the same samples, and a metric summed over the ranks counts each "
                    f"{len(by_rank)} times"
                )
            )
        else:
            pad = f" (the sampler's padding explains at most {allowed})" if distributed else ""
            what = (
                f"{repeated} samples of {dataset} were drawn by more than one rank in pass {number + 1}{pad}: "
                "the ranks' shards overlap (a DistributedSampler given the wrong rank or num_replicas, or "
                "a hand-made split)"
            )
        code = ("no-sampler" if identical and not distributed else "overlap") if training else "eval-overlap"
        found.append(Finding(ERROR if training else WARNING, code, what, any_p["where"]))
    return found


# ----------------------------------------------------------------- 3. files


def files(records):
    found = []
    saves = _of(records, "save")
    by_path = {}
    for rank, recs in saves.items():
        for s in recs:
            by_path.setdefault(s["path"], {}).setdefault(rank, s)
    for path, by_rank in by_path.items():
        if len(by_rank) > 1:
            s = by_rank[min(by_rank)]
            found.append(
                Finding(
                    ERROR,
                    "same-file",
                    f"{_ranks(by_rank)} all wrote {_short(path)}: the same file written by several processes at "
                    "once can end up torn; save from rank 0 alone (if rank == 0:), then a barrier",
                    s["where"],
                )
            )
    prefixed = {}
    for recs in saves.values():
        for s in recs:
            if s["prefixed"]:
                prefixed.setdefault(s["path"], s)
    for path, s in prefixed.items():
        found.append(
            Finding(
                WARNING,
                "module-prefix",
                f"the state dict saved to {_short(path)} has DDP's `module.` prefix on every key: a model "
                "without DDP cannot load it as it is; save model.module.state_dict()",
                s["where"],
            )
        )
    loads = _of(records, "load")
    flagged = set()
    for recs in loads.values():
        for load in recs:
            gpus = [loc for loc in load["locations"] if loc.startswith("cuda")]
            if load["map_location"] or not gpus or (load["path"], load["where"]) in flagged:
                continue
            flagged.add((load["path"], load["where"]))
            found.append(
                Finding(
                    ERROR,
                    "map-location",
                    f"{_short(load['path'] or 'a checkpoint')} was saved from {', '.join(gpus)} and loaded without "
                    f"map_location: every rank puts its copy on {gpus[0]} (or fails without a GPU); pass "
                    "map_location='cpu' or the rank's own device",
                    load["where"],
                )
            )
    return found


def _short(path):
    try:
        rel = str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path
    return rel


# ----------------------------------------------------------------- 4. collectives


def collectives(records, result=None):
    """A collective that a rank never joined, or joined with another operation or shape."""
    enters = _of(records, "enter")
    stalls = _of(records, "stall")
    found = []
    groups = {}
    for rank, recs in enters.items():
        for e in recs:
            if e.get("join"):
                continue  # inside an enabled Join: ranks out of inputs shadow the others' calls, by design
            groups.setdefault(tuple(e.get("group") or ()), {}).setdefault(rank, []).append(e)
    for members, by_rank in groups.items():
        ranks = sorted(members) if members else sorted(records)
        for i in range(max(len(v) for v in by_rank.values())):
            calls = {r: by_rank.get(r, [])[i] for r in ranks if i < len(by_rank.get(r, []))}
            missing = [r for r in ranks if r not in calls]
            kinds = {(c["op"], tuple(c.get("shape") or ()), c.get("dtype")) for c in calls.values()}
            ops = {c["op"] for c in calls.values()}
            mismatch = len(ops) > 1 or (
                len(kinds) > 1 and ops <= SAME_SHAPE and all("shape" in c for c in calls.values())
            )
            if mismatch:
                told = "; ".join(f"rank {r}: {_call(c)} at {c['where']}" for r, c in sorted(calls.items()))
                code = "uneven" if "backward" in ops else "mismatch"
                found.append(
                    Finding(
                        ERROR,
                        code,
                        f"collective #{i + 1} does not match across the ranks: {told}"
                        + (UNEVEN if code == "uneven" else ""),
                        calls[min(calls)]["where"],
                    )
                )
                return found
            if missing and (any(stalls.values()) or (result is not None and not result.ok)):
                waiting = sorted(calls)
                stalled = [s for r in waiting for s in stalls.get(r, []) if s["n"] == calls[r]["n"]]
                waited = f", waited {stalled[0]['seconds']:g} s" if stalled else ""
                c = calls[waiting[0]]
                absent = "; ".join(_elsewhere(r, by_rank.get(r, []), result) for r in missing)
                code = "uneven" if "backward" in ops else "never-joined"
                found.append(
                    Finding(
                        ERROR,
                        code,
                        f"{_ranks(missing)} never joined collective #{i + 1}, {_call(c)}, that {_ranks(waiting)} "
                        f"called{waited}: {absent}" + (UNEVEN if code == "uneven" else ""),
                        c["where"],
                    )
                )
                return found
    return found


UNEVEN = (
    "; one rank ran more training steps than another (uneven batches): every rank must run as many DDP "
    "backwards, so give them equal shards (DistributedSampler pads or trims) or use DDP's join()"
)


def _call(c):
    if c["op"] == "backward":
        return "backward (DDP's all-reduce of the gradients)"
    shape = f" of shape {list(c['shape'])} {c.get('dtype', '')}".rstrip() if "shape" in c else ""
    return f"{c['op']}{shape}"


def _elsewhere(rank, calls, result):
    """Where `rank` was instead: its last collective, and how it ended (from the launch's result)."""
    last = f"its last was #{len(calls)}, {_call(calls[-1])} at {calls[-1]['where']}" if calls else "it called none"
    if result is None or rank >= len(result.ranks):
        return f"rank {rank}: {last}"
    from lessonlib.view.story import rank_line

    line = rank_line(result, result.ranks[rank])
    return f"rank {rank} {line.what}" + (f", {line.where}" if line.where else "") + f" ({last})"


# ----------------------------------------------------------------- 5. the run


def the_run(records):
    groups = _of(records, "group")
    starts = _of(records, "optimizer")
    passes = _of(records, "pass")
    world = len(records)
    backend = next((g[0]["backend"] for g in groups.values() if g), None)
    parts = [f"{world} rank{'s' if world != 1 else ''}", f"backend {backend}" if backend else "no process group"]
    devices = [(starts[r][0]["device"] if starts.get(r) else None) for r in sorted(records)]
    if any(devices):
        shown = devices[0] if len(set(devices)) == 1 else ", ".join(str(d) for d in devices)
        parts.append(f"device {shown}" + (" on every rank" if len(set(devices)) == 1 and world > 1 else ""))
    batch = ""
    per_rank = []
    for r in sorted(records):
        train = [p for p in passes.get(r, []) if p["steps"] > 0 and p.get("first_batch")]
        if train:
            p = train[0]
            per_rank.append((p["first_batch"], max(1, p.get("per_step") or 1)))
    if per_rank and len(per_rank) == world:
        sizes, accum = {b for b, _ in per_rank}, {a for _, a in per_rank}
        total = sum(b * a for b, a in per_rank)
        size = sizes.pop() if len(sizes) == 1 else "/".join(str(b) for b, _ in per_rank)
        k = accum.pop() if len(accum) == 1 else "/".join(str(a) for _, a in per_rank)
        batch = (
            f"batch {size} per rank x {k} micro-batch{'es' if k != 1 else ''} per step x {world} = global batch {total}"
        )
        parts.append(batch)
    first = starts.get(min(records)) or []
    if first:
        parts.append(
            f"lr {first[0]['lr']:g} ({first[0]['kind']})"
            if isinstance(first[0]["lr"], (int, float))
            else first[0]["kind"]
        )
    note = ""
    if batch:
        note = (
            "; the global batch changes with the world size unless the script divides by it, and the lr "
            "goes with the global batch"
        )
    return Finding(INFO, "run", "the run: " + ", ".join(parts) + note)


# ----------------------------------------------------------------- a GPU the machine lacks

NEEDS_GPU = re.compile(
    r"Torch not compiled with CUDA enabled|No CUDA GPUs are available|Found no NVIDIA driver|"
    r"ProcessGroupNCCL is only supported with GPUs|NCCL is not available|CUDA driver initialization failed|"
    r"Attempting to deserialize object on a CUDA device",
)


def needs_gpu(result):
    """The first failed rank's error when it says the script needs a GPU, else None."""
    for r in result.ranks:
        text = f"{r.error or ''}\n{r.stderr[-4000:]}"
        m = NEEDS_GPU.search(text)
        if m:
            return r, m.group(0)
    return None
