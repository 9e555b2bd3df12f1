"""scripts/plot_runs.py: PNGs from a real tiny run's event files, the values it reads against
the run's history.jsonl, images/s, an accuracy axis holding every epoch, resumed and cut-short
event files, and one-line errors."""
import json
import shutil

import numpy as np
import pytest

from conftest import load_script, run_entry_point

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plot_runs():
    return load_script("plot_runs")


def history(run_dir):
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


def assert_png(path, min_bytes=2000, max_bytes=150_000):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert min_bytes < len(data) < max_bytes, (path, len(data))
    pixels = matplotlib.image.imread(path)  # (height, width, channels) floats in [0, 1]
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels[..., :3].std() > 0.05  # drawn on, not a blank canvas
    return pixels


def test_plots_curves_and_reconstructions_of_real_runs(plot_runs, trained_run, tmp_path, capsys):
    run_dir, _ = trained_run
    out = tmp_path / "img"
    written = plot_runs.main([str(run_dir), str(run_dir), "--out", str(out), "--names", "tiny,again"])

    expected = [out / "curves.png", out / "tiny_reconstructions.png", out / "again_reconstructions.png"]
    assert written == expected
    assert capsys.readouterr().out.split() == [str(p) for p in expected]
    for path in expected:
        assert_png(path)
    assert sorted(out.iterdir()) == sorted(expected)

    # The reconstruction PNG shows the last epoch's grid: dark background, bright strokes.
    grid = plot_runs.last_image(plot_runs.read_run(run_dir))[1]
    assert grid.shape == (2 * 28, 4 * 28, 1)  # train.num_images=4: inputs row over reconstructions row
    recon = assert_png(out / "tiny_reconstructions.png")
    assert recon.shape[1] / recon.shape[0] > 1.5  # the 4:2 grid's aspect (plus a title strip)


def test_reads_what_training_wrote(plot_runs, trained_run):
    run_dir, metrics = trained_run
    epochs = history(run_dir)
    run = plot_runs.load_run(run_dir)
    assert run["epochs"] == [h["epoch"] for h in epochs] == [1, 2, 3, 4]
    np.testing.assert_allclose(run["accuracy"], [h["test_accuracy"] for h in epochs], rtol=1e-6)
    test_x, test_loss = run["losses"]["test"]
    assert test_x == [1.0, 2.0, 3.0, 4.0]
    np.testing.assert_allclose(test_loss, [h["test_loss"] for h in epochs], rtol=1e-6)
    # Train losses are logged every 4 of the 20 steps of an epoch: x = step / 20.
    train_x, train_loss = run["losses"]["train"]
    assert train_x == pytest.approx([s / 20 for s in range(4, 81, 4)])
    assert all(np.isfinite(train_loss))
    # images/s: each log window's, where the train losses are (its first window has no timed step).
    speed_x, speeds = run["images_per_sec"]
    assert speed_x == train_x[-len(speed_x):] and len(speed_x) >= len(train_x) - 1
    assert all(s > 0 for s in speeds)
    assert run["mean_images_per_sec"] > 0
    assert run["image_epoch"] == 4


@pytest.mark.slow
def test_reads_the_trained_weights_accuracy_of_a_weight_average_run(plot_runs, tiny_config, tmp_path):
    """train.ema_decay > 0: test/accuracy is the average's, test/raw_accuracy (the dotted
    curve) the trained weights', each as history.jsonl has it; a run without one has none."""
    from capsnet.training import train

    run_dir = tmp_path / "ema"
    train(tiny_config("train.ema_decay=0.9", "train.epochs=2", run_dir=run_dir))
    epochs = history(run_dir)
    run = plot_runs.load_run(run_dir)
    np.testing.assert_allclose(run["accuracy"], [h["test_accuracy"] for h in epochs], rtol=1e-6)
    np.testing.assert_allclose(run["raw_accuracy"], [h["test_raw_accuracy"] for h in epochs], rtol=1e-6)
    assert_png(plot_runs.main([str(run_dir), "--out", str(tmp_path / "img")])[0])


@pytest.mark.slow
def test_a_run_tested_every_other_epoch_is_plotted_at_its_tested_epochs(plot_runs, tiny_config, tmp_path):
    """train.test_every_epochs=2: test points at epochs 2 and 4 (history.jsonl's tested epochs), not 1 and 2."""
    from capsnet.training import train

    run_dir = tmp_path / "every2"
    train(tiny_config("train.test_every_epochs=2", "train.epochs=4", run_dir=run_dir))
    tested = [h for h in history(run_dir) if "test_accuracy" in h]
    run = plot_runs.load_run(run_dir)
    assert run["epochs"] == [h["epoch"] for h in tested] == [2, 4]
    np.testing.assert_allclose(run["accuracy"], [h["test_accuracy"] for h in tested], rtol=1e-6)
    assert run["losses"]["test"][0] == [2.0, 4.0]
    assert run["losses"]["train"][0][-1] == pytest.approx(4.0)
    assert run["image_epoch"] == 4


