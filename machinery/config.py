"""Config loading: a dataclass per script from YAML plus key=value overrides, with errors that name
the key, the file and the line; the repo root and paths relative to it; atomic file writes, and the
one reader of the files a run appends to (a torn last line dropped with a warning)."""
import dataclasses
import difflib
import inspect
import io
import json
import os
import sys
import textwrap
import tokenize
import typing
import zlib
from pathlib import Path
import yaml


REPO = Path(__file__).resolve().parent.parent  # the repo root, above this package


class ConfigError(ValueError):
    """A bad config file, key, value or data row, or a refusal. The message says which.
    this_rank_only: a problem of this rank's machine (its node's memory, a rank that cannot reach
    the others), printed by whichever rank has it; else rank 0 alone prints (machinery/exits.py)."""

    def __init__(self, message, this_rank_only=False):
        super().__init__(message)
        self.this_rank_only = this_rank_only


def _coerce(value, tp, where, typed=None):
    """Check `value` against the annotation `tp`; convert the few lossless cases (int -> float,
    "1e-6" -> float). `typed`: the text the value was read from, for the message."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = list(typing.get_args(tp))
        if isinstance(value, bool) and value not in choices:  # YAML 1.1: off, no, n, false ...
            instead = "none, or one of" if "none" in choices else "one of"
            raise ConfigError(f"{where}: YAML reads {typed or value!r} as {str(value).lower()}; "
                              f"write {instead} {choices}")
        if value not in choices:
            raise ConfigError(f"{where}: {typed or value!r} is not one of {choices}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (typing.Any,)
        if isinstance(value, str):  # benchmarks=aime24,aime25 or ks=1,16 on the command line
            value = [yaml.safe_load(v) for v in value.split(",") if v]
        elif not isinstance(value, (list, tuple, dict)):  # seeds=0, `ks: 16`: a list of one
            value = [value]
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
        if isinstance(value, bool) and typed:
            raise ConfigError(f"{where}: YAML reads {typed!r} as {str(value).lower()}; quote it "
                              f"(\"{typed}\") to mean the text")
        raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
    name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    raise ConfigError(f"{where}: unsupported config type {name}")


def _line_numbers(text):
    """Map dotted key -> (line number, the value's text) in a YAML document, so errors can say
    file:line and quote what was written."""
    lines = {}

    def walk(node, prefix):
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = (key_node.start_mark.line + 1,
                              value_node.value if isinstance(value_node, yaml.ScalarNode) else None)
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
        line, typed = lines.get(dotted, (None, None))
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
            setattr(cfg, key, _coerce(value, tp, where, typed))


def require_at_least(cfg, minimum, *names):
    """A ConfigError naming the first of `names` whose value is below `minimum`."""
    for name in names:
        if getattr(cfg, name) < minimum:
            raise ConfigError(f"{name}={getattr(cfg, name)}: must be >= {minimum}")


def load_config(cls, argv=None, doc=None):
    """Build a `cls` dataclass from `[CONFIG.yaml] [key=value ...]` (default: sys.argv[1:]): the
    dataclass's defaults, then the YAML file, then the overrides, parsed as YAML scalars (`lr=1e-6`,
    `benchmarks=aime24,aime25`). `-h`/`--help` prints config_help (with `doc`, the script's
    docstring, for its commands) and exits; a bare command line that the defaults cannot run gets
    the same text after its error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_help(cls, doc), flush=True)
        sys.exit(0)
    cfg = cls()
    bare = not argv
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
                              "(the config file must come first; --help lists the keys)")
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
        _apply(cfg, value, "command line", {key: (None, raw)})
    if hasattr(cfg, "validate"):
        try:
            cfg.validate()
        except ConfigError as e:
            if bare:  # the script run with nothing: what is missing, then what it takes
                raise ConfigError(f"{e}\n\n{config_help(cls, doc)}") from None
            raise
    return cfg


