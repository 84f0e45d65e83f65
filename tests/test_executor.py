"""executor.py: the python_code_with_standard_io tool and its sandbox, run for real. The hostile
cases follow docs/design.md, "The sandbox: designs and hostile inputs" (A time ... J load); each
asserts the status the model sees and the containment. The namespace cases need root (CI's)."""
import json
import os
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from bench.executor import leak_counters, soak, stray_processes
from machinery.sandbox import SANDBOX_UID_BASE
from executor import ExecResult, Executor

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 2.0
# bounds that catch a hang, not a slow machine: 2 cores shared with other jobs stall for seconds
SLACK = 10.0
IS_ROOT = os.geteuid() == 0
# set before any Executor starts: it must never reach a snippet
os.environ["RSTAR2_TEST_SECRET"] = "hunter2"


@pytest.fixture(scope="module")
def ex():
    with Executor(workers=2, timeout_s=TIMEOUT, memory_mb=512, max_file_mb=8) as e:
        e.wait_ready()
        yield e


@pytest.fixture(scope="module")
def solo():
    """One slot: consecutive light calls land in the same warm worker."""
    with Executor(workers=1, timeout_s=TIMEOUT) as e:
        e.wait_ready()
        yield e


def worker_pids(e):
    return [w.proc.pid for slot in e._slots for w in slot if w.proc is not None]


def assert_contained(e):
    """Nothing of a call left running, no zombie, and a benign call still works."""
    assert stray_processes(e) == []
    assert leak_counters(e)[0] == 0
    for _ in range(3):   # a machine shared with other jobs can stall a benign call past the timeout
        after = e.run("print('next')")
        if after.status != "timeout":
            break
    assert after.stdout == "next\n", after


def run_hostile(e, code, status, stdin=""):
    start = time.monotonic()
    result = e.run(textwrap.dedent(code), stdin)
    wall = time.monotonic() - start
    assert result.status == status, result
    assert wall < TIMEOUT + SLACK, f"took {wall:.1f} s: {result}"
    assert_contained(e)
    return result


def uid_in_use(uid):
    return any(p.info["uids"] and p.info["uids"].real == uid
               for p in psutil.process_iter(["uids"]))


needs_root = pytest.mark.skipif(not IS_ROOT, reason="namespaces and the sandbox uid need root")


# -----------------------------------------------------------------------------
# the tool's behaviour: python_code_with_standard_io(code, input)


def test_runs_code_with_stdin_and_shows_a_final_expression_like_ipython(ex):
    code = 'print("""a"""\' b \\\\ {} {x} %s\')'   # never templated
    assert ex.run(code).stdout == "a b \\ {} {x} %s\n"
    assert ex.run("print(input())", '"""{}\\').stdout == '"""{}\\\n'
    result = ex.run("print(1 + 1)")
    assert (result.status, result.stdout, result.stderr, result.truncated, result.returncode) == (
        "ok", "2\n", "", False, 0)
    assert ex.run("x = 6\nx * 7").stdout == "42\n"
    # None is not shown, print's None neither
    assert ex.run("print(1)\nNone").stdout == "1\n"
    assert ex.run("'text'").stdout == "'text'\n"                        # a repr, not a str
    assert ex.run("a, b = map(int, input().split())\nprint(a * b)", "6 7").stdout == "42\n"
    assert (ex.run("import sys\nprint(sys.stdin.read().splitlines())", "l1\nl2\n").stdout
            == "['l1', 'l2']\n")
    sympy = ex.run("import sympy as sp\nx = sp.symbols('x')\nsp.factor(x**2 - 1)")
    assert (sympy.status, sympy.stdout) == ("ok", "(x - 1)*(x + 1)\n")


def test_exceptions_show_the_snippets_traceback_only(ex):
    result = ex.run("def f():\n    return 1 / 0\nf()")
    assert (result.status, result.returncode, result.reason) == ("error", 1, "exit status 1")
    assert result.stderr.startswith("Traceback (most recent call last):\n"
                                    "  File \"main.py\", line 3, in <module>")
    assert "    return 1 / 0\n" in result.stderr                          # the source line is shown
    assert result.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert "sandbox.py" not in result.stderr                              # no wrapper frames


