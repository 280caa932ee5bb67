"""lessonlib.launcher.torchpatches: each change made inside torch, on the installed torch itself, and its guard
(unit tier: no process, torch imported in this one, every patch undone after its test).

Each patch is applied to the real torch and checked for what it promises: torchrun's worker start routes a
rank's command to the function given; the rendezvous names the same methods as torch's own
get_method_name; a TCPStore server listens on the one address given. Each guard is checked twice: on the
installed torch it finds nothing changed, and on a shape that differs from what the patch relies on it
says what changed, naming the torch version the patch was written for. And no other module of lessonlib
changes anything inside torch.
"""

import ast
import inspect
import sys
from types import ModuleType

import pytest

from lessonlib import ROOT
from lessonlib.launcher import torchpatches
from lessonlib.sockets import own_tcp_sockets

pytestmark = pytest.mark.unit
RANK_MODULE = "lessonlib.launcher._rank_main"


def module(**names):
    """A stand-in for a torch module with these names (a module, as the guards are given)."""
    made = ModuleType("torch_as_it_might_be")
    vars(made).update(names)
    return made


@pytest.fixture
def patched():
    """torchpatches, with torch's own names put back after the test, whatever it did."""
    try:
        yield torchpatches
    finally:
        torchpatches.restore()


# --------------------------------------------------------------------------- the worker start


def test_torchrun_starts_a_rank_through_the_function_given(patched):
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler_class = subprocess_handler.SubprocessHandler
    own = handler_class._popen
    assert patched.worker_start_problem(handler_class) is None
    started = []
    assert patched.fork_workers(RANK_MODULE, lambda *call: started.append(call) or "a worker")
    assert handler_class._popen is not own
    handler = object.__new__(handler_class)  # as torchrun's __init__ leaves it, without starting anything
    handler._stdout, handler._stderr = "out file", "err file"
    env = {"RANK": "1"}
    worker = handler._popen((sys.executable, "-u", "-m", RANK_MODULE, "lessons/x.py", "--steps", "3"), env)
    assert worker == "a worker"
    assert started == [(["lessons/x.py", "--steps", "3"], env, "out file", "err file")]
    patched.restore()
    assert handler_class._popen is own


def test_the_worker_start_guard_names_what_changed():
    class Handler:  # a torch whose worker start takes other arguments
        def __init__(self):
            self._stdout = self._stderr = None

        def _popen(self, argv, env, numa):
            pass

    problem = torchpatches.worker_start_problem(Handler)
    assert problem == "SubprocessHandler._popen takes (self, argv, env, numa), not (self, args, env)", problem

    class Quiet:  # one that no longer keeps the worker's output files
        def __init__(self):
            self.files = None

        def _popen(self, args, env):
            pass

    assert "no longer sets self._stdout and self._stderr" in torchpatches.worker_start_problem(Quiet)
    assert torchpatches.worker_start_problem(object) == "SubprocessHandler has no _popen"


# --------------------------------------------------------------------------- the rendezvous's event names


