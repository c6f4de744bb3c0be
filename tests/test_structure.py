"""The architecture's rules, checked: imports go down the layers, the core never imports ShapesWorld,
training never imports the world builder, and the public API loads without torch."""

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import grpo_vision

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_vision"
CORE = sorted(p for p in PACKAGE.rglob("*.py") if "shapes" not in p.relative_to(PACKAGE).parts)
PLUGIN = "grpo_vision.shapes"  # ShapesWorld: may import anything; nothing outside it may import it

# The package's parts, lowest first: a module may import its own layer and lower ones, never a higher
# one (at module level or inside a function; `if TYPE_CHECKING:` imports are exempt, they never run).
# A name covers its submodules; "grpo_vision" is the package's __init__ only, whose public API
# (`grpo_vision.load_config`, ...) is imported lazily by importlib from strings, not by import
# statements, so the re-exports are exempt by construction.
LAYERS = [
    ("core", ["grpo_vision", "grpo_vision.config", "grpo_vision.files", "grpo_vision.reading", "grpo_vision.plugins",
              "grpo_vision.policy", "grpo_vision.prompts", "grpo_vision.splits", "grpo_vision.sampling",
              "grpo_vision.grpo", "grpo_vision.images", "grpo_vision.seeds",
              "grpo_vision.rollouts"]),  # contracts and math; the step's first half, shared by every measurement
    ("run", ["grpo_vision.run"]),  # checkpoints, safe state, distributed, health, memory, metrics, lock, ...
    ("models and rewards", ["grpo_vision.models", "grpo_vision.rewards"]),  # which must not import each other
    ("the step", ["grpo_vision.step"]),  # set-up, the phases, the update, the reference, credit, iterative RL
    ("evaluation", ["grpo_vision.evaluation", "grpo_vision.export"]),  # export: a run loaded as evaluation loads it
    ("train", ["grpo_vision.train", "grpo_vision.trainer"]),
    ("tools", ["grpo_vision.tools"]),  # demo, matrix, benches
    ("cli", ["grpo_vision.cli"]),
]
LAZY = {**grpo_vision._EXPORTS, **{m: f"grpo_vision.{m}" for m in grpo_vision._SUBMODULES}}  # the public API's names
PARTS = {part: layer for layer, (_, parts) in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    """grpo_vision/run/lock.py -> grpo_vision.run.lock; a package's __init__.py -> the package."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def is_module(dotted: str) -> bool:
    """Whether `dotted` is a module or package of this tree."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(source: str, module: str, is_package: bool = False, type_checking: bool = False):
    """(line, dotted module) for each module that `source` (module `module`) imports, anywhere in it:
    `import a.b` -> a.b; `from a import b` -> a.b where that is a module, else a; relative imports
    resolved against the module's package. A name of the public API (`from grpo_vision import
    register_reward`, or `grpo_vision.train.train(...)` after `import grpo_vision`) counts as an import of
    the module that defines it, which grpo_vision's __getattr__ imports at run time. `if TYPE_CHECKING:`
    bodies are skipped unless `type_checking`."""
    package = module if is_package else module.rpartition(".")[0]
    stack = [ast.parse(source)]
    while stack:
        node = stack.pop()
        if not type_checking and _is_type_checking(node):
            stack.extend(node.orelse)  # the `else:` of a TYPE_CHECKING block does run
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "grpo_vision":
            if node.attr in LAZY:
                yield node.lineno, LAZY[node.attr]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `.` is the module's package, each further dot one package up
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                public = LAZY.get(alias.name, base) if base == "grpo_vision" else base
                yield node.lineno, full if is_module(full) else public


def part_of(dotted: str) -> str | None:
    """The entry of LAYERS (or PLUGIN) that holds module `dotted`: the longest name it starts with."""
    if dotted == PLUGIN or dotted.startswith(PLUGIN + "."):
        return PLUGIN
    names = [p for p in PARTS if dotted == p or (p != "grpo_vision" and dotted.startswith(p + "."))]
    return max(names, key=len, default=None)


def layer_violations(source: str, module: str, label: str, is_package: bool = False) -> list[str]:
    """`label:line: imports X (layer N) from layer M` for each import of `source` (module `module`) that
    goes up the layers, crosses between models/ and rewards/, or reaches the ShapesWorld plugin."""
    home = part_of(module)
    if home == PLUGIN:
        return []  # a plugin builds on the whole package
    if home is None:
        return [f"{label}: {module} has no layer in LAYERS"]
    found = []
    for line, target in sorted(imported_modules(source, module, is_package)):
        if not (target == "grpo_vision" or target.startswith("grpo_vision.")):
            continue
        there = part_of(target)
        where = f"{label}:{line}: imports {target}"
        if there is None:
            found.append(f"{where} (no layer: a module that does not exist?) from layer {PARTS[home]}")
        elif there == PLUGIN:
            found.append(f"{where} (the ShapesWorld plugin) from layer {PARTS[home]}")
        elif PARTS[there] > PARTS[home]:
            found.append(f"{where} (layer {PARTS[there]}) from layer {PARTS[home]}")
        elif {home, there} == {"grpo_vision.models", "grpo_vision.rewards"}:
            found.append(f"{where} (layer {PARTS[there]}) from layer {PARTS[home]}: models/ and rewards/ "
                         "must not import each other")
    return found


def test_every_module_has_a_layer():
    loose = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py")) if part_of(module_name(p)) is None]
    assert loose == [], "give each new module a layer in LAYERS (tests/test_structure.py)"


def test_imports_go_down_the_layers():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += layer_violations(path.read_text(), module_name(path), str(path.relative_to(ROOT)),
                                  is_package=path.name == "__init__.py")
    assert found == [], "imports that go up the layers (tests/test_structure.py, LAYERS):\n" + "\n".join(found)


def test_the_layer_check_finds_every_spelling():
    def check(module: str, source: str, is_package: bool = False) -> list[str]:
        return layer_violations(textwrap.dedent(source), module, "f.py", is_package)

    assert check("grpo_vision.run.lock", """
        import grpo_vision.train
        from grpo_vision import train
        from grpo_vision.train import train as fit
        def later():
            from grpo_vision.evaluation.report import write_report  # a lazy import counts
        from ..tools import demo  # relative: grpo_vision.tools.demo
        from . import metrics, checkpoint  # down or level: allowed
        import numpy, grpo_vision, grpo_vision.config
        from grpo_vision import __version__, files, load_config
        from grpo_vision import register_reward  # the public API: rewards/, imported by grpo_vision's __getattr__
        grpo_vision.train.train(grpo_vision.load_config("c.yaml"))  # the same, through attributes
    """) == ["f.py:2: imports grpo_vision.train (layer 5) from layer 1",
             "f.py:3: imports grpo_vision.train (layer 5) from layer 1",
             "f.py:4: imports grpo_vision.train (layer 5) from layer 1",
             "f.py:6: imports grpo_vision.evaluation.report (layer 4) from layer 1",
             "f.py:7: imports grpo_vision.tools.demo (layer 6) from layer 1",
             "f.py:11: imports grpo_vision.rewards (layer 2) from layer 1",
             "f.py:12: imports grpo_vision.train (layer 5) from layer 1"]
    assert check("grpo_vision.rewards", """
        from .base import RewardFn  # the package's own module
        from ..models.llama import LlamaImagePolicy
        from grpo_vision.shapes.world import World
    """, is_package=True) == [
        "f.py:3: imports grpo_vision.models.llama (layer 2) from layer 2: models/ and rewards/ must not import "
        "each other",
        "f.py:4: imports grpo_vision.shapes.world (the ShapesWorld plugin) from layer 2"]
    assert check("grpo_vision.tools.demo", """
        from typing import TYPE_CHECKING
        import typing
        if TYPE_CHECKING:
            from grpo_vision.cli.args import MAX_SEED  # exempt: never runs
        if typing.TYPE_CHECKING:
            import grpo_vision.cli
        else:
            import grpo_vision.cli.app  # the else branch runs
        from grpo_vision.nothing_here import x
    """) == ["f.py:9: imports grpo_vision.cli.app (layer 7) from layer 6",
             "f.py:10: imports grpo_vision.nothing_here (no layer: a module that does not exist?) from layer 6"]
    assert check("grpo_vision.shapes.plugin", "from grpo_vision.cli.app import main\n") == []  # a plugin


def world_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The modules of grpo_vision.shapes that `source` (module `module`) imports, `line N: name`, those under
    `if TYPE_CHECKING:` included (even a type-only dependency on a plugin is one too many)."""
    return [f"line {line}: {target}" for line, target in imported_modules(source, module, is_package, True)
            if part_of(target) == PLUGIN]


def test_the_import_check_finds_every_spelling():
    source = textwrap.dedent("""
        import grpo_vision.shapes
        from grpo_vision.shapes.scene import parse_caption
        from grpo_vision import shapes
        def f():
            from .shapes import checker
        import grpo_vision.sampling
    """)
    assert len(world_imports(source, "grpo_vision.rewards")) == 4


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_core_module_imports_the_world(path):
    found = world_imports(path.read_text(), module_name(path), is_package=path.name == "__init__.py")
    assert found == [], f"{path.relative_to(ROOT)} imports grpo_vision.shapes"


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_each_core_module_leaves_the_world_out():
    modules = [module_name(p) for p in CORE if p.name != "__main__.py"]  # importing __main__ runs the CLI
    code = f"""
import importlib, json, sys
loaded = {{}}
for name in {modules!r}:
    importlib.import_module(name)
    loaded[name] = sorted(m for m in sys.modules if m.startswith("grpo_vision.shapes"))
print(json.dumps(loaded))
"""
    assert _fresh(code) == {m: [] for m in modules}


@pytest.mark.e2e  # a training in a fresh interpreter
def test_training_a_policy_from_outside_the_world_never_imports_it(tmp_path):
    """A tiny LlamaGen-style policy and diffusers VQ tokenizer, saved in their real formats, trained for
    one step on a built-in reward with a sample grid and the report: no ShapesWorld module is loaded."""
    code = f"""
import json, sys
import torch
from diffusers import VQModel
from grpo_vision.config import load_config
from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.models.tokenizer import VQTokenizer
from grpo_vision.train import train

torch.manual_seed(0)
root = {str(tmp_path)!r}
vq = VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
             latent_channels=4, sample_size=16, num_vq_embeddings=16, vq_embed_dim=4, norm_num_groups=4)
