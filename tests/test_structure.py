"""The architecture's rules, checked: the core never imports ShapesWorld, training never imports the
world builder, and files and functions stay small enough to read."""

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpo_vision"
CORE = sorted(p for p in PACKAGE.rglob("*.py") if "shapes" not in p.relative_to(PACKAGE).parts)
MAX_FILE_LINES = 350
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED = {"train"}  # the one loop, read top to bottom (STYLE.md, rule 1)


def world_imports(source: str, module: str) -> list[str]:
    """The `import` statements of `source` (module `module`, dotted) that reach grpo_vision.shapes."""
    found = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        if any(n == "grpo_vision.shapes" or n.startswith("grpo_vision.shapes.") for n in names):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


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
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    assert world_imports(path.read_text(), module) == [], f"{path.relative_to(ROOT)} imports grpo_vision.shapes"


def _fresh(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_each_core_module_leaves_the_world_out():
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for p in CORE]
    code = f"""
import importlib, json, sys
loaded = {{}}
for name in {modules!r}:
    importlib.import_module(name)
    loaded[name] = sorted(m for m in sys.modules if m.startswith("grpo_vision.shapes"))
print(json.dumps(loaded))
"""
    assert _fresh(code) == {m: [] for m in modules}


def test_training_a_policy_from_outside_the_world_never_imports_it(tmp_path):
    """A tiny LlamaGen-style policy and diffusers VQ tokenizer, saved in their real formats, trained for
    one step on a built-in reward with a sample grid and the report: no ShapesWorld module is loaded."""
    code = f"""
import json, sys
import torch
from diffusers import VQModel
from grpo_vision.config import load_config
from grpo_vision.llama_policy import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.tokenizer import VQTokenizer
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
                         "log.tensorboard=false", f"run.out_dir={{root}}/runs", "run.device=cpu"])
run = train(cfg, progress=False)
assert (run / "report.md").is_file() and (run / "samples" / "step_000001.png").is_file()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("grpo_vision.shapes"))))
"""
    assert _fresh(code) == []


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


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_files_and_functions_stay_small():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        if source.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for fn in _functions(ast.parse(source)):
            length = fn.end_lineno - fn.lineno + 1
            if length > MAX_FUNCTION_LINES and fn.name not in LONG_FUNCTIONS_ALLOWED:
                too_long.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}(): {length} lines")
    assert too_long == []
