"""The `run_name` resolver that names run dirs in configs/hydra/default.yaml:
outputs/<date>/<time>_<name>, so that TensorBoard's run list (`tensorboard --logdir outputs`)
tells an op run from a matmul run without its HParams tab.

    python train.py custom_op=true seed=1     -> outputs/2026-11-28/10-00-00_custom_op-true+seed-1
    python train.py custom_op=true name=op    -> outputs/2026-11-28/10-00-00_op
    python train.py                           -> outputs/2026-11-28/10-00-00

<name> is the `name` key where one is given, else the command line's overrides, which are
what differs from the defaults: Hydra's hydra.job.override_dirname, sorted by key, paths
and the name left out (hydra.job.config.override_dirname.exclude_keys), `key-value` joined
by `+`. Not Hydra's default `key=value,key=value`: a run dir is what `evaluate.py
checkpoint=<run dir>` takes, and Hydra's override parser rejects a value holding `=`, and
reads one holding `,` as a sweep. Other characters a path or that parser would trip on
(`/`, `[`, `,`, spaces, quotes) become `_`. A boolean is written as on the command line
(`custom_op-true`): a sweep's jobs get Python's `True`/`False` from Hydra, and one glob
(`*_custom_op-true*`) should find a single run and a sweep's jobs alike. A name longer than
MAX_LENGTH keeps the overrides that fit, and the seed, and says how many it left out
(`+seed-1+3-more`): a file name has 255 bytes, and runs are told apart by their seed.

Registered here, not by train.py: Hydra imports every module of the `hydra_plugins`
namespace package when it looks for plugins, before it composes a config, in every process
that composes one (train.py, a sweep's jobs, the tests' compose), so the resolver is there
before hydra.run.dir and hydra.sweep.subdir are resolved.
"""
import re

from omegaconf import OmegaConf

MAX_LENGTH = 120
ITEM_SEP, KV_SEP = "+", "-"  # as hydra.job.config.override_dirname in configs/hydra/default.yaml
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")
_BOOLEAN = re.compile(r"(?<=-)(True|False)$")  # a `key-value` item's Python boolean value


def run_name(overrides, name=None, prefix="_"):
    """`prefix` + the name given, else the override_dirname string `overrides`, made safe
    for a path and Hydra's override parser; "" when both are empty."""
    given = name is not None and str(name) != ""
    if not given:
        overrides = ITEM_SEP.join(_BOOLEAN.sub(lambda m: m.group(0).lower(), item)
                                  for item in str(overrides or "").split(ITEM_SEP))
    text = _UNSAFE.sub("_", str(name if given else overrides or "")).strip("_")
    if not text:
        return ""
    if len(text) > MAX_LENGTH:
        text = text[:MAX_LENGTH] if given else _shortened(text.split(ITEM_SEP))
    return prefix + text


def _shortened(items):
    """The overrides `items` that fit in MAX_LENGTH, the seed's among them, then
    `+<left out>-more`."""
    seeds = [item for item in items if item.startswith(f"seed{KV_SEP}")]
    others = [item for item in items if item not in seeds]
    more = f"{ITEM_SEP}{len(items)}{KV_SEP}more"  # at least as long as the one written
    room = MAX_LENGTH - len(more) - sum(len(ITEM_SEP) + len(seed) for seed in seeds)
    kept = []
    for item in others:
        if len(ITEM_SEP.join([*kept, item])) > room:
            break
        kept.append(item)
    if not kept and not seeds:  # the first override alone is too long: its start
        kept = [others[0][:room]]
    kept += seeds
    left = len(items) - len(kept)
    return ITEM_SEP.join(kept) + (f"{ITEM_SEP}{left}{KV_SEP}more" if left else "")


OmegaConf.register_new_resolver("run_name", run_name, replace=True)
