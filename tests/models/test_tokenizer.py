"""The VQ tokenizer: a diffusers VQModel behind encode/decode, saved and loaded as a diffusers folder."""

import pytest
import torch

from grpo_vision.shapes.build.train_vq import EMACodebook, VQ_PRESETS, build_vq, image_loss, kmeans
from grpo_vision.models.tokenizer import Float32GroupNorm, ImageTokenizer, VQTokenizer


@pytest.fixture(scope="module")
def tok():
    torch.manual_seed(0)
    return build_vq(VQ_PRESETS["micro"]).eval()


def test_round_trip_shapes_and_dtypes(tok):
    assert isinstance(tok, ImageTokenizer) and tok.grid == (8, 8) and tok.codebook_size == 256
    images = torch.rand(3, 3, 64, 64)
    codes = tok.encode(images)
    assert codes.shape == (3, 64) and codes.dtype == torch.int64
    assert 0 <= codes.min() and codes.max() < 256
    out = tok.decode(codes)
    assert out.shape == (3, 3, 64, 64) and out.dtype == torch.float32
    assert 0 <= out.min() and out.max() <= 1


def test_codes_are_the_nearest_codebook_entries(tok):
    z = tok.latents(torch.rand(2, 3, 64, 64))  # [2, D, 8, 8]
    codes = tok.nearest(z)
    flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    brute = torch.cdist(flat, tok.codebook).argmin(1)  # slow, obvious
    assert torch.equal(codes.flatten(), brute)
    torch.testing.assert_close(tok.lookup(codes), tok.codebook[codes].view(2, 8, 8, -1).permute(0, 3, 1, 2))


def test_save_and_load_give_identical_outputs(tok, tmp_path):
    tok.save_pretrained(tmp_path / "vq")
    assert (tmp_path / "vq" / "config.json").is_file()
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "vq").iterdir())
    loaded = VQTokenizer.from_pretrained(tmp_path / "vq")
    images = torch.rand(2, 3, 64, 64)
    assert torch.equal(loaded.encode(images), tok.encode(images))
    codes = tok.encode(images)
    assert torch.equal(loaded.decode(codes), tok.decode(codes))
    loaded.save_pretrained(tmp_path / "again")  # a loaded model remembers its path; the saved config must not
    assert "_name_or_path" not in (tmp_path / "again" / "config.json").read_text()
    assert torch.equal(VQTokenizer.from_pretrained(tmp_path / "again").decode(codes), tok.decode(codes))


def test_group_norms_run_in_float32_under_autocast(tok):
    norms = [m for m in tok.vq.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(type(m) is Float32GroupNorm for m in norms)
    norm = norms[0]
    x = torch.randn(2, norm.num_channels, 8, 8)
    plain = torch.nn.functional.group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps)
    assert torch.equal(norm(x), plain)  # without autocast: exactly nn.GroupNorm
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16  # the autocast dtype flows on to the next convolution
    torch.testing.assert_close(out.float(), torch.nn.functional.group_norm(
        x.bfloat16().float(), norm.num_groups, norm.weight, norm.bias, norm.eps).bfloat16().float())


def test_errors_name_the_problem(tok, tmp_path):
    with pytest.raises(ValueError, match="expected 64 codes per image, got 10"):
        tok.decode(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(FileNotFoundError, match="VQ tokenizer .*nowhere has no config.json"):
        VQTokenizer.from_pretrained(tmp_path / "nowhere")


def test_code_vectors_are_the_unit_codebook_directions(tok):
    # the tokenizer hook train.token_weighting=stage reads (step/credit.py: STAGE's e)
    from grpo_vision.policy import check_weighting_hooks

    assert isinstance(tok, VQTokenizer)
    codes = torch.tensor([[0, 5, 5], [7, 0, 1]])
    vectors = tok.code_vectors(codes)  # [2, 3, D], unit length, the codebook's directions
    assert vectors.shape == (2, 3, tok.codebook.shape[1])
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(2, 3))
    torch.testing.assert_close(vectors[0, 1], torch.nn.functional.normalize(tok.codebook[5], dim=0))
    assert torch.equal(vectors[0, 1], vectors[0, 2])
    check_weighting_hooks("stage", "llama", None, tok)  # stage reads the tokenizer alone


def test_kmeans_finds_separated_clusters():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    x = torch.cat([c + 0.1 * torch.randn(100, 2, generator=g) for c in centres])
    found = kmeans(x, 3, 10, g)
    assert torch.cdist(found, centres).min(0).values.max() < 0.1


def test_ema_codebook_moves_codes_to_their_means_and_restarts_dead_ones():
    g = torch.Generator().manual_seed(0)
    book = torch.tensor([[0.0, 0.0], [5.0, 5.0], [100.0, 100.0]])
    ema = EMACodebook(book, decay=0.0)  # decay 0: the codebook becomes this batch's means at once
    flat = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 6.0]])
    restarted = ema.update(flat, torch.tensor([0, 0, 1]), g)
    torch.testing.assert_close(book[0], torch.tensor([0.5, 0.5]), atol=1e-4, rtol=0)
    torch.testing.assert_close(book[1], torch.tensor([5.0, 6.0]), atol=1e-4, rtol=0)
    assert restarted == 1 and any(torch.equal(book[2], row) for row in flat)  # unused code moved onto data


def test_image_loss_weights_objects_and_edges():
    target = torch.full((1, 3, 16, 16), 0.9)
    target[..., 4:8, 4:8] = 0.1  # a dark object on a light background
    assert image_loss(target, target).item() == 0.0
    bg_err, obj_err = target.clone(), target.clone()
    bg_err[..., 12, 12] -= 0.3  # one background pixel wrong
    obj_err[..., 5, 5] += 0.3  # one object pixel wrong, same size of error
    assert image_loss(obj_err, target) > image_loss(bg_err, target)
