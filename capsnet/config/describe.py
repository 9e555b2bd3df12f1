"""What each config key means, for `--help`: the comment next to the key in configs/, read
from the YAML files (the one place the keys are described) and cut to one line.

`descriptions(app)` maps every dotted key that configs/ comments (`train.epochs`,
`data.dir`, ...) to its whole comment; `shown_values(text)` reads the `$CONFIG` of Hydra's
help (derived values resolved where they can be); `format_keys(values, app)` lays it out as
`section.key=default  description` (`one_line`: the comment's first sentence), by section.

Which comment describes a key: the app's own file first (configs/train.yaml, eval.yaml,
...), then the options its defaults list picks (model/capsnet.yaml, data/mnist.yaml, and
theirs: model/routing/dynamic.yaml), then the group's other options, the most fully
commented first (data/folder.yaml before data/cifar10.yaml, whose few comments speak of
CIFAR-10 alone). configs/experiment/ (a preset's comments speak of its own values) and
configs/hydra/ are not read.
"""
import functools
import re
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from capsnet.errors import CapsnetError

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SKIPPED_GROUPS = ("experiment", "hydra")
ONE_LINE = 100  # characters of a description, at most: `--help` gives one line a key

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*)\s*:(?P<rest>.*)$")
_DEFAULT = re.compile(r"^ *- (?P<key>[A-Za-z_]\w*)\s*:(?P<rest>.*)$")  # a defaults list's `- group: option`
_PACKAGE = re.compile(r"^#\s*@package\s+(\S+)")


def _comment_of(rest):
    """The comment on a YAML line after its key (`rest`: what follows `key:`), or None: from
    the first `#` that starts the text or follows a space (`a#b` is a value)."""
    found = re.search(r"(?:^|\s)#(.*)$", rest)
    return found.group(1).strip() if found else None


def file_comments(path, package=""):
    """{dotted key: its whole comment (continuation lines joined)} of one YAML file, keys
    under `package` (its `# @package` line wins). A comment-only line indented past a
    commented key continues that key's comment; a block scalar's lines (a help template)
    are text, not keys."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header = _PACKAGE.match(lines[0]) if lines else None
    if header:
        package = "" if header.group(1) == "_global_" else header.group(1)
    found, stack, last, block_indent = {}, [], None, None
    for line in lines:
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if block_indent is not None:
            if not stripped or indent > block_indent:
                continue
            block_indent = None
        if stripped.startswith("#"):
            if last is not None and indent > last[1]:
                found[last[0]] += " " + stripped.lstrip("#").strip()
            else:
                last = None
            continue
        match = _KEY.match(line)
        if match is None:  # a defaults list's `- group: option  # what the group is`, another list item, a blank line
            chosen = _DEFAULT.match(line)
            comment = chosen and _comment_of(chosen.group("rest"))
            if comment:
                found[".".join([package] * bool(package) + [chosen.group("key")])] = comment
            last = None if stripped else last
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([package] * bool(package) + [k for _, k in stack] + [match.group("key")])
        stack.append((indent, match.group("key")))
        comment = _comment_of(match.group("rest"))
        value = re.split(r"(?:^|\s)#", match.group("rest"))[0].strip()
        if value in ("|", "|-", ">", ">-"):
            block_indent = indent
        if comment:
            found[key] = comment
            last = (key, indent)
        else:
            last = None
    return found


def _defaults(path):
    """The `group: option` entries of a YAML file's defaults list (none: {})."""
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    entries = loaded.get("defaults", []) if isinstance(loaded, dict) else []
    return {k: v for e in entries if isinstance(e, dict) for k, v in e.items()
            if isinstance(v, str) and not k.startswith(("override", "/"))}


def _chosen_files(path, group=""):
    """The files a config file's defaults list picks (relative groups nested under `group`), recursively."""
    chosen = []
    for sub, option in _defaults(path).items():
        sub_group = f"{group}/{sub}" if group else sub
        if sub_group.split("/")[0] in SKIPPED_GROUPS:
            continue
        picked = CONFIG_DIR / sub_group / f"{option}.yaml"
        if picked.is_file():
            chosen.append((picked, sub_group))
            chosen += _chosen_files(picked, sub_group)
    return chosen