def test_the_rendezvous_names_its_events_as_torchs_own_get_method_name_does(patched):
    """The stand-in names the same function at every depth, and the same "no_method_name" past the stack."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    torchs = dynamic_rendezvous.get_method_name
    assert patched.rendezvous_name_problem(dynamic_rendezvous) is None
    assert patched.quicken_rendezvous()
    ours = dynamic_rendezvous.get_method_name
    assert ours is patched.get_method_name

    def record(name_of, depth):  # as torch calls it: from a method that records an event
        return name_of() if depth is None else name_of(depth)

    def next_rendezvous(name_of, depth):
        return record(name_of, depth)

    for depth in (None, 0, 1, 2, 3, 10_000):
        assert next_rendezvous(ours, depth) == next_rendezvous(torchs, depth), depth
    assert next_rendezvous(ours, None) == "next_rendezvous"
    assert ours(10_000) == "no_method_name"
    patched.restore()
    assert dynamic_rendezvous.get_method_name is torchs


def test_the_rendezvous_guard_names_what_changed():
    class Module:  # a torch whose get_method_name counts frames from elsewhere
        @staticmethod
        def get_method_name(depth=3):
            pass

    problem = torchpatches.rendezvous_name_problem(Module)
    assert problem == "get_method_name takes (depth=3), not (depth=2)", problem
    assert torchpatches.rendezvous_name_problem(object) == "dynamic_rendezvous has no get_method_name"


# --------------------------------------------------------------------------- TCPStore servers on one address


def listening_on(port):
    return sorted({address for state, address, local, *_ in own_tcp_sockets() if state == "LISTEN" and local == port})


def test_a_store_server_listens_on_the_address_given_alone(patched):
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    real = dist.TCPStore
    assert patched.store_problem(real) is None
    unbound = real("localhost", 0, 1, True, datetime.timedelta(seconds=30))
    assert listening_on(unbound.port) in (["0.0.0.0"], ["::"]), "torch's own server listens on every address"
    patched.bind_store_servers("127.0.0.1")
    assert dist.TCPStore is not real and c10d_rendezvous_backend.TCPStore is dist.TCPStore
    positional = dist.TCPStore("localhost", 0, 1, True, datetime.timedelta(seconds=30))  # as torchrun calls it
    keywords = dist.TCPStore(host_name="localhost", port=0, world_size=1, is_master=True)
    for store in (positional, keywords):
        assert listening_on(store.port) == ["127.0.0.1"], store.port
        store.set("key", "value")
        assert store.get("key") == b"value"
    client = dist.TCPStore("127.0.0.1", keywords.port, 1, False, datetime.timedelta(seconds=30))
    assert client.get("key") == b"value"  # clients are torch's own
    patched.restore()
    assert dist.TCPStore is real and c10d_rendezvous_backend.TCPStore is real


def test_the_store_guard_names_what_changed_and_refuses():
    class Store:
        def __init__(self, *args):
            pass

    Store.__init__.__doc__ = "__init__(self: TCPStore, host_name: str, port: int, is_master: bool = False) -> None"
    problem = torchpatches.store_problem(Store)
    assert problem.startswith("TCPStore takes (host_name, port, is_master), not (host_name, port, world_size"), problem
    said = torchpatches.changed("TCPStore", problem)
    assert f"as torch {torchpatches.WRITTEN_FOR} has it" in said and f"({torchpatches.torch_version()})" in said
    assert issubclass(torchpatches.TorchChanged, RuntimeError)


# --------------------------------------------------------------------------- one module


def _torch_names(tree):
    """The names a module binds to torch or a piece of it by importing."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    return names


def _root_name(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_no_other_module_of_lessonlib_changes_torch():
    """Assigning to (or setattr on) anything imported from torch happens in torchpatches.py alone, where each
    change has its guard. (A rank's own torch calls, such as torch.manual_seed, are not changes.) The one
    other place is the check's probe, which instruments a rank only under `python -m lessonlib check`, each
    wrapper calling torch's own function unchanged, and skips an instrument whose name torch no longer has."""
    found = []
    for path in sorted((ROOT / "lessonlib").rglob("*.py")):
        if path.name == "torchpatches.py" or path.relative_to(ROOT).as_posix() == "lessonlib/check/probe.py":
            continue
        tree = ast.parse(path.read_text())
        torch_names = _torch_names(tree)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for target in targets:
                if isinstance(target, ast.Attribute) and _root_name(target) in torch_names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}")
    assert found == [], f"changes to torch outside lessonlib/launcher/torchpatches.py: {found}"


def test_each_guard_is_documented_with_the_version_it_was_written_for():
    doc = inspect.getdoc(torchpatches)
    assert torchpatches.WRITTEN_FOR == "2.14.1" and "WRITTEN_FOR" in doc
    for name in (
        "fork_workers",
        "quicken_rendezvous",
        "bind_store_servers",
        "name_the_script",
        "skip_empty_compile_times",
        "keep_forks_cuda_free",
    ):
        assert f"`{name}`" in doc, name


