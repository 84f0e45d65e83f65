"""Config loading: a dataclass per script from YAML plus key=value overrides, with errors that name
the key, the file and the line; the repo root and paths relative to it; atomic file writes."""
import dataclasses
import difflib
import os
import sys
import typing
from pathlib import Path
import yaml


REPO = Path(__file__).resolve().parent.parent  # the repo root, above this package


class ConfigError(ValueError):
    """A bad config file, key, value or data row. The message says which."""


def _coerce(value, tp, where):
    """Check `value` against the annotation `tp`; convert the few lossless cases (int -> float,
    "1e-6" -> float)."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(tp))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (typing.Any,)
        if isinstance(value, str):  # benchmarks=aime24,aime25 or ks=1,16 on the command line
            value = [yaml.safe_load(v) for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is typing.Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a float, got {type(value).__name__} {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # model=123 or a numeric run name
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    raise ConfigError(f"{where}: unsupported config type {name}")


def _line_numbers(text):
    """Map dotted key -> line number in a YAML document, so errors can say file:line."""
    lines = {}

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return lines


def _apply(cfg, updates, source, lines, prefix=""):
    """Set the fields of dataclass instance `cfg` from the mapping `updates`, recursing into nested
    sections."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg))
    for key, value in updates.items():
        dotted = f"{prefix}{key}"
        line = lines.get(dotted)
        where = f"{source}:{line}: '{dotted}'" if line else f"{source}: '{dotted}'"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key{hint}; "
                              f"{type(cfg).__name__} has {sorted(fields)}")
        tp = hints[key]
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: is a section ({type(current).__name__}); "
                                  f"expected a mapping, got {value!r}")
            _apply(current, value, source, lines, dotted + ".")
        else:
            setattr(cfg, key, _coerce(value, tp, where))


def load_config(cls, argv=None):
    """Build a `cls` dataclass from `[CONFIG.yaml] [key=value ...]` (default: sys.argv[1:]): the
    dataclass's defaults, then the YAML file, then the overrides, parsed as YAML scalars (`lr=1e-6`,
    `benchmarks=aime24,aime25`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = cls()
    if argv and "=" not in argv[0]:
        path = Path(argv.pop(0))
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        text = path.read_text()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys, "
                              f"got {type(data).__name__}")
        _apply(cfg, data, str(path), _line_numbers(text))
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(f"command line: bad override {arg!r}; expected key=value "
                              "(the config file must come first)")
        key, raw = arg.split("=", 1)
        if not key:
            raise ConfigError(f"command line: bad override {arg!r}; the key is empty")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        # rollout.max_turns=15 -> {"rollout": {"max_turns": 15}}
        for part in reversed(key.split(".")):
            value = {part: value}
        _apply(cfg, value, "command line", {})
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def save_config(cfg, run_dir):
    """Print the resolved config and save it as run_dir/config.yaml, so every run says what it ran
    with."""
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    print(f"# {type(cfg).__name__}\n{text}", flush=True)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / "config.yaml", text)


def atomic_write_text(path, text):
    """Write-then-rename, so a reader never sees half a file (a crash leaves the old file
    intact)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve(path):
    """Relative paths are relative to the repo, so scripts work from any working directory."""
    path = Path(path)
    return path if path.is_absolute() or path.exists() else REPO / path