VQTokenizer(vq).save_pretrained(root + "/vq")
words = "a cat dog on the mat".split()
LlamaImagePolicy(LlamaPolicyConfig(words=words, max_caption_words=6, codebook_size=16, image_grid=(8, 8), dim=32,
                                   n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=48)).save_pretrained(root + "/policy")
open(root + "/train.txt", "w").write("a cat on the mat\\na dog\\n")
open(root + "/eval.txt", "w").write("a dog on the mat\\n")
cfg = load_config(None, ["policy.kind=llama", f"policy.path={{root}}/policy", f"policy.tokenizer={{root}}/vq",
                         f"data.train_prompts={{root}}/train.txt", f"data.eval_prompts={{root}}/eval.txt",
                         "reward.weights={{jpeg_compressibility: 1.0}}", "reward.monitor=[placebo]",
                         "sample.prompts_per_step=2", "sample.group_size=2", "train.micro_batch_size=2",
                         "train.steps=1", "train.reference=none", "log.sample_every=1", "log.eval_images=1",
                         "log.trackers=[]", f"run.out_dir={{root}}/runs", "run.device=cpu"])
run = train(cfg, progress=False)
assert (run / "report.md").is_file() and (run / "samples" / "step_000001.png").is_file()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("grpo_vision.shapes"))))
"""
    assert _fresh(code) == []


@pytest.mark.e2e  # a training in a fresh interpreter
def test_training_on_the_world_never_imports_its_builder(micro_world, tmp_path):
    code = f"""
