"""GenEval's own rules served in GenEval's own environment, in the wire format of `grpo-vision serve-reward`, so that
a run's `remote` reward scores with them (docs/real_models.md, "Rewards behind a server").

GenEval (djghosh13/geneval, evaluation/evaluate_images.py) needs mmdet 2.x, mmcv-full 1.7.1, torch 1.12.1 and
Python 3.9 (its environment.yml); grpo_vision needs Python >= 3.10 and a recent torch, so it does not install there.
This script needs only the standard library and GenEval's checkout: it loads GenEval's detector and colour CLIP once
through GenEval's own `load_models`, and scores each image with GenEval's own `evaluate_image`.

    cd geneval    # the checkout, in its activated environment
    python geneval_server.py --model-path OBJECT_DETECTOR_FOLDER --port 8000 [--options threshold=0.3 ...]

Score per image: 1.0 when GenEval judges it correct, 0.0 when not, null ("does not apply") when the prompt's
metadata has no GenEval `tag`. GET /health, GET /info, POST /score as serve-reward answers them.
"""

import argparse
import base64
import json
import os
import sys
import tempfile
import traceback
from http.server import BaseHTTPRequestHandler, HTTPServer

NAME = "geneval (djghosh13/geneval evaluate_images.py)"
SETTINGS = (("THRESHOLD", "threshold", 0.3, float), ("COUNTING_THRESHOLD", "counting_threshold", 0.9, float),
            ("MAX_OBJECTS", "max_objects", 16, int), ("NMS_THRESHOLD", "max_overlap", 1.0, float),
            ("POSITION_THRESHOLD", "position_threshold", 0.1, float))  # evaluate_images.py's __main__ block


def load_geneval(checkout, model_path, model_config, options):
    """GenEval's evaluate_images module with its models and thresholds set, as its __main__ block sets them."""
    sys.path.insert(0, os.path.join(checkout, "evaluation"))
    sys.argv = ["evaluate_images.py", "-", "--model-path", model_path, "--options"] + list(options)
    if model_config:
        sys.argv += ["--model-config", model_config]
    import evaluate_images as geneval

    args = geneval.parse_args()
    geneval.object_detector, (geneval.clip_model, geneval.transform, geneval.tokenizer), geneval.classnames = \
        geneval.load_models(args)
    settings = {}
    for name, key, default, kind in SETTINGS:
        settings[key] = kind(args.options.get(key, default))
        setattr(geneval, name, settings[key])
    return geneval, settings


def make_handler(geneval, settings):
    class Handler(BaseHTTPRequestHandler):
        def answer(self, status, value):
            data = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.answer(200, {"status": "ok", "rewards": [NAME]})
            elif self.path == "/info":
                self.answer(200, {"version": "geneval", "max_batch": None,
                                  "rewards": [{"name": NAME, "options": settings}]})
            else:
                self.answer(404, {"error": "GET /health or /info"})

        def do_POST(self):
            if self.path not in ("/score", "/score/geneval"):
                self.answer(404, {"error": "POST /score"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                images, prompts = body["images"], body["prompts"]
                metadata = body.get("metadata") or [{} for _ in images]
                if not len(images) == len(prompts) == len(metadata):
                    raise ValueError("give one prompt and one metadata per image")
            except (ValueError, KeyError, TypeError) as e:
                self.answer(400, {"error": "a bad request: %s" % e})
                return
            try:
                scores = []
                with tempfile.TemporaryDirectory() as folder:
                    for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata)):
                        if not meta.get("tag"):
                            scores.append(None)  # not a GenEval prompt
                            continue
                        path = os.path.join(folder, "%04d.png" % i)  # evaluate_image reads a file
                        with open(path, "wb") as f:
                            f.write(base64.b64decode(image))
                        result = geneval.evaluate_image(path, dict(meta, prompt=prompt))
                        scores.append(1.0 if result["correct"] else 0.0)
            except Exception as e:  # GenEval's code failed: the client's one line says so
                traceback.print_exc()
                self.answer(500, {"error": "GenEval failed: %s: %s" % (type(e).__name__, e)})
                return
            self.answer(200, {"scores": scores, "reward": NAME, "options": settings, "version": "geneval"})

    return Handler


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkout", default=".", help="GenEval's checkout (holds evaluation/evaluate_images.py)")
    parser.add_argument("--model-path", required=True, help="the folder download_models.sh wrote the detector to")
    parser.add_argument("--model-config", default="", help="mmdet config (default: GenEval's Mask2Former Swin-S)")
    parser.add_argument("--options", nargs="*", default=[], help="GenEval's key=value options, e.g. threshold=0.3")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    geneval, settings = load_geneval(args.checkout, args.model_path, args.model_config, args.options)
    server = HTTPServer((args.host, args.port), make_handler(geneval, settings))  # one request at a time: one GPU
    print("[geneval_server] on http://%s:%d (POST /score)" % (args.host, args.port), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