def test_the_snippet_runs_as_a_script_named_main_in_an_empty_main_each_call(ex):
    ex.run("import sys\nleft_behind = 1\nsys.argv.append('x')\n"
           "sys.modules['__main__'].__dict__['also'] = 2")
    result = ex.run("import sys, os\nprint(__name__, __file__, sys.argv, os.listdir('.'))\n"
                    "def g(): pass\nimport pickle\nprint(len(pickle.dumps(g)) > 0)")
    assert result.stdout == "__main__ main.py ['main.py'] ['main.py']\nTrue\n"
    result = ex.run("import os, sys\nprint(sorted(k for k in globals() if not k.startswith('__')), "
                    "sys.argv)")
    assert result.stdout == "['os', 'sys'] ['main.py']\n", result


# -----------------------------------------------------------------------------
# ExecResult.tool_response: the text inside <tool_response>


def test_tool_response_matches_the_releases_wording():
    ok = ExecResult("ok", "2\n", "", 0.031, False)
    # byte for byte tests/reference/tool_turn_rendered_code.txt
    assert ok.tool_response() == "Tool call success\nstdout: 2\n\nexecution time: 0.03s"
    assert ok.tool_response(show_time=False) == "Tool call success\nstdout: 2\n"
    timeout = ExecResult("timeout", "", "TimeoutError: ...\n", 4.0, False, "wall-clock limit")
    assert timeout.tool_response(show_time=False) == ("Tool call failure\nreason: worker_timeout\n"
                                                      "stderr: TimeoutError: ...\n")
    error = ExecResult("error", "part\n", "Traceback ...\nNameError: x\n", 0.5, False)
    assert error.tool_response(show_time=False) == ("Tool call failure\nreason: \nstdout: part\n\n"
                                                    "stderr: Traceback ...\nNameError: x\n")
    assert (ExecResult("oom", "", "MemoryError\n", 0.1, False).tool_response(show_time=False)
            .startswith("Tool call failure\nreason: memory_limit\n"))


def test_each_stream_keeps_head_and_tail_at_max_output_chars(ex):
    result = ex.run("print('A' * 3000 + 'B' * 3000)")
    assert result.status == "ok" and result.truncated
    assert result.stdout == "A" * 500 + "...(truncated)..." + "B" * 499 + "\n"
    assert not ex.run("print('x' * 900)").truncated


def test_tool_responses_are_byte_identical_across_executors():
    """An RL resume needs the same tool text on a rerun."""
    code = ("import random, numpy as np, os, tempfile\nprint({'apple', 'pear', 'fig', 'kiwi'})\n"
            "print(random.random(), np.random.rand())\nprint(os.getcwd(), tempfile.gettempdir())\n"
            "{}['missing']")
    texts = []
    for _ in range(2):
        with Executor(workers=1, timeout_s=5) as e:
            texts.append(e.run(code).tool_response(max_chars=0, show_time=False))
    assert texts[0] == texts[1]
    assert "KeyError: 'missing'" in texts[0]


# -----------------------------------------------------------------------------
# A. time: the wall clock is the parent's, so nothing in the snippet can stop it


@pytest.mark.parametrize("code", [
    "while True:\n    pass",
    "import time\ntime.sleep(10**6)",
    "import re\nre.match('(a+)+$', 'a' * 40 + 'b')",                       # C code holding the GIL
    """
    import signal
    signal.alarm(0); signal.signal(signal.SIGALRM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        pass
    """,
    """
    while True:
        try:
            while True:
                pass
        except BaseException:
            pass
    """,
], ids=["cpu-loop", "sleep", "regex-backtracking", "alarm-and-sigterm-defused",
        "catch-everything"])
def test_time_hostile_snippets_time_out(ex, code):
    result = run_hostile(ex, code, "timeout")
    assert result.reason == "wall-clock limit"
    assert result.stderr.endswith(f"TimeoutError: the code ran longer than {TIMEOUT:g} s and was "
                                  "killed\n")
    assert TIMEOUT <= result.elapsed_s < TIMEOUT + SLACK


def test_time_spent_waiting_for_a_cpu_does_not_count(busy_machine):
    """The deadline moves out by the time a call waited for a CPU: ~0.25 s of CPU at timeout_s=1
    beside 24 busy processes on 2 cores takes ~3 s of wall time and is "ok"."""
    benign = "s = 0\nfor i in range(3_000_000):\n    s += i * i\nprint(s % 7)"
    with Executor(workers=2, timeout_s=1.0) as e:
        e.wait_ready()
        assert e.run(benign).status == "ok"
        with busy_machine(24):
            results = e.map([benign] * 2)
        assert [(r.status, r.stdout) for r in results] == [("ok", "5\n")] * 2, results


