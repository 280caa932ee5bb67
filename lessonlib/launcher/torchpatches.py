"""Every change lessonlib makes inside torch, in one place, each behind a guard (chapter 1, chapter 16).

All six run in the torchrun agent that `lessonlib.launch` starts (lessonlib.launcher._agent_main), never in a
lesson's own process (a forked rank inherits the agent's), and each replaces one name where torch looks it up:

- `fork_workers`: torch.distributed.elastic's `SubprocessHandler._popen`, the one step of torchrun that
  starts a worker. For a rank's exact command (`python -u -m lessonlib.launcher._rank_main ...`) it calls
  the function it is given instead (lessonlib.launcher.fastpath.forkrank forks the agent); anything else
  goes to torch's own. Everything else stays torchrun's: its environment for each rank, its watching,
  stopping, restarting and failure summary.
- `quicken_rendezvous`: the rendezvous's `get_method_name`, which names the method that records each
  rendezvous event with `inspect.stack()`: that looks up the source file and module of every frame,
  walking all of sys.modules for each (a few thousand modules once torch is imported), most of what a
  launch of a script that does nothing costs the agent. The replacement reads the same name from the
  frame itself.
- `bind_store_servers`: `TCPStore`, in the modules where torchrun, its rendezvous and init_process_group
  look it up (STORE_MODULES), replaced by a subclass whose server listens on one address. A TCPStore
  server listens on every address of the machine whatever host name it is given; on a laptop on a LAN,
  every lesson would accept connections from the LAN while it runs. The subclass binds a socket to the
  address (127.0.0.1 for a one-machine launch) and hands it to TCPStore (its own `master_listen_fd`);
  clients, and everything else, are unchanged. Ranks forked from the agent inherit it; a fresh rank (a
  machine with NVIDIA GPUs) does not, since importing torch before the lesson does would make it differ
  from what a plain torchrun starts.
- `name_the_script`: torchrun's `_get_entrypoint_name`, which names the program in its failure report
  (`ChildFailedError`: "... FAILED", then the root cause) and its start-up log. For a launch's ranks,
  `python -u -m lessonlib.launcher._rank_main SCRIPT ARGS`, torch's names the module; the replacement names
  SCRIPT (lessons/01_launch.py), what the reader ran and what a bare torchrun would have named.
- `skip_empty_compile_times`: torch._dynamo's exit function `dump_compile_times`, which `import
  torch._dynamo` registers with atexit. It tabulates the compile times (importing the `tabulate` package
  to do it) and logs the table at INFO, whether or not anything compiled. The agent imports torch._dynamo
  for its forked ranks (lessonlib.launcher.fastpath.forkrank), so every forked rank inherited it and ran
  it at exit, also in a rank that imported no torch._dynamo itself; a rank stopped by torchrun meanwhile
  printed a stack of `tabulate` frames. The replacement, registered in its place, runs torch's own only
  when something compiled (`compilation_time_metrics` not empty): the one case whose table has a row.
- `keep_forks_cuda_free`: torchrun's `LaunchConfig.__post_init__`, which asks
  `torch.accelerator.is_available()` to decide on NUMA binding. On a CUDA build of torch that asks the
  CUDA runtime, which marks the process: every process forked from it afterwards fails its first CUDA
  call with "Cannot re-initialize CUDA in forked subprocess". Ranks are forked only on a machine without
  NVIDIA devices (forkrank.wanted), where a script that wants a GPU must be told what a fresh process is
  told ("Found no NVIDIA driver on your system"). While it runs, the replacement answers False for
  `torch.accelerator.is_available`, the answer the CUDA runtime would give on such a machine; torch's own
  function is back before any rank starts.

The guards. Each patch was written for torch WRITTEN_FOR and relies on a shape of torch's code: a
function's parameters, an attribute's name, TCPStore's positional parameters (it takes them
positionally, and the subclass names them). Before it patches, each checks that shape in the installed
torch (`*_problem`, which say what changed, or None); the shape decides, not the version string, so a
later torch that keeps it gets the patch. When it changed:
- `fork_workers`, `quicken_rendezvous`, `name_the_script`, `skip_empty_compile_times` and
  `keep_forks_cuda_free` warn, naming both
  torch versions, and leave torch as it is: the ranks start as fresh processes, the rendezvous names its
  events the slow way, torchrun's report names lessonlib.launcher._rank_main, forked ranks tabulate empty
  compile times at exit; the run is the same.
- `bind_store_servers` raises TorchChanged, naming both versions: it keeps the stores off the network,
  and guessing which argument is which could bind the wrong address or none.

`restore()` puts torch's own names back, and its exit function in atexit (the unit tests patch and
restore in their own process).
"""