@functools.cache
def descriptions(app="train"):
    """{dotted key: its whole comment, one line} for configs/<app>.yaml's keys and its groups'
    (a group's own key, `model`, the comment on its line of the defaults list)."""
    app_file = CONFIG_DIR / f"{app}.yaml"
    chosen = _chosen_files(app_file)
    others = []
    if chosen:  # an app with config groups (train): every option of every group
        seen = {p for p, _ in chosen}
        for path in sorted(CONFIG_DIR.rglob("*.yaml")):
            group = path.parent.relative_to(CONFIG_DIR).as_posix()
            if group != "." and group.split("/")[0] not in SKIPPED_GROUPS and path not in seen:
                comments = file_comments(path, group.replace("/", "."))
                others.append((-len(comments), path.as_posix(), comments))
    found = {}
    sources = [file_comments(app_file)] + [file_comments(p, g.replace("/", ".")) for p, g in chosen]
    for comments in sources + [c for *_, c in sorted(others, key=lambda o: o[:2])]:
        for key, comment in comments.items():
            found.setdefault(key, comment)
    return found


def one_line(comment, width=ONE_LINE):
    """A comment's first sentence (up to `. ` outside brackets), cut to `width` characters."""
    depth = 0
    for i, char in enumerate(comment):
        depth += (char in "([{") - (char in ")]}")
        if depth == 0 and char == "." and comment[i + 1:i + 2] == " ":
            comment = comment[:i]
            break
    if len(comment) > width:
        comment = comment[:width - 1].rsplit(" ", 1)[0].rstrip(",;:( ") + " …"
    return comment


def _leaves(values, prefix=""):
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _override_text(value):
    """A value as it is written on the command line (key=<this>)."""
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().replace(", ", ",")
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def shown_values(text):
    """The config of Hydra's help (`text`: its $CONFIG, YAML as OmegaConf writes it) as a nested
    dict, each interpolation resolved where it can be (model.input_shape from the dataset:
    [28, 28, 1]), else as written: one that needs a run (run_dir's ${hydra:runtime.output_dir},
    null in a help) or data not given (a folder's classes without data.dir), and a required `???`."""
    cfg = OmegaConf.create(text)

    def walk(node, written):
        shown = {}
        for key, value in written.items():
            if isinstance(value, dict) and value:
                shown[key] = walk(node[key], value)
                continue
            try:
                resolved = node[key]
                shown[key] = OmegaConf.to_container(resolved, resolve=True) if OmegaConf.is_config(resolved) \
                    else resolved
            except (OmegaConfBaseException, CapsnetError, ValueError):
                shown[key] = value
            if shown[key] is None:  # ${hydra:runtime.output_dir} outside a run: not known yet
                shown[key] = value
        return shown

    return walk(cfg, OmegaConf.to_container(cfg, resolve=False))


def format_keys(values, app="train", width=None):
    """The keys of `values` (a composed config, a nested dict) as `key=default  description`
    lines, the top-level keys first, then one block per section (model, data, train, ...),
    each line at most `width` characters where its key and default leave room (None: a
    description of ONE_LINE characters)."""
    described = descriptions(app)
    top = {k: v for k, v in values.items() if not (isinstance(v, dict) and v)}
    sections = [("", top)] + [(k, v) for k, v in values.items() if k not in top]
    blocks = []
    for name, section in sections:
        rows = [(f"{key}={_override_text(value)}", described.get(key)) for key, value in
                _leaves(section, f"{name}." if name else "")]
        left = min(max(len(r[0]) for r in rows), 40)
        room = ONE_LINE if width is None else max(width - left - 4, 40)
        title = f"{name}: {one_line(described[name], room)}" if name in described else f"{name or 'top level'}:"
        blocks.append("\n".join([title] + [f"  {key.ljust(left)}  {one_line(text or '', room)}".rstrip()
                                           for key, text in rows]))
    return "\n\n".join(blocks) + "\n"
