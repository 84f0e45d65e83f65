"""The metrics log (JSONL, optionally W&B and TensorBoard) and the tool's busy time."""
import json
from pathlib import Path
from machinery.config import atomic_write_text


class MetricsLogger:
    """Appends one JSON object per step to run_dir/metrics.jsonl (rank 0 only); mirrors to wandb/tensorboard
    when asked. On resume, lines past the resumed step are dropped so the file stays one line per step."""

    def __init__(self, run_dir, enabled=True, wandb_project="", tensorboard=False, config=None, resume_step=0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb = self.tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [l for l in self.path.read_text().splitlines() if l.strip() and json.loads(l).get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(l + "\n" for l in kept))
        if wandb_project:
            import wandb  # optional: pip install wandb

            self.wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir), resume="allow")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional: pip install tensorboard

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, step, metrics):
        if not self.enabled:
            return
        row = {"step": step, **{k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, str)) else v)
                                for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb:
            self.wandb.log(row, step=step)
        if self.tb:
            for k, v in row.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()


class TimedExecutor:
    """The executor, adding up the seconds its calls run. Calls overlap decoding (no per-turn barrier), so this
    is the tool's load, not a slice of the rollout's wall time."""

    def __init__(self, executor):
        self.executor, self.busy_s = executor, 0.0

    def submit(self, code, stdin=""):
        future = self.executor.submit(code, stdin=stdin)
        future.add_done_callback(self._count)
        return future

    def _count(self, future):
        if future.exception() is None:
            self.busy_s += future.result().elapsed_s  # float += under the GIL: the callbacks' threads cannot tear it
