"""How a script ends (run_script): bad input, a lost peer or a stalled job (watch_progress) in one
line, an interrupt in a paragraph with the command that resumes. Where a rank is (WHERE) is kept on
disk while rl.py runs, so the next attempt sees a crash that repeats (crash_loop)."""
import atexit
import faulthandler
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from tqdm import tqdm

from machinery.config import ConfigError, read_records

# The signals this process received: after one, an error is its echo, not a bug to show.
RECEIVED = []

# Where this process is: the step and its prompts (rl.py), the phase (metrics.timed), and `record`,
# the file that keeps them on disk (rl_run.py; None: nowhere).
WHERE = {"step": None, "phase": None, "prompts": [], "record": None}

# The most an error's exit waits for the atexit handlers (vLLM's finalizer can hang on NCCL while a
# peer is gone), as torchrun restarts once every rank exits.
LEAVE_TIMEOUT_S = float(os.environ.get("RSTAR2_LEAVE_TIMEOUT_S", "20"))


def run_script(script, parse, run, interrupt_paragraph):
    """A script's `__main__`: run(parse(argv)), interrupt_paragraph(config or None, argv) on Ctrl-C
    or SIGTERM. No error path destroys the process group: that can hang on NCCL (docs/design.md)."""
    stop_on_signals()
    argv, config = sys.argv[1:], None

    try:
        config = parse(argv)
        run(config)
    except (KeyboardInterrupt, Exception) as error:
        # a signal from now on (torchrun's agent stopping the ranks) must not cut this path short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for bar in list(tqdm._instances):  # open bars would redraw after the last line
            bar.close()

        rank, lost = os.environ.get("RANK", "0"), peer_lost(error)
        if lost or interrupted():
            forget_where()  # the cause is elsewhere: not this rank's crash to count
        if lost and not interrupted():
            print(f"{script}: rank {rank} lost another rank{where()} ({lost}): "
                  f"{restart_or_resume(script, argv)}", file=sys.stderr, flush=True)
            leave(1)
        if RECEIVED[:1] == ["SIGTERM"] and restarts_left() > 0:  # torchrun's agent stopping all
            print(f"{script}: rank {rank} stopped by SIGTERM{where()}: if a rank failed, "
                  f"{restart_or_resume(script, argv)}", file=sys.stderr, flush=True)
            leave(exit_status())
        if interrupted() or isinstance(error, KeyboardInterrupt):
            if is_main_rank():
                print(interrupt_paragraph(config, argv), flush=True)
            leave(exit_status())
        if not isinstance(error, ConfigError):
            traceback.print_exc()
        elif is_main_rank() or error.this_rank_only:  # a rank that could not reach the others
            print(f"{script}: {error}", file=sys.stderr, flush=True)
        leave(1)

    end_process_group()
    leave(0)


# gloo's and the TCPStore's errors on a rank whose peer is gone: the cause is on the other rank
PEER_LOST = re.compile(r"(Connection (closed|reset) by peer|Connection refused|Broken pipe"
                       r"|Socket closed)( \[[^\]]*\]:\d+)?")


def peer_lost(error):
    """"gloo: Connection closed by peer [10.0.0.7]:41234" when `error` says a peer is gone."""
    found = isinstance(error, RuntimeError) and PEER_LOST.search(str(error))
    if not found:
        return ""
    return f"{'gloo' if 'gloo' in str(error) else type(error).__name__}: {found.group(0)}"


def where():
    """" in step 5 (rollout)": what WHERE knows, for a rank's last line."""
    step, phase = WHERE["step"], WHERE["phase"]
    return (f" in step {step}" if step is not None else "") + (f" ({phase})" if phase else "")