def test_epochs_of_a_run_whose_time_scalars_start_late(plot_runs, tmp_path):
    """A run begun before train() wrote time/ scalars and resumed after: epochs from their spacing, not count."""
    import tensorflow as tf

    with tf.summary.create_file_writer(str(tmp_path)).as_default():
        for epoch in (1, 2, 3, 4):
            tf.summary.scalar("test/accuracy", 0.9 + epoch / 100, step=20 * epoch)
            if epoch >= 3:
                tf.summary.scalar("time/train_seconds", 1.0, step=20 * epoch)
        tf.summary.flush()
    run = plot_runs.load_run(tmp_path)
    assert run["epochs"] == [1, 2, 3, 4]
    np.testing.assert_allclose(run["accuracy"], [0.91, 0.92, 0.93, 0.94], rtol=1e-6)


def write_events(run_dir, accuracies, speeds, run_speeds=()):
    """A run's event files with a test accuracy an epoch of 20 steps, a train images/s window
    every 10 steps and, if given, the run's mean images/s after each epoch."""
    import tensorflow as tf

    with tf.summary.create_file_writer(str(run_dir)).as_default():
        for epoch, accuracy in enumerate(accuracies, start=1):
            tf.summary.scalar("test/accuracy", accuracy, step=20 * epoch)
            tf.summary.scalar("time/train_seconds", 1.0, step=20 * epoch)
        for k, speed in enumerate(speeds, start=1):
            tf.summary.scalar("train/images_per_sec", speed, step=10 * k)
        for epoch, speed in enumerate(run_speeds, start=1):
            tf.summary.scalar("train/mean_images_per_sec", speed, step=20 * epoch)
        tf.summary.flush()


def test_the_accuracy_axis_holds_every_epoch(plot_runs, tmp_path):
    """A slow start (10% then 60%) is drawn, not cut off below the axis."""
    write_events(tmp_path / "slow", [0.10, 0.60, 0.97, 0.98, 0.985], [50.0] * 10)
    write_events(tmp_path / "fast", [0.95, 0.97, 0.98], [60.0] * 6)
    runs = {name: plot_runs.load_run(tmp_path / name) for name in ("slow", "fast")}
    low, high = plot_runs.plot_curves(runs, tmp_path / "curves.png")
    assert low < 10.0 < 98.5 < high
    assert_png(tmp_path / "curves.png")


