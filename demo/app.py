"""`python demo/app.py RUN [--host 127.0.0.1] [--port N]`: the same app as `grpo-vision demo RUN`.

The logic lives in grpo_vision/tools/demo.py; this script only forwards its arguments to the CLI, so
errors (a missing run directory, a taken port) exit 2 with the same messages.
"""

import sys

from grpo_vision.cli import main

if __name__ == "__main__":
    main(["demo", *sys.argv[1:]])
