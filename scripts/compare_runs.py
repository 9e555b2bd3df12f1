"""Seeds of training recipes side by side: each run's final test accuracy and training speed
(images/s), each group's mean and spread, its in-run mean at chosen epochs, and its difference
from a reference group on the seeds both ran (accuracy) and its speed against the reference's.
Markdown on stdout, as docs/results.md's tables are.

    .venv/bin/python scripts/compare_runs.py 'A=/tmp/runs/w512e16_*' 'T64=/tmp/runs/t64_*' \\
        [--reference A] [--at 25,50,75,100] [--threshold 0.996] [--json PATH]
    # the op against TensorFlow's matmul: `python train.py -m custom_op=false,true seed=0,1,2`, then
    .venv/bin/python scripts/compare_runs.py 'matmul=outputs/multirun/*/*/*_custom_op-false*' \\
        'op=outputs/multirun/*/*/*_custom_op-true*'

Each positional argument is NAME=PATTERN: the run dirs (train.py's hydra.run.dir) that the glob
PATTERN matches form group NAME (quote the pattern so that the shell leaves it alone). A bare
PATTERN is a group named after it. --reference (default: the first group) is what the others
are compared with, seed by seed.

What a run contributes, read from its own files (no TensorFlow is imported):
- its seed and train.epochs: config.yaml (train.py writes the resolved config there);
- final: the test accuracy of its last tested epoch in history.jsonl. These are the weights
  `evaluate.py which=latest` scores (the average's with train.ema_decay > 0), and in
  float32 the same number. A run stopped before train.epochs is marked `*` and still counts:
  the note under its table says so;
- evaluate.py: the accuracy in the report evaluate.py left at its default place for the
  checkpoint it picks by default (checkpoints.default_which): `evaluations/best-ckpt-<best
  epoch>.json` for a run with a validation split (data.validation_fraction), else
  `evaluations/latest-ckpt-<last epoch>.json`, if there is one (evaluated with the default output
  and the run's own settings: one with others, e.g. custom_op switched, is named after them,
  `latest-ckpt-<epoch>.custom_op-true.json`, and not read; a report of another checkpoint is not
  the one evaluate.py's default scores); a run dir evaluated by an older version has it beside the
  checkpoint, `checkpoints/<best|latest>/ckpt-<epoch>.eval.json`, read where the first is missing;
- best epoch: the epoch best/ holds, chosen as train.py chose it (TrainingState.new_best: the
  highest validation accuracy where history.jsonl has one, else the highest test accuracy; the
  earliest of equal bests), with its test accuracy and what it was chosen on ("test": a number
  picked on the test set, optimistic);
- the last epoch's training accuracy, and with --threshold the first epoch at or
  above it (a column shown only then: a target that fits one dataset means nothing for another);
- images/s: the mean of its epochs' training speeds in history.jsonl (train_images_per_sec),
  as metrics.json's images_per_sec and TensorBoard's HParams images/s have it; a group's is the
  mean of its runs', and against the reference group it is their ratio (×1.20: 20% faster);
- its recipe: config.yaml's values (in today's shape: a key added since takes the default the
  run had, capsnet.config.migrate) but for where and how it ran, logged and saved (NOT_RECIPE:
  the seed, run name, run and data dirs, XLA cache, test and save schedules, logging, steps per
  call).
  Each group is shown with the keys its recipe changes from the reference group's, and any
  key its own runs disagree on: a glob that caught another recipe's runs shows there.

A group's spread is the sample standard deviation of its finals, and its standard error is
that over the square root of the number of runs. The comparison is paired: on the seeds both
groups ran, the mean of the per-seed differences, with the standard error of that mean.
Pairing by seed removes what the two recipes' runs share (the data order, the start) when
they have the same seed.

A pattern that matches nothing, a run dir without history.jsonl or config.yaml, a run with no
tested epoch, two runs of one group with the same seed, or an unknown --reference is a user
error: `error: ...` on one line, exit status 2.
"""
import argparse
import glob
import json
import math
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a clone without `pip install -e .` too

from capsnet.cli import fail  # noqa: E402  (`error: ...` on one line, exit 2, as train.py does)
from capsnet.console import count  # noqa: E402
from capsnet.config import migrate  # noqa: E402  (no TensorFlow either)
from capsnet.errors import ConfigError  # noqa: E402

# config.yaml keys that say where or how a run was made, logged and saved, not what it trained.
NOT_RECIPE = {"seed", "name", "run_dir", "debug", "data.dir", "train.xla_cache_dir", "train.progress_bar",
              "train.log_every_steps", "train.save_every_epochs", "train.keep_checkpoints", "train.test_batch_size",
              "train.test_every_epochs", "train.num_images", "train.histogram_examples", "train.steps_per_execution",
              "train.collapse_patience", "train.long_run_notice_minutes"}