import atexit
import inspect
import socket
import sys
import warnings

WRITTEN_FOR = "2.14.1"  # the torch these patches were written against (requirements.txt pins it)
# TCPStore's parameters, in order, as torch 2.14.1 takes them positionally.
STORE_PARAMETERS = (
    "host_name",
    "port",
    "world_size",
    "is_master",
    "timeout",
    "wait_for_workers",
    "multi_tenant",
    "master_listen_fd",
    "use_libuv",
)
STORE_MODULES = (  # where torchrun, its rendezvous and init_process_group look TCPStore up
    "torch.distributed",
    "torch.distributed.rendezvous",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
)

_originals = {}  # (module or class, name) -> torch's own object, for restore()
_exit_functions = []  # (torch's, ours): ours registered with atexit in place of torch's, for restore()


class TorchChanged(RuntimeError):
    """The installed torch no longer has what a patch relies on; the message names both versions."""


def torch_version():
    import torch

    return torch.__version__


def changed(what, problem):
    """The sentence a guard says: what it patches, what changed, and which torch each is."""
    return (
        f"lessonlib patches {what} as torch {WRITTEN_FOR} has it, but this torch ({torch_version()}) differs: {problem}"
    )


def _replace(owner, name, value):
    _originals.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def restore():
    """Put back every name a patch replaced (torch's own objects), and torch's exit functions in atexit."""
    while _exit_functions:
        torchs, ours = _exit_functions.pop()
        atexit.unregister(ours)
        atexit.register(torchs)
    while _originals:
        (owner, name), original = _originals.popitem()
        setattr(owner, name, original)


# --------------------------------------------------------------------------- the workers torchrun starts


def worker_start_problem(handler_class):
    """What differs from 2.14.1's SubprocessHandler that fork_workers relies on, or None: `_popen(self, args,
    env)` starts the worker, and `__init__` keeps the worker's output files as `_stdout` and `_stderr`."""
    popen = getattr(handler_class, "_popen", None)
    if popen is None:
        return "SubprocessHandler has no _popen"
    params = list(inspect.signature(popen).parameters)
    if params != ["self", "args", "env"]:
        return f"SubprocessHandler._popen takes ({', '.join(params)}), not (self, args, env)"
    try:
        source = inspect.getsource(handler_class.__init__)
    except (OSError, TypeError):
        return "SubprocessHandler.__init__'s source cannot be read to find its output files"
    missing = [attr for attr in ("self._stdout", "self._stderr") if attr not in source]
    if missing:
        return f"SubprocessHandler.__init__ no longer sets {' and '.join(missing)}"
    return None


def fork_workers(module, start):
    """Have torchrun call `start(args, env, stdout, stderr)` instead of starting `python -u -m MODULE ARGS`
    (a rank), and return True; or warn and return False (torch left as it is) when the guard finds torch
    changed. `start` returns what torchrun uses of a worker's Popen (pid, poll, wait, returncode)."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    if problem := worker_start_problem(handler):
        warnings.warn(changed("SubprocessHandler._popen", problem) + "; every rank starts fresh", stacklevel=2)
        return False
    original = _originals.get((handler, "_popen"), handler._popen)
    command = ["-u", "-m", module]

    def _popen(self, args, env):
        if len(args) > 4 and args[0] == sys.executable and list(args[1:4]) == command:
            return start(list(args[4:]), env, self._stdout, self._stderr)
        return original(self, args, env)

    _replace(handler, "_popen", _popen)
    return True


# --------------------------------------------------------------------------- the rendezvous's event names


def get_method_name(depth=2):
    """torch's dynamic_rendezvous.get_method_name: the function `depth` frames up from this one (its
    caller's caller by default), or "no_method_name" when the stack is not that deep; without
    inspect.stack(), which also reads each frame's source file and searches sys.modules for its module."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def rendezvous_name_problem(dynamic_rendezvous):
    """What differs from 2.14.1's `dynamic_rendezvous.get_method_name(depth=2)`, or None."""
    fn = _originals.get((dynamic_rendezvous, "get_method_name"), getattr(dynamic_rendezvous, "get_method_name", None))
    if fn is None:
        return "dynamic_rendezvous has no get_method_name"
    params = inspect.signature(fn).parameters
    if list(params) != ["depth"] or params["depth"].default != 2:
        return f"get_method_name takes {inspect.signature(fn)}, not (depth=2)"
    return None