# --------------------------------------------------------------------------- the program torchrun's report names


def test_torchruns_report_names_the_script_not_the_rank_wrapper(patched):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from torch.distributed.launcher import api

    torchs = api._get_entrypoint_name
    rank = ["-u", "-m", RANK_MODULE, "lessons/x.py", "--steps", "3"]
    assert patched.entrypoint_name_problem(api, RANK_MODULE) is None
    assert torchs(sys.executable, rank) == RANK_MODULE  # what the report said
    assert patched.name_the_script(RANK_MODULE)
    assert api._get_entrypoint_name(sys.executable, rank) == "lessons/x.py"
    legacy = ["-u", "-m", RANK_MODULE, "--local-rank=${local_rank}", "lessons/x.py"]  # torch.distributed.launch's
    assert api._get_entrypoint_name(sys.executable, legacy) == "lessons/x.py"
    for entrypoint, args in [
        (sys.executable, ["-u", "train.py", "--lr", "1"]),
        (sys.executable, ["-u", "-m", "some.module", "a.py"]),
        ("/usr/bin/env", ["a.py"]),
        (sys.executable, ["-u", "-m", RANK_MODULE]),
    ]:
        assert api._get_entrypoint_name(entrypoint, args) == torchs(entrypoint, args), (entrypoint, args)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="<N/A>")  # no such file: none read
    report = ChildFailedError(name=api._get_entrypoint_name(sys.executable, rank), failures={0: failure}).format_msg()
    assert "lessons/x.py FAILED" in report and RANK_MODULE not in report, report
    patched.restore()
    assert api._get_entrypoint_name is torchs


def test_the_report_name_guard_names_what_changed():
    def launch_agent(config, entrypoint, args):
        entrypoint_name = _get_entrypoint_name(entrypoint, args)
        raise RuntimeError(name=entrypoint_name)  # ChildFailedError( in torch's

    def _get_entrypoint_name(entrypoint, args):
        return next(arg for arg in args if not arg.startswith("-"))

    def with_config(entrypoint, args, config):
        pass

    def first_of(entrypoint, args):
        return args[0]

    def nameless(config, entrypoint, args):
        raise RuntimeError("the report names nothing")

    shape = torchpatches.entrypoint_name_problem
    assert shape(module(), RANK_MODULE) == "torch.distributed.launcher.api has no _get_entrypoint_name"
    api = module(_get_entrypoint_name=with_config, launch_agent=launch_agent)
    assert shape(api, RANK_MODULE) == "_get_entrypoint_name takes (entrypoint, args, config), not (entrypoint, args)"
    api = module(_get_entrypoint_name=first_of, launch_agent=launch_agent)
    assert shape(api, RANK_MODULE) == (
        f"_get_entrypoint_name names '-u' for `python -u -m {RANK_MODULE} SCRIPT`, not '{RANK_MODULE}'"
    )
    api = module(_get_entrypoint_name=_get_entrypoint_name, launch_agent=nameless)
    assert "launch_agent no longer names its failure report" in shape(api, RANK_MODULE)
    api = module(_get_entrypoint_name=_get_entrypoint_name, launch_agent=launch_agent)
    assert shape(api, RANK_MODULE) is None


# --------------------------------------------------------------------------- torch._dynamo's compile times at exit


