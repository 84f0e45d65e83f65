"""The rStar2 prompt formats (paper Fig. 3, the release's): the rendered prompt and tool turn,
token-exact, tool output kept apart from control tokens; the format a model directory carries."""
import dataclasses
import functools
import json
import re
import warnings
from pathlib import Path
from typing import Literal

from machinery.config import ConfigError, resolve

# The two prompt formats (paper vs release differ in four places,
# tests/reference/prompt_template_paper_fig3.txt); explicit paths override either file.
PROMPT_VARIANTS = {
    "code": ("configs/templates/rstar2_code.jinja",
             "configs/templates/python_code_with_standard_io.json"),
    "paper": ("configs/templates/rstar2_paper.jinja",
              "configs/templates/execute_python_code_with_standard_io.json"),
}

AUTO_VARIANT = "auto"  # the format saved in the model directory (FORMAT_FILE)
PromptVariant = Literal["code", "paper", "auto"]  # rollout.prompt_variant: a variant, or auto

# The format a checkpoint was trained with, written beside config.json by sft.py and rl.py
# (write_format), so eval.py evaluates it in that format by default: in another one its tool calls
# fail as "unknown tool". How to prompt it outside this repo: docs/design.md (prompt format).
FORMAT_FILE = "rstar2_format.json"
FORMAT_TEMPLATE_FILE = "rstar2_chat_template.jinja"
FORMAT_SCHEMA_FILE = "rstar2_tool_schema.json"


def format_paths(cfg):
    """(template, schema) paths; prompt_variant=auto is resolved first by apply_model_format."""
    if cfg.prompt_variant == AUTO_VARIANT:
        raise ValueError("rollout.prompt_variant=auto: apply_model_format(cfg, model_dir) first")
    template, schema = PROMPT_VARIANTS[cfg.prompt_variant]
    return resolve(cfg.chat_template or template), resolve(cfg.tool_schema or schema)


@functools.lru_cache(maxsize=8)
def _read_format(template_path, schema_path):
    try:
        schema = json.loads(Path(schema_path).read_text())
        if not schema["function"]["name"]:
            raise KeyError("name")
    except (ValueError, TypeError, KeyError):  # not JSON, or not {"function": {"name": ...}}
        raise ValueError(f"rollout.tool_schema {schema_path}: no function name") from None
    return Path(template_path).read_text(), schema


def load_format(cfg):
    """(template text, tool schema dict, tool name) for this config."""
    template, schema = _read_format(*map(str, format_paths(cfg)))
    return template, schema, schema["function"]["name"]


def variant_of(template, schema):
    """The built-in variant whose template (and schema, unless None) these are, else None."""
    for name, paths in PROMPT_VARIANTS.items():
        variant_template, variant_schema = _read_format(*map(str, map(resolve, paths)))
        if template == variant_template and schema in (None, variant_schema):
            return name
    return None


def write_format(directory, template, schema, written_by):
    """The template and schema (either may be None) into a model directory, and FORMAT_FILE naming
    them and their variant (null: custom)."""
    directory = Path(directory)
    record = {"prompt_variant": variant_of(template, schema), "chat_template": None,
              "tool_schema": None, "written_by": written_by}
    if template is not None:
        (directory / FORMAT_TEMPLATE_FILE).write_text(template)
        record["chat_template"] = FORMAT_TEMPLATE_FILE
    if schema is not None:
        (directory / FORMAT_SCHEMA_FILE).write_text(json.dumps(schema, indent=2) + "\n")
        record["tool_schema"] = FORMAT_SCHEMA_FILE
    (directory / FORMAT_FILE).write_text(json.dumps(record, indent=2) + "\n")


def read_format(model_dir):
    """(record, template or None, schema or None) from model_dir's FORMAT_FILE, or None."""
    model_dir = Path(model_dir)
    if not (model_dir / FORMAT_FILE).is_file():
        return None
    record = json.loads((model_dir / FORMAT_FILE).read_text())
    template = ((model_dir / record["chat_template"]).read_text()
                if record["chat_template"] else None)
    schema = (json.loads((model_dir / record["tool_schema"]).read_text())
              if record["tool_schema"] else None)
    return record, template, schema