def test_a_call_that_makes_its_own_waits_is_cut_at_its_cpu_time():
    """The stretch is bounded by the CPU of all the call's processes: this snippet starves itself
    beside a busy child of its own on one CPU, and ends at timeout_s of CPU, not at the backstop."""
    starve = """
    import os
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if os.fork() == 0:
        while True:
            pass
    os.nice(10)
    while True:
        pass
    """
    with Executor(workers=1, timeout_s=0.5) as e:
        result = e.run(textwrap.dedent(starve))
        assert result.status == "timeout" and result.reason == "cpu-time limit", result
        assert result.elapsed_s < 10 * 0.5  # the backstop: 20 x 0.5 s
        assert_contained(e)


def test_limits_are_hard_so_the_snippet_cannot_raise_them(ex):
    code = """
    import resource
    for limit in (resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_NPROC,
                  resource.RLIMIT_FSIZE):
        try:
            resource.setrlimit(limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            print("raised")
        except (ValueError, OSError):
            print("refused")
    """
    assert run_hostile(ex, code, "ok").stdout == "refused\n" * 4


def test_a_slow_call_does_not_block_the_others(ex):
    slow = ex.submit("import time\ntime.sleep(1.8)\nprint('slow')")
    for i in range(5):
        assert ex.submit(f"print({i})").result().stdout == f"{i}\n"
        assert not slow.done()
    assert slow.result().stdout == "slow\n"


# -----------------------------------------------------------------------------
# B. memory


@pytest.mark.parametrize("code", ["x = bytearray(10**11)", "x = 'x' * 10**11", "x = [0] * 10**10",
                                  "import numpy as np\nnp.zeros((10**5, 10**5))",
                                  "import numpy as np\nchunks = []\nwhile True:\n"
                                  "    chunks.append(np.zeros(10**7))"],
                         ids=["bytearray", "str", "list", "numpy", "slow-growth"])
def test_memory_bombs_are_oom(ex, code):
    result = run_hostile(ex, code, "oom")
    assert "MemoryError" in result.stderr and result.reason == "memory limit"


def test_memory_up_to_the_limit_works(ex):
    """memory_mb (512 here) is address space on top of the worker's own: a 400 MB mapping fits."""
    code = ("import mmap\nm = mmap.mmap(-1, 400 * 2**20)\nm[-1:] = b'x'\n"
            "x = bytearray(50 * 2**20)\nprint(len(m) >> 20)")
    assert run_hostile(ex, code, "ok").stdout == "400\n"


def test_a_crash_in_c_is_an_error_naming_the_signal(ex):
    result = run_hostile(ex, "import ctypes\nctypes.string_at(0)", "error")
    assert (result.returncode, result.reason) == (-11, "signal SIGSEGV")
    assert result.stderr.endswith("Killed by signal 11 (SIGSEGV)\n")


def test_deep_recursion_is_contained(ex):
    result = ex.run("import sys\nsys.setrecursionlimit(10**6)\n"
                    "def f(n):\n    return f(n + 1)\nf(0)")
    assert result.status in ("error", "timeout", "oom")
    assert_contained(ex)


# -----------------------------------------------------------------------------
# C. processes: nothing a call starts outlives it


@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "import subprocess\nsubprocess.run(['sh', '-c', 'f() { f | f & }; f'])",
    "import multiprocessing\nmultiprocessing.Pool(1000)",
], ids=["os-fork-bomb", "shell-fork-bomb", "pool-1000"])
def test_fork_bombs_are_bounded_and_swept(ex, code):
    """RLIMIT_NPROC makes forks fail; the snippet's status is its business, nothing survives it."""
    start = time.monotonic()
    assert ex.run(code).status in ("timeout", "error", "ok")
    assert time.monotonic() - start < TIMEOUT + SLACK
    assert_contained(ex)


@pytest.mark.parametrize("code", [
    """
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(100)       # a daemon: setsid + double fork escapes a process-group kill
        os._exit(0)
    print('parent done')
    """,
    "import subprocess\nsubprocess.Popen(['sleep', '100'], start_new_session=True)\n"
    "print('parent done')",
    "import os, time\nif os.fork() == 0:\n    time.sleep(100)\nprint('parent done')",
], ids=["setsid-double-fork", "popen-new-session", "plain-orphan"])
def test_orphans_and_escapees_die_with_the_call(ex, code):
    # "ok": the call ended with its main process, not with the one that sleeps
    assert run_hostile(ex, code, "ok").stdout == "parent done\n"


def test_blas_and_openmp_run_single_threaded(ex):
    code = ("import os\nprint([os.environ[k] for k in "
            "('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS')])")
    assert ex.run(code).stdout == "['1', '1', '1']\n"


