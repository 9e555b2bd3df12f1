"""The entry points' --help (each key with its default and its comment in configs/) and the
errors they report before TensorFlow loads. In this process: each script's Hydra main is run
through capsnet.cli.run with its command line in sys.argv; TensorFlow's import is replaced by
a failure, so an error reported here came before it. One slow test checks sys.modules in a
fresh interpreter for all of them."""
import dataclasses
import logging
import runpy
import string
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml

from conftest import REPO, compose_config, entry_point_env, run_entry_point, write_idx_dataset

from capsnet import cli, config
from capsnet.config import describe

APPS = {"train.py": "train", "evaluate.py": "eval", "export.py": "export", "predict.py": "predict"}


@pytest.fixture
def run_main(monkeypatch, capsys):
    """run_main(script, *args) → (exit status, stdout, stderr) of the script run in this process."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def tensorflow_must_not_load():
        raise AssertionError("TensorFlow imported before the error")

    monkeypatch.setattr(cli, "import_tensorflow_quietly", tensorflow_must_not_load)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # cli.run sets it; restored afterwards

    def run(script, *args):
        monkeypatch.setattr(sys, "argv", [str(REPO / script), *map(str, args)])
        capsys.readouterr()
        with pytest.raises(SystemExit) as done:  # as `python script args` runs it (cli.run(main))
            runpy.run_path(str(REPO / script), run_name="__main__")
        out, err = capsys.readouterr()
        return done.value.code, out, err

    yield run
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


def _schema_keys(schema, prefix=""):
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.type):
            yield from _schema_keys(f.type, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def _config_keys(values, prefix=""):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _config_keys(value, f"{prefix}{key}.")
        else:
            yield prefix + key


# --------------------------------------------------------------------------- --help

@pytest.mark.parametrize("app, schema, overrides", [
    ("train", config.TrainAppConfig, ["run_dir=/r", "model/routing=self_attention"]),
    ("train", config.TrainAppConfig, ["run_dir=/r"]),
    ("eval", config.EvalAppConfig, ["checkpoint=/c"]),
    ("predict", config.PredictAppConfig, ["checkpoint=/c", "images=/i"]),
])
def test_every_key_has_a_description(app, schema, overrides):
    """Each key of the schema and of the composed config (model.routing's keys come from the
    router's file) has a comment in configs/."""
    described = describe.descriptions(app)
    keys = set(_schema_keys(schema)) | set(_config_keys(compose_config(app, overrides)))
    missing = sorted(k for k in keys if not described.get(k, "").strip())
    assert not missing, f"keys without a comment in configs/: {missing}"


def test_every_export_key_has_a_description():
    own = yaml.safe_load((REPO / "configs" / "export.yaml").read_text())
    keys = [k for k in own if k not in ("defaults", "hydra")]
    assert keys and all(describe.descriptions("export").get(k) for k in keys)


def test_comments_are_read_as_yaml_lays_them_out(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(textwrap.dedent("""\
        # @package data
        # a file's own comment, not a key's
        defaults:
          - schema           # not a group: no option
          - routing: dynamic # the router
        size: 3              # the side
                             #   in pixels
        # a standalone comment: no continuation
        bare: 1
        nested:              # a section
          inner: a#b         # a '#' inside a value is the value's
          other: 2
        help:
          template: |-
            looks: like a key # but is text
        after: x             # read again after the block
        """))
    assert describe.file_comments(path) == {
        "data.routing": "the router", "data.size": "the side in pixels", "data.nested": "a section",
        "data.nested.inner": "a '#' inside a value is the value's", "data.after": "read again after the block"}


def test_one_line_is_the_first_sentence_cut_to_the_width():
    assert describe.one_line("total epochs. A resumed run (e.g. this. one) continues") == "total epochs"
    assert describe.one_line("keeps (a. b) whole") == "keeps (a. b) whole"
    cut = describe.one_line("word " * 40, width=30)
    assert len(cut) <= 30 and cut.endswith(" …") and cut.startswith("word word")


def test_a_key_is_described_by_the_default_options_comment_first():
    """data.dir: MNIST's IDX files (data/mnist.yaml, the default), not data/folder.yaml's words."""
    described = describe.descriptions("train")
    assert "IDX" in described["data.dir"]
    mnist = describe.file_comments(REPO / "configs" / "data" / "mnist.yaml", "data")
    assert described["data.dir"] == mnist["data.dir"]
    assert described["model.routing.epsilon"] == describe.file_comments(
        REPO / "configs" / "model" / "routing" / "self_attention.yaml", "model.routing")["model.routing.epsilon"]


def _help_template(app):
    """The help template of configs/<app>.yaml (train's: configs/hydra/default.yaml's)."""
    path = REPO / "configs" / ("hydra/default.yaml" if app == "train" else f"{app}.yaml")
    loaded = yaml.safe_load(path.read_text())
    return (loaded if app == "train" else loaded["hydra"])["help"]["template"]


def _row(text, key):
    return next(line for line in text.splitlines() if line.startswith("  ") and line.split()[0].split("=")[0] == key)


@pytest.mark.parametrize("app, overrides", [("train", ["data=fashion_mnist", "train.epochs=7"]),
                                            ("eval", ["checkpoint=/c"]), ("predict", ["checkpoint=/c", "images=/i"]),
                                            ("export", [])])
def test_help_lays_out_every_key_with_its_default_and_description(app, overrides):
    """Hydra's help text as its template makes it (string.Template, $CONFIG the composed config
    as YAML), then as cli writes it out: each key `section.key=default` and its comment's first
    words, grouped by section; the config groups without the schema option."""
    from omegaconf import OmegaConf

    if app == "export":
        composed = {k: v for k, v in yaml.safe_load((REPO / "configs" / "export.yaml").read_text()).items()
                    if k not in ("defaults", "hydra")}
    else:
        composed = compose_config(app, ["run_dir=/r"] * (app == "train") + overrides)
    text = string.Template(_help_template(app)).safe_substitute(
        CONFIG=OmegaConf.to_yaml(composed), APP_CONFIG_GROUPS="data: folder, mnist, schema\nmodel/routing: dynamic")
    out = cli._described_help(text)
    head, keys = out.split(f"== Keys (configs/{app}.yaml) ==")
    assert "Use --hydra-help" in keys
    if app == "train":
        assert "data: folder, mnist\n" in head and "model/routing: dynamic\n" in head  # the schemas are no option
        assert _row(keys, "train.epochs").split()[0] == "train.epochs=7"
        assert _row(keys, "data.name").split()[0] == "data.name=fashion_mnist"
        assert _row(keys, "model.decoder_units").split()[0] == "model.decoder_units=[512,1024]"
    described = describe.descriptions(app)
    for key in _config_keys(composed):
        value = composed
        for part in key.split("."):
            value = value[part]
        row = _row(keys, key)
        assert row.split()[0] == f"{key}={describe._override_text(value)}"
        assert described[key][:20] in row  # the comment's first words
    titles = [line.split(":")[0] for line in keys.splitlines() if line and not line.startswith(" ") and ":" in line]
    sections = [k for k, v in composed.items() if isinstance(v, dict)]
    assert titles[-1 - len(sections):] == ["top level", *sections]


def test_help_shows_an_interpolation_resolved_where_it_can_be():
    """model.input_shape from the dataset (capsnet.datasets' shape, with data.pad_pixels' canvas);
    what needs a run or data not given stays as written; a required key stays ???."""
    from capsnet.datasets import DATASETS, example_shape

    text = textwrap.dedent("""\
        model:
          input_shape: ${dataset_shape:${data.name},${data.shift_pixels},${data.pad_pixels}}
          num_classes: ${dataset_classes:${data.name}}
        data:
          name: expanded_mnist
          shift_pixels: 2
          pad_pixels: 6
          dir: null
        run_dir: ${hydra:runtime.output_dir}
        checkpoint: ???
        folder_classes: ${dataset_classes:folder}
        """)
    shown = describe.shown_values(text)
    assert shown["model"]["input_shape"] == list(example_shape("expanded_mnist", DATASETS["mnist"].image_shape, 2, 6))
    assert shown["model"]["num_classes"] == DATASETS["expanded_mnist"].num_classes
    assert shown["run_dir"] == "${hydra:runtime.output_dir}" and shown["checkpoint"] == "???"
    assert shown["folder_classes"] == "${dataset_classes:folder}"  # a folder without data.dir: its error, not shown


def test_help_without_the_keys_mark_is_hydras_own():
    text = "Hydra (1.3)\nSee https://hydra.cc for more info.\n\n== Flags ==\n--help,-h : Application's help\n"
    assert cli._described_help(text) == text


@pytest.mark.slow  # two Hydra help texts, ~3 s each: Hydra lists every config group's options
def test_train_help_and_hydras_help_through_hydra(tmp_path):
    # As a user runs it, in a process of its own: Hydra's help, run in this process, leaves the
    # test process's output streams closed behind it under pytest-xdist.
    done = run_entry_point("train.py", "--help", "data=fashion_mnist", "train.epochs=7", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    groups, keys = done.stdout.split("== Keys (configs/train.yaml) ==")
    assert "data: " + ", ".join(sorted(p.stem for p in (REPO / "configs" / "data").glob("*.yaml"))) in groups
    assert "schema" not in groups
    assert _row(keys, "train.epochs").startswith("  train.epochs=7 ") and "total epochs" in _row(keys, "train.epochs")
    assert _row(keys, "data.name").split()[0] == "data.name=fashion_mnist"
    assert _row(keys, "model.input_shape").split()[0] == "model.input_shape=[28,28,1]"  # resolved from the dataset
    done = run_entry_point("train.py", "--hydra-help", cwd=tmp_path)
    assert done.returncode == 0 and "--multirun" in done.stdout and "== Keys" not in done.stdout, done.stderr


# --------------------------------------------------------------------------- errors before TensorFlow

def test_a_missing_mnist_data_dir_is_said_before_the_run_dir_and_tensorflow(run_main, tmp_path):
    missing = tmp_path / "nowhere"
    status, out, err = run_main("train.py", f"data.dir={missing}", f"hydra.run.dir={tmp_path / 'run'}")
    assert status == 2 and "run dir:" not in out
    assert err.strip().splitlines() == [f"error: data dir {missing} does not exist or is not a directory (it should "
                                         "hold the IDX files train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], "
                                         "t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz])"]
    assert not (tmp_path / "run").exists()


def test_a_data_dir_without_the_test_files_is_named(tmp_path):
    data = write_idx_dataset(tmp_path / "data", n_train=8, n_test=4)
    (data / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(config_errors()) as caught:
        config.check_data_files({"name": "multimnist", "dir": str(data)})
    assert str(caught.value) == (f"data dir {data} has no t10k-labels-idx1-ubyte or t10k-labels-idx1-ubyte.gz (the "
                                 "test split needs t10k-images-idx3-ubyte[.gz] and t10k-labels-idx1-ubyte[.gz])")
    write_idx_dataset(tmp_path / "data", n_train=8, n_test=4)
    config.check_data_files({"name": "multimnist", "dir": str(data)})  # both splits: nothing to say
    config.check_data_files({"name": "cifar10", "dir": str(tmp_path / "nowhere")})  # natural images: their rule's


def config_errors():
    from capsnet.errors import CapsnetError

    return CapsnetError


@pytest.mark.parametrize("layout", ["train/{c}/{i}.png", "{c}/{i}.jpg"])
def test_class_folders_given_as_mnist_say_add_data_folder(run_main, tmp_path, layout):
    for c in ("cat", "dog"):
        for i in range(2):
            image = tmp_path / "pets" / layout.format(c=c, i=i)
            image.parent.mkdir(parents=True, exist_ok=True)
            image.write_bytes(b"not decoded: the paths alone tell")
    status, out, err = run_main("train.py", f"data.dir={tmp_path / 'pets'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert status == 2 and "run dir:" not in out
    assert err.strip().splitlines() == [f"error: data.dir={tmp_path / 'pets'} holds no IDX files for data.name=mnist: "
                                         "this looks like an image folder (class folders of images): add data=folder"]


def test_a_folder_of_other_files_is_not_called_an_image_folder(tmp_path):
    (tmp_path / "d" / "notes").mkdir(parents=True)
    (tmp_path / "d" / "notes" / "a.txt").write_text("x")
    from capsnet import folder

    assert not folder.looks_like_image_folder(tmp_path / "d")
    with pytest.raises(config_errors(), match="has no train-images-idx3-ubyte"):
        config.check_data_files({"name": "mnist", "dir": str(tmp_path / "d")})


@pytest.fixture
def saved_model_dir(tmp_path):
    export = tmp_path / "exported" / "mnist"
    export.mkdir(parents=True)
    (export / "saved_model.pb").write_bytes(np.zeros(4, np.uint8).tobytes())
    return export


@pytest.mark.parametrize("script", ["evaluate.py", "export.py"])
def test_an_export_given_as_checkpoint_says_what_takes_it(run_main, saved_model_dir, tmp_path, script):
    args = [f"checkpoint={saved_model_dir}"] + ([f"output={tmp_path / 'out'}"] if script == "export.py" else [])
    status, _, err = run_main(script, *args)
    assert status == 2
    assert err.strip().splitlines() == [
        f"error: checkpoint={saved_model_dir} is an exported SavedModel, not a run dir or checkpoint: {script} reads "
        f"the run dir it was exported from; the export itself is for predict.py checkpoint={saved_model_dir} "
        "images=... or TF Serving (README: Export and serve)"]


@pytest.mark.parametrize("given_name", [False, True])
def test_evaluates_data_dir_is_checked_for_the_runs_dataset_before_tensorflow(run_main, tmp_path, given_name):
    """evaluate.py data.dir=... for an MNIST-family run: the test split's IDX files, by the
    dataset the run's config.yaml names (or data.name given), as train.py checks its own."""
    run = tmp_path / "run"
    (run / "checkpoints" / "best").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"name": "fashion_mnist", "dir": None}}))
    data = write_idx_dataset(tmp_path / "data", n_train=4, n_test=4)
    (data / "t10k-images-idx3-ubyte.gz").unlink()
    status, _, err = run_main("evaluate.py", f"checkpoint={run}", f"data.dir={data}",
                              *(["data.name=mnist"] if given_name else []))
    assert status == 2
    assert err.strip().splitlines() == [f"error: data dir {data} has no t10k-images-idx3-ubyte or "
                                         "t10k-images-idx3-ubyte.gz (the test split needs t10k-images-idx3-ubyte[.gz] "
                                         "and t10k-labels-idx1-ubyte[.gz])"]


def test_evaluates_data_dir_needs_only_the_test_files(tmp_path):
    data = write_idx_dataset(tmp_path / "data", n_train=4, n_test=4)
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        (data / name).unlink()
    cli.check_evaluation_data(tmp_path / "run", {"name": "mnist", "dir": str(data)})  # nothing to say
    with pytest.raises(config_errors(), match="has no train-images"):
        config.check_data_files({"name": "mnist", "dir": str(data)})  # a training needs both splits


@pytest.fixture
def run_with_a_checkpoint(tmp_path):
    """A run dir's files as the path checks see them: config.yaml, checkpoints/best/ckpt-1.index."""
    run = tmp_path / "run"
    (run / "checkpoints" / "best").mkdir(parents=True)
    (run / "checkpoints" / "best" / "ckpt-1.index").write_bytes(b"")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"name": "mnist", "dir": None}}))
    return run