def apply_model_format(cfg, model_dir):
    """cfg (a RolloutConfig) for evaluating model_dir: "auto" takes its saved format, else the
    paper's (rStar2-Agent-14B's); an explicit setting wins, warned where it differs."""
    saved = read_format(model_dir)
    if saved is None:
        if cfg.prompt_variant == AUTO_VARIANT:
            warnings.warn(f"{model_dir} has no {FORMAT_FILE} to read: rollout.prompt_variant=paper")

            return dataclasses.replace(cfg, prompt_variant="paper")
        return cfg

    record, template, schema = saved
    if cfg.prompt_variant == AUTO_VARIANT:
        # a named variant reads as that variant; a custom one (null) as its own files, the paper's
        # for the parts it lacks
        custom = record["prompt_variant"] is None
        own = [str(Path(model_dir) / name) if custom and part is not None else ""
               for name, part in ((FORMAT_TEMPLATE_FILE, template), (FORMAT_SCHEMA_FILE, schema))]
        cfg = dataclasses.replace(cfg, prompt_variant=record["prompt_variant"] or "paper",
                                  chat_template=cfg.chat_template or own[0],
                                  tool_schema=cfg.tool_schema or own[1])

    used_template, used_schema, _ = load_format(cfg)
    differ = [name for name, used, trained in (("chat template", used_template, template),
                                               ("tool schema", used_schema, schema))
              if trained is not None and used != trained]
    if differ:
        warnings.warn(f"{model_dir} was trained with another {' and '.join(differ)} "
                      f"(prompt_variant={record['prompt_variant']}, here rollout.prompt_variant="
                      f"{cfg.prompt_variant}): its tool calls may fail; use prompt_variant=auto")
    return cfg


def _render(tokenizer, messages, cfg, add_generation_prompt):
    # The template comes from config, not from the tokenizer: the same checkpoint can be trained and
    # evaluated in either rStar2 format, and the released checkpoint served with its own.
    template, schema, _ = load_format(cfg)
    return tokenizer.apply_chat_template(messages, tools=[schema] if cfg.use_tool else None,
                                         chat_template=template,
                                         add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def render_prompt(tokenizer, problem_text, cfg):
    """Token ids of the first prompt: system + tools, the user turn with the bare problem (the
    template adds the answer-format prefix), the generation prompt."""
    text = _render(tokenizer, [{"role": "user", "content": problem_text}], cfg,
                   add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


# Stands in for untrusted text while a template renders: the template's own text told from data.
DATA_PLACEHOLDER = "\x00data\x00"


@functools.lru_cache(maxsize=4)
def _plain_tokenizer(tokenizer):
    """The tokenizer's normalizer, pre-tokenizer and BPE without its added tokens: "<|im_end|>" in
    its input is the ten characters, never the control token (encode_rendered)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.update(added_tokens=[], truncation=None, padding=None)
    return type(tokenizer.backend_tokenizer).from_str(json.dumps(spec))


@functools.lru_cache(maxsize=4)
def _control_tokens(tokenizer):
    """(regex matching any added token's text, leftmost-longest as the tokenizer matches them; text
    -> id)."""
    # Qwen's added tokens have no lstrip/rstrip/single_word, whose whitespace rules this skips
    ids = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
    return re.compile("|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))), ids


def encode_rendered(tokenizer, fixed, data):
    """Token ids of fixed[0] + data[0] + fixed[1] + ... + fixed[-1] as tokenizer.encode gives them,
    except that a control-token string inside data (a template's substituted text: tool output
    that prints "<|im_end|>") stays plain text. Control tokens come from the fixed parts only; the
    text between two of them is one plain BPE encoding, as the tokenizer itself splits."""
    control, control_ids = _control_tokens(tokenizer)
    plain = _plain_tokenizer(tokenizer)
    ids, stretch = [], []

    def flush():
        text = "".join(stretch)
        stretch.clear()
        ids.extend(plain.encode(text, add_special_tokens=False).ids if text else [])

    for i, part in enumerate(fixed):
        at = 0
        for match in control.finditer(part):
            stretch.append(part[at:match.start()])
            flush()
            ids.append(control_ids[match.group()])
            at = match.end()
        stretch.append(part[at:])
        if i < len(data):
            stretch.append(data[i])
    flush()
    return ids


def render_tool_turn(tokenizer, tool_text, cfg):
    """Token ids appended after the <|im_end|> that closes a tool-call turn: the user turn with
    the tool response, then the assistant's generation prompt. Rendered by the template itself (a
    conversation with and without the tool message, the common prefix cut), as the release does;
    tool_text is data (encode_rendered)."""
    question = [{"role": "user", "content": "?"}]
    before = _render(tokenizer, question, cfg, add_generation_prompt=False)
    after = _render(tokenizer, question + [{"role": "tool", "content": DATA_PLACEHOLDER}], cfg,
                    add_generation_prompt=True)
    fixed = after[len(before):].split(DATA_PLACEHOLDER)
    real = _render(tokenizer, question + [{"role": "tool", "content": tool_text}], cfg,
                   add_generation_prompt=True)
    if (not after.startswith(before) or len(fixed) != 2
            or real != before + fixed[0] + tool_text + fixed[1]):
        raise ValueError(f"{format_paths(cfg)[0]}: a tool message is not rendered once, verbatim")

    return encode_rendered(tokenizer, fixed, [tool_text])


def check_format_files(cfg):
    """A ConfigError naming a rollout.* template or schema file set and missing (the variants' own
    files are the repo's)."""
    for name in ("chat_template", "tool_schema"):
        path = getattr(cfg, name)
        if path and not resolve(path).is_file():
            raise ConfigError(f"rollout.{name}: file not found: {resolve(path)}")