# -----------------------------------------------------------------------------
# D. output: read with a cap while it streams


def test_runaway_output_is_stopped_at_once_and_memory_stays_flat(ex):
    rss_before = int(Path("/proc/self/statm").read_text().split()[1])
    for code in ("while True:\n    print('x' * 10**6)",
                 "import os\nwhile True:\n    os.write(2, b'e' * 65536)"):
        result = run_hostile(ex, code, "error")
        assert result.reason == "output limit" and result.elapsed_s < TIMEOUT
        assert result.stderr.endswith("OutputLimitError: the code wrote more than 16 MiB and was "
                                      "killed\n")
        assert len(result.stdout) <= 1000 + len("...(truncated)...")
    assert (int(Path("/proc/self/statm").read_text().split()[1]) - rss_before) * 4096 < 50 << 20


def test_binary_and_control_characters_never_break_the_executor(ex):
    result = run_hostile(ex, "import sys, os\nsys.stdout.buffer.write(b'\\xff\\xfe' * 10 + b'ok')\n"
                             "n = os.write(2, b'\\x00\\x1b[31m\\r')", "ok")
    assert result.stdout == "\ufffd" * 20 + "ok" and result.stderr == "\x00\x1b[31m\r"


def test_printed_markers_cannot_spoof_the_status(ex):
    result = ex.run("print('Tool call success')\nprint('@@E execution time: 0.00s')\n"
                    "raise SystemExit(2)")
    assert (result.status, result.returncode) == ("error", 2)
    assert result.tool_response(show_time=False).startswith("Tool call failure\nreason: \n"
                                                            "stdout: Tool call success")


# -----------------------------------------------------------------------------
# E. filesystem


def test_disk_fill_stops_at_the_file_size_limit(ex):
    code = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'0' * 2**20)"
    assert "File too large" in run_hostile(ex, code, "error").stderr
    many = ("import os\nfor i in range(10**4):\n    with open(f'/tmp/f{i}', 'wb') as f:\n"
            "        f.write(b'0' * 2**20)")
    # /tmp is a small private tmpfs
    assert "No space left on device" in run_hostile(ex, many, "error").stderr


@needs_root
def test_nothing_persists_between_calls_in_the_same_worker(solo):
    write = """
    import os
    for path in ['here.txt', '/tmp/t', '/var/tmp/v', '/dev/shm/s', '/run/lock/l',
                 os.path.expanduser('~/.cache/c')]:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        open(path, 'w').write('x')
    print(sorted(os.listdir('.')))
    """
    look = ("import os\nprint(sorted(os.listdir('.')), "
            "[sorted(os.listdir(d)) for d in ('/tmp', '/var/tmp', '/dev/shm', '/run/lock')])")
    assert solo.run(textwrap.dedent(write)).stdout == "['.cache', 'here.txt', 'main.py']\n"
    assert (solo.run(look).stdout
            == f"['main.py'] [{sorted(['sandbox'] + venv_roots(solo))}, [], [], []]\n")


def venv_roots(e):
    """The road to a venv under /tmp (a CI clone), bound back into the private /tmp."""
    return sorted({k.split("/")[2] for k in e.isolation["kept_paths"] if k.startswith("/tmp/")})


# calls that change what they were given: the next call still gets a fresh directory and main.py
SWAPS = {
    "main.py replaced, mode 000": "import os\nos.unlink('main.py')\n"
                                  "open('main.py', 'w').write('x')\nos.chmod('main.py', 0)",
    "the call's directory replaced by a file": "import os\nos.chdir('/tmp')\n"
                                               "os.unlink('sandbox/main.py')\n"
                                               "os.rmdir('sandbox')\n"
                                               "open('/tmp/sandbox', 'w').write('x')",
    "an extended attribute on the call's directory": "import os\nos.setxattr('.', 'user.note', "
                                                     "b'x' * 64)",
}


@needs_root
@pytest.mark.parametrize("swap", SWAPS)
def test_nothing_persists_when_a_call_swaps_what_it_was_given(solo, swap):
    assert solo.run(SWAPS[swap]).status == "ok"
    look = ("import os\nprint(sorted(os.listdir('.')), sorted(os.listdir('/tmp')), "
            "os.listdir('/dev/shm'), os.listxattr('.'), "
            "oct(os.stat('main.py').st_mode), os.path.isfile('main.py'))")
    assert (solo.run(look).stdout
            == f"['main.py'] {sorted(['sandbox'] + venv_roots(solo))} [] [] 0o100644 True\n")