def test_dynamos_exit_function_runs_only_where_something_compiled(patched, monkeypatch):
    """Swapped in atexit for torch's (atexit's own calls, seen on their way through), it calls torch's own
    only when compile times were recorded; restore() puts torch's back. (A forked rank's exit with and
    without a compile: tests/test_stack_folding.py.)"""
    import atexit

    from lessonlib.launcher.fastpath.forkrank import import_dynamo

    import_dynamo()  # as the agent does: no inductor cache folder or variable left to later tests' launches
    from torch._dynamo import utils

    calls = []
    for name in ("register", "unregister"):
        real = getattr(atexit, name)
        monkeypatch.setattr(atexit, name, lambda fn, _name=name, _real=real: calls.append((_name, fn)) or _real(fn))
    torchs = utils.dump_compile_times
    assert patched.compile_times_problem(utils) is None
    assert patched.skip_empty_compile_times() and patched.skip_empty_compile_times()  # twice: done once
    ours = utils.dump_compile_times
    assert ours is not torchs and calls == [("unregister", torchs), ("register", ours)], calls
    tabulated = []
    monkeypatch.setattr(utils, "compile_times", lambda **kw: tabulated.append(kw) or "")
    monkeypatch.setattr(utils, "compilation_time_metrics", {})
    ours()
    assert tabulated == [], "nothing compiled, yet torch's exit function ran"
    utils.compilation_time_metrics["_compile.compile_inner"] = [0.5]
    ours()
    assert tabulated == [{"repr": "str", "aggregate": True}]
    del calls[:]
    patched.restore()
    assert utils.dump_compile_times is torchs and calls == [("unregister", ours), ("register", torchs)], calls


def test_the_compile_times_guard_names_what_changed():
    import atexit

    @atexit.register
    def dump_compile_times():
        log(compile_times(repr="str", aggregate=True))

    atexit.unregister(dump_compile_times)

    def compile_times(repr="str", aggregate=False):
        return str(compilation_time_metrics)

    def unregistered():
        log(compile_times(repr="str", aggregate=True))

    def with_file(file):
        pass

    log, compilation_time_metrics = print, {}
    shape = torchpatches.compile_times_problem
    names = dict(dump_compile_times=dump_compile_times, compile_times=compile_times, compilation_time_metrics={})
    assert shape(module(**names)) is None
    assert shape(module()) == "torch._dynamo.utils has no dump_compile_times"
    assert shape(module(**{**names, "dump_compile_times": with_file})) == ("dump_compile_times takes (file), not ()")
    assert shape(module(**{**names, "compilation_time_metrics": []})) == (
        "torch._dynamo.utils has no dict compilation_time_metrics"
    )
    assert shape(module(**{**names, "dump_compile_times": unregistered})) == (
        "dump_compile_times is no longer registered with atexit where it is defined"
    )


def test_launch_config_asks_no_cuda_while_patched_and_torch_gets_its_function_back(patched, monkeypatch, tmp_path):
    """keep_forks_cuda_free: while LaunchConfig.__post_init__ runs, torch.accelerator.is_available answers
    False without being called; afterwards (and after restore) torch's own function is there again."""
    import tempfile

    import torch
    from torch.distributed.launcher import api

    # LaunchConfig() makes torchrun's torchelastic_* log folder as it is built: in this test's folder, not in /tmp.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    asked = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: asked.append(1) or True)
    own = torch.accelerator.is_available
    assert patched.launch_config_problem(api) is None
    assert patched.keep_forks_cuda_free()
    config = api.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2)
    assert asked == [] and config.numa_options is None
    assert torch.accelerator.is_available is own
    patched.restore()
    api.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2)
    assert asked == [1], "torch's own __post_init__ is back, and asks"


def test_the_launch_config_guard_names_what_changed():
    class Asks:
        def __post_init__(self):
            torch.accelerator.is_available()  # noqa: F821 - read, never run

    class Quiet:
        def __post_init__(self):
            pass

    shape = torchpatches.launch_config_problem
    assert shape(module(LaunchConfig=Asks)) is None
    assert shape(module()) == "torch.distributed.launcher.api has no LaunchConfig.__post_init__"
    assert shape(module(LaunchConfig=Quiet)) == (
        "LaunchConfig.__post_init__ no longer asks torch.accelerator.is_available()"
    )
