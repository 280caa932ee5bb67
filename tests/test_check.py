"""`python -m lessonlib check` (lessonlib.check): a gallery of broken scripts (tests/check_gallery), each
flagged with the right finding, at the right line, naming the right chapter section; the course's two
templates come out clean; the command is bounded, refuses bad input before starting anything, and leaves
nothing behind on success, failure or Ctrl-C. Real processes and real gloo throughout.
"""

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from conftest import ended_by, processes_with_env
from lessonlib import ROOT, run_bounded
from lessonlib.check.findings import SECTIONS, Finding
from lessonlib.processes.bounded import poll_until

GALLERY = ROOT / "tests" / "check_gallery"
PYTHON = sys.executable


def check(*args, timeout=180, cwd=None, env=None):
    """`python -m lessonlib check ARGS` in a session of its own, bounded: (exit status, output)."""
    done = run_bounded([PYTHON, "-m", "lessonlib", "check", *map(str, args)], timeout, cwd=cwd or ROOT, env=env)
    assert not done.timed_out, done.output[-4000:]
    return done.returncode, done.output


def marked(script, marker="FINDING"):
    """'tests/check_gallery/FILE:LINE' of the line of `script` that carries `# MARKER`."""
    lines = (GALLERY / script).read_text().splitlines()
    found = [i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}")]
    assert len(found) == 1, f"{script}: {len(found)} lines marked {marker}"
    return f"tests/check_gallery/{script}:{found[0]}"


STEP, LOADER = ("_common.py", "FINDING: step"), ("_common.py", "FINDING: loader")

# script -> (severity, finding, where: the script's FINDING line or _common's, arguments, exit status)
GALLERY_CASES = {
    "replicas_loaded_after_wrap.py": ("error", "replicas-start", STEP, [], 1),
    "replicas_rank_branch.py": ("error", "replicas-step", STEP, [], 1),
    "no_ddp.py": ("error", "no-ddp", None, [], 1),
    "no_set_epoch.py": ("error", "set-epoch", LOADER, [], 1),
    "new_sampler_each_epoch.py": ("error", "set-epoch", LOADER, [], 1),
    "no_sampler.py": ("error", "no-sampler", LOADER, [], 1),
    "sampler_wrong_rank.py": ("error", "overlap", LOADER, [], 1),
    "eval_without_sampler.py": ("warning", "eval-overlap", None, [], 0),
    "every_rank_saves.py": ("error", "same-file", None, ["{tmp}/ckpt.pt"], 1),
    "module_prefix.py": ("warning", "module-prefix", None, ["{tmp}/ckpt.pt"], 0),
    "gpu_checkpoint_no_map_location.py": ("error", "map-location", None, ["{tmp}/ckpt.pt"], 1),
    "skips_collective.py": ("error", "never-joined", None, [], 1),
    "shape_mismatch.py": ("error", "mismatch", None, [], 1),
    "uneven_batches.py": ("error", "uneven", None, [], 1),
}


def finding_lines(output):
    return [line for line in output.splitlines() if re.search(r"(^|: )(error|warning|info): ", line)]


@pytest.mark.parametrize("script", sorted(GALLERY_CASES))
def test_each_broken_script_is_flagged_with_its_chapter(script, tmp_path):
    severity, code, where, args, status = GALLERY_CASES[script]
    where = marked(script) if where is None else marked(*where)
    chapter, title = SECTIONS[code]
    rc, out = check("--quiet", "--stall", "4", "--", GALLERY / script, *[a.format(tmp=tmp_path) for a in args])
    found = finding_lines(out)
    expected = f"{where}: {severity}: "
    hits = [line for line in found if line.startswith(expected) and f"[chapter {int(chapter[:2])}, “{title}”]" in line]
    assert hits, f"no {severity} at {where} naming {chapter} “{title}”:\n{out}"
    # One finding of the mistake, and no error beside it: the gallery's scripts make one mistake each.
    errors = [line for line in found if ": error: " in line]
    assert len(errors) == (1 if severity == "error" else 0), out
    assert rc == status, out
    assert found[-1].startswith("info: the run: 2 ranks, backend gloo"), out