@needs_root
def test_paths_outside_the_call_directory_are_read_only(ex):
    code = f"""
    import os, sys
    for path in ['/escape', '{REPO}/escape', '/usr/local/escape', sys.executable, os.__file__,
                 '/bin/sh', '/etc/passwd']:
        try:
            open(path, 'a').write('x')
            print('WROTE', path)
        except OSError as e:
            print(type(e).__name__)
    """
    result = run_hostile(ex, code, "ok")
    assert "WROTE" not in result.stdout and len(result.stdout.splitlines()) == 7
    assert not (REPO / "escape").exists() and not Path("/escape").exists()


@needs_root
def test_the_answer_key_the_repo_and_home_are_hidden(ex):
    code = f"""
    import os
    print(os.listdir('{REPO}'), os.listdir('{REPO}/.venv') != [],
          os.listdir(os.path.expanduser('~root')))
    for path in ['{REPO}/data/aime25.jsonl', '{REPO}/executor.py', '/root/.ssh/id_rsa',
                 '/root/.bash_history']:
        print(os.path.exists(path))
    """
    assert run_hostile(ex, code, "ok").stdout == "['.venv'] True ['.pyenv']\n" + "False\n" * 4


@needs_root
def test_secrets_never_reach_the_snippet(ex):
    code = """
    import os
    # started clean
    print('RSTAR2_TEST_SECRET' in os.environ, 'hunter2' in open('/proc/self/environ').read())
    try:
        print(open('/proc/1/environ').read())
    except OSError as e:
        print(type(e).__name__)
    pids = [p for p in os.listdir('/proc') if p.isdigit()]
    print('pytest' in ' '.join(open(f'/proc/{p}/cmdline').read() for p in pids),
          os.environ['CUDA_VISIBLE_DEVICES'] == '')
    """
    assert run_hostile(ex, code, "ok").stdout == "False False\nPermissionError\nFalse True\n"


# -----------------------------------------------------------------------------
# F. network and IPC


@needs_root
def test_no_network_not_even_the_hosts_loopback(ex):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = f"""
    import socket
    for address in [('1.1.1.1', 80), ('127.0.0.1', {port})]:
        try:
            socket.create_connection(address, timeout=1)
            print('connected')
        except OSError as e:
            print(e.strerror)
    try:
        socket.getaddrinfo('example.com', 80)
    except OSError:
        print('no dns')
    """
    assert (run_hostile(ex, code, "ok").stdout
            == "Network is unreachable\nNetwork is unreachable\nno dns\n")
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


# -----------------------------------------------------------------------------
# G. attacks on the caller, the workers and the host


@pytest.mark.parametrize("code", [
    "import os\nos.kill(os.getppid(), 9)\nprint('alive')",
    "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('alive')",
    "import os\nos.killpg(0, 9)",
    "import ctypes\nctypes.CDLL(None).kill(1, 9)\nimport posix\nposix.kill(1, 15)\nprint('alive')",
    """
    import os
    for pid in os.listdir('/proc'):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
    print('alive')
    """,
], ids=["kill-parent", "kill-minus-one", "killpg-own-group", "ctypes-and-posix", "kill-every-pid"])
def test_signals_cannot_reach_the_caller_or_the_workers(ex, code):
    pids = worker_pids(ex)
    result = ex.run(textwrap.dedent(code))
    assert result.status in ("ok", "error", "timeout")   # the snippet's fate is its own business
    assert worker_pids(ex) == pids            # no worker died or was replaced
    assert_contained(ex)


def test_a_worker_killed_from_outside_is_replaced(ex):
    light = ex._slots[0][0].proc
    light.kill()
    light.wait()
    time.sleep(0.1)   # its PID 1 follows through PDEATHSIG
    results = ex.map(["print('after')"] * 4)
    assert {r.stdout for r in results} == {"after\n"}
    assert ex._slots[0][0].proc.pid != light.pid
    assert_contained(ex)