def test_exports_existing_output_is_said_before_tensorflow(run_main, run_with_a_checkpoint, tmp_path):
    from capsnet.errors import ConfigError
    from capsnet.export import export

    (tmp_path / "exported").mkdir()
    status, _, err = run_main("export.py", f"checkpoint={run_with_a_checkpoint}", f"output={tmp_path / 'exported'}")
    with pytest.raises(ConfigError) as reference:  # the library's own check, the same words
        export(run_with_a_checkpoint, tmp_path / "exported")
    assert status == 2 and err.strip().splitlines() == [f"error: {reference.value}"]
    assert "already exists" in err


@pytest.mark.parametrize("output", ["config.yaml", "checkpoints/best/report.json"])
def test_evaluates_output_over_a_runs_file_is_said_before_tensorflow(run_main, run_with_a_checkpoint, output):
    status, _, err = run_main("evaluate.py", f"checkpoint={run_with_a_checkpoint}",
                              f"output={run_with_a_checkpoint / output}")
    assert status == 2 and err.strip().splitlines() == [
        f"error: output={run_with_a_checkpoint / output} is a file of a run (its config, history, metrics or "
        "checkpoints): write the report elsewhere (output=null puts it in the run's evaluations/)"]


@pytest.mark.parametrize("script", ["evaluate.py", "export.py"])
def test_a_folder_without_a_checkpoint_is_said_as_resolving_it_would(run_main, tmp_path, script):
    """outputs/ (the run dirs' parent) given as checkpoint: resolve_checkpoint's words, before TensorFlow."""
    from capsnet.errors import CheckpointError
    from capsnet.training.checkpoints import resolve_checkpoint

    (tmp_path / "outputs" / "2026-01-01").mkdir(parents=True)
    extra = [f"output={tmp_path / 'out'}"] if script == "export.py" else []
    status, _, err = run_main(script, f"checkpoint={tmp_path / 'outputs'}", *extra)
    with pytest.raises(CheckpointError) as reference:
        resolve_checkpoint(tmp_path / "outputs")
    assert status == 2 and err.strip().splitlines() == [f"error: {reference.value}"]