def test_long_run_names_are_shortened_and_the_legend_fits_beside_the_curves(plot_runs, tmp_path):
    """Three runs with train.py's auto-generated names (120 characters, the same overrides but
    the seed), one of them a single epoch: the legend shows the seed that differs, lies inside
    the image and covers no panel, and the one-epoch run's test point is drawn (a marker)."""
    common = "10-00-00_" + "+".join(f"model.some_long_key_{k}-{k}" for k in range(5))
    names = [f"{common}+seed-{seed}" for seed in range(3)]
    for name, accuracies in zip(names, ([0.9, 0.95, 0.97], [0.91, 0.96], [0.5])):
        write_events(tmp_path / name, accuracies, [50.0] * (2 * len(accuracies)))
    runs = {name: plot_runs.load_run(tmp_path / name) for name in names}
    assert plot_runs.short_names(names) == ["seed-0", "seed-1", "seed-2"]
    fig, _ = plot_runs.curves_figure(runs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert [t.get_text().split(" ")[0] for t in fig.legends[0].get_texts()] == ["seed-0", "seed-1", "seed-2"]
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1 and fig.bbox.y0 <= legend.y0 <= legend.y1 <= fig.bbox.y1
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
    one_epoch = fig.axes[0].get_lines()[2]
    assert list(one_epoch.get_xdata()) == [1] and one_epoch.get_marker() not in ("None", "", None)
    # A name longer than the legend's share is cut in the middle; names that shortening would
    # make equal stay whole.
    long = "x" * 200
    assert len(plot_runs.short_names([long])[0]) == plot_runs.LABEL_CHARS
    assert plot_runs.short_names(["10-00-00_a", "11-00-00_a"]) == ["10-00-00_a", "11-00-00_a"]


def test_images_per_sec_and_the_runs_mean(plot_runs, tmp_path):
    """The windows on an epoch axis; the mean is the run's as train() writes it (47 and 51 in
    the last window and epoch, 53 over the run), else for an older run the windows' mean."""
    write_events(tmp_path / "new", [0.9, 0.95], [57.0, 55.0, 59.0, 47.0], run_speeds=[56.0, 53.0])
    write_events(tmp_path / "old", [0.9, 0.95], [40.0, 44.0, 42.0, 46.0])
    new, old = plot_runs.load_run(tmp_path / "new"), plot_runs.load_run(tmp_path / "old")
    assert new["images_per_sec"] == ([0.5, 1.0, 1.5, 2.0], [57.0, 55.0, 59.0, 47.0])
    assert new["mean_images_per_sec"] == 53.0
    assert old["mean_images_per_sec"] == 43.0
    plot_runs.plot_curves({"new": new, "old": old}, tmp_path / "curves.png")
    assert_png(tmp_path / "curves.png")


def test_a_run_without_a_weight_average_has_no_raw_curve(plot_runs, trained_run):
    assert plot_runs.load_run(trained_run[0])["raw_accuracy"] == []


def test_purge_keeps_the_latest_value_of_rewritten_steps(plot_runs):
    # A run killed in epoch 3 (steps 50, 60 written), resumed from the epoch-2 checkpoint.
    written = [(20, "a"), (40, "b"), (50, "killed"), (60, "killed"), (50, "c"), (60, "d"), (80, "e")]
    assert plot_runs.purge_rewritten_steps(written) == [(20, "a"), (40, "b"), (50, "c"), (60, "d"), (80, "e")]
    assert plot_runs.purge_rewritten_steps([(10, "x"), (10, "y")]) == [(10, "y")]
    assert plot_runs.purge_rewritten_steps([]) == []


def test_resumed_and_cut_short_event_files(plot_runs, trained_run, tmp_path):
    import tensorflow as tf

    run_dir, _ = trained_run
    original = plot_runs.load_run(run_dir)
    copy = tmp_path / "resumed"
    copy.mkdir()
    (source,) = sorted(run_dir.glob("events.out.tfevents.*"))
    # An earlier start time in the name than the writer below gets: read first, whatever the mtimes.
    first = copy / "events.out.tfevents.1000000000.host.1.0.v2"
    shutil.copy(source, first)
    # A second process rewrote epoch 4 and trained a fifth epoch.
    with tf.summary.create_file_writer(str(copy)).as_default():
        for step, accuracy in ((80, 0.5), (100, 0.25)):
            tf.summary.scalar("test/accuracy", accuracy, step=step)
    resumed = plot_runs.load_run(copy)
    assert resumed["epochs"] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(resumed["accuracy"], original["accuracy"][:3] + [0.5, 0.25], rtol=1e-6)

    # A writer killed mid-record: the partial record is dropped, the rest is read.
    data = source.read_bytes()
    for path in copy.iterdir():
        path.unlink()
    (copy / source.name).write_bytes(data + data[:30])
    np.testing.assert_allclose(plot_runs.load_run(copy)["accuracy"], original["accuracy"], rtol=1e-6)


@pytest.mark.slow
def test_bad_inputs_exit_2_with_one_line(plot_runs, trained_run, tmp_path, capsys):
    run_dir, _ = trained_run
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "o")], "missing"),
        ([str(empty), "--out", str(tmp_path / "o")], "no TensorBoard event files"),
        ([str(run_dir), "--out", str(tmp_path / "o"), "--names", "a,b"], "2 names for 1 run dirs"),
        ([str(run_dir), str(run_dir), "--out", str(tmp_path / "o")], "unique"),
        ([str(run_dir), "--out", str(tmp_path / "o"), "--names", "../x"], "'../x'"),
    ]
    for argv, words in cases:
        with pytest.raises(SystemExit) as exit_info:
            plot_runs.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "o").exists()
    # A default run dir name (overrides joined by "+") is a plain name: only the name is checked here.
    assert plot_runs.parse_args([str(run_dir), "--out", str(tmp_path / "o"), "--names",
                                 "10-00-00_custom_op-true+seed-1"]).names == ["10-00-00_custom_op-true+seed-1"]

    # As a user runs it: the same one line from the command line, and nothing on stdout.
    result = run_entry_point("scripts/plot_runs.py", tmp_path / "missing", "--out", tmp_path / "o", cwd=tmp_path,
                             timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == f"error: run dir {tmp_path / 'missing'} does not exist or is not a directory\n"