import json, sys
from grpo_vision.config import load_config
from grpo_vision.train import train

cfg = load_config("configs/shapes_micro.yaml", ["policy.path={micro_world}", "run.out_dir={tmp_path}", "train.steps=1",
                                                "log.eval_images=1"])
train(cfg, progress=False)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("grpo_vision.shapes"))))
"""
    loaded = _fresh(code)
    assert "grpo_vision.shapes.plugin" in loaded  # the world's kind was found through its entry point
    assert [m for m in loaded if m.startswith("grpo_vision.shapes.build")] == []


def test_the_public_api_loads_without_torch():
    code = """
import json, sys
import grpo_vision
names = grpo_vision.__all__
grpo_vision.load_config, grpo_vision.Config, grpo_vision.__version__
listed = sorted([*grpo_vision._EXPORTS, *grpo_vision._SUBMODULES, "__version__"])
print(json.dumps({"torch": "torch" in sys.modules, "__all__": names == listed}))
"""
    assert _fresh(code) == {"torch": False, "__all__": True}


@pytest.mark.parametrize("import_first", [False, True], ids=["attribute first", "import first"])
def test_grpo_vision_train_is_the_module_in_either_order(import_first):
    """Python sets the package's attribute `train` to the submodule on `import grpo_vision.train`, so the
    API leaves that name to the module (grpo_vision/__init__.py says why); the function is
    `grpo_vision.train.train`, whichever of the attribute and the import statement comes first."""
    steps = ["import grpo_vision.train", "before = grpo_vision.train"]
    steps = "\n".join(steps if import_first else steps[::-1])
    code = f"""
