"""capsnet/figures.py and scripts/visualize.py: the perturbation grid against the decoder
run here, c_ij maps against capsnet/routing/functional.py's routing of u_hat computed in
NumPy, the confusion counts against a loop, the PNG files and their sizes, and the
end-of-training figures in TensorBoard."""
import shutil

import numpy as np
import pytest

from conftest import load_script, read_events

# conftest's TINY_MODEL as CapsNet arguments: 6x6x4 primary capsules, 8D digit capsules.
TINY = {"conv1_filters": 16, "primary_caps_types": 4, "digit_caps_dim": 8, "decoder_units": (32, 64)}


@pytest.fixture(scope="module")
def tiny_capsnet():
    import keras

    from capsnet.model import build_model

    keras.utils.set_random_seed(3)
    return build_model(**TINY)


def test_perturbed_capsules_move_one_entry_each():
    from capsnet.figures import PERTURBATIONS, perturbed_capsules

    assert PERTURBATIONS.tolist() == [-0.25, -0.2, -0.15, -0.1, -0.05, 0.0, 0.05, 0.1, 0.15, 0.2, 0.25]
    v_j = np.random.default_rng(0).normal(size=(10, 8)).astype(np.float32)
    out = perturbed_capsules(v_j, 3).reshape(8, 11, 10, 8)
    for d in range(8):
        for s, step in enumerate(PERTURBATIONS):
            expected = v_j.copy()
            expected[3, d] += step
            np.testing.assert_allclose(out[d, s], expected, rtol=0, atol=1e-7)


def test_perturbation_grid_at_step_zero_is_the_plain_reconstruction(tiny_capsnet):
    import tensorflow as tf

    from capsnet.figures import PERTURBATIONS, model_figures

    model = tiny_capsnet
    rng = np.random.default_rng(1)
    images = rng.random((20, 28, 28, 1)).astype(np.float32)
    labels = np.arange(20) % 10
    figures = model_figures(model, images, labels)
    v_j = model(tf.constant(images), training=False)["v_j"]
    zero = list(PERTURBATIONS).index(0.0)
    for k in (0, 7):  # class k's first example is example k
        grid = figures.images[f"perturbation/{k}"]
        assert grid.shape == (8 * 28, 11 * 28, 1)
        plain = model.decoder(v_j[k:k + 1], tf.constant([k])).numpy()[0]      # (28, 28, 1)
        for d in range(8):
            np.testing.assert_allclose(grid[d * 28:(d + 1) * 28, zero * 28:(zero + 1) * 28], plain, atol=1e-5)
        # A nonzero step changes the picture (the decoder reads the perturbed entry).
        assert np.abs(grid[:28, :28] - grid[:28, zero * 28:(zero + 1) * 28]).max() > 0
    # Inputs over reconstructions: class k's tile is example k over the model's reconstruction of it.
    grid = figures.images["reconstructions"]
    assert grid.shape == (56, 10 * 28, 1)
    reconstructions = model(tf.constant(images), training=False)["reconstructions"].numpy()
    np.testing.assert_allclose(grid[:28, 7 * 28:8 * 28], images[7], atol=1e-6)
    np.testing.assert_allclose(grid[28:, 7 * 28:8 * 28], reconstructions[7], atol=1e-5)


def test_routing_maps_are_the_reference_routing_on_the_capsule_grid(tiny_capsnet):
    import tensorflow as tf

    from capsnet.figures import primary_grid, routing_maps
    from capsnet.routing.functional import dynamic_routing

    model = tiny_capsnet
    images = np.random.default_rng(2).random((3, 28, 28, 1)).astype(np.float32)
    c_ij = model(tf.constant(images), training=False)["c_ij"].numpy()             # (3, 144, 10)
    np.testing.assert_allclose(c_ij.sum(axis=-1), 1.0, rtol=1e-5)
    # The reference: u from the model's own layers, u_hat = W u in NumPy, the functional routing.
    u = model.primary_caps(model.conv1(tf.constant(images))).numpy()               # (3, 144, 8)
    W = model.digit_caps.W.numpy()                                                 # (144, 10, 8, 8)
    u_hat = np.einsum("ijdk,bik->bijd", W, u)                                      # (3, 144, 10, 8)
    _, reference = dynamic_routing(tf.constant(u_hat), iterations=3)
    np.testing.assert_allclose(c_ij, reference.numpy(), atol=1e-5)
    assert primary_grid(model) == (6, 6, 4)
    maps = routing_maps(c_ij[1], (6, 6, 4))                                        # (10, 6, 6)
    for k in (0, 9):
        for h, w in ((0, 0), (2, 5), (5, 5)):
            # PrimaryCaps' order: capsule i = (h·6 + w)·4 + t.
            expected = np.mean([reference.numpy()[1, (h * 6 + w) * 4 + t, k] for t in range(4)])
            assert maps[k, h, w] == pytest.approx(expected, abs=1e-6)


def test_confusion_counts_are_a_loop_count():
    from capsnet.figures import confusion_counts

    rng = np.random.default_rng(4)
    labels, predictions = rng.integers(0, 10, 300), rng.integers(0, 10, 300)
    expected = np.zeros((10, 10), np.int64)
    for label, prediction in zip(labels, predictions):
        expected[label, prediction] += 1
    np.testing.assert_array_equal(confusion_counts(labels, predictions, 10), expected)