@pytest.mark.parametrize(
    "script, args",
    [
        ("lessons/train_ddp.py", ["--epochs", "2"]),
        ("lessons/train_fsdp.py", ["--epochs", "2"]),
        ("tests/check_gallery/uneven_with_join.py", []),
        ("tests/check_gallery/zero_optimizer.py", []),
    ],
)
def test_the_templates_come_out_clean(script, args, tmp_path):
    """The templates, uneven shards trained inside Join (uneven on purpose), and ZeroRedundancyOptimizer
    (each rank's inner optimizer holds another part of the model): no finding."""
    rc, out = check("--quiet", "--", script, *args, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert rc == 0, out
    assert not list(tmp_path.iterdir()), f"left in the temporary folder: {list(tmp_path.iterdir())}"
    assert finding_lines(out) == [line for line in finding_lines(out) if line.startswith("info: ")], out
    assert out.rstrip().endswith("lessonlib check: no findings"), out
    if "check_gallery" in script:
        return
    # What the run is: 48 is the templates' global batch (--batch-size), split over the 2 ranks.
    assert "2 ranks, backend gloo, device cpu on every rank" in out, out
    assert "batch 24 per rank x 1 micro-batch per step x 2 = global batch 48" in out, out


def test_the_global_batch_follows_the_world_size_in_the_summary():
    """With 4 ranks, the template's global batch stays 48 (it divides --batch-size by the world size); a
    script that fixes the per-rank batch would show it grow: the summary says which it is."""
    rc, out = check("--quiet", "-n", "4", "--", "lessons/train_ddp.py", "--epochs", "1")
    assert rc == 0, out
    assert "4 ranks" in out and "batch 12 per rank x 1 micro-batch per step x 4 = global batch 48" in out, out
    rc, out = check("--quiet", "-n", "4", "--", GALLERY / "eval_without_sampler.py")
    assert "batch 8 per rank x 1 micro-batch per step x 4 = global batch 32" in out, out


def test_a_script_that_needs_a_gpu_is_told_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: needs_gpu.py runs here")
    rc, out = check("--quiet", "--", GALLERY / "needs_gpu.py")
    assert rc == 1, out
    lines = [line for line in out.splitlines() if "needs a GPU" in line]
    assert len(lines) == 1 and lines[0].startswith("lessonlib check: this script needs a GPU"), out


def test_the_stall_bound_ends_a_hang_long_before_the_timeout():
    """skips_collective.py's rank 1 sleeps 120 s; with --stall 5 the run ends within a bound far below that,
    rank 0's wait and rank 1's place both named."""
    rc, out = check("--quiet", "--stall", "5", "--timeout", "100", "--", GALLERY / "skips_collective.py")
    assert rc == 1, out  # not 124: the stall bound ended it, not the timeout
    assert "a collective waited more than 5 s (--stall)" in out, out
    line = next(line for line in finding_lines(out) if "never joined" in line)
    assert "rank 1 never joined collective #2, all_reduce of shape [3] float32, that rank 0 called" in line, line
    sleep = marked("skips_collective.py", "other work: it never calls the all_reduce rank 0 waits in")
    assert f"rank 1 stopped by torchrun (SIGTERM) after another rank failed, at {sleep}" in line, line
    waited = float(re.search(r"waited ([\d.]+) s", line).group(1))
    assert ended_by(5, waited), line  # what rank 0's watchdog measured: the bound, and less than twice it


def test_bad_input_is_refused_before_anything_starts(tmp_path):
    for args, said in [
        ([], "no script: give it after `--`"),
        (["--", tmp_path / "missing.py"], "missing.py: no such file"),
        (["--", ROOT / "README.md"], "not a Python script"),
        (["-n", "0", "--", "lessons/train_ddp.py"], "-n"),
        (["--stall", "0", "--", "lessons/train_ddp.py"], "--stall must be from 1"),
        (["--epochs", "1", "--", "lessons/train_ddp.py"], "unrecognized argument(s) --epochs 1"),
        (["--list", "--", "lessons/train_ddp.py"], "--list takes no script"),
    ]:
        rc, out = check(*args, timeout=60)
        assert rc == 2 and said in out, (args, out)
        assert "Traceback" not in out, out


def test_nothing_is_left_behind_after_a_failure_or_ctrl_c(tmp_path):
    """The check's folder is removed and no process of the run lives on, after a failing run and after a
    Ctrl-C in the middle of a hang (exit 130)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tag = os.urandom(8).hex()
    env = {**os.environ, "TMPDIR": str(tmp), "TEST_TAG": tag}
    rc, out = check("--quiet", "--", GALLERY / "no_sampler.py", env=env)
    assert rc == 1, out
    assert not [p for p in tmp.iterdir() if p.name.startswith("lessonlib-check-")], list(tmp.iterdir())
    proc = subprocess.Popen(
        [PYTHON, "-m", "lessonlib", "check", "--quiet", "--stall", "100", "--", GALLERY / "skips_collective.py"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        # Both ranks are up once rank 0 waits in its second all_reduce: the probe's records say so.
        def waiting():
            files = list(tmp.glob("lessonlib-check-*/rank-0.jsonl"))
            return files and sum(1 for line in files[0].read_text().splitlines() if '"t": "enter"' in line) >= 2

        poll_until(waiting, 60, what="rank 0 in its second collective")
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out
    assert "interrupted (Ctrl-C)" in out, out
    poll_until(lambda: not processes_with_env("TEST_TAG", tag), 20, what="the run's processes to end")
    assert not list(tmp.iterdir()), list(tmp.iterdir())


def test_a_dead_checks_folder_is_swept_by_the_next_check(tmp_path):
    """A check killed outright (SIGKILL) leaves its folder; the next check removes it, its owner being gone."""
    from lessonlib.processes import owners

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead = subprocess.run([PYTHON, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    left = tmp / f"lessonlib-check-{pid}-1-abc"
    left.mkdir()
    assert owners.owner_in(left.name, "lessonlib-check-") == (pid, 1)
    rc, out = check("--quiet", "--", GALLERY / "no_sampler.py", env={**os.environ, "TMPDIR": str(tmp)})
    assert not left.exists(), out


@pytest.mark.unit
def test_every_section_a_finding_names_is_a_heading_of_its_chapter():
    for code, (chapter, title) in SECTIONS.items():
        notebook = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())
        headings = {
            line.lstrip("#").strip()
            for cell in notebook["cells"]
            if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines()
            if line.startswith("#")
        }
        assert title in headings, f"{code}: “{title}” is not a heading of book/{chapter}.ipynb"
        assert Finding("error", code, "x").section.startswith(f"chapter {int(chapter[:2])}, ")


@pytest.mark.unit
def test_every_finding_says_what_it_sees():
    from lessonlib.check.findings import SEEN

    assert set(SEEN) == set(SECTIONS)


def test_the_list_names_every_finding_and_its_section():
    rc, out = check("--list", timeout=60)
    assert rc == 0, out
    for code, (chapter, title) in SECTIONS.items():
        assert f"{code}: " in out and f"chapter {int(chapter[:2])}, “{title}”" in out, code
