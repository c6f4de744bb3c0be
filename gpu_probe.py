import json, sys, time, traceback, os
import torch
from dataclasses import replace
from grpo_vision import sampling
from grpo_vision.config import load_config
from grpo_vision.policy import load_bundle
from grpo_vision.tools.presets import preset_overrides, prompts_for
from grpo_vision.tools.bench_gpu import _timed
out = {}
t = time.time()
bundle = load_bundle(load_config(None, preset_overrides("janus-pro-1b", "/tmp/presets/janus-pro-1b", "bfloat16")).policy, "cuda")
out["load_s"] = time.time() - t
policy = bundle.policy
params = sampling.SamplingParams(cfg_scale=5.0)
for G in (16, 8):
    cond = policy.encode_prompts(prompts_for("janus-pro-1b", 1) * G)
    ref = sampling.sample(policy, cond, list(range(G)), replace(params, decode="graph"))
    s = _timed(lambda: sampling.sample(policy, cond, list(range(G)), replace(params, decode="graph")), 2)
    out[f"G{G}_graph_ms"] = 1000 * s / 576
    for dyn in (False, None):
        key = f"G{G}_compiled_dynamic_{dyn}"
        sampling._COMPILED[:] = [torch.compile(sampling.decode_step, dynamic=dyn)]
        try:
            s, first = _timed(lambda: sampling.sample(policy, cond, list(range(G)), replace(params, decode="compiled")), 2, first=True)
            r = sampling.sample(policy, cond, list(range(G)), replace(params, decode="compiled"))
            out[key] = {"ms": 1000 * s / 576, "compile_s": first - s, "same_tokens": bool(torch.equal(r.tokens, ref.tokens)),
                        "frac_same": (r.tokens == ref.tokens).float().mean().item()}
        except Exception as e:
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "tb": traceback.format_exc()[-3000:]}
        print(json.dumps(out), flush=True)
        torch._dynamo.reset()
    if time.time() - t > 200:
        break
json.dump(out, open(os.environ["OUT"] + "/probe.json", "w"), indent=1)