def restarts_left():
    """The restarts torchrun's --max-restarts still allows this job (0 outside torchrun)."""
    return (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
            - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def restart_or_resume(script, argv):
    """torchrun's restart of the job while --max-restarts allows, else the command that resumes."""
    allowed = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if restarts_left() > 0:
        return f"torchrun restarts the job ({restarts_left()} of --max-restarts={allowed} left)"
    return f"no restart left (--max-restarts={allowed}); to resume: {rerun_command(script, argv)}"


def reached(phase, step=None):
    """This process enters `phase` (of `step`): WHERE, on disk where rl.py keeps it (a SIGKILL
    leaves no exception to say where it struck)."""
    WHERE["phase"] = phase
    if step is not None:
        WHERE["step"] = step
    if WHERE["record"]:
        partial = WHERE["record"].with_suffix(".tmp")
        partial.write_text(json.dumps({key: WHERE[key] for key in ("step", "phase", "prompts")}))
        partial.replace(WHERE["record"])
    fault_point(phase)


def forget_where():
    """This rank's record removed: it ended cleanly, or the cause of its end is elsewhere."""
    if WHERE["record"]:
        WHERE["record"].unlink(missing_ok=True)
        WHERE["record"] = None


def fault_point(point):
    """The tests' seam: RSTAR2_FAULTS="ATTEMPT:RANK:STEP:POINT:ACTION,..." ends this process here
    with kill (a lost GPU), raise (a bug, an OOM) or stop (SIGSTOP: a hung kernel, no Python)."""
    rank = os.environ.get("RANK", "0")
    here = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}:{rank}:{WHERE['step']}:{point}:"
    for fault in os.environ.get("RSTAR2_FAULTS", "").split(","):
        action = fault.removeprefix(here) if fault.startswith(here) else None
        if action == "raise":
            raise RuntimeError(f"RSTAR2_FAULTS: rank {rank}, step {WHERE['step']}, {point}")
        if action in ("kill", "stop"):
            os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)


def crash_loop(records_dir, skip_prompts):
    """The refusal when the last two attempts failed in the same step and phase with prompts not in
    skip_prompts (a resume replays them), else None (docs/design.md, "Crash loops")."""
    records_dir.mkdir(parents=True, exist_ok=True)
    left = sorted(records_dir.glob("rank*.json"))
    records = [r for r in map(json.loads, (path.read_text() for path in left)) if r["step"]]
    if records:
        first = min(records, key=lambda r: r["step"])
        prompts = sorted({p for r in records if r["step"] == first["step"] for p in r["prompts"]})
        with open(records_dir / "failures.jsonl", "a") as history:
            history.write(json.dumps({"step": first["step"], "phase": first["phase"],
                                      "prompts": prompts}) + "\n")
    for path in left:
        path.unlink()

    last = read_records(records_dir / "failures.jsonl")[-2:]
    if (len(last) < 2 or (last[0]["step"], last[0]["phase"]) != (last[1]["step"], last[1]["phase"])
            or set(last[1]["prompts"]) <= set(skip_prompts)):
        return None
    ids = ",".join(map(str, last[1]["prompts"]))
    return (f"step {last[1]['step']} failed in its {last[1]['phase']} on the last 2 attempts, "
            f"prompts {ids} in flight: skip them with skip_prompts={ids}")


