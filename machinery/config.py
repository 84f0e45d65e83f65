"""Config loading: a dataclass per script from YAML and key=value overrides, a wrong key or value
refused in one line naming file:line and key; repo-relative paths; atomic writes; JSONL reading."""
import dataclasses
import difflib
import inspect
import io
import json
import operator
import os
import sys
import textwrap
import tokenize
import typing
import zlib
from pathlib import Path

import yaml
from annotated_types import Ge, GroupedMetadata, Gt, Le, Lt

REPO = Path(__file__).resolve().parent.parent  # the repo root, above this package


class ConfigError(ValueError):
    """A bad config, value or data row, or a refusal. this_rank_only: a problem of this rank's
    machine, printed by that rank; else rank 0 alone prints (exits.py)."""

    def __init__(self, message, this_rank_only=False):
        super().__init__(message)
        self.this_rank_only = this_rank_only


# A key's bounds are declared beside it, `epochs: Annotated[int, Ge(1)] = 3` (annotated_types, the
# constraints pydantic reads), and checked as the value is read, so the refusal names file:line.
BOUNDS = {Gt: (operator.gt, ">"), Ge: (operator.ge, ">="), Lt: (operator.lt, "<"),
          Le: (operator.le, "<=")}
PositiveInt = typing.Annotated[int, Ge(1)]
NonNegativeInt = typing.Annotated[int, Ge(0)]
PositiveFloat = typing.Annotated[float, Gt(0)]
NonNegativeFloat = typing.Annotated[float, Ge(0)]
Fraction = typing.Annotated[float, Ge(0), Le(1)]
PositiveFraction = typing.Annotated[float, Gt(0), Le(1)]


def _bounds(tp):
    """[(check, "op limit")] of the bounds Annotated on `tp` (an Interval taken apart)."""
    metadata = typing.get_args(tp)[1:] if typing.get_origin(tp) is typing.Annotated else ()
    found = [bound for item in metadata
             for bound in (item if isinstance(item, GroupedMetadata) else [item])]
    return [(lambda value, b=bound: BOUNDS[type(b)][0](value, dataclasses.astuple(b)[0]),
             f"{BOUNDS[type(bound)][1]} {dataclasses.astuple(bound)[0]}")
            for bound in found if type(bound) in BOUNDS]


