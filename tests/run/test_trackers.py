"""The trackers (run/trackers.py) on micro runs: TensorBoard's event files hold the sample grid as an image
and its text; W&B (offline) and MLflow (a local file store) are written and read back where installed;
log.stop_on stops a run at the alert it names. Each run is a few seconds of the micro world in this process."""

import importlib.util
import json

import pytest

from grpo_vision.config import ConfigError
from grpo_vision.run.metrics import load_metrics
from tests.helpers import micro_cfg


def run_micro(world, out, *overrides):
    from grpo_vision.train import train

    return train(micro_cfg(world, out, "log.report=false", *overrides), progress=False)


def test_tensorboard_holds_the_sample_grid_its_text_and_the_scalars(micro_world, tmp_path, one_thread):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = run_micro(micro_world, tmp_path, "log.sample_every=1", "log.trackers=[tensorboard]")
    events = EventAccumulator(str(run / "tensorboard" / "grpo_vision"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    images = events.Images("samples/grid")
    assert [e.step for e in images] == [1, 2]  # at log.sample_every, as samples/step_N.png
    from PIL import Image

    disk = Image.open(run / "samples" / "step_000002.png")
    assert (images[1].width, images[1].height) == disk.size
    text = events.Tensors("samples/grid/text_summary")[1].tensor_proto.string_val[0].decode()
    prompts = [json.loads(ln)["prompt"] for ln in (run / "prompts" / "test.jsonl").read_text().splitlines()[:4]]
    assert all(p in text for p in prompts)  # the grid's first four rows are test prompts
    assert "clip: policy / reference" in text and "shapes_exact: policy / reference" in text
    assert "judge: policy / reference" in text and ("right" in text or "wrong: " in text)
    rows = load_metrics(run)
    logged = [e.value for e in events.Scalars("reward/clip/mean")]
    assert logged == pytest.approx([r["reward/clip/mean"] for r in rows])
    assert [e.value for e in events.Scalars("judge/correct")] == pytest.approx([r["judge/correct"] for r in rows])
    assert all(r["reward/clip/group_std"] >= 0 for r in rows)


def test_no_trackers_write_no_events(micro_world, tmp_path, one_thread):
    run = run_micro(micro_world, tmp_path, "log.sample_every=1", "log.trackers=[]")
    assert not (run / "tensorboard").exists() and not (run / "trackers.json").exists()
    assert len(load_metrics(run)) == 2 and (run / "samples" / "step_000002.png").is_file()


def test_a_tracker_that_is_not_installed_is_named_before_the_run_starts(micro_world, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"log.trackers names wandb, and the wandb package is not installed: "
                                          r"pip install 'grpo_vision\[wandb\]'"):
        run_micro(micro_world, tmp_path, "log.trackers=[tensorboard,wandb]")
    assert not (tmp_path / "shapes_micro").exists()
    with pytest.raises(ConfigError, match="log.trackers .* may name only tensorboard, wandb, mlflow"):
        micro_cfg(micro_world, tmp_path, "log.trackers=[neptune]")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install "
                                                                      "'grpo_vision[wandb]')")
def test_wandb_offline_gets_the_grid_and_the_rollouts_table(micro_world, tmp_path, monkeypatch, one_thread):
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: everything stays in run/wandb/ and WANDB_DATA_DIR
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    run = run_micro(micro_world, tmp_path, "log.sample_every=1", "log.trackers=[wandb]")
    wandb_id = json.loads((run / "trackers.json").read_text())["wandb"]
    [offline] = (run / "wandb").glob(f"offline-run-*-{wandb_id}")
    assert (offline / f"run-{wandb_id}.wandb").stat().st_size > 0
    assert len(list((offline / "files" / "media" / "images" / "samples").glob("grid_*.png"))) == 2
    rows = load_metrics(run)
    for step in (1, 2):
        [table] = (offline / "files" / "media" / "table").glob(f"rollouts_{step}_*.table.json")
        table = json.loads(table.read_text())
        assert table["columns"] == ["prompt", "image", "clip", "aesthetic", "shapes_exact", "advantage", "judge"]
        assert len(table["data"]) == 8  # 2 prompts x 4 images, one process
        clip = [r[2] for r in table["data"]]
        assert sum(clip) / len(clip) == pytest.approx(rows[step - 1]["reward/clip/mean"], abs=1e-6)
        assert sum(r[5] for r in table["data"]) == pytest.approx(0, abs=1e-2)  # advantages centre on their groups
        assert all(r[6] == "right" or r[6].startswith("wrong: ") for r in table["data"])
    # the images of the table travel as its run-table artifact, staged until `wandb sync`
    staged = [p.read_bytes()[:8] for p in (tmp_path / "wandb_data").rglob("*") if p.is_file()]
    assert sum(b.startswith(b"\x89PNG") for b in staged) >= 16


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (pip install "
                                                                       "'grpo_vision[mlflow]')")
def test_mlflow_file_store_gets_the_scalars_and_grids_and_a_resume_continues_its_run(micro_world, tmp_path,
                                                                                     monkeypatch, one_thread):
    from mlflow.tracking import MlflowClient

    from grpo_vision.run.folder import resume_config
    from grpo_vision.train import train

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for local use behind this
    run = run_micro(micro_world, tmp_path, "log.sample_every=1", "log.trackers=[mlflow]")
    train(resume_config(run, ["train.steps=3"]), resume=run, progress=False)
    client = MlflowClient(uri)
    [found] = client.search_runs([client.get_experiment_by_name("grpo_vision").experiment_id])
    assert found.info.run_id == json.loads((run / "trackers.json").read_text())["mlflow"]  # one run, resumed
    history = client.get_metric_history(found.info.run_id, "reward/clip/mean")
    rows = load_metrics(run)
    assert [m.step for m in history] == [1, 2, 3] == [r["step"] for r in rows]
    assert [m.value for m in history] == pytest.approx([r["reward/clip/mean"] for r in rows])
    assert found.data.params["sample.group_size"] == "4"
    assert sorted(a.path for a in client.list_artifacts(found.info.run_id, "samples")) == [
        "samples/step_000001.png", "samples/step_000002.png", "samples/step_000003.png"]


def test_stop_on_stops_at_the_alert_with_a_checkpoint_and_the_report_lists_it(micro_world, tmp_path, one_thread):
    from grpo_vision.run.checkpoint import latest_checkpoint
    from grpo_vision.train import StoppedByAlert, train

    # num_iterations 2 moves loss/ratio_mean off 1 by about 1e-4; with no tolerance and a hair of noise allowed
    # ratio_drift fires at step 2, the first full window
    cfg = micro_cfg(micro_world, tmp_path, "train.steps=4", "log.alerts.window=2", "log.alerts.sigmas=1e-6",
                    "log.alerts.ratio_tolerance=0", "log.stop_on=[ratio_drift]", "log.checkpoint_every=0")
    with pytest.raises(StoppedByAlert, match=r"stopped by the ratio_drift alert at step 2 \(log.stop_on\): .* to go on "
                                             r"anyway: grpo-vision train --resume .* log.stop_on=\[\]") as stopped:
        train(cfg, progress=False)  # the CLI says it in one line and exits 1 (a stop, not "done")
    run = stopped.value.run_dir
    assert [r["step"] for r in load_metrics(run)] == [1, 2]
    assert latest_checkpoint(run).name == "step_000002"
    alerts = [json.loads(ln) for ln in (run / "alerts.jsonl").read_text().splitlines()]
    assert [(a["step"], a["name"]) for a in alerts] == [(2, "ratio_drift")]
    report = (run / "report.md").read_text()
    assert "## Alerts during training" in report and "- step 2, **ratio_drift**: loss/ratio_mean averaged" in report