class CompareError(Exception):
    """A user error: the message is the one line shown."""


class Run(NamedTuple):
    path: Path
    seed: int
    epochs: int                 # train.epochs of its config: what a finished run has done
    last_epoch: int             # the last epoch in history.jsonl
    final: float                # test accuracy of the last tested epoch
    evaluated: float | None     # evaluate.py's report of the final checkpoint, at its default place
    best: tuple[float | None, int]  # (test accuracy, epoch) of best/'s epoch (None: not tested then)
    best_on: str                # what best/ was chosen on: "validation" or "test"
    first_at: int | None        # first epoch whose test accuracy is >= the threshold (None: none, or no threshold)
    train_accuracy: float       # the last epoch's
    images_per_sec: float | None  # the mean of its epochs' training speeds; None if none was measured
    tested: dict[int, float]    # epoch -> test accuracy
    recipe: dict                # dotted config key -> value, NOT_RECIPE left out

    @property
    def finished(self):
        return self.last_epoch >= self.epochs


def read_run(path, threshold=None):
    """One run dir's Run, from config.yaml, history.jsonl and evaluate.py's default report."""
    path = Path(path)
    history_file, config_file = path / "history.jsonl", path / "config.yaml"
    if not history_file.is_file():
        raise CompareError(f"{path} has no history.jsonl: not a train.py run dir")
    if not config_file.is_file():
        raise CompareError(f"{path} has no config.yaml (train.py writes the run's seed there)")
    config = yaml.safe_load(config_file.read_text())
    try:
        recipe = {k: v for k, v in flatten(migrate(config)).items() if k not in NOT_RECIPE}
    except ConfigError as exc:
        raise CompareError(f"{config_file}: {exc}") from None
    records = [json.loads(line) for line in history_file.read_text().splitlines() if line.strip()]
    # One record an epoch: a redone epoch's line (a resumed run) supersedes the earlier one.
    speeds = {r["epoch"]: r["train_images_per_sec"] for r in records if r.get("train_images_per_sec") is not None}
    tested = {r["epoch"]: r["test_accuracy"] for r in records if r.get("test_accuracy") is not None}
    if not tested:
        raise CompareError(f"{path}: no epoch of history.jsonl has a test accuracy")
    last_tested = max(tested)
    validated = {r["epoch"]: r["validation_accuracy"] for r in records if r.get("validation_accuracy") is not None}
    best_on, chosen = ("validation", validated) if validated else ("test", tested)
    best_epoch = max(chosen, key=lambda e: (chosen[e], -e))  # the earliest of equal bests, as new_best keeps
    # evaluate.py's default checkpoint (checkpoints.default_which): best/ where the run held out a
    # validation split, else latest/, the final one.
    if (config.get("data") or {}).get("validation_fraction"):
        evaluated = evaluated_accuracy(path, "best", best_epoch)
    else:
        evaluated = evaluated_accuracy(path, "latest", records[-1]["epoch"])
    return Run(path=path, seed=int(config["seed"]), epochs=int(config["train"]["epochs"]),
               last_epoch=records[-1]["epoch"], final=tested[last_tested], evaluated=evaluated,
               best=(tested.get(best_epoch), best_epoch), best_on=best_on,
               first_at=None if threshold is None else min((e for e, a in tested.items() if a >= threshold),
                                                           default=None),
               train_accuracy=records[-1]["train_accuracy"], tested=tested, recipe=recipe,
               images_per_sec=statistics.fmean(speeds.values()) if speeds else None)


def evaluated_accuracy(path, which, epoch):
    """The accuracy of evaluate.py's default report of run `path`'s checkpoints/`which`/ckpt-`epoch`,
    or None: evaluations/<which>-ckpt-<epoch>.json (capsnet.evaluation.report_path), else where
    an older evaluate.py wrote it, beside the checkpoint (a run dir evaluated before the move)."""
    for report in (path / "evaluations" / f"{which}-ckpt-{epoch}.json",
                   path / "checkpoints" / which / f"ckpt-{epoch}.eval.json"):
        if report.is_file():
            return json.loads(report.read_text()).get("accuracy")
    return None


def flatten(section, prefix=""):
    """A config as {dotted key: value}, lists as tuples (comparable, hashable)."""
    flat = {}
    for key, value in section.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return flat


ABSENT = "(absent)"  # a recipe key some runs' config.yaml lacks


def group_recipe(runs):
    """(the values every run of the group shares, {key: the values its runs disagree on})."""
    keys = set().union(*(r.recipe for r in runs))
    values = {k: [r.recipe.get(k, ABSENT) for r in runs] for k in sorted(keys)}
    shared = {k: v[0] for k, v in values.items() if all(x == v[0] for x in v)}
    varies = {k: sorted({repr(x) for x in v}) for k, v in values.items() if k not in shared}
    return shared, varies