@pytest.mark.parametrize("names", [
    [str(k) for k in range(10)],                                                  # MNIST's digits
    ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
    [f"a folder of images named at length, number {k}" for k in range(12)],       # data=folder's own classes
    [f"class_{k:03d}" for k in range(40)],
])
def test_the_confusion_matrix_s_class_names_stay_apart_and_inside(names):
    """Its tick labels, drawn: none overlaps another, all inside the figure, and no two alike."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from capsnet.figures import _confusion_chart

    figure = Figure(dpi=80)
    canvas = FigureCanvasAgg(figure)
    _confusion_chart(figure, np.diag(np.arange(1, len(names) + 1)), names)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = figure.axes[0]
    for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
        boxes = [label.get_window_extent(renderer) for label in labels]
        assert len({label.get_text() for label in labels}) == len(names)
        for i, box in enumerate(boxes):
            assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 + 0.5, labels[i].get_text()
            assert figure.bbox.y0 <= box.y0 and box.y1 <= figure.bbox.y1 + 0.5, labels[i].get_text()
            assert not any(box.overlaps(other) for other in boxes[i + 1:]), labels[i].get_text()


def test_no_decoder_and_the_cnn_leave_figures_out_with_a_reason():
    from capsnet.baseline import build_baseline
    from capsnet.figures import model_figures
    from capsnet.model import build_model

    images = np.random.default_rng(5).random((10, 28, 28, 1)).astype(np.float32)
    labels = np.arange(10)
    plain = model_figures(build_model(**TINY, decoder=False), images, labels)
    assert set(plain.images) == {"routing", "lengths", "confusion"}
    assert plain.notes == ["perturbation, reconstructions: left out, the model has no decoder (model.decoder=false)"]
    cnn = model_figures(build_baseline(filters=(4,), dense_units=(8,)), images, labels)
    assert set(cnn.images) == {"lengths", "confusion"}
    assert len(cnn.notes) == 1 and "has no capsules" in cnn.notes[0]


def test_visualize_writes_pngs_of_a_run_and_training_put_them_in_tensorboard(trained_run, tmp_path, capsys):
    import tensorflow as tf

    run_dir, metrics = trained_run
    visualize = load_script("visualize")
    written = visualize.main([str(run_dir), "--out", str(tmp_path / "figs"), "--examples", "60"])
    names = {p.name for p in written}
    assert names == {*(f"perturbation_{k}.png" for k in range(10)), "reconstructions.png", "routing.png",
                     "lengths.png", "confusion.png"}
    assert capsys.readouterr().out.split() == [str(p) for p in written]
    sizes = {p.name: tf.io.decode_png(p.read_bytes()).shape for p in written}
    assert sizes["perturbation_4.png"] == (8 * 28, 11 * 28, 1)
    assert sizes["reconstructions.png"] == (2 * 28, 10 * 28, 1)
    assert sizes["confusion.png"][2] == 4 and sizes["routing.png"][2] == 4
    events = read_events(run_dir)
    assert {f"figures/perturbation/{k}" for k in range(10)} | {"figures/routing", "figures/lengths",
                                                               "figures/confusion"} <= set(events)
    step, value = events["figures/perturbation/4"][-1]
    assert step == metrics["global_step"]
    width, height = (int(x) for x in tf.make_ndarray(value.tensor)[:2])
    assert (height, width) == (8 * 28, 11 * 28)


def test_visualize_refuses_a_missing_run_dir_in_one_line(tmp_path, capsys):
    visualize = load_script("visualize")
    with pytest.raises(SystemExit) as exit_info:
        visualize.main([str(tmp_path / "nowhere")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: run dir or checkpoint {tmp_path / 'nowhere'} does not exist"


def test_displayable_keeps_unit_images_and_stretches_standardised_ones():
    from capsnet.figures import displayable

    unit = np.array([[0.0, 0.25], [0.5, 1.0]], np.float32)
    np.testing.assert_array_equal(displayable(unit), unit)
    standardised = np.array([[-2.0, 0.0], [1.0, 2.0]], np.float32)  # per-image standardisation's range
    np.testing.assert_allclose(displayable(standardised), [[0.0, 0.5], [0.75, 1.0]])
    np.testing.assert_array_equal(displayable(np.full((2, 2), 3.0, np.float32)), np.zeros((2, 2)))


def test_visualize_defaults_to_evaluates_checkpoint(trained_run, tmp_path, capsys):
    """A run without a validation split: evaluate.py's default is latest/ (best/ was chosen on the test
    set); visualize.py reads the same one and says which, so it works without best/."""
    run_dir, _ = trained_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "best")
    visualize = load_script("visualize")
    visualize.main([str(copy), "--out", str(tmp_path / "figs"), "--examples", "10"])
    latest = (copy / "checkpoints" / "latest").resolve()
    err = capsys.readouterr().err
    assert err.startswith(f"figures of {latest}/ckpt-") and "on the first 10 test examples" in err