def _coerce(value, tp, where, typed=None):
    """`value` checked against the annotation `tp`, converted only losslessly (int, "1e-6" ->
    float). `typed`: the text the value was read from, for the message."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        value = _coerce(value, typing.get_args(tp)[0], where, typed)
        bounds = _bounds(tp)
        if not all(check(value) for check, _ in bounds):
            raise ConfigError(f"{where}: must be {' and '.join(t for _, t in bounds)}, got {value}")
        return value
    if origin is typing.Literal:
        choices = list(typing.get_args(tp))
        if value not in choices:  # YAML 1.1 reads off as false: `typed` shows what was written
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

    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is typing.Any or type(value) is tp:  # bool is an int's subclass, not its type
        return value
    if tp is float and (number or isinstance(value, str)):
        try:  # YAML 1.1 reads 1e-6 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is str and number:
        return str(value)  # model=123 or a numeric run name
    if tp is str and isinstance(value, bool) and typed:
        raise ConfigError(f"{where}: YAML reads {typed!r} as {str(value).lower()}; quote it")
    expected = {bool: "true/false", int: "an int", float: "a float", str: "a string"}[tp]
    raise ConfigError(f"{where}: expected {expected}, got {type(value).__name__} {value!r}")


def _line_numbers(node, prefix=""):
    """{dotted key: (line number, the value's text)} of a YAML document, for file:line."""
    lines = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = (key_node.start_mark.line + 1,
                          value_node.value if isinstance(value_node, yaml.ScalarNode) else None)
            lines.update(_line_numbers(value_node, key + "."))
    return lines


def _apply(cfg, updates, source, lines, prefix=""):
    """Set the fields of dataclass instance `cfg` from the mapping `updates`, sections nested."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for key, value in updates.items():
        dotted = f"{prefix}{key}"
        line, typed = lines.get(dotted, (None, None))
        where = f"{source}:{line}: '{dotted}'" if line else f"{source}: '{dotted}'"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key{hint}; --help lists the keys")
        current = getattr(cfg, key)
        if not dataclasses.is_dataclass(current):
            setattr(cfg, key, _coerce(value, hints[key], where, typed))
        elif isinstance(value, dict):
            _apply(current, value, source, lines, dotted + ".")
        else:
            raise ConfigError(f"{where}: is a section; expected a mapping, got {value!r}")


def load_config(cls, argv=None, doc=None):
    """A `cls` from `[CONFIG.yaml] [key=value ...]` (default: sys.argv[1:]): defaults, the YAML,
    the overrides as YAML scalars, then validate(). -h/--help prints config_help (`doc`: the
    script's docstring) and exits, as does a bare command line the defaults cannot run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(config_help(cls, doc), flush=True)
        sys.exit(0)
    cfg, bare = cls(), not argv
    if argv and "=" not in argv[0]:
        path = Path(argv.pop(0))
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        text = path.read_text()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(data, dict | None):
            raise ConfigError(f"{path}: the top level must be a mapping of keys")
        _apply(cfg, data or {}, str(path), _line_numbers(yaml.compose(text)))


    for arg in argv:
        key, _, raw = arg.partition("=")
        if not key or "=" not in arg:
            raise ConfigError(f"command line: bad override {arg!r}; expected key=value")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        for part in reversed(key.split(".")):  # rollout.max_turns=15 -> {"rollout": {...: 15}}
            value = {part: value}
        _apply(cfg, value, "command line", {key: (None, raw)})
    try:
        getattr(cfg, "validate", lambda: None)()
    except ConfigError as e:
        if bare:  # the script run with nothing: what is missing, then what it takes
            raise ConfigError(f"{e}\n\n{config_help(cls, doc)}") from None
        raise
    return cfg


# --help: every key with its default, bounds and comment, read from the dataclass's source, so the
# help cannot drift from the code

def field_comments(cls):
    """({field: its comment}, {field: the heading comments above it}) from the class's source: a
    comment on a field's line, continued by lines indented past the body; a comment line at the
    body's indent heads the next field. Tokenized: a '#' in a string is no comment."""
    source = textwrap.dedent(inspect.getsource(cls))
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
        if code and code.split(":")[0].strip() == last:
            comments[last] = text
        elif not code and last in comments and col > body_indent:
            comments[last] += " " + text  # a continuation line
        elif not code:
            pending.append(text)
            last = None
    return comments, headings


def _value_text(value):
    if isinstance(value, str):
        return repr(value) if value == "" or ":" in value or " " in value else value
    return yaml.safe_dump(value, default_flow_style=True, width=10**4).strip().removesuffix("\n...")



def _keys_help(cls, instance, prefix=""):
    by_field, headings = field_comments(cls)
    hints = typing.get_type_hints(cls, include_extras=True)
    lines = []
    for f in dataclasses.fields(cls):
        lines += [f"  # {heading}" for heading in headings.get(f.name, [])]
        value, key, tp = getattr(instance, f.name), prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(value):
            lines.append(f"  {key}: a section: {key}.KEY=VALUE, or a `{f.name}:` mapping in YAML")
            lines += _keys_help(type(value), value, key + ".")
            continue
        allowed = [text for _, text in _bounds(tp)]
        if typing.get_origin(tp) is typing.Literal:
            allowed = [" | ".join(map(str, typing.get_args(tp)))]
        comment = " ".join([f"[{', '.join(allowed)}]"] * bool(allowed)
                           + [by_field.get(f.name, "")]).strip()
        head = f"  {key} = {_value_text(value)}"
        lines += textwrap.wrap(comment, 100, initial_indent=f"{head:<40} ",
                               subsequent_indent=" " * 41) or [head]
    return lines


def config_help(cls, doc=None):
    """--help: the usage line, the docstring's first paragraph and first indented block (its
    commands), and every key of `cls` under its source's headings."""
    path = Path(sys.argv[0]) if sys.argv else Path()
    script = (f"-m tools.{path.stem}" if path.parent.name == "tools" and path.suffix == ".py"
              else path.name if path.suffix == ".py" else "SCRIPT.py")
    parts = [f"usage: python {script} [CONFIG.yaml] [key=value ...]        (-h, --help: this text)"]
    paragraphs = textwrap.dedent(doc or "").strip("\n").split("\n\n")
    commands = next((p for p in paragraphs[1:] if p.startswith(" ")), None)
    parts += [p for p in paragraphs[:1] + [commands] if p]
    parts.append(f"{cls.__name__} (KEY = default): a YAML file sets them, key=value on the command "
                 "line overrides it.\n" + "\n".join(_keys_help(cls, cls())))
    return "\n\n".join(parts)


def config_summary(cfg, saved_to=None):
    """The console's lines about a config: the settings that differ from the defaults."""
    defaults = flatten_config(dataclasses.asdict(type(cfg)()))
    changed = {key: value for key, value in flatten_config(dataclasses.asdict(cfg)).items()
               if value != defaults.get(key)}
    items = " ".join(f"{key}={_value_text(value)}" for key, value in changed.items())
    where = f"the whole config: {saved_to}; " if saved_to else ""
    head = f"{type(cfg).__name__}: {len(changed)} settings differ from the defaults ({where}--help)"
    return "\n".join([head] + textwrap.wrap(items, 100, initial_indent="  ",
                                            subsequent_indent="  "))


def save_config(cfg, run_dir):
    """run_dir/config.yaml, the resolved config a run ran with; its summary printed."""
    text = yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / "config.yaml", text)
    print(config_summary(cfg, Path(run_dir) / "config.yaml"), flush=True)


def read_saved_config(run_dir):
    """run_dir/config.yaml (save_config's) as a dict, None where there is none."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        saved = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        saved = None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path}: not a YAML mapping of settings; fix or move it")
    return saved


def atomic_write_text(path, text):
    """Write-then-rename: a reader never sees half a file, a crash leaves the old one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_records(path, required=(), torn_tail=True):
    """The JSON objects of a JSONL file (.gz too), [] if none, each `required` key a non-empty
    string. A torn last line of a file a run appends to (torn_tail) is dropped with one warning;
    any other bad line is a ConfigError naming file:line."""
    path = Path(path)
    if not path.is_file():
        return []

    data, torn = path.read_bytes(), False
    if path.suffix == ".gz":  # every member before a tear, which gzip.open drops
        members = []
        while data:  # one member per write; appended files have several
            member = zlib.decompressobj(wbits=31)
            try:
                members.append(member.decompress(data))
            except zlib.error:
                break
            if not member.eof:
                break
            data = member.unused_data
        data, torn = b"".join(members), bool(data)  # data left: a tear

    records = []
    numbered = [(number, line) for number, line in  # "\n" alone: JSON may hold a raw U+2028
                enumerate(data.decode("utf-8", errors="replace").split("\n"), 1) if line.strip()]
    for number, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if torn_tail and number == numbered[-1][0]:
                torn = True
                break
            raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg}); fix it") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}:{number}: not a JSON object: {type(record).__name__}")
        for key in required:
            if not isinstance(record.get(key), str) or not record[key].strip():
                raise ConfigError(f"{path}:{number}: '{key}' must be a non-empty string")
        records.append(record)

    if torn:
        warn_torn(path, f"the {len(records)} records before it are kept")
    return records


def warn_torn(path, kept):
    """A torn file's one warning per process (`kept`: what is left of it)."""
    if str(path) not in _TORN_WARNED:
        _TORN_WARNED.add(str(path))
        print(f"WARNING: {path}: its end is torn and dropped; {kept}", flush=True)


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


def differing(before, after):
    """{dotted key: (before's value, after's)} where two flattened configs differ; a key one lacks
    (added since) differs."""
    return {key: (before.get(key, "(not set)"), after.get(key, "(not set)"))
            for key in sorted(before.keys() | after.keys())
            if before.get(key, "(not set)") != after.get(key, "(not set)")}