def recipe_changes(ours, theirs):
    """{key: (theirs, ours)} where two groups' recipes (group_recipe's pairs) differ: the keys
    each shares across its runs (one group's runs may lack a key: ABSENT); a key the runs of
    either disagree on is not compared (its `varies` says so)."""
    (ours, ours_vary), (theirs, theirs_vary) = ours, theirs
    keys = (set(ours) | set(theirs)) - set(ours_vary) - set(theirs_vary)
    return {k: (theirs.get(k, ABSENT), ours.get(k, ABSENT)) for k in sorted(keys)
            if ours.get(k, ABSENT) != theirs.get(k, ABSENT)}


def parse_group(arg):
    """NAME=PATTERN (or a bare PATTERN) -> (name, sorted run dirs)."""
    name, sep, pattern = arg.partition("=")
    if not sep:
        name, pattern = arg, arg
    paths = sorted(p for p in glob.glob(pattern) if Path(p).is_dir())
    if not name or not paths:
        raise CompareError(f"{arg}: matches no directory (give NAME=PATTERN, the pattern a glob of run dirs)")
    return name, paths


def spread(values):
    """(mean, sample standard deviation, standard error of the mean); sd and se are None for one value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    sd = statistics.stdev(values)
    return mean, sd, sd / math.sqrt(len(values))


def by_seed(name, runs):
    seeds = {}
    for run in runs:
        if run.seed in seeds:
            raise CompareError(f"group {name}: {seeds[run.seed].path} and {run.path} both ran seed {run.seed}")
        seeds[run.seed] = run
    return seeds


def paired(ours, theirs):
    """(seeds both ran, mean difference, its standard error) of finals, ours minus theirs
    (each {seed: Run}, by_seed's)."""
    common = sorted(set(ours) & set(theirs))
    if not common:
        return common, None, None
    mean, _, se = spread([ours[s].final - theirs[s].final for s in common])
    return common, mean, se


def group_speed(runs):
    """The mean images/s of the runs that measured one, or None."""
    speeds = [r.images_per_sec for r in runs if r.images_per_sec is not None]
    return statistics.fmean(speeds) if speeds else None


def summarize(groups, reference, at, threshold):
    """Every group's numbers as one JSON-able dict (what --json writes and the tables show)."""
    seeds = {name: by_seed(name, runs) for name, runs in groups.items()}  # every group checked first
    recipes = {name: group_recipe(runs) for name, runs in groups.items()}
    out = {"reference": reference, "threshold": threshold, "groups": {}}
    for name, runs in groups.items():
        finals = [r.final for r in runs]
        mean, sd, se = spread(finals)
        in_run = {}
        for epoch in at:
            accs = [r.tested.get(epoch) for r in runs]
            in_run[epoch] = statistics.fmean(accs) if None not in accs else None
        group = {"runs": [{"path": str(r.path), "seed": r.seed, "final": r.final, "evaluated": r.evaluated,
                           "last_epoch": r.last_epoch, "epochs": r.epochs, "finished": r.finished,
                           "best": r.best[0], "best_epoch": r.best[1],
                           "best_chosen_on": r.best_on, "first_at_threshold": r.first_at,
                           "train_accuracy": r.train_accuracy, "images_per_sec": r.images_per_sec}
                          for r in sorted(runs, key=lambda r: r.seed)],
                 "mean": mean, "sd": sd, "se": se, "min": min(finals), "max": max(finals),
                 "images_per_sec": group_speed(runs), "in_run_mean": in_run, "varies": recipes[name][1]}
        if name != reference:
            common, diff, diff_se = paired(seeds[name], seeds[reference])
            changes = recipe_changes(recipes[name], recipes[reference])
            ours, theirs = group["images_per_sec"], group_speed(groups[reference])
            group["vs_reference"] = {"seeds": common, "mean_difference": diff, "se": diff_se,
                                     "speed_ratio": ours / theirs if ours and theirs else None,
                                     "recipe": {k: list(v) for k, v in changes.items()}}
        out["groups"][name] = group
    return out


def pct(x, digits=2):
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def value(x):
    """A config value as config.yaml would show it (a list for a tuple)."""
    return str(list(x)) if isinstance(x, tuple) else str(x)


def speed(x):
    """images/s as read at a glance: 51.3, 20,346."""
    return "–" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def ratio(x):
    return "–" if x is None else f"×{x:.2f}"


def points(x, digits=3):
    return "–" if x is None else f"{100 * x:+.{digits}f}"


def markdown(summary, at):
    threshold = summary["threshold"]
    lines = []
    first_header = "" if threshold is None else f" first ≥ {pct(threshold)} |"
    for name, g in summary["groups"].items():
        lines += [f"### {name} ({count(len(g['runs']), 'run')})", "",
                  f"| seed | final | evaluate.py | best epoch: test acc (epoch, chosen on) |{first_header} train acc, last epoch | images/s | run |",
                  "|---:|---:|---:|---:|" + ("---:|" if threshold is not None else "") + "---:|---:|---|"]
        for r in g["runs"]:
            mark = "" if r["finished"] else f" * (epoch {r['last_epoch']} of {r['epochs']})"
            first = "" if threshold is None else f" {r['first_at_threshold'] or '–'} |"
            lines.append(f"| {r['seed']} | {pct(r['final'])}{mark} | {pct(r['evaluated'])} | "
                         f"{pct(r['best'])} ({r['best_epoch']}, {r['best_chosen_on']}) |{first} {pct(r['train_accuracy'])} | "
                         f"{speed(r['images_per_sec'])} | {r['path']} |")
        sd = "–" if g["sd"] is None else f"{100 * g['sd']:.3f}"
        se = "–" if g["se"] is None else f"{100 * g['se']:.3f}"
        lines += ["", f"Mean {pct(g['mean'], 3)} (min {pct(g['min'])}, max {pct(g['max'])}; sd {sd}, "
                      f"standard error {se} points); {speed(g['images_per_sec'])} images/s."]
        shown = [e for e in at if g["in_run_mean"][e] is not None]
        if shown:
            lines.append(f"In-run mean at epoch {' / '.join(map(str, shown))}: "
                         f"{' / '.join(pct(g['in_run_mean'][e], 3) for e in shown)}.")
        vs = g.get("vs_reference")
        if vs is not None:
            changed = "; ".join(f"{k} {value(a)} → {value(b)}" for k, (a, b) in vs["recipe"].items())
            lines.append(f"Recipe against {summary['reference']}: {changed or 'the same'}.")
        if g["varies"]:
            lines.append("Its runs differ in: " + "; ".join(f"{k} ({', '.join(v)})" for k, v in g["varies"].items())
                         + ".")
        unfinished = [r for r in g["runs"] if not r["finished"]]
        if unfinished:
            lines.append(f"* {count(len(unfinished), 'run')} stopped before train.epochs: their last tested epoch counts.")
        lines.append("")
    lines += [f"| group | runs | mean | min | max | sd | vs {summary['reference']} (paired seeds) | images/s | "
              f"speed vs {summary['reference']} |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, g in summary["groups"].items():
        sd = "–" if g["sd"] is None else f"{100 * g['sd']:.3f}"
        vs = g.get("vs_reference")
        if vs is None:
            cell = "reference"
        elif not vs["seeds"]:
            cell = "no common seed"
        else:
            err = "" if vs["se"] is None else f" ± {100 * vs['se']:.3f}"
            cell = f"{points(vs['mean_difference'])}{err} points ({len(vs['seeds'])} seeds)"
        speed_cell = "reference" if vs is None else ratio(vs["speed_ratio"])
        lines.append(f"| {name} | {len(g['runs'])} | {pct(g['mean'], 3)} | {pct(g['min'])} | {pct(g['max'])} | "
                     f"{sd} | {cell} | {speed(g['images_per_sec'])} | {speed_cell} |")
    return "\n".join(lines)


def epochs_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated epochs, e.g. 25,50,75,100") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: epochs count from 1")
    return values


def fraction(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an accuracy in (0, 1], e.g. 0.996")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="+", metavar="NAME=PATTERN", help="a group of run dirs (a quoted glob)")
    parser.add_argument("--reference", help="the group the others are compared with (default: the first)")
    parser.add_argument("--at", type=epochs_list, default=[25, 50, 75, 100],
                        help="epochs whose in-run mean test accuracy is shown, where every run of a group "
                             "was tested (default 25,50,75,100)")
    parser.add_argument("--threshold", type=fraction,
                        help="a test accuracy, e.g. 0.996: each run's first epoch at or above it is shown "
                             "(a column of its own; default: none)")
    parser.add_argument("--json", type=Path, help="also write the numbers here as JSON")
    args = parser.parse_args(argv)
    try:
        groups = {}
        for arg in args.groups:
            name, paths = parse_group(arg)
            if name in groups:
                raise CompareError(f"group {name} given twice")
            groups[name] = [read_run(p, args.threshold) for p in paths]
        reference = args.reference or next(iter(groups))
        if reference not in groups:
            raise CompareError(f"--reference {reference}: not a group (groups: {', '.join(groups)})")
        summary = summarize(groups, reference, args.at, args.threshold)
    except CompareError as exc:
        fail(str(exc))
    print(markdown(summary, args.at))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
