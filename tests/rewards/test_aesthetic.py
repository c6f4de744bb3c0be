"""The LAION v2 aesthetic head: exact layout of the released weights, save/load, affinity, training."""

import json

import pytest
import torch
import torch.nn.functional as F

from grpo_vision.rewards.aesthetic import (
    CONFIG_NAME, AestheticMLP, load_aesthetic, save_aesthetic,
)
from grpo_vision.shapes.build.train_aesthetic import SHAPES_HIDDEN, fit_aesthetic, spearman


pytestmark = pytest.mark.usefixtures("one_thread")


# sac+logos+ava1-l14-linearMSE.pth, inspected (research notes, section B)
LAION_SHAPES = {
    "layers.0.weight": (1024, 768), "layers.0.bias": (1024,),
    "layers.2.weight": (128, 1024), "layers.2.bias": (128,),
    "layers.4.weight": (64, 128), "layers.4.bias": (64,),
    "layers.6.weight": (16, 64), "layers.6.bias": (16,),
    "layers.7.weight": (1, 16), "layers.7.bias": (1,),
}


def test_laion_layout_keys_and_shapes_are_exact():
    sd = AestheticMLP(768).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == LAION_SHAPES
    # a state dict with exactly those keys (what the real file holds) loads strictly
    AestheticMLP(768).load_state_dict({k: torch.zeros(s) for k, s in LAION_SHAPES.items()}, strict=True)


def test_relu_variant_puts_linears_where_upstream_does():
    # upstream avaclipmlp_inf_wds-relu.py: Linear, ReLU, Dropout x3, then Linear, ReLU, Linear
    head = AestheticMLP(768, relu=True)
    linears = sorted({int(k.split(".")[1]) for k in head.state_dict()})
    assert linears == [0, 3, 6, 9, 11]
    assert [type(m).__name__ for m in head.layers][:3] == ["Linear", "ReLU", "Dropout"]


def test_pth_round_trip_gives_identical_scores(tmp_path):
    torch.manual_seed(0)
    head = AestheticMLP(768).eval()
    torch.save(head.state_dict(), tmp_path / "head.pth")
    loaded = load_aesthetic(tmp_path / "head.pth", input_dim=768)
    x = F.normalize(torch.randn(5, 768), dim=-1)
    assert torch.equal(head(x), loaded(x))
    assert not loaded.training


def test_pth_architecture_is_read_off_the_weights(tmp_path):
    # The LAION files carry no config: the linear head, the ReLU variant (layers.{0,3,6,9,11}) and a
    # head for another CLIP width all load from the state dict alone, also inside {"state_dict": ...}.
    torch.manual_seed(0)
    heads = {"linear.pth": AestheticMLP(768), "relu.pth": AestheticMLP(768, relu=True),
             "small.pth": AestheticMLP(64, SHAPES_HIDDEN, relu=True)}
    for name, head in heads.items():
        head.eval()
        torch.save(head.state_dict() if name != "small.pth" else {"state_dict": head.state_dict()}, tmp_path / name)
        loaded = load_aesthetic(tmp_path / name)
        assert loaded.config == head.config
        x = F.normalize(torch.randn(3, head.config["input_dim"]), dim=-1)
        assert torch.equal(head(x), loaded(x))
    torch.save({"fc.weight": torch.zeros(1, 768)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="5 Linear layers"):
        load_aesthetic(tmp_path / "other.pth")


def test_safetensors_directory_round_trip_rebuilds_the_small_head(tmp_path):
    torch.manual_seed(0)
    head = AestheticMLP(64, SHAPES_HIDDEN, relu=True).eval()
    save_aesthetic(head, tmp_path)
    assert json.loads((tmp_path / CONFIG_NAME).read_text())["hidden"] == list(SHAPES_HIDDEN)
    loaded = load_aesthetic(tmp_path)  # architecture from aesthetic_config.json
    x = F.normalize(torch.randn(7, 64), dim=-1)
    assert torch.equal(head(x), loaded(x))


def test_linear_head_is_affine_in_eval_mode():
    torch.manual_seed(0)
    head = AestheticMLP(768).eval()  # dropout off; no activations
    x, y = torch.randn(4, 768, dtype=torch.float64), torch.randn(4, 768, dtype=torch.float64)
    head = head.double()
    for a in (-1.5, 0.3, 2.0):
        assert torch.allclose(head(a * x + (1 - a) * y), a * head(x) + (1 - a) * head(y), atol=1e-10)
    relu = AestheticMLP(768, relu=True).double().eval()  # the ReLU variant is not
    with torch.no_grad():
        for m in relu.layers:
            if isinstance(m, torch.nn.Linear):
                m.bias.normal_()
    a = 0.5
    assert not torch.allclose(relu(a * x + (1 - a) * y), a * relu(x) + (1 - a) * relu(y), atol=1e-6)


def test_score_normalises_its_input():
    head = AestheticMLP(64, SHAPES_HIDDEN).eval()
    x = torch.randn(3, 64)
    assert torch.allclose(head.score(10 * x), head(F.normalize(x, dim=-1)))


def test_missing_weights_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        load_aesthetic(tmp_path / "nope.pth")
    with pytest.raises(FileNotFoundError, match="aesthetic.safetensors"):
        load_aesthetic(tmp_path)  # a directory without weights


def test_spearman_matches_hand_values():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert spearman(a, a * 10) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    # ranks (1,2,3,4) vs (2,1,4,3): 1 - 6 * sum d^2 / (n (n^2 - 1)) = 1 - 6 * 4 / 60 = 0.6
    assert spearman(a, torch.tensor([2.0, 1.0, 4.0, 3.0])) == pytest.approx(0.6)


def test_fit_on_precomputed_embeddings_learns_a_hidden_rating():
    # Embeddings that carry the rating along one direction, among 63 nuisance directions, the
    # way a CLIP embedding carries image quality among content: the head must find it.
    g = torch.Generator().manual_seed(0)
    n, d = 2048, 64
    rating = torch.randint(0, 11, (n,), generator=g).float()  # 0..10
    emb = torch.randn(n, d, generator=g)
    emb[:, 0] = (rating - 5) / 3
    emb = F.normalize(emb, dim=-1)
    head, info = fit_aesthetic(emb[:1536], rating[:1536], epochs=10, batch_size=128, seed=0)
    rho = spearman(head(emb[1536:]).detach(), rating[1536:])
    assert rho > 0.5, (rho, info)
