"""The documentation stays usable: README.md is short, its commands run, every relative
link in README.md, docs/, CHANGELOG.md and configs/experiment/README.md resolves (files
and #anchors), and no tracked file outside CHANGELOG.md narrates how the work was
organised (the words are listed in NARRATION below).

README's commands are checked cheaply, without training: a Hydra app (train.py,
evaluate.py, export.py) composes the command's overrides with `--cfg job` (Hydra and the
config schemas reject an unknown key, group option or a value of the wrong type); any
other script answers `--help`; `make X` names a real Makefile target. Other tools
(tensorboard, docker, saved_model_cli, pip, ...) are not run.
"""
import concurrent.futures
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, entry_point_env

README = REPO / "README.md"
README_MAX_LINES = 250
# The markdown files whose relative links must resolve (those that exist).
LINKED_DOCS = ["README.md", "CHANGELOG.md", "configs/experiment/README.md", *sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
# Words that narrate how the work was organised, not what the code does. Spelled in parts
# so that this file passes its own check.
NARRATION = re.compile(r"\b(" + "|".join(["se" + "ssions?", "le" + "ases?", "gpuk" + "it", "gpu-k" + "it",
                                          "gpu" + "calls", "gpuca" + "rry"]) + r")\b", re.IGNORECASE)
# pytest's fixture scope of that name is its API, not narration.
ALLOWED = re.compile(r"""scope=(["'])se""" + r"""ssion\1""")
NARRATION_EXEMPT = {"CHANGELOG.md"}  # history belongs there
COMMAND_TIMEOUT = 120


# --------------------------------------------------------------------------- helpers

def tracked_files():
    """The repository's tracked files (relative paths) that exist in the work tree."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


def read_text(path):
    """A file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = Path(path).read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def narration_words(text):
    """[(line number, word)] of the narration words in `text` (whole words, any case)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [(number, m.group(0)) for m in NARRATION.finditer(ALLOWED.sub("", line))]
    return found


def without_code(markdown):
    """markdown with fenced code blocks blanked (lines kept, for line numbers) and inline
    code spans removed: links and headings are not read from code."""
    lines, fence = [], None
    for line in markdown.splitlines():
        opened = re.match(r"\s{0,3}(`{3,}|~{3,})", line)
        if fence is None and opened:
            fence = opened.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            lines.append("")
        else:
            lines.append(re.sub(r"(`+).*?\1", "", line))
    return lines


def github_slug(heading):
    """The anchor GitHub gives a heading: the rendered text lower-cased, punctuation other
    than '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link (or image): its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown):
    """The #anchors of a markdown text: its headings' slugs (a repeated one numbered -1, -2, ...,
    as GitHub does) and explicit HTML ids/names."""
    raw = markdown.splitlines()
    lines = without_code(markdown)
    headings = []
    for i, line in enumerate(lines):
        atx = re.match(r"\s{0,3}#{1,6}\s+(.*?)(?:\s+#+\s*)?$", line)
        if atx:
            headings.append(atx.group(1).strip())
        elif (i > 0 and re.fullmatch(r"\s{0,3}(=+|-+)\s*", line) and lines[i - 1].strip()
              and raw[i - 1] == lines[i - 1] and not re.match(r"\s*([-*+]|\d+\.)\s", lines[i - 1])):
            headings.append(lines[i - 1].strip())  # a setext heading: text underlined by === or ---
    seen, result = {}, set()
    for heading in headings:
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    result.update(re.findall(r"""<[^>]*\b(?:id|name)=["']([^"']+)["']""", markdown))
    return result


def relative_links(markdown):
    """[(line number, target)] of a markdown text's links and images that point inside the
    repository (no scheme, not mail), inline [text](target) and reference [id]: target."""
    found = []
    for number, line in enumerate(without_code(markdown), 1):
        targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)", line)
        targets += re.findall(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", line)
        targets += re.findall(r"""<(?:a|img)\s[^>]*\b(?:href|src)=["']([^"']+)["']""", line)
        found += [(number, t) for t in targets if t and not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:|//", t)]
    return found


def broken_links(doc, root=REPO):
    """The relative links of the markdown file `doc` (a path under root) that do not resolve:
    ["doc:line: target (why)"]."""
    doc = Path(doc)
    text = doc.read_text(encoding="utf-8")
    broken = []
    for number, target in relative_links(text):
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc.resolve()
        name = f"{doc.relative_to(root)}:{number}: {target}"
        if not where.exists():
            broken.append(f"{name} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where.read_text(encoding="utf-8")):
            broken.append(f"{name} (no such heading)")
    return broken


def command_lines(markdown):
    """The shell command lines of a markdown text's code blocks: fenced ```bash, ```sh,
    ```shell and ```console blocks (in a console block the lines with a `$ ` prompt, when
    it has any) and indented code blocks; continuation lines (a trailing backslash) joined."""
    blocks, block, kind = [], None, None
    previous_blank = True
    for line in markdown.splitlines():
        fence = re.match(r"\s{0,3}```+\s*([\w-]*)", line)
        if kind == "fenced":
            if fence and not fence.group(1):
                blocks.append(block)
                block, kind = None, None
            elif block is not None:
                block.append(line)
        elif fence:
            if kind == "indented":
                blocks.append(block)
            kind = "fenced"
            language = fence.group(1).lower()
            block = [] if language in ("bash", "sh", "shell", "console") else None
            if language == "console":
                block = ["$console"]
        elif line.startswith("    ") and (kind == "indented" or previous_blank):
            if kind != "indented":
                block, kind = [], "indented"
            block.append(line[4:])
        elif kind == "indented" and not line.strip():
            block.append("")
        else:
            if kind == "indented":
                blocks.append(block)
                block, kind = None, None
        previous_blank = not line.strip()
    if kind == "indented":
        blocks.append(block)
    commands = []
    for lines in filter(None, blocks):
        if lines[0] == "$console":
            lines = lines[1:]
            prompted = [line.strip()[2:] for line in lines if line.strip().startswith("$ ")]
            lines = prompted or lines
        joined, pending = [], ""
        for line in lines:
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1].strip() + " "
                continue
            joined.append((pending + line.strip()).strip())
            pending = ""
        commands += [line for line in joined if line and not line.startswith("#")]
    return commands


def split_command(line):
    """The simple commands of a shell line (split at |, &&, ||, ;), each a list of words with
    leading VAR=value assignments dropped; [] for a line shlex cannot split."""
    try:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
    except ValueError:
        return []
    commands, current = [], []
    for word in words:
        if word in ("|", "||", "&&", ";", "&"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    result = []
    for command in commands:
        while command and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", command[0]):
            command = command[1:]
        if command:
            result.append(command)
    return result


def is_synopsis(line):
    """A usage line, not a runnable command: <placeholders>, [optional|alternatives] or `...`."""
    return bool(re.search(r"<[A-Za-z][^<>]*>|\[[^\]]*\|[^\]]*\]|\.\.\.", line))


def first_of_sweeps(overrides):
    """Hydra overrides with each sweep (a,b / range(...) / glob(...)) reduced to its first
    value: `--cfg job` composes one job's config."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    reduced = []
    for text in overrides:
        override = parser.parse_override(text)
        if override.is_sweep_override():
            value = next(iter(override.sweep_string_iterator()))
            reduced.append(f"{override.get_key_element()}={value}")
        else:
            reduced.append(text)
    return reduced


def makefile_targets(makefile=REPO / "Makefile"):
    """The explicit targets of a Makefile (rule lines `a b: prerequisites`, not `X := value`)."""
    targets = set()
    for line in Path(makefile).read_text().splitlines():
        rule = re.match(r"([A-Za-z0-9_./%$()-][A-Za-z0-9_./%$() -]*?)\s*::?(?![=])", line)
        if rule and not line.startswith(("\t", "#")):
            targets.update(rule.group(1).split())
    return targets


PYTHONS = re.compile(r"(?:.*/)?python(?:3(?:\.\d+)?)?")
HYDRA_SWITCHES = {"-m", "--multirun"}
HYDRA_INFO = {"-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-p", "--package", "--resolve"}


def check_for(words, line):
    """What checks README's command `words` (one simple command of `line`): ("run", argv) for a
    process to start from the repository root, ("make", target) for a Makefile target, or
    None when it is another tool's command (not run)."""
    program = words[0]
    if program == "make":
        return [("make", w) for w in words[1:] if not w.startswith("-") and "=" not in w] or [("make", "all")]
    if not PYTHONS.fullmatch(program) or len(words) < 2 or words[1].startswith("-"):
        return None  # python -m ..., python -c ...: another tool's command
    script, args = words[1], words[2:]
    path = REPO / script
    if not path.is_file():
        return [("missing", script)]
    if "@hydra.main" not in path.read_text(encoding="utf-8"):
        return [("run", [script, "--help"])]
    if is_synopsis(line) or any(a in HYDRA_INFO for a in args):
        return [("run", [script, "--help"])]
    overrides = [a for a in args if a not in HYDRA_SWITCHES]
    try:
        overrides = first_of_sweeps(overrides)
    except Exception:  # noqa: BLE001  (not Hydra's grammar: the app itself reports it)
        pass
    return [("run", [script, *overrides, "--cfg", "job"])]


def readme_checks(markdown):
    """{README line: [checks]} for each command line of README's code blocks that this test runs."""
    checks = {}
    for line in command_lines(markdown):
        found = []
        for words in split_command(line):
            found += check_for(words, line) or []
            if words[0] == "make" and "train" in words[1:]:
                # `make train ARGS="..."` runs train.py with ARGS (the Makefile's train target).
                args = next((w.split("=", 1)[1] for w in words if w.startswith("ARGS=")), "")
                if args.strip():
                    found += check_for(["python", "train.py", *shlex.split(args)], args) or []
        if found:
            checks[line] = found
    return checks


def run_check(argv):
    """(returncode, output tail) of `python argv...` from the repository root."""
    try:
        done = subprocess.run([sys.executable, *argv], cwd=REPO, env=entry_point_env(), capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {COMMAND_TIMEOUT} s"
    return done.returncode, (done.stdout + done.stderr)[-1500:]


# --------------------------------------------------------------------------- the repository's docs

def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the details to docs/"


@pytest.mark.slow
def test_no_narration_of_how_the_work_was_organised():
    found = []
    for name in tracked_files():
        if name in NARRATION_EXEMPT:
            continue
        text = read_text(REPO / name)
        if text is not None:
            found += [f"{name}:{number}: {word}" for number, word in narration_words(text)]
    assert not found, f"{len(found)} narrating words in tracked files:\n" + "\n".join(found[:200])


def test_relative_links_resolve():
    broken = []
    for name in LINKED_DOCS:
        if (REPO / name).is_file():
            broken += broken_links(REPO / name)
    assert not broken, "broken links:\n" + "\n".join(broken)


README_CHECKS = readme_checks(README.read_text(encoding="utf-8")) if README.is_file() else {}


@pytest.fixture(scope="module")
def readme_results():
    """Every process the README's commands check, run once, two at a time: {argv: (rc, output)}."""
    argvs = {tuple(argv) for checks in README_CHECKS.values() for kind, argv in checks if kind == "run"}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(argvs, pool.map(run_check, argvs)))


@pytest.mark.slow
@pytest.mark.parametrize("line", sorted(README_CHECKS) or [pytest.param(None, marks=pytest.mark.skip(reason="no commands"))])
def test_readme_command_runs(line, readme_results):
    targets = makefile_targets()
    for kind, what in README_CHECKS[line]:
        if kind == "missing":
            pytest.fail(f"README: `{line}`: no such script {what}")
        elif kind == "make":
            assert what in targets, f"README: `{line}`: the Makefile has no target {what!r}"
        else:
            rc, output = readme_results[tuple(what)]
            assert rc == 0, f"README: `{line}`: `python {shlex.join(what)}` exited {rc}:\n{output}"


def test_readme_has_the_main_commands():
    """The checks above see README's commands at all (a README whose blocks this test no longer
    parses would pass them vacuously)."""
    scripts = {check[1][0] for checks in README_CHECKS.values() for check in checks if check[0] == "run"}
    targets = {check[1] for checks in README_CHECKS.values() for check in checks if check[0] == "make"}
    assert "train.py" in scripts and {"train", "test"} <= targets, (scripts, targets)


def first_run_block(markdown):
    """The commands of README's first run end to end: the code block that trains into outputs/demo."""
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.DOTALL):
        if "hydra.run.dir=outputs/demo" in block:
            return command_lines(f"```bash\n{block}```")
    raise AssertionError("README has no first run (a block training into hydra.run.dir=outputs/demo)")


def test_every_script_a_readme_command_runs_exists():
    """Without starting them (the slow tier runs each): a renamed or removed script fails here."""
    missing = [f"{line}: {check[1]}" for line, checks in README_CHECKS.items() for check in checks
               if check[0] == "missing"]
    assert not missing, missing


def test_the_readmes_first_run_uses_only_what_it_makes_or_the_repository_has():
    """Each path the first run's commands read (a script, checkpoint=, images='...') is in the
    repository or is made by a command before it (hydra.run.dir=, output=, a script's folder
    argument): a new user has nothing else, e.g. no folder of their own digit images."""
    made, missing = set(), []
    for line in first_run_block(README.read_text(encoding="utf-8")):
        for words in split_command(line):
            reads, makes = [], []
            if PYTHONS.fullmatch(words[0]):
                reads.append(words[1])
                for word in words[2:]:
                    key, equals, value = word.partition("=")
                    if key in ("checkpoint", "images"):
                        reads.append(value.split("*")[0].rstrip("/") or ".")
                    elif key in ("hydra.run.dir", "output"):
                        makes.append(value)
                    elif not equals and not word.startswith("-"):
                        makes.append(word)  # a script's positional argument: the folder it writes
            missing += [f"{line}: {path}" for path in reads
                        if not (REPO / path).exists() and not any(path == m or path.startswith(m + "/") for m in made)]
            made.update(makes)
    assert "my_digits" in made and not missing, missing


def test_the_paper_recipes_length_is_stated_as_its_preset_sets_it():
    """The paper's recipe is experiment=paper_mnist: every place that states its length says
    the preset's train.epochs, and README's plain `python train.py` line the default's."""
    from conftest import compose_config

    recipe = compose_config("train", ["experiment=paper_mnist", "run_dir=x"])["train"]["epochs"]
    default = compose_config("train", ["run_dir=x"])["train"]["epochs"]
    stated = {  # file: a pattern whose group is the length it states
        "README.md": [r"\| \[`paper_mnist`\][^\n]*?the paper's recipe: (\d+) epochs",
                      r"python train.py custom_op=true +# the paper's model on MNIST, compiled op, (\d+) epochs"],
        "Makefile": [r"experiment=paper_mnist[^\n]*the paper's (\d+)-epoch recipe"],
        "configs/experiment/quickstart.yaml": [r"The paper's recipe: python train.py experiment=paper_mnist .*\((\d+) epochs\)"],
        "docs/results.md": [r"\| `paper_mnist` \| MNIST \|[^\n]* for (\d+) epochs",
                            r"### paper_mnist\n\n[^#]*? for (\d+) epochs"],
    }
    found = {}
    for name, patterns in stated.items():
        text = (REPO / name).read_text(encoding="utf-8")
        for pattern in patterns:
            match = re.search(pattern, text)
            assert match, f"{name}: no statement matching {pattern}"
            found[pattern] = int(match.group(1))
    assert list(found.values()) == [recipe, default, recipe, recipe, recipe, recipe], found
    # No other line about the paper recipe states another length (lines that set train.epochs
    # themselves, or are about another preset, aside).
    for name in [*stated, "configs/experiment/README.md", "configs/experiment/paper_mnist.yaml"]:
        for number, line in enumerate((REPO / name).read_text(encoding="utf-8").splitlines(), start=1):
            if re.search(r"paper_mnist\b|paper's (\d+-epoch )?recipe|full recipe", line) and \
                    not re.search(r"train\.epochs=|fast_mnist|tuned_mnist|_fashion|cifar", line):
                lengths = {int(n) for n in re.findall(r"(\d+)[- ]epochs?\b", line)}
                assert lengths <= {recipe}, f"{name}:{number}: {line}"


def test_make_install_says_what_it_does_and_how_long_before_pip_runs():
    """pip -q printed nothing for minutes: the install recipe first says what it installs and
    how long that takes, and pip's own lines for the dependencies are shown."""
    lines = (REPO / "Makefile").read_text().split("$(VENV)/.installed: pyproject.toml\n", 1)[1].split("\n\n")[0]
    recipe = [line.strip() for line in lines.splitlines()]
    announce = next(i for i, line in enumerate(recipe) if line.startswith("@echo") and "minutes" in line)
    install = next(i for i, line in enumerate(recipe) if "pip install" in line and "-e" in line.split())
    assert announce < install and " -q" not in recipe[install], recipe


# --------------------------------------------------------------------------- the checks' own logic

def test_narration_words_are_found_as_whole_words_in_any_case():
    text = "\n".join([
        "ok: processing, released, " + "se" + "ssionless, " + "le" + "asehold",
        "the Twelfth " + "Se" + "ssion's fix",
        "two le" + "ases were held",
        "pytest.fixture(scope=\"se" + "ssion\") is pytest's",
        "copied by GPUK" + "IT; GPU-K" + "it; gpu" + "calls/; .gpuca" + "rry/",
    ])
    assert [n for n, _ in narration_words(text)] == [2, 3, 5, 5, 5, 5]
    assert narration_words("a tf.compat.v1.Se" + "ssion() call")[0][0] == 1  # only the fixture scope is allowed


@pytest.mark.slow
def test_narration_check_reads_tracked_text_files_only(tmp_path):
    (tmp_path / "binary.bin").write_bytes(b"\0\1 " + ("se" + "ssion").encode())
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    assert read_text(tmp_path / "binary.bin") is None and read_text(tmp_path / "latin1.txt") is None
    names = tracked_files()
    assert "README.md" in names and "tests/conftest.py" in names


def test_readme_length_check_counts_lines(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    monkeypatch.setattr(sys.modules[__name__], "README", readme)
    readme.write_text("line\n" * README_MAX_LINES)
    test_readme_is_short()
    readme.write_text("line\n" * (README_MAX_LINES + 1))
    with pytest.raises(AssertionError, match=f"{README_MAX_LINES + 1} lines"):
        test_readme_is_short()


def test_github_slugs():
    assert github_slug("Training throughput") == "training-throughput"
    assert github_slug("`train.data_on_device`: the data on the GPU (H100)") == "traindata_on_device-the-data-on-the-gpu-h100"
    assert github_slug("Install & run: 2 × H200") == "install--run-2--h200"
    assert github_slug("See [the docs](docs/x.md)") == "see-the-docs"
    text = "# Results\n## MNIST\n```\n# not a heading\n```\n## MNIST\nSetext one\n----------\n<a id=\"custom\"></a>\n"
    assert anchors(text) == {"results", "mnist", "mnist-1", "setext-one", "custom"}


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n## Speed on one GPU\n[up](../README.md#usage)\n")
    (tmp_path / "README.md").write_text("\n".join([
        "# Title", "## Usage",
        "[guide](docs/guide.md) [speed](docs/guide.md#speed-on-one-gpu) [self](#usage) [dir](docs)",
        "[web](https://example.com/x.md) [mail](mailto:a@b.c) ![img](docs/missing.png)",
        "[gone](docs/gone.md) [bad anchor](docs/guide.md#speed) [ref]: docs/nothing.md",
        "`[code](not/checked.md)`", "```", "[fenced](not/checked.md)", "```",
        "[ref]: docs/also-missing.md",
    ]))
    assert broken_links(tmp_path / "docs" / "guide.md", tmp_path) == []
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:4: docs/missing.png (no such file)",
        "README.md:5: docs/gone.md (no such file)",
        "README.md:5: docs/guide.md#speed (no such heading)",
        "README.md:10: docs/also-missing.md (no such file)",
    ]


def test_readme_commands_are_read_from_shell_blocks():
    text = "\n".join([
        "Intro", "", "    make train        # first run", "    python train.py -m seed=0,1 \\",
        "        hydra/launcher=gpus", "",
        "```bash", "make test", "# a comment", "python evaluate.py checkpoint=<run dir> [which=best|latest]", "```",
        "```python", "import capsnet", "```",
        "```console", "$ python scripts/plot_runs.py --help", "usage: plot_runs.py", "```",
        "```sh", "tensorboard --logdir outputs && make ops", "```",
        "- a list item", "    python not_a_block.py", "",
    ])
    lines = command_lines(text)
    assert lines == ["make train        # first run", "python train.py -m seed=0,1 hydra/launcher=gpus",
                     "make test", "python evaluate.py checkpoint=<run dir> [which=best|latest]",
                     "python scripts/plot_runs.py --help", "tensorboard --logdir outputs && make ops"]
    checks = readme_checks(text)
    assert checks[lines[0]] == [("make", "train")]
    assert checks[lines[1]] == [("run", ["train.py", "seed=0", "hydra/launcher=gpus", "--cfg", "job"])]
    assert checks[lines[3]] == [("run", ["evaluate.py", "--help"])]  # a synopsis: its app's help
    assert checks[lines[4]] == [("run", ["scripts/plot_runs.py", "--help"])]
    assert checks[lines[5]] == [("make", "ops")]  # tensorboard is not run
    assert readme_checks("    make train ARGS=\"custom_op=true train.epochs=5\"\n")[
        'make train ARGS="custom_op=true train.epochs=5"'] == [
        ("make", "train"), ("run", ["train.py", "custom_op=true", "train.epochs=5", "--cfg", "job"])]
    assert readme_checks("    python scripts/nosuch.py\n") == {"python scripts/nosuch.py": [("missing", "scripts/nosuch.py")]}


def test_makefile_targets():
    targets = makefile_targets()
    assert {"install", "ops", "test", "train"} <= targets
    assert not {"SHELL", "VENV", "PY", "PYTHON"} & targets


@pytest.mark.slow
def test_a_wrong_override_fails_its_check():
    """`--cfg job` composes without training, and still rejects what a user's run would."""
    assert run_check(["train.py", "custom_op=false", "train.epochs=2", "--cfg", "job"])[0] == 0
    rc, output = run_check(["train.py", "train.no_such_key=1", "--cfg", "job"])
    assert rc != 0 and "no_such_key" in output