@needs_root
def test_gpu_device_nodes_are_masked(tmp_path):
    """A fake /dev with NVIDIA and AMD nodes, in a helper's mount namespace: all masked."""
    script = f"""
    import os, sys, json
    sys.path.insert(0, {str(REPO)!r})
    from executor import Executor
    from machinery import sandbox
    sandbox._unshare(sandbox.CLONE_NEWNS)
    sandbox._mount(None, "/", None, sandbox.MS_REC | sandbox.MS_PRIVATE)
    fake = {str(tmp_path)!r}
    sandbox._mount("tmpfs", fake, "tmpfs", 0, "mode=755")
    for name, major, minor in [("null", 1, 3), ("zero", 1, 5), ("urandom", 1, 9),
                               ("nvidia0", 195, 0), ("nvidiactl", 195, 255), ("kfd", 238, 0)]:
        os.mknod(f"{{fake}}/{{name}}", 0o20666, os.makedev(major, minor))
    os.makedirs(f"{{fake}}/dri")
    os.mknod(f"{{fake}}/dri/renderD128", 0o20666, os.makedev(226, 128))
    os.makedirs(f"{{fake}}/shm")
    sandbox._mount(fake, "/dev", None, sandbox.MS_BIND)
    with Executor(workers=1) as e:
        r = e.run("import os\\nprint([os.stat('/dev/' + n).st_rdev == os.stat('/dev/null').st_rdev "
                  "for n in ('nvidia0', 'nvidiactl', 'kfd')], os.listdir('/dev/dri'))")
        print(json.dumps([r.stdout, e.isolation["gpu_devices_masked"]]))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                         text=True, timeout=120)
    stdout, masked = json.loads(out.stdout.splitlines()[-1])
    assert stdout == "[True, True, True] []\n"
    assert masked == ["/dev/dri", "/dev/kfd", "/dev/nvidia0", "/dev/nvidiactl"]


# -----------------------------------------------------------------------------
# H. exit status, reported faithfully


@pytest.mark.parametrize("code,status,returncode,stderr", [
    ("import sys\nsys.exit(3)", "error", 3, ""),
    ("exit()", "ok", 0, ""),
    ("import sys\nsys.exit('bad input')", "error", 1, "bad input\n"),
    # os._exit skips the flush, as in python
    ("print('lost')\nimport os\nos._exit(0)", "ok", 0, ""),
    # rebinding print does not break the display
    ("print = None\n1 + 1", "ok", 0, ""),
    ("import sys, os\nsys.stdout = open(os.devnull, 'w')\nprint('hidden')", "ok", 0, ""),
])
def test_exit_codes(ex, code, status, returncode, stderr):
    result = ex.run(code)
    assert (result.status, result.returncode, result.stderr) == (status, returncode, stderr)
    assert result.stdout == ("2\n" if "1 + 1" in code else "")


# -----------------------------------------------------------------------------
# I. input and encoding


@pytest.mark.parametrize("code,error", [
    ("input()", "EOFError: EOF when reading a line\n"),
    ("int a = 1", "SyntaxError: invalid syntax\n"),
    ("x = (" * 3 + "\n", "SyntaxError: '(' was never closed\n"),
    ("print(1)\x00", "source code string cannot contain null bytes\n"),
    ("print(str(10**5000))",
     "ValueError: Exceeds the limit (4300 digits) for integer string conversion; "
     "use sys.set_int_max_str_digits() to increase the limit\n"),
], ids=["eof", "c-syntax", "unclosed", "nul-byte", "int-str-limit"])
def test_bad_snippets_are_errors_with_pythons_message(ex, code, error):
    result = ex.run(code)
    assert result.status == "error" and result.stderr.endswith(error), result


def test_parser_bombs_and_huge_code_are_contained(ex):
    assert ex.run("(" * 10**6).status == "error"
    # a 1 MB snippet
    assert ex.run("x = '" + "a" * 10**6 + "'\nprint(len(x))").stdout == "1000000\n"
    assert_contained(ex)


def test_bad_arguments_name_the_problem():
    with Executor(workers=1) as e:
        with pytest.raises(TypeError, match="code must be a str, got bytes"):
            e.submit(b"print(1)")
        with pytest.raises(TypeError, match="stdin must be a str, got NoneType"):
            e.submit("print(1)", None)
        with pytest.raises(ValueError, match="2 codes but 1 stdins"):
            e.map(["1", "2"], [""])
    with pytest.raises(RuntimeError, match="closed"):
        e.submit("print(1)")


# -----------------------------------------------------------------------------
# J. load, lifecycle, soak


def test_a_burst_returns_every_result_in_order_without_cross_talk(ex):
    codes = [f"import sys\nprint({i}, sys.stdin.read())" for i in range(40)]
    stdins = [f"in{i}" for i in range(40)]
    assert [r.stdout for r in ex.map(codes, stdins)] == [f"{i} in{i}\n" for i in range(40)]


def test_starts_fast_and_close_leaves_nothing():
    start = time.monotonic()
    e = Executor(workers=2)
    # it waits for one light worker only, not the heavy ones
    assert time.monotonic() - start < SLACK
    # the light worker is up in a fraction of a second
    assert e.run("print('first')").stdout == "first\n"
    assert time.monotonic() - start < SLACK
    pids = worker_pids(e)
    queued = [e.submit("import time\ntime.sleep(5)") for _ in range(6)]
    time.sleep(0.3)
    e.close()
    assert sum(f.cancelled() for f in queued) >= 4        # the queued ones are cancelled, not run
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(
            Path(f"/proc/{p}").exists() or uid_in_use(SANDBOX_UID_BASE + p) for p in pids):
        # the namespaces are torn down asynchronously
        time.sleep(0.05)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()          # the workers are reaped, no zombies
        assert not uid_in_use(SANDBOX_UID_BASE + pid)     # and nothing of their calls runs on
    e.close()                                             # idempotent


def test_soak_1000_mixed_calls_leaks_nothing():
    """The short form of `python -m bench.executor mode=soak`, one call in ten hostile: no
    unexpected status, no zombie, no stray, no fd or memory growth."""
    with Executor(workers=2, timeout_s=TIMEOUT) as e:
        stats = soak(e, 1000)
    assert stats["wrong"] == [] and stats["benign_after"]
    # A benign call can still time out when the machine starves it past 20 x timeout_s: allowed,
    # but rare. Everything else must have exactly its status.
    assert stats["benign_timeouts"] <= stats["calls"] // 100, stats
    assert stats["zombies"] == 0 and stats["strays"] == 0
    assert stats["fds_after"] <= stats["fds_before"]
    assert stats["rss_mb_after"] <= stats["rss_mb_before"] + 20
    assert stats["statuses"]["timeout"] >= 10 and stats["statuses"]["oom"] >= 10


# -----------------------------------------------------------------------------
# isolation levels: what this machine reaches, and what a caller without root gets


@needs_root
def test_as_root_every_layer_is_in_place(ex):
    iso = ex.isolation
    assert iso["level"] == "namespaces" and iso["warnings"] == []
    assert all(iso[k] for k in ("pid_namespace", "private_proc", "readonly_mounts", "private_tmp"))
    assert iso["sandbox_uid"] >= SANDBOX_UID_BASE and str(REPO) in iso["hidden_paths"]


NON_ROOT_CHECKS = """
import json, os, sys, time
import psutil
sys.path.insert(0, REPO)
from executor import Executor
cases = {
    "timeout": "while True:\\n    pass",
    "escapee": "import subprocess\\nsubprocess.Popen(['sleep', '100'], start_new_session=True)\\n"
               "print('bye')",
    "flood": "while True:\\n    print('x' * 10**6)",
    "oom": "x = bytearray(10**11)",
    "repo": "import os\\nprint(os.path.exists(REPO + '/data/aime25.jsonl'))",
    "net": "import socket\\ntry:\\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\\n"
           "except OSError as e:\\n    print(e.strerror)",
    "kill_parent": "import os\\nos.kill(os.getppid(), 9)\\nprint('alive')",
}
with Executor(workers=1, timeout_s=2.0) as e:
    out = {name: e.run(code.replace("REPO", repr(REPO))) for name, code in cases.items()}
    def mine():   # live processes of this uid (init reaps orphaned zombies in its own time)
        return sum(p.info["uids"].real == os.getuid() and p.info["status"] != "zombie"
                   for p in psutil.process_iter(["uids", "status"]))
    # the least seen over 3 s: a process on its way out (a replaced worker) is not a stray
    fewest = min(mine() for _ in range(30) if time.sleep(0.1) is None)
    print(json.dumps({"isolation": e.isolation, "processes": fewest,
                      "results": {k: [v.status, v.stdout, v.reason] for k, v in out.items()}}))