# -----------------------------------------------------------------------------
# --help: the usage and every key with its default and its comment, read from the dataclass's
# source, so the help is the code's own documentation and cannot drift from it

def _script():
    path = Path(sys.argv[0]) if sys.argv else Path()
    if path.parent.name == "tools" and path.suffix == ".py":  # run as python -m tools.NAME
        return f"-m tools.{path.stem}"
    return path.name if path.name.endswith(".py") else "SCRIPT.py"


def usage_line():
    script = _script()
    return f"usage: python {script} [CONFIG.yaml] [key=value ...]        (-h, --help: this text)"


def _commands(doc):
    """The docstring's first paragraph and its first indented block: the script's own commands."""
    if not doc:
        return ""
    paragraphs = textwrap.dedent(doc).strip("\n").split("\n\n")
    commands = next((p for p in paragraphs[1:] if p.startswith(" ")), None)
    return "\n\n".join(paragraphs[:1] + ([commands] if commands else []))


def field_comments(cls):
    """({field: its comment}, {field: the heading comments above it}) from the class's source: a
    field's comment is the one on its line plus the comment lines indented past the body below it;
    a comment line at the body's indent heads the next field. Read with tokenize: a '#' in a string
    is no comment."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}, {}
    fields = {f.name for f in dataclasses.fields(cls)}
    lines = source.splitlines()
    comments, headings, pending, last, body_indent = {}, {}, [], None, None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        row, col = token.start
        code = lines[row - 1][:col].strip() if row <= len(lines) else ""
        if token.type == tokenize.NAME and not code and token.string in fields:
            body_indent = col if body_indent is None else body_indent
            last = token.string
            if pending:
                headings[last], pending = pending, []
        if token.type != tokenize.COMMENT:
            continue
        text = token.string.lstrip("#").strip()
        if code.split(":")[0].strip() == last and code:
            comments[last] = text
        elif not code and last in comments and body_indent is not None and col > body_indent:
            comments[last] += " " + text  # a continuation line
        elif not code:
            pending.append(text)
            last = None
    return comments, headings


def _value_text(value):
    if isinstance(value, str):
        return repr(value) if value == "" or ":" in value or " " in value else value
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix(
        "\n...").strip()


def _keys_help(cls, instance, prefix=""):
    by_field, headings = field_comments(cls)
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        lines += [f"  # {heading}" for heading in headings.get(f.name, [])]
        value, key = getattr(instance, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            lines.append(f"  {key}: a section ({type(value).__name__}): {key}.KEY=VALUE, or a "
                         f"`{f.name}:` mapping in YAML")
            lines += _keys_help(type(value), value, key + ".")
            continue
        comment = by_field.get(f.name, "")
        if typing.get_origin(hints[f.name]) is typing.Literal:
            comment = f"[{' | '.join(map(str, typing.get_args(hints[f.name])))}] {comment}".strip()
        head = f"  {key} = {_value_text(value)}"
        if not comment:
            lines.append(head)
            continue
        if len(head) >= 40:
            lines.append(head)
            head = ""
        lines += textwrap.wrap(comment, 100, initial_indent=f"{head:<40} ",
                               subsequent_indent=" " * 41)
    return lines


def config_help(cls, doc=None):
    """What --help prints: the usage line, the script's commands, and every key of `cls` with its
    default and its comment, in the order and under the headings of the source."""
    parts = [usage_line()]
    commands = _commands(doc)
    if commands:
        parts.append(commands)
    parts.append(f"{cls.__name__} (KEY = default): a YAML file sets them, key=value on the command "
                 "line overrides it.\n" + "\n".join(_keys_help(cls, cls())))
    return "\n\n".join(parts)


def changed_keys(cfg, defaults=None, prefix=""):
    """{dotted key: value} of every setting of `cfg` that differs from its dataclass's defaults."""
    defaults = type(cfg)() if defaults is None else defaults
    out = {}
    for f in dataclasses.fields(cfg):
        value, default = getattr(cfg, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value) and dataclasses.is_dataclass(default):
            out.update(changed_keys(value, default, f"{prefix}{f.name}."))
        elif value != default:
            out[prefix + f.name] = value
    return out


