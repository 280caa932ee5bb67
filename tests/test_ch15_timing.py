"""Chapter 15's timing definitions and its bucket-cost model, on synthetic inputs (no process).

- hidden() is (NaiveDDP's step - the overlapped step) / the communication alone, the one definition that
  lessons/15_overlap_ddp.py, the chapter and benchmarks/build_ddp.py use (the benchmark imports it);
- medians() gives the median step and that same step's parts, which add up;
- step_model() (lessons/15_bucket_sizes.py) equals a step-by-step simulation of b equal buckets ready
  evenly through backward() and sent one after the other, and has the model's two limits; comm_model()
  is b fixed costs plus the bytes; fit() recovers alpha and beta from exact points;
- check_launches() accepts buckets launched from their last gradient's hook and rejects a bucket sent
  before it was full, one sent in a later hook and one left for finish: the check can fail.
The real-process side (gloo, 1 to 4 ranks) is tests/test_lessons.py running the lessons.
"""

import itertools
import math
from types import SimpleNamespace

import pytest

import lessonlib
from lessonlib import ROOT

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def overlap():
    return lessonlib.load_lesson("15_overlap_ddp")


@pytest.fixture(scope="module")
def sizes():
    return lessonlib.load_lesson("15_bucket_sizes")


def test_hidden_is_the_step_saved_over_the_communication_alone(overlap):
    assert overlap.hidden(30.0, 20.0, 10.0) == 1.0  # all of it gone from the step
    assert overlap.hidden(30.0, 30.0, 10.0) == 0.0  # no shorter
    assert overlap.hidden(30.0, 25.0, 10.0) == 0.5
    assert overlap.hidden(30.0, 35.0, 10.0) == -0.5  # slower: backward's slowdown counts against it


def test_medians_takes_one_step_and_its_parts(overlap):
    runs = [
        {"finish_ms": 30.0, "backward_ms": 10.0},
        {"finish_ms": 20.0, "backward_ms": 15.0},
        {"finish_ms": 40.0, "backward_ms": 5.0},
    ]
    assert overlap.medians(runs) == {"step": 30.0, "backward": 10.0, "exposed": 20.0}
    even = runs[:2]  # an even count: the lower middle, a step that really happened
    assert overlap.medians(even) == {"step": 20.0, "backward": 15.0, "exposed": 5.0}


def simulate(b, total, alpha, per_byte, backward):
    """Bucket i of b is ready at i * backward / b and is sent once it is ready and the one before is done."""
    end = 0.0
    for i in range(1, b + 1):
        end = max(end, i * backward / b) + alpha + total / b * per_byte
    return end


def test_the_step_model_is_the_pipeline_it_describes(sizes):
    for b, alpha, per_byte, backward in itertools.product(
        (1, 2, 3, 5, 12, 40), (0.0, 0.05, 0.3, 2.0), (1e-6, 1e-5), (0.0, 1.0, 10.0, 50.0)
    ):
        got = sizes.step_model(b, 400_000, alpha, per_byte, backward)
        assert math.isclose(got, simulate(b, 400_000, alpha, per_byte, backward), rel_tol=1e-12, abs_tol=1e-12), (
            b,
            alpha,
            per_byte,
            backward,
        )


def test_the_models_limits(sizes):
    total, alpha, per_byte, backward = 400_000, 0.3, 1e-6, 10.0
    comm = sizes.comm_model(12, total, alpha, per_byte)
    assert math.isclose(comm, 12 * alpha + total * per_byte)
    # One bucket cannot start before backward ends: the whole communication is exposed
    assert math.isclose(sizes.step_model(1, total, alpha, per_byte, backward), backward + alpha + total * per_byte)
    # Communication that keeps pace leaves only the last bucket after backward
    assert math.isclose(sizes.step_model(4, total, alpha, per_byte, backward), backward + alpha + total / 4 * per_byte)
    # Too many buckets: the chain of fixed costs is longer than backward
    assert sizes.step_model(200, total, alpha, per_byte, backward) > sizes.step_model(
        20, total, alpha, per_byte, backward
    )


def test_fit_recovers_alpha_and_beta(sizes):
    alpha, per_byte = 0.25, 1 / 2e6  # 250 us and 2 GB/s, in ms
    points = [4096, 32768, 131072, 524288, 2097152]
    got = sizes.fit(points, [alpha + s * per_byte for s in points])
    assert math.isclose(got[0], alpha, rel_tol=1e-9) and math.isclose(got[1], per_byte, rel_tol=1e-9), got


def test_check_launches_rejects_a_bucket_sent_too_early_too_late_or_never(sizes):
    import torch

    layer = torch.nn.Linear(2, 2)  # parameters: weight (index 0), bias (index 1)
    ready = [(1, 1.0), (0, 2.0)]  # backward finishes the bias first
    per_tensor = SimpleNamespace(module=layer, buckets=[[layer.bias], [layer.weight]])
    right = {"ready": ready, "comm": [(1.0, 5.0, 0), (2.0, 6.0, 1)]}  # each launched in its own gradient's hook
    sizes.check_launches("right", per_tensor, [right], 0)
    both = SimpleNamespace(module=layer, buckets=[[layer.bias, layer.weight]])
    sizes.check_launches("one bucket", both, [{"ready": ready, "comm": [(2.0, 6.0, 0)]}], 0)
    wrong = {
        "sent before it was full": (both, {"ready": ready, "comm": [(1.0, 6.0, 0)]}),
        "sent in a later hook": (per_tensor, {"ready": ready, "comm": [(2.0, 5.0, 0), (2.0, 6.0, 1)]}),
        "left for finish": (per_tensor, {"ready": ready, "comm": [(1.0, 5.0, 0)]}),
    }
    for name, (ddp, step) in wrong.items():
        with pytest.raises(AssertionError):
            sizes.check_launches(name, ddp, [step], 0)


def test_the_benchmark_uses_the_lessons_definition_not_a_copy():
    source = (ROOT / "benchmarks" / "build_ddp.py").read_text()
    assert "overlap.hidden(" in source and "def hidden" not in source
    assert "overlap.communication_alone(" in source
