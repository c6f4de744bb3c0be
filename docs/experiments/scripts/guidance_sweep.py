"""The judge's rates of a run's base policy and trained policy under other sampling settings: the guidance and
temperature sweep of text_plans.md ("Guidance on the canvas world"). Each setting draws the set's captions
`log.eval_images` images each with the eval seeds (the images `grpo-vision eval` and the matrix score), both models
on the same seeds.

Usage: python guidance_sweep.py RUN [SET] [SETTINGS] [--base-only] [--step N]
  RUN       a run folder (a matrix row's: runs/plan_study/canvas_cfg/runs/...-s0)
  SET       test | heldout | train_sample (default test)
  SETTINGS  ';'-separated, each 'cfg=C,T=T' (either may be left out: the run's own), default the table's
  --step N  the run's checkpoint of step N instead of its latest (the longer-run curve of text_plans.md)
Prints one JSON line per setting and model: all-right, count and shape rates over all captions and over the
relation captions."""
import argparse
import dataclasses
import json
import sys

import torch

from grpo_vision.config import ConfigError, validate
from grpo_vision.evaluation.evaluate import eval_params
from grpo_vision.rollouts import draw, eval_seeds, repeat, verdict_rates
from grpo_vision.splits import run_prompt_sets
from grpo_vision.step.load import load_run

TABLE = "cfg=1;cfg=1.5;cfg=2;cfg=2.5;cfg=3;cfg=1.5,T=0.6;cfg=3,T=0.6"


def parse(setting: str) -> dict:
    keys = {"cfg": "cfg_scale", "T": "temperature"}
    try:
        pairs = [part.split("=") for part in setting.split(",")]
        return {keys[k]: float(v) for k, v in pairs}
    except (KeyError, ValueError):
        raise SystemExit(f"guidance_sweep: setting {setting!r}: write 'cfg=C,T=T' (either part may be left out)")


def rates(verdicts, forms) -> dict:
    """The means of `verdict_rates` (NaN where an attribute does not apply) over all images and the relation ones."""
    relation = torch.tensor([f == "relation" for f in forms])
    out = {}
    for key, per_image in verdict_rates(verdicts, ("correct", "count", "shape")).items():
        out[f"all/{key}"] = round(per_image.nanmean().item(), 3)
        out[f"relation/{key}"] = round(per_image[relation].nanmean().item(), 3)
    return dict(sorted(out.items()))


def checked(cfg, text: str, values: dict) -> dict:
    """`values` as the run's own sample.cfg_scale / sample.temperature would be checked (config/schema.py's
    validate: finite, guidance >= 0, temperature > 0; the sampler draws, it has no greedy T=0): NaN or inf
    guidance turns every logit into NaN, and the judge then rates images of one token code as a result."""
    try:
        validate(dataclasses.replace(cfg, sample=dataclasses.replace(cfg.sample, **values)))
    except ConfigError as err:
        raise SystemExit(f"guidance_sweep: setting {text!r}: {err}") from None
    return values


def main(argv: list[str]) -> None:
    from grpo_vision.files import FolderError
    from grpo_vision.prompts import PromptsError
    from grpo_vision.run.checkpoint import CheckpointError

    ap = argparse.ArgumentParser(prog="guidance_sweep.py", description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("set", nargs="?", default="test")
    ap.add_argument("settings", nargs="?", default=TABLE)
    ap.add_argument("--base-only", action="store_true")
    ap.add_argument("--step", type=int)
    args = ap.parse_args(argv)
    run_dir, set_name = args.run, args.set
    settings = {text: parse(text) for text in args.settings.split(";")}
    try:
        run = load_run(run_dir, args.step)
        sets = run_prompt_sets(run.cfg, run_dir).scored()
    except (ConfigError, CheckpointError, FileNotFoundError, FolderError, PromptsError) as err:
        raise SystemExit(f"guidance_sweep: {err}: give a run folder, as `grpo-vision train` or a matrix writes it, "
                         "and a step it has a checkpoint of") from None
    if run.bundle.judge is None:  # the rates are the ShapesWorld judge's verdicts
        raise SystemExit(f"guidance_sweep: {run_dir} trained a {run.cfg.policy.kind} policy, which brings no judge: "
                         "the sweep reports the judge's rates, so give a run on a ShapesWorld policy (policy.kind "
                         "shapes)")
    settings = {text: checked(run.cfg, text, values) for text, values in settings.items()}
    if set_name not in sets:
        raise SystemExit(f"guidance_sweep: set {set_name!r}: choose one of {', '.join(sets)}")
    captions, n = sets[set_name], run.cfg.log.eval_images
    entries, seeds = repeat(captions, n), eval_seeds(len(captions), n)
    prompts = [e.prompt for e in entries]
    forms = [run.bundle.judge.form(p) for p in prompts]
    models = {"base": run.reference.sampler(run.policy)[0]} | ({} if args.base_only else {"trained": run.policy})
    for setting, values in settings.items():
        params = dataclasses.replace(eval_params(run.cfg), **values)
        for who, model in models.items():
            images = draw(model, run.bundle.tokenizer, entries, seeds, params, 64).images
            verdicts = run.bundle.judge.verdicts(images, prompts)
            step_of = 0 if who == "base" else run.step
            print(json.dumps({"set": set_name, "setting": setting, "model": who, "step": step_of,
                              **rates(verdicts, forms)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