"""


def run_as_nobody(tmp_path, chroot):
    """NON_ROOT_CHECKS as uid 65534, root's 0700 home covered, the interpreter bound back; chroot:
    no user namespaces either (the kernel refuses CLONE_NEWUSER to a chrooted process)."""
    checks = f"REPO = {str(REPO)!r}\n" + NON_ROOT_CHECKS
    launcher = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from executor import Executor
        from machinery import sandbox
        sandbox._unshare(sandbox.CLONE_NEWNS)
        sandbox._mount(None, "/", None, sandbox.MS_REC | sandbox.MS_PRIVATE)
        sandbox._hide_paths([], sandbox._keep_paths(), {{"hidden_paths": [], "warnings": []}})
        if {chroot}:
            sandbox._mount("/", {str(tmp_path)!r}, None, sandbox.MS_BIND | sandbox.MS_REC)
            os.chroot({str(tmp_path)!r})
        os.chdir("/tmp")
        os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
        os.execve(sys.executable, [sys.executable, "-c", {checks!r}],
                  {{"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}})
    """)
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@needs_root
def test_without_root_a_user_namespace_gives_the_same_containment(tmp_path):
    report = run_as_nobody(tmp_path, chroot=False)
    iso, results = report["isolation"], report["results"]
    assert (iso["level"] == "user-namespace" and iso["capabilities_dropped"]
            and iso["sandbox_uid"] is None)
    assert iso["pid_namespace"]
    assert (results["timeout"][0] == "timeout" and results["flood"][2] == "output limit"
            and results["oom"][0] == "oom")
    assert results["escapee"][:2] == ["ok", "bye\n"] and results["repo"][1] == "False\n"
    assert (results["net"][1] == "Network is unreachable\n"
            and results["kill_parent"][:2] == ["ok", "alive\n"])
    # this helper, and waiter + PID 1 for each of the two workers: no strays
    assert report["processes"] == 5