def config_summary(cfg, saved_to=None):
    """A few console lines about the config: the settings that differ from the defaults; the whole
    of it is in config.yaml (`saved_to`)."""
    changed = changed_keys(cfg)
    items = " ".join(f"{key}={_value_text(value)}" for key, value in changed.items())
    where = f"the whole config: {saved_to}; " if saved_to else ""
    head = (f"{type(cfg).__name__}: {len(changed)} settings differ from the defaults ({where}"
            "every key: --help):")
    return "\n".join([head] + textwrap.wrap(items, 100, initial_indent="  ",
                                            subsequent_indent="  "))


def save_config(cfg, run_dir):
    """Save the resolved config as run_dir/config.yaml, so every run says what it ran with, and
    print its summary (config_summary)."""
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / "config.yaml", text)
    print(config_summary(cfg, Path(run_dir) / "config.yaml"), flush=True)


def read_saved_config(run_dir):
    """run_dir/config.yaml (save_config's) as a dict, None where there is none; one that does not
    parse (edited by hand, or a disk that lost its end) is a ConfigError naming it."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        saved = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())}); fix it, or move "
                          "the run directory away") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: expected the settings as a mapping, got "
                          f"{type(saved).__name__}; fix it, or move the run directory away")
    return saved


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


def read_records(path):
    """The JSON objects of a JSONL file a run appends to (metrics.jsonl, eval's samples.jsonl, a
    saved step's rank_R.jsonl.gz), [] if it does not exist: what every reader of a run uses. A torn
    last line (a kill or a full disk mid-write; a .gz cut short) is dropped with one warning naming
    the file; nothing before it is lost. A bad line before the last is no tear: a ConfigError
    naming the file and line."""
    path = Path(path)
    if not path.is_file():
        return []
    data, torn = path.read_bytes(), False
    if path.suffix == ".gz":
        data, torn = _gunzip(data)
    records = []
    numbered = [(number, line) for number, line in
                enumerate(data.decode("utf-8", errors="replace").splitlines(), 1) if line.strip()]
    for number, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == numbered[-1][0]:
                torn = True
                break
            raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}), "
                              "and not the last line: fix or move the file") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number}: expected a JSON object, got "
                              f"{type(record).__name__}")
        records.append(record)
    if torn:
        warn_torn(path, f"the {len(records)} records before it are kept")
    return records


def _gunzip(data):
    """(the bytes a gzip file holds, whether it is cut short): all it holds before a tear, which
    gzip.open would drop with the block it was reading."""
    out = []
    while data:  # one member per write; appended files have several
        member = zlib.decompressobj(wbits=31)
        try:
            out.append(member.decompress(data))
        except zlib.error:
            return b"".join(out), True
        if not member.eof:
            return b"".join(out), True
        data = member.unused_data
    return b"".join(out), False


def warn_torn(path, kept):
    """The one warning of a torn file (`kept`: what is left of it), once per file and process
    however often it is read."""
    if str(path) in _TORN_WARNED:
        return
    _TORN_WARNED.add(str(path))
    print(f"WARNING: {path}: its end is torn (a kill, a crash or a full disk mid-write) and "
          f"dropped; {kept}", flush=True)


_TORN_WARNED = set()


def resolve(path):
    """Relative paths are relative to the repo, so scripts work from any working directory."""
    path = Path(path)
    try:
        here = path.is_absolute() or path.exists()
    except OSError:  # a name too long: not here; whoever uses it says why
        here = False
    return path if here else REPO / path


def flatten_config(config, prefix=""):
    """{"rollout.temperature": 1.0, ...} from a nested config dict (dataclasses.asdict's)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flatten_config(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