import importlib, json, sys
import grpo_vision
{steps}
import grpo_vision.train as as_module
from grpo_vision import train
module = sys.modules["grpo_vision.train"]
exports = grpo_vision._EXPORTS  # name -> module
print(json.dumps({{
    "module": [before is module, grpo_vision.train is module, as_module is module, train is module],
    "function": callable(grpo_vision.train.train),
    "exports": sorted(n for n, m in exports.items()
                      if getattr(grpo_vision, n) is not getattr(importlib.import_module(m), n)),
}}))
"""
    assert _fresh(code) == {"module": [True] * 4, "function": True, "exports": []}


def test_every_pointer_to_a_docs_section_names_one_that_exists():
    # an error or docstring that sends a user to (docs/usage.md, "Title") or (README, "Title") must name a heading
    # of that file; a renamed section left pointers to nowhere
    pointer = re.compile(r'(docs/[a-z_]+\.md|README), \\?"([^"\\]{2,80})\\?"')
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for doc, title in pointer.findall(path.read_text()):
            target = ROOT / ("README.md" if doc == "README" else doc)
            headings = [line.lstrip("#").strip() for line in target.read_text().splitlines() if line.startswith("#")]
            if not any(h.startswith(title) for h in headings):
                missing.append(f"{path.relative_to(ROOT)}: {doc}, {title!r}")
    assert missing == [], "pointers to sections that do not exist:\n" + "\n".join(missing)


# ---------------------------------------------------------------- the figures a feature must not undo
# Round three's figures slipped within hours of being reached because nothing held them
# (shared/research/aesthetics-review-2026-12-07.md, section 1): each is a test now.

TRAIN_LINES, LOOP_LINES = 250, 40  # train.py, and the `for` over steps in `_train` (its `else:` aside)
TOP_LEVEL_MODULES = 16  # .py files directly in grpo_vision/, __init__.py included
README_LINES = 260  # the README is the map (STYLE.md, 15); studies and long explanations live in docs/
CROSS_CUTTING = {"test_algorithms.py", "test_security.py", "test_structure.py"}  # test-root files of no one module
# test folders that mirror no subpackage: e2e/ follows a feature across modules (the `e2e` marker, not the
# folder, decides the tier), docs/ runs what docs/ ships, data/ holds fixtures' files
OTHER_TEST_FOLDERS = {"e2e", "docs", "data"}
ISSUE = re.compile(r"\bissues? \d+", re.IGNORECASE)  # "issue" and a number, "issues" and numbers


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of `sources` ({module: (source, is_package)}) it imports, at module level or inside a
    function (either can close a cycle at run time); `if TYPE_CHECKING:` imports are exempt, they never run."""
    return {module: {target for _, target in imported_modules(source, module, is_package)
                     if target in sources and target != module}
            for module, (source, is_package) in sources.items()}


