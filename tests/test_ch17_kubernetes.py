"""Chapter 17's Kubernetes section: the manifests in its text set what its table says they set.

The chapter shows two manifests (the legacy `kubeflow.org/v1` PyTorchJob and Kubeflow Trainer v2's TrainJob)
as YAML in a markdown cell, and a code cell's `SET_BY` names, for each torchrun option in its table, the field
of each manifest that sets it (or says that the operator fills it in). Nothing here runs Kubernetes: these
tests read the notebook's own text, so a field the table cites and the manifest lacks (the PyTorchJob's
`rdzvId` was once such a field) fails in seconds.
"""

import ast
import json
import re

import pytest
import yaml

from lessonlib import ROOT

pytestmark = pytest.mark.unit

CHAPTER = ROOT / "book" / "17_slurm.ipynb"
TEXT_CELL, TABLE_CELL = "c17-43", "c17-44"  # the section's prose with the manifests, and the table's code cell
OPERATOR = "the operator"  # SET_BY's words for a value the operator fills in, not a field of the manifest


def _cell(cell_id):
    cells = json.loads(CHAPTER.read_text())["cells"]
    return "".join(next(c["source"] for c in cells if c["id"] == cell_id))


def manifests():
    """The YAML blocks of the section's text, by kind."""
    blocks = re.findall(r"```yaml\n(.*?)```", _cell(TEXT_CELL), re.S)
    return {doc["kind"]: doc for doc in map(yaml.safe_load, blocks)}


def set_by():
    """The table cell's SET_BY: torchrun option -> (PyTorchJob field, TrainJob field), as written there."""
    for node in ast.walk(ast.parse(_cell(TABLE_CELL))):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "SET_BY":
            return ast.literal_eval(node.value)
    raise AssertionError(f"no SET_BY in cell {TABLE_CELL}")


def fields(where):
    """A SET_BY entry as paths: 'a.b, c' is a.b and a.c (a sibling of the first)."""
    first, *siblings = where.split(", ")
    path = tuple(first.split("."))
    return [path] + [path[:-1] + (name,) for name in siblings]


def lookup(spec, path):
    for key in path:
        if not isinstance(spec, dict) or key not in spec:
            return None
        spec = spec[key]
    return spec


def test_the_section_shows_the_legacy_api_and_its_successor():
    found = manifests()
    assert found["PyTorchJob"]["apiVersion"] == "kubeflow.org/v1", found["PyTorchJob"]["apiVersion"]
    assert found["TrainJob"]["apiVersion"] == "trainer.kubeflow.org/v1alpha1", found["TrainJob"]["apiVersion"]
    # The same job: the chapter's first, 2 nodes of 2 ranks, the same command.
    legacy, trainjob = found["PyTorchJob"]["spec"], found["TrainJob"]["spec"]
    command = legacy["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert command == trainjob["trainer"]["command"] == ["torchrun", "lessons/17_ranks.py", "--expect-world", "4"]
    assert legacy["pytorchReplicaSpecs"]["Worker"]["replicas"] == trainjob["trainer"]["numNodes"] == 2


@pytest.mark.parametrize("api", [0, 1], ids=["PyTorchJob", "TrainJob"])
def test_every_field_the_table_cites_is_in_that_manifest(api):
    spec = manifests()[("PyTorchJob", "TrainJob")[api]]["spec"]
    cited = 0
    for option, where in set_by().items():
        if where[api] is None or where[api].startswith(OPERATOR):
            continue
        for path in fields(where[api]):
            assert lookup(spec, path) is not None, (
                f"the table says {'.'.join(path)} sets {option}; the manifest lacks it"
            )
            cited += 1
    assert cited >= 2, set_by()  # the check has something to check


def test_the_legacy_manifest_sets_the_rendezvous_id_the_table_lists():
    assert set_by()["--rdzv-id"][0] == "elasticPolicy.rdzvId"
    assert manifests()["PyTorchJob"]["spec"]["elasticPolicy"]["rdzvId"]


def test_the_field_reader_finds_a_missing_field():
    """The check above can fail: a manifest without the field is caught."""
    spec = manifests()["PyTorchJob"]["spec"]
    del spec["elasticPolicy"]["rdzvId"]
    assert lookup(spec, ("elasticPolicy", "rdzvId")) is None
    assert fields("elasticPolicy.minReplicas, maxReplicas") == [
        ("elasticPolicy", "minReplicas"),
        ("elasticPolicy", "maxReplicas"),
    ]