@needs_root
def test_without_any_namespace_the_executor_degrades_and_says_so(tmp_path):
    report = run_as_nobody(tmp_path, chroot=True)
    iso, results = report["isolation"], report["results"]
    assert iso["level"] == "process" and not iso["pid_namespace"]
    assert iso["warnings"] and iso["warnings"][0].startswith("no namespaces")
    assert (results["timeout"][0] == "timeout" and results["flood"][2] == "output limit"
            and results["oom"][0] == "oom")
    # the subreaper still catches the setsid escapee
    assert results["escapee"][:2] == ["ok", "bye\n"]
    assert report["processes"] == 3                    # this helper and its two workers: no strays


# -----------------------------------------------------------------------------
# the interpreter reached through a symlink, and a sandbox that cannot run calls

SYMLINKED_CHECKS = """
import json, sys
sys.path.insert(0, REPO)
from executor import Executor
with Executor(workers=1, timeout_s=10.0) as e:
    codes = ["print(1 + 1)", "import numpy\\nprint(numpy.arange(4).sum())",
             "import os, subprocess, sys\\nprint(os.path.exists(sys.executable), "
             "subprocess.run([sys.executable, '-c', 'import sys; print(sys.prefix)'], "
             "capture_output=True, text=True).stdout.strip())",
             "print(3)"]
    print(json.dumps([[r.status, r.stdout, r.stderr[-800:]] for r in map(e.run, codes)]))
"""


def run_through_link(python, cwd, home):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    out = subprocess.run([str(python), "-c", f"REPO = {str(REPO)!r}\n" + SYMLINKED_CHECKS], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("placement", ["tmp", "home", "venv-in-tmp"])
def test_an_interpreter_reached_through_a_symlink_works(tmp_path, placement):
    """The venv through a link the sandbox removes: in /tmp (also the cwd), in home, and a venv
    under /tmp finding its packages through a .pth line that is a link too."""
    venv = Path(os.path.realpath(sys.prefix))
    cwd, home = "/", tmp_path / "home"
    home.mkdir()
    if placement == "tmp":
        (tmp_path / "v").symlink_to(venv)
        link, cwd = tmp_path / "v", tmp_path
    elif placement == "home":
        (home / "v").symlink_to(venv)
        link = home / "v"
    else:
        subprocess.run([os.path.realpath(sys.executable), "-m", "venv", "--without-pip",
                        str(tmp_path / "real")], check=True, timeout=60)
        (tmp_path / "packages").symlink_to(sysconfig.get_paths()["purelib"])
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        (tmp_path / "real" / "lib" / version / "site-packages" / "packages.pth").write_text(
            f"{tmp_path / 'packages'}\n")
        (tmp_path / "v").symlink_to(tmp_path / "real")
        link = tmp_path / "v"
    results = run_through_link(link / "bin" / "python", cwd, home)
    # sys.executable runs in the sandbox too, as the same venv (its prefix, resolved)
    prefix = os.path.realpath(link)
    assert results == [["ok", "2\n", ""], ["ok", "6\n", ""], ["ok", f"True {prefix}\n", ""],
                       ["ok", "3\n", ""]]


def test_a_sandbox_that_cannot_run_calls_fails_at_construction_naming_why():
    """The interpreter's own site-packages hidden: every call would fail to import numpy, so
    Executor() raises and names the directory."""
    site_packages = sysconfig.get_paths()["purelib"]
    with pytest.raises(RuntimeError, match="could not set up its sandbox") as raised:
        Executor(workers=1, hide_paths=[site_packages])
    assert os.path.realpath(site_packages) in str(raised.value)