@pytest.mark.parametrize("script", ["evaluate.py", "export.py", "predict.py"])
def test_a_missing_checkpoint_is_said_before_tensorflow(run_main, tmp_path, script):
    extra = {"export.py": [f"output={tmp_path / 'out'}"], "predict.py": [f"images={tmp_path}"]}.get(script, [])
    status, _, err = run_main(script, f"checkpoint={tmp_path / 'gone'}", *extra)
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert str(tmp_path / "gone") in err and err.startswith("error: ")


@pytest.mark.slow
def test_no_entry_point_imports_tensorflow_before_its_path_errors(tmp_path, saved_model_dir):
    """The in-process tests above replace TensorFlow's import; here a fresh interpreter runs each
    entry point with a path mistake and reports whether TensorFlow is in sys.modules after it."""
    (tmp_path / "pets" / "cat").mkdir(parents=True)
    (tmp_path / "pets" / "cat" / "a.png").write_bytes(b"x")
    commands = [["train.py", f"data.dir={tmp_path / 'nowhere'}", f"hydra.run.dir={tmp_path / 'run'}"],
                ["train.py", f"data.dir={tmp_path / 'pets'}", f"hydra.run.dir={tmp_path / 'run'}"],
                ["evaluate.py", f"checkpoint={saved_model_dir}"],
                ["evaluate.py", f"checkpoint={tmp_path / 'gone'}"],
                ["export.py", f"checkpoint={tmp_path / 'gone'}", f"output={tmp_path / 'out'}"],
                ["predict.py", f"checkpoint={tmp_path / 'gone'}", f"images={tmp_path}"]]
    probe = textwrap.dedent(f"""
        import runpy, sys
        for command in {[[str(REPO / c[0]), *c[1:]] for c in commands]!r}:
            sys.argv = command
            try:
                runpy.run_path(command[0], run_name="__main__")
            except SystemExit as exc:
                print("exit", exc.code, "tensorflow" in sys.modules, flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=entry_point_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.stdout.split("\n")[:len(commands)] == ["exit 2 False"] * len(commands), result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == len(commands) and all(e.startswith("error: ") for e in errors), result.stderr
    assert "add data=folder" in errors[1] and "exported SavedModel" in errors[2]
