"""The LAION improved-aesthetic-predictor v2 head: an MLP on the L2-normalised CLIP image embedding.

Layer for layer the model of christophschuhmann/improved-aesthetic-predictor (`simple_inference.py`,
`train_predictor.py`), so its released weights load with strict=True:

    layers = Sequential(Linear(768, 1024), Dropout(0.2), Linear(1024, 128), Dropout(0.2),
                        Linear(128, 64), Dropout(0.1), Linear(64, 16), Linear(16, 1))

- `sac+logos+ava1-l14-linearMSE.pth` (the default everyone uses, e.g. ddpo-pytorch): no
  activations (the ReLUs are commented out upstream), so the head is affine; keys
  `layers.{0,2,4,6,7}.{weight,bias}`.
- `ava+logos-l14-reluMSE.pth` (`relu=True`): a ReLU after each of the first four Linears. The
  ReLUs take Sequential slots, so the Linears sit at `layers.{0,3,6,9,11}` (upstream
  `avaclipmlp_inf_wds-relu.py` builds exactly this Sequential and loads that file into it).

The input is the L2-normalised image embedding of the CLIP the head was trained on (OpenAI
ViT-L/14 for the released files, 768-d); a head for a narrower CLIP scales the widths (`hidden`).
The output is an unbounded regression of a ~1..10 rating.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from grpo_vision.run.load_checks import non_finite

LAION_HIDDEN = (1024, 128, 64, 16)  # released v2 widths, input 768
LAION_DROPOUT = (0.2, 0.2, 0.1)  # after the first three Linears
WEIGHTS_NAME = "aesthetic.safetensors"
CONFIG_NAME = "aesthetic_config.json"


class AestheticMLP(nn.Module):
    def __init__(self, input_dim: int = 768, hidden: tuple[int, ...] = LAION_HIDDEN,
                 dropout: tuple[float, ...] = LAION_DROPOUT, relu: bool = False):
        super().__init__()
        if len(hidden) != 4 or len(dropout) != 3:
            raise ValueError(f"the v2 layout has 4 hidden widths and 3 dropouts, got {hidden}, {dropout}")
        self.config = {"input_dim": input_dim, "hidden": list(hidden), "dropout": list(dropout), "relu": relu}
        widths = (input_dim, *hidden)
        mods: list[nn.Module] = []
        for i in range(4):
            mods.append(nn.Linear(widths[i], widths[i + 1]))
            if relu:
                mods.append(nn.ReLU())
            if i < 3:
                mods.append(nn.Dropout(dropout[i]))
        mods.append(nn.Linear(hidden[-1], 1))
        self.layers = nn.Sequential(*mods)

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        """Score `[B]` of L2-normalised CLIP image embeddings `[B, input_dim]`."""
        return self.layers(embedding).squeeze(-1)

    def score(self, clip_embedding: torch.Tensor) -> torch.Tensor:
        """Score `[B]` of raw CLIP image embeddings `[B, input_dim]` (normalised here, as upstream)."""
        return self(F.normalize(clip_embedding.float(), dim=-1))


def save_aesthetic(head: AestheticMLP, directory: str | Path) -> Path:
    """Write `directory/aesthetic.safetensors` and `aesthetic_config.json`; load_aesthetic(directory)
    rebuilds the head from them."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(d / WEIGHTS_NAME))
    (d / CONFIG_NAME).write_text(json.dumps(head.config, indent=2) + "\n")
    return d / WEIGHTS_NAME


def architecture_of(state_dict: dict[str, torch.Tensor]) -> dict:
    """input_dim, hidden widths and relu of an AestheticMLP state dict, read off its Linear weights:
    the LAION files need no config (layers.{0,2,4,6,7} = linear head, layers.{0,3,6,9,11} = ReLU)."""
    linears = sorted(int(k.split(".")[1]) for k, v in state_dict.items()
                     if k.startswith("layers.") and k.endswith(".weight") and v.ndim == 2)
    if len(linears) != 5:
        raise ValueError(f"an aesthetic head has 5 Linear layers (layers.N.weight), this state dict has "
                         f"{len(linears)}: {sorted(state_dict)[:12]}")
    shapes = [state_dict[f"layers.{i}.weight"].shape for i in linears]  # (out, in) each
    return {"input_dim": shapes[0][1], "hidden": [s[0] for s in shapes[:4]], "relu": linears[1] - linears[0] == 3}


def _read_weights(p: Path) -> dict:
    """The state dict in `p`; a damaged file or one holding pickled objects (refused) names the file."""
    from safetensors.torch import load_file

    from grpo_vision.run.safe_state import UnsafeFileError, load_pickled_tensors

    try:
        sd = load_file(str(p)) if p.suffix == ".safetensors" else load_pickled_tensors(p)
    except UnsafeFileError as e:
        raise ValueError(f"{e}. Use a safetensors copy of the head; to make one from a file you trust, see "
                         "docs/security.md") from None
    except Exception as e:
        raise ValueError(f"cannot read the aesthetic head weights {p}: the file is damaged, cut short or not a "
                         f"state dict ({type(e).__name__}: {str(e).strip()[:200]}); copy it again") from None
    sd = sd.get("state_dict", sd) if isinstance(sd, dict) else sd
    if isinstance(sd, dict) and (bad := non_finite(sd)):
        raise ValueError(f"the aesthetic head weights {p} hold {bad}: the file is damaged; copy it again")
    return sd


def load_aesthetic(path: str | Path, input_dim: int | None = None, hidden: tuple[int, ...] | None = None,
                   dropout: tuple[float, ...] | None = None, relu: bool | None = None) -> AestheticMLP:
    """An AestheticMLP in eval mode from a `.pth` state dict (torch.load weights_only=True, e.g. the
    LAION files, also inside a `{"state_dict": ...}` wrapper), a `.safetensors` file, or a directory
    written by save_aesthetic. Architecture: the arguments given, else `aesthetic_config.json` beside
    `.safetensors` weights, else read off the weights (architecture_of); dropout (inactive in eval)
    defaults to LAION's."""
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS_NAME
    if not p.is_file():
        raise FileNotFoundError(f"aesthetic head weights not found: {p}")
    sd = _read_weights(p)
    cfg = {"dropout": LAION_DROPOUT, **architecture_of(sd)}
    if (p.parent / CONFIG_NAME).is_file() and p.suffix == ".safetensors":
        cfg.update(json.loads((p.parent / CONFIG_NAME).read_text()))
    given = {"input_dim": input_dim, "hidden": hidden, "dropout": dropout, "relu": relu}
    cfg.update({k: v for k, v in given.items() if v is not None})
    head = AestheticMLP(cfg["input_dim"], tuple(cfg["hidden"]), tuple(cfg["dropout"]), cfg["relu"])
    head.load_state_dict(sd, strict=True)
    return head.eval()