def quicken_rendezvous():
    """Replace the rendezvous's get_method_name with the frame-reading one; True, or warn and False."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if problem := rendezvous_name_problem(dynamic_rendezvous):
        warnings.warn(changed("dynamic_rendezvous.get_method_name", problem) + "; left as it is", stacklevel=2)
        return False
    _replace(dynamic_rendezvous, "get_method_name", get_method_name)
    return True


# --------------------------------------------------------------------------- TCPStore servers on one address


def store_parameters(store_class):
    """TCPStore's constructor parameters, in order, from the signature pybind11 writes in its docstring."""
    doc = (store_class.__init__.__doc__ or "").strip().splitlines()
    head = doc[0] if doc else ""
    if not head.startswith("__init__(") or ")" not in head:
        return ()
    inside, depth, parts, word = head[len("__init__(") :], 0, [], ""
    for ch in inside:  # split on the commas outside brackets: a default like timedelta(seconds=300) has some
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(word)
            word = ""
        else:
            word += ch
    parts.append(word)
    names = tuple(p.split(":")[0].split("=")[0].strip() for p in parts)
    return names[1:] if names and names[0] == "self" else names


def store_problem(store_class):
    """What differs from 2.14.1's TCPStore positional parameters, or None."""
    found = store_parameters(store_class)
    if found != STORE_PARAMETERS:
        return f"TCPStore takes ({', '.join(found) or 'unreadable'}), not ({', '.join(STORE_PARAMETERS)})"
    return None


def listen_socket(address, port):
    """A TCP socket listening on (address, port), port 0 for any; SO_REUSEADDR, as TCPStore's own are."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def bind_store_servers(address):
    """Make every TCPStore server made from now on in this process listen on `address` alone. TorchChanged
    when torch's TCPStore no longer takes what the subclass passes it."""
    import importlib

    import torch.distributed as dist

    real = _originals.get((dist, "TCPStore"), dist.TCPStore)
    if problem := store_problem(real):
        raise TorchChanged(changed("TCPStore", problem) + "; its servers would not stay on " + address)

    class TCPStore(real):
        def __init__(self, *args, **kwargs):
            kwargs.update(zip(STORE_PARAMETERS, args))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                try:
                    sock = listen_socket(address, int(kwargs.get("port") or 0))
                except OSError as e:
                    # As TCPStore's own server fails: torchrun's rendezvous, when two agents on one machine
                    # both try to host it, catches this and joins the other's store as a client.
                    raise dist.DistNetworkError(f"TCPStore server on {address}:{kwargs.get('port')}: {e}") from e
                kwargs["port"] = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns it from here
            super().__init__(**kwargs)

    TCPStore.__qualname__ = TCPStore.__name__ = "TCPStore"
    TCPStore.__module__ = real.__module__
    for name in STORE_MODULES:
        module = sys.modules.get(name) or importlib.import_module(name)
        if getattr(module, "TCPStore", None) is not None:
            _replace(module, "TCPStore", TCPStore)


# --------------------------------------------------------------------------- the program torchrun's report names


def entrypoint_name_problem(api, module):
    """What differs from 2.14.1's `torch.distributed.launcher.api` that name_the_script relies on, or None:
    `_get_entrypoint_name(entrypoint, args)` names `module` for `python -u -m MODULE SCRIPT`, and
    `launch_agent` hands its name to ChildFailedError."""
    fn = _originals.get((api, "_get_entrypoint_name"), getattr(api, "_get_entrypoint_name", None))
    if fn is None:
        return "torch.distributed.launcher.api has no _get_entrypoint_name"
    params = list(inspect.signature(fn).parameters)
    if params != ["entrypoint", "args"]:
        return f"_get_entrypoint_name takes ({', '.join(params)}), not (entrypoint, args)"
    try:
        named = fn(sys.executable, ["-u", "-m", module, "lessons/x.py"])
    except Exception as e:  # noqa: BLE001 - any failure is a change to report
        return f"_get_entrypoint_name(python, [-u, -m, {module}, SCRIPT]) raises {type(e).__name__}: {e}"
    if named != module:
        return f"_get_entrypoint_name names {named!r} for `python -u -m {module} SCRIPT`, not {module!r}"
    try:
        source = inspect.getsource(api.launch_agent)
    except (AttributeError, OSError, TypeError):
        return "launch_agent's source cannot be read to find the name its failure report gives"
    if "_get_entrypoint_name(" not in source or "name=entrypoint_name" not in source:
        return "launch_agent no longer names its failure report (ChildFailedError) with _get_entrypoint_name"
    return None