def watch_progress(store, rank, world_size, heartbeat_s, script):
    """A thread that exits this rank when no rank has moved for heartbeat_s, naming the one that
    stopped first, so torchrun restarts the job (docs/design.md); returns the Event that ends it."""
    main, stop = threading.main_thread().ident, threading.Event()
    # A rank moves when its main thread's frame does, or it switches: a poll loop returns to one
    # frame, but its waits end in context switches, which a thread blocked for good does not make.
    status = Path(f"/proc/self/task/{threading.main_thread().native_id}/status")
    keys = [f"rstar2/progress/{r}" for r in range(world_size)]
    period = max(1.0, heartbeat_s / 10)

    def watch():
        beats, moves, frame_seen = 0, 0, None
        # per rank: its last (beats, moves), and when each of the two last changed
        values, beat, moved = [None] * world_size, [0.0] * world_size, [0.0] * world_size

        while not stop.wait(period):
            frame = sys._current_frames().get(main)
            switches = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status.read_text(), re.M)
            here = frame and (id(frame), frame.f_lasti, switches.group(1))
            beats, moves, frame_seen = beats + 1, moves + (here != frame_seen), here
            try:
                store.set(keys[rank], f"{beats} {moves}")
                now, everyone = time.monotonic(), store.check(keys)
                published = [v.decode().split() for v in store.multi_get(keys)] if everyone else []
            except RuntimeError:
                return  # the store is gone: the main thread's next collective says so

            if not everyone or None in values:  # a rank still starting: nothing to judge yet
                beat, moved = [now] * world_size, [now] * world_size
            for other, value in enumerate(published):
                seen = values[other] or value
                beat[other] = now if value[0] != seen[0] else beat[other]
                moved[other] = now if value[1] != seen[1] else moved[other]
                values[other] = value

            if now - max(moved) > heartbeat_s:
                # one that stopped publishing (SIGSTOP, the GIL held) before one that waits
                first = min(range(world_size), key=lambda r: (beat[r] > now - 3 * period,
                                                              moved[r]))
                print(f"{script}: rank {rank}{where()}: no rank made progress for "
                      f"{heartbeat_s:.0f} s (heartbeat_min), rank {first} stopped first: "
                      f"{restart_or_resume(script, sys.argv[1:])}", file=sys.stderr, flush=True)
                if first != rank:
                    forget_where()
                bound_exit(1)
                atexit._run_exitfuncs()
                os._exit(1)

    store.set(keys[rank], "0 0")
    threading.Thread(target=watch, daemon=True, name="watch_progress").start()
    return stop


def end_process_group():
    """Destroy the process groups where a script succeeded (looked up: demo.py has no torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave(code):
    """Exit with `code` after the atexit handlers, without the interpreter's teardown, where a gloo
    thread can abort the process (7 of 20 two-rank launches, 0 of 20 this way: docs/design.md)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # raised in a handler, one would skip the rest
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if code:
        bound_exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def bound_exit(code):
    """End this process with `code` after LEAVE_TIMEOUT_S whatever runs; faulthandler's C watchdog
    (exit 1, at most 5 s later) for a C call that holds the GIL."""
    def give_up():
        print(f"rank {os.environ.get('RANK', '0')}: the exit handlers were still running after "
              f"{LEAVE_TIMEOUT_S:.0f} s: left without them", file=sys.stderr, flush=True)
        os._exit(code)

    threading.Timer(LEAVE_TIMEOUT_S, give_up).start()  # os._exit ends it with the process
    faulthandler.dump_traceback_later(LEAVE_TIMEOUT_S + min(LEAVE_TIMEOUT_S, 5), exit=True)


def stop_on_signals(forward_to=()):
    """SIGINT and SIGTERM raise KeyboardInterrupt once (the cleanup runs once), and reach the child
    processes (Popen) in `forward_to`."""
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


def is_main_rank():
    return os.environ.get("RANK", "0") == "0"


def shown(path):
    """A path relative to the working directory when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def typed(path):
    """shown without resolving links (.venv may link to a shared environment)."""
    return path.removeprefix(os.getcwd().rstrip("/") + "/")


def rerun_command(script, argv, set_keys=None):
    """The command line that runs `script` with `argv` again, `set_keys` set: with the interpreter
    as typed, or under torchrun its flags as a placeholder (each node launches its own line)."""
    set_keys = set_keys or {}
    args = [a for a in argv if a.split("=", 1)[0] not in set_keys]
    args += [f"{key}={value}" for key, value in set_keys.items()]
    launcher = ("torchrun [the same flags]" if "TORCHELASTIC_RUN_ID" in os.environ
                else shlex.quote(typed(sys.executable)))
    return f"{launcher} {shlex.join([*script.split(), *args])}"


def training_interrupted(script, argv, out_dir, checkpoint, total_steps=None, save_every=0,
                         resume="auto"):
    """rl.py's and sft.py's paragraph when interrupted: the step reached, the last checkpoint
    (passed in: demo.py imports this module without torch), what a resume redoes, the command."""
    saved = int(checkpoint.name.split("_")[-1]) if checkpoint else 0
    rows = read_records(Path(out_dir) / "metrics.jsonl")
    done = max(rows[-1].get("step", 0) if rows else 0, saved)
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