def import_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Each set of modules that import one another, directly or round a longer loop, as a sorted tuple."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        return seen

    reach = {module: reachable(module) for module in graph}
    return {tuple(sorted({m} | {n for n in reach[m] if m in reach[n]})) for m in graph if m in reach[m]}


def package_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_cycle_finder_counts_lazy_imports_and_exempts_type_checking_ones():
    sources = {name: (textwrap.dedent(source), False) for name, source in {
        "p.a": "import p.b\n",
        "p.b": "def later():\n    import p.a\n",  # a lazy import closes the loop a -> b -> a
        "p.c": "from p.d import x\n",
        "p.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.c import y\n",  # exempt
        "p.e": "import p.f\n", "p.f": "import p.g\n", "p.g": "import p.e\n",  # round three modules
    }.items()}
    sources["p"] = ("", True)
    assert import_cycles(import_graph(sources)) == {("p.a", "p.b"), ("p.e", "p.f", "p.g")}


def test_no_import_cycle_among_the_package_modules():
    found = sorted(import_cycles(import_graph(package_sources())))
    assert found == [], "modules that import one another (move what one needs so the arrow goes one way):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def test_train_py_and_its_loop_stay_one_screen():
    source = (PACKAGE / "train.py").read_text()
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "_train")
    loop = next(n for n in ast.walk(fn) if isinstance(n, ast.For))  # the first `for` of _train: over the steps
    lines = loop.body[-1].end_lineno - loop.lineno + 1
    assert len(source.splitlines()) <= TRAIN_LINES, "train.py: move set-up or a phase into step/"
    assert lines <= LOOP_LINES, f"the loop in train._train is {lines} lines: give a phase a function in step/"


def test_the_package_top_level_holds_at_most_16_modules():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, f"{len(modules)} modules at grpo_vision/'s top level: {modules}"


def test_each_test_file_at_the_root_is_named_for_a_top_level_module_and_each_folder_for_a_subpackage():
    tests = ROOT / "tests"
    loose = [p.name for p in sorted(tests.glob("test_*.py")) if p.name not in CROSS_CUTTING
             and not (PACKAGE / f"{p.stem[5:]}.py").is_file() and not (PACKAGE / p.stem[5:]).is_dir()]
    folders = [p.name for p in sorted(tests.iterdir()) if p.is_dir() and not p.name.startswith((".", "_"))
               and p.name not in OTHER_TEST_FOLDERS and not (PACKAGE / p.name / "__init__.py").is_file()]
    assert loose == [], "test files named for no module of grpo_vision/: move each beside the module it tests " \
                        "(tests/<subpackage>/) or, when it follows a feature across modules, to tests/e2e/"
    assert folders == [], "test folders that mirror no subpackage of grpo_vision/"


def test_no_issue_numbers_in_the_package_or_the_tests():
    # an issue number tells a reader nothing the code does; say the behaviour it guards (another project's
    # tracker is cited as "project #N")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for folder in (PACKAGE, ROOT / "tests")
             for p in sorted(folder.rglob("*.py")) for i, line in enumerate(p.read_text().splitlines(), 1)
             if ISSUE.search(line)]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("package", sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_each_subpackage_docstring_names_every_module_of_its_folder(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [p.name for p in sorted(package.glob("*.py")) if p.name != "__init__.py"
               and not re.search(rf"(?<![\w/.]){re.escape(p.name)}", doc)]
    assert missing == [], f"{package.relative_to(ROOT)}/__init__.py's docstring, the folder's map, leaves out {missing}"


def test_the_readme_is_a_map_of_at_most_260_lines():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md is {lines} lines: move a study or a long explanation to docs/"


def test_the_readmes_test_command_is_what_ci_runs():
    # .ci/run says it runs "exactly the README's test command": its lines after `cd` and its comments
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    after_cd = lines[next(i for i, line in enumerate(lines) if line.startswith("cd ")) + 1:]
    command = "\n".join(line for line in after_cd if not line.startswith("#"))
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert command in blocks, "README.md's test command and .ci/run's differ"
