"""capsnet/training/summaries.py's HParams: the run's epochs and data limits among the
hparams, and images/s as the run's mean (metrics.json's), not the last logged window."""
import json

import numpy as np
import pytest

from conftest import compose_config, read_events, tiny_overrides


def hparams_events(run_dir):
    """(session_start_info, experiment) of the HParams summaries in run_dir's event files."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = read_events(run_dir)

    def plugin_data(tag):
        return plugin_data_pb2.HParamsPluginData.FromString(events[tag][0][1].metadata.plugin_data.content)

    return plugin_data("_hparams_/session_start_info").session_start_info, plugin_data("_hparams_/experiment").experiment


@pytest.mark.parametrize("overrides, routing, backend", [
    (["custom_op=true"], "dynamic", "fused_op"),
    (["custom_op=false", "model.routing.backend=xla"], "dynamic", "matmul_xla"),
    (["custom_op=true", "model/routing=self_attention"], "self_attention", "op"),
    (["model=baseline_cnn"], "none", "none"),
])
def test_hparams_hold_the_routing_algorithm_and_its_backend(tiny_idx_dir, tmp_path, overrides, routing, backend):
    """A model/routing= sweep's rows differ in HParams: the algorithm and the backend the
    model was built with (the Router make_router builds from the config), not custom_op alone."""
    import tensorflow as tf

    from capsnet.routing import make_router
    from capsnet.training import summaries

    cfg = compose_config("train", tiny_overrides(tiny_idx_dir, tmp_path / "run", *overrides))
    writer = tf.summary.create_file_writer(str(tmp_path / "run"))
    summaries.write_hparams(writer, tmp_path / "run", cfg, cfg["data"])
    writer.close()

    start, experiment = hparams_events(tmp_path / "run")
    assert (start.hparams["routing"].string_value, start.hparams["backend"].string_value) == (routing, backend)
    if routing != "none":
        from capsnet import config

        built = make_router(**config.router_spec(cfg["custom_op"], cfg["model"]))
        assert (built.algorithm, built.backend) == (routing, backend)
    assert {"routing", "backend"} <= {info.name for info in experiment.hparam_infos}


def scalars(run_dir, tag):
    import tensorflow as tf

    return [(step, float(tf.make_ndarray(value.tensor))) for step, value in read_events(run_dir).get(tag, [])]


def test_hparams_hold_the_epochs_and_data_limits(tiny_idx_dir, tmp_path):
    import tensorflow as tf

    from capsnet.training import summaries

    cfg = compose_config("train", tiny_overrides(tiny_idx_dir, tmp_path / "run", "train.epochs=3",
                                                 "data.limit_train=200"))
    writer = tf.summary.create_file_writer(str(tmp_path / "run"))
    summaries.write_hparams(writer, tmp_path / "run", cfg, cfg["data"])
    writer.close()

    start, experiment = hparams_events(tmp_path / "run")
    assert start.hparams["epochs"].number_value == 3
    assert start.hparams["limit_train"].number_value == 200
    assert start.hparams["limit_test"].number_value == 0  # null: all, as the description says
    assert start.hparams["custom_op"].bool_value is False and start.hparams["dataset"].string_value == "mnist"
    infos = {info.name: info for info in experiment.hparam_infos}
    assert {"epochs", "limit_train", "limit_test"} <= set(infos)
    assert "0: all" in infos["limit_train"].description
    metrics = {m.name.tag: m.display_name for m in experiment.metric_infos}
    assert metrics == {"test/accuracy": "test accuracy (last tested epoch)",
                       "validation/accuracy": "validation accuracy (last tested epoch; data.validation_fraction)",
                       "train/mean_images_per_sec": "images/s (the run's mean)"}


def test_the_run_speed_is_the_mean_of_its_epochs_so_far(tmp_path):
    """The numbers of the report: windows ending at 47 images/s while the epochs averaged 51."""
    import tensorflow as tf

    from capsnet.training import summaries

    history = [{"epoch": 1, "train_images_per_sec": 55.0}, {"epoch": 2, "train_images_per_sec": 51.0},
               {"epoch": 3, "train_images_per_sec": 47.0}]
    writer = tf.summary.create_file_writer(str(tmp_path))
    for epoch in (1, 2, 3):
        summaries.write_run_scalars(writer, history[:epoch], step=20 * epoch)
    summaries.write_run_scalars(writer, [{"epoch": 1}], step=80)  # no speed measured yet: nothing written
    writer.close()
    assert scalars(tmp_path, "train/mean_images_per_sec") == [(20, 55.0), (40, 53.0), (60, 51.0)]
    assert summaries.mean_images_per_sec(history) == pytest.approx(np.mean([55.0, 51.0, 47.0]))
    assert summaries.mean_images_per_sec([]) is None


def test_a_trained_runs_hparams_speed_is_its_metrics_json_mean(trained_run):
    """End to end: the HParams images/s column (the metric's last value) is metrics.json's
    images_per_sec, written after every epoch by the training loop."""
    run_dir, _ = trained_run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    speeds = scalars(run_dir, "train/mean_images_per_sec")
    assert [step for step, _ in speeds] == [h["global_step"] for h in history]
    assert speeds[-1][1] == pytest.approx(metrics["images_per_sec"], rel=1e-6)
    assert speeds[-1][1] != pytest.approx(scalars(run_dir, "train/images_per_sec")[-1][1], rel=1e-6)
    start, _ = hparams_events(run_dir)
    assert start.hparams["epochs"].number_value == len(history)