def name_the_script(module):
    """Have torchrun's failure report name SCRIPT for a rank command `python -u -m MODULE SCRIPT ARGS` (the
    deprecated launcher's `--local-rank=N` before SCRIPT skipped, as any option), and return True; or warn
    and return False when the guard finds torch changed."""
    from torch.distributed.launcher import api

    if problem := entrypoint_name_problem(api, module):
        warnings.warn(changed("_get_entrypoint_name", problem) + "; its report names the module", stacklevel=2)
        return False
    original = _originals.get((api, "_get_entrypoint_name"), api._get_entrypoint_name)
    command = ["-u", "-m", module]

    def _get_entrypoint_name(entrypoint, args):
        args = list(args)
        if entrypoint == sys.executable and args[:3] == command:
            script = next((arg for arg in args[3:] if not str(arg).startswith("-")), None)
            if script is not None:
                return script
        return original(entrypoint, args)

    _replace(api, "_get_entrypoint_name", _get_entrypoint_name)
    return True


# --------------------------------------------------------------------------- torch._dynamo's compile times at exit


def compile_times_problem(utils):
    """What differs from 2.14.1's `torch._dynamo.utils` that skip_empty_compile_times relies on, or None:
    `dump_compile_times()` registered with atexit where it is defined, and its table made from the dict
    `compilation_time_metrics`, empty until something compiled."""
    fn = _originals.get((utils, "dump_compile_times"), getattr(utils, "dump_compile_times", None))
    if fn is None:
        return "torch._dynamo.utils has no dump_compile_times"
    if inspect.signature(fn).parameters:
        return f"dump_compile_times takes {inspect.signature(fn)}, not ()"
    if not isinstance(getattr(utils, "compilation_time_metrics", None), dict):
        return "torch._dynamo.utils has no dict compilation_time_metrics"
    try:
        source, table = inspect.getsource(fn), inspect.getsource(utils.compile_times)
    except (AttributeError, OSError, TypeError):
        return "the sources of dump_compile_times and compile_times cannot be read"
    if "@atexit.register" not in source:
        return "dump_compile_times is no longer registered with atexit where it is defined"
    if "compile_times(" not in source or "compilation_time_metrics" not in table:
        return "dump_compile_times no longer logs a table of compilation_time_metrics (compile_times)"
    return None


def skip_empty_compile_times():
    """Have the exit function torch._dynamo registered run only when something compiled (imports
    torch._dynamo), and return True; or warn and return False when the guard finds torch changed."""
    from torch._dynamo import utils

    if problem := compile_times_problem(utils):
        warnings.warn(changed("dump_compile_times", problem) + "; every rank runs it at exit", stacklevel=2)
        return False
    if (utils, "dump_compile_times") in _originals:
        return True  # done already: torch's own is no longer registered
    torchs = utils.dump_compile_times

    def dump_compile_times():
        if utils.compilation_time_metrics:
            torchs()

    atexit.unregister(torchs)
    atexit.register(dump_compile_times)
    _exit_functions.append((torchs, dump_compile_times))
    _replace(utils, "dump_compile_times", dump_compile_times)
    return True


# --------------------------------------------------------------------------- no CUDA call in the agent that forks


def launch_config_problem(api):
    """What differs from 2.14.1's LaunchConfig that keep_forks_cuda_free relies on, or None: its
    `__post_init__` calls `torch.accelerator.is_available()` (the one CUDA call torchrun makes before
    starting the workers)."""
    config = getattr(api, "LaunchConfig", None)
    post_init = _originals.get((config, "__post_init__"), getattr(config, "__post_init__", None))
    if post_init is None:
        return "torch.distributed.launcher.api has no LaunchConfig.__post_init__"
    try:
        source = inspect.getsource(post_init)
    except (OSError, TypeError):
        return "LaunchConfig.__post_init__'s source cannot be read"
    if "torch.accelerator.is_available()" not in source:
        return "LaunchConfig.__post_init__ no longer asks torch.accelerator.is_available()"
    return None


def keep_forks_cuda_free():
    """Have LaunchConfig.__post_init__ see `torch.accelerator.is_available()` answer False without asking
    the CUDA runtime, and return True; or warn and return False when the guard finds torch changed. Only
    for an agent that forks its ranks (no NVIDIA devices: lessonlib.launcher.fastpath.forkrank)."""
    import torch
    from torch.distributed.launcher import api

    if problem := launch_config_problem(api):
        warnings.warn(changed("LaunchConfig.__post_init__", problem), stacklevel=2)
        return False
    config = api.LaunchConfig
    original = _originals.get((config, "__post_init__"), config.__post_init__)

    def __post_init__(self):
        accelerator = torch.accelerator
        asks = accelerator.is_available
        accelerator.is_available = lambda: False  # no NVIDIA device here: what CUDA would answer
        try:
            original(self)
        finally:
            accelerator.is_available = asks

    _replace(config, "__post_init__", __post_init__)
    return True
