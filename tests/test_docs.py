"""The repository explains itself: package code and benchmarks cite no issue, case or pass number and point to nothing
outside the repository (the spec is ``docs/spec.md``); every "spec N.M" they cite is a section of ``docs/spec.md``;
and ``docs/`` points to nothing outside the repository either.

``README.md`` cannot go stale: its set-up and test commands are the ones ``.ci/run`` runs, every output it quotes
(a fenced ``text`` block) is re-run here from the command above it and compared, and its claims about the code
(what ``--data`` folders read, what ``--fp8`` needs, ``kimi ablate``'s default text) are read from the code.

Mutations killed: a comment ``(case 15)`` in ``kernels_torch/mla.py``; a docstring citing ``spec 11.2`` (no such
section); a ``../shared/spec/kernels.md`` pointer in ``docs/design.md``; ``.ci/run`` installing ``.[dev,gpu]`` or
running ``-n 4``; the README quoting eval loss 2.7179 for 2.7079, a generated text four words longer, a logits
shape ``(1, 9, 256)`` for ``(1, 9, 512)``, a folder suffix (``.rst``) ``kimi_tools/data.py`` does not read, ``.text``
dropped from ``TEXT_SUFFIXES``, ``--fp8`` without ``--dtype bfloat16``, and ``kimi ablate``'s text left unnamed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ("kimi", "reference_jax", "kernels_torch", "kimi_tools", "benchmarks")
BANNED = re.compile(
    r"\b(issues?|cases?|pass(es)?) [0-9]+|shared/spec|\.\./shared/(spec|gpu)|\b(cases|architecture)\.md", re.I
)
CITED = re.compile(r"\bspec(?: section)? ([0-9]+(?:\.[0-9]+)?)|docs/spec\.md``? section ([0-9]+(?:\.[0-9]+)?)")

KNOWN: set[tuple[str, str]] = set()  # (file, line text) left to their owners; none left


def _files():
    for top in CODE:
        for f in sorted((ROOT / top).rglob("*")):
            if f.suffix in (".py", ".sh") and f.is_file():
                yield f


def _known(rel: str, line: str) -> bool:
    return any(rel == f and text in line for f, text in KNOWN)


def test_no_issue_case_or_pass_numbers_nor_pointers_outside():
    bad = []
    for f in _files():
        rel = str(f.relative_to(ROOT))
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if BANNED.search(line) and not _known(rel, line):
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "say the reason in place, cite docs/spec.md by section:\n  " + "\n  ".join(bad)


def _sections() -> set[str]:
    heads = re.findall(r"^#{2,3} ([0-9]+(?:\.[0-9]+)?)[. ]", (ROOT / "docs/spec.md").read_text(encoding="utf-8"), re.M)
    return set(heads)


def test_spec_citations_name_existing_sections():
    sections = _sections()
    assert {"0", "2.2", "3.3", "9", "10.5"} <= sections
    bad = []
    for f in _files():
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITED.finditer(line):
                number = m.group(1) or m.group(2)
                if number not in sections:
                    bad.append(f"{f.relative_to(ROOT)}:{n}: spec {number}")
    assert not bad, "citations of sections docs/spec.md does not have:\n  " + "\n  ".join(bad)


def test_docs_point_to_nothing_outside_the_repository():
    bad = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in sorted((ROOT / "docs").glob("*.md"))
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if "../shared" in line or "shared/spec" in line
    ]
    assert not bad, "\n  ".join(bad)


# --- README.md -------------------------------------------------------------------------------------------------------

README = ROOT / "README.md"
CI = ROOT / ".ci/run"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?")
SECONDS = re.compile(r"\bin [0-9][0-9.,]* s\b")  # "3,840 tokens in 7 s": wall time, the one field that may vary
FLOAT_REL_TOL = 1e-3  # a printed loss may move in its last digit on another CPU's kernels; a code change moves more
# What the README must show a newcomer with its real output (a fenced ``text`` block below the command).
CHECKED = ("kimi train", "kimi generate", "model.apply(", "kimi ablate")


def _blocks(text: str) -> list[tuple[str, str]]:
    """The README's fenced blocks, in order, as ``(language, body)``."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def _shell_lines(body: str) -> list[str]:
    """The commands of a ``bash`` block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [ln.split(" #")[0].strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _pip_install_args(line: str) -> list[str]:
    """What a ``pip install`` line installs: its arguments after ``install``, without ``-q``."""
    words = shlex.split(line)
    return [w for w in words[words.index("install") + 1 :] if w != "-q"]


def test_readme_commands_are_the_ones_ci_runs():
    """README's set-up installs exactly what ``.ci/run`` installs, and its test command is ``.ci/run``'s, verbatim."""
    blocks = _blocks(README.read_text(encoding="utf-8"))
    readme_lines = [ln for lang, body in blocks if lang == "bash" for ln in _shell_lines(body)]
    ci_lines = [ln.strip() for ln in CI.read_text(encoding="utf-8").splitlines()]
    readme_pip = [ln for ln in readme_lines if ln.startswith("pip install")]
    ci_pip = [ln for ln in ci_lines if "pip install" in ln]
    assert readme_pip and len(ci_pip) == 1, (readme_pip, ci_pip)
    assert _pip_install_args(readme_pip[0]) == _pip_install_args(ci_pip[0]), (readme_pip[0], ci_pip[0])
    readme_test = [ln for ln in readme_lines if ln.startswith("python -m pytest")]
    ci_test = [ln for ln in ci_lines if ln.startswith("python -m pytest")]
    assert len(readme_test) == 1 and ci_test == readme_test, (readme_test, ci_test)


def _same_output(quoted: str, printed: str) -> list[str]:
    """The quoted lines that differ from the printed ones: text equal, integers equal, decimals within
    ``FLOAT_REL_TOL``, the seconds of ``in N s`` ignored. Empty when they agree."""
    want = [SECONDS.sub("in _ s", ln.rstrip()) for ln in quoted.strip("\n").splitlines()]
    got = [SECONDS.sub("in _ s", ln.rstrip()) for ln in printed.strip("\n").splitlines()]
    if len(want) != len(got):
        return [f"{len(want)} lines quoted, {len(got)} printed"]
    bad = []
    for w, g in zip(want, got, strict=True):
        ok = NUMBER.sub("#", w) == NUMBER.sub("#", g)
        for a, b in zip(NUMBER.findall(w), NUMBER.findall(g), strict=False) if ok else ():
            x, y = float(a.replace(",", "")), float(b.replace(",", ""))
            decimal = any(c in a + b for c in ".e")
            ok = ok and (abs(x - y) <= FLOAT_REL_TOL * abs(y) if decimal else a == b)
        if not ok:
            bad.append(f"quoted:  {w}\n  printed: {g}")
    return bad


def _run_block(lang: str, body: str, cwd: Path, env: dict[str, str]) -> str:
    """Run a README block as a user would, in ``cwd``; return its stdout. ``kimi`` is this checkout's command line."""
    if lang == "python":
        cmds = [([sys.executable, "-"], {}, body)]
    else:
        cmds = []
        for line in _shell_lines(body):
            words = shlex.split(line)
            extra = {}
            while "=" in words[0] and not words[0].startswith("-"):
                key, value = words.pop(0).split("=", 1)
                extra[key] = value
            assert words[0] in ("kimi", "torchrun"), f"README block runs {words[0]!r}; this test runs kimi and torchrun"
            run = ["kimi_tools.cli"] if words[0] == "kimi" else ["torch.distributed.run"]  # torchrun: gloo on the CPU
            cmds.append(([sys.executable, "-m", *run, *words[1:]], extra, None))
    out = []
    for argv, extra, stdin in cmds:
        r = subprocess.run(
            argv, cwd=cwd, env={**env, **extra}, input=stdin, capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, f"{argv} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        out.append(r.stdout)
    return "".join(out)


def _torchrun(src: tuple[str, str]) -> bool:
    """Whether a README block (``(language, body)``) launches ``torchrun``."""
    return src[0] == "bash" and any(re.search(r"(^|\s)torchrun\s", line) for line in _shell_lines(src[1]))


def _readme_outputs(tmp_path: Path, torchrun: bool) -> None:
    """Run the README's commands whose output it quotes (the ``torchrun`` ones, or the others) in ``tmp_path`` and
    compare; see :func:`test_readme_outputs_are_what_the_commands_print`."""
    (tmp_path / "kimi").symlink_to(ROOT / "kimi", target_is_directory=True)
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    blocks = _blocks(README.read_text(encoding="utf-8"))
    pairs = []
    for i, (lang, body) in enumerate(blocks):
        if lang == "text":
            source = [b for b in blocks[:i] if b[0] in ("bash", "python")]
            assert source, "a quoted output with no command above it"
            pairs.append((source[-1], body))
    if not torchrun:
        shown = " ".join(src[1] for src, _ in pairs)
        assert all(c in shown for c in CHECKED), f"README must show the output of each of {CHECKED}"
    pairs = [(src, quoted) for src, quoted in pairs if _torchrun(src) == torchrun]
    assert pairs, "README quotes no output of a torchrun command" if torchrun else "README quotes no output"
    bad = []
    for (lang, body), quoted in pairs:
        printed = _run_block(lang, body, tmp_path, env)
        diff = _same_output(quoted, printed)
        if diff:
            bad.append(f"{body.strip()}\n  " + "\n  ".join(diff) + f"\n--- it printed:\n{printed}")
    assert not bad, "README's quoted output is stale:\n" + "\n".join(bad)


def test_readme_outputs_are_what_the_commands_print(tmp_path):
    """Each fenced ``text`` block is the output of the nearest ``bash`` / ``python`` block above it, run in order in
    one folder (the fine-tune writes the checkpoint the later blocks read), from a fresh clone's point of view:
    ``kimi/`` (the bundled text) is the only thing the folder holds. A failure prints the real output to paste. The
    ``torchrun`` blocks run in :func:`test_readme_torchrun_outputs`."""
    _readme_outputs(tmp_path, torchrun=False)


@pytest.mark.distributed
def test_readme_torchrun_outputs(tmp_path):
    """The README's CPU ``torchrun`` example (gloo processes) prints what the README quotes."""
    _readme_outputs(tmp_path, torchrun=True)


def test_readme_claims_match_the_code():
    """What README says of ``--data`` folders, ``--fp8`` and ``kimi ablate``'s default text is what the code does."""
    from kimi_tools.common import DEFAULT_TEXT
    from kimi_tools.data import TEXT_SUFFIXES

    text = README.read_text(encoding="utf-8")
    folder = re.search(r"A folder\s+contributes (.*?)\.\s", text, re.S)
    said = set(re.findall(r"`(\.[a-z]+)`", folder.group(1))) if folder else set()
    assert said == {*TEXT_SUFFIXES, ".jsonl"}, f"README's --data folders read {sorted(said)}"
    fp8 = pytest.importorskip("kernels_torch.fp8")
    major, minor = fp8.FP8_MIN_CAPABILITY
    assert re.search(rf"`--fp8[^.]*needs\s+`--dtype bfloat16`[^.]*capability {major}\.{minor}\b", text), "--fp8 needs"
    trained_on = re.search(r"kimi train [^\n]*--data (\S+)", text).group(1)
    assert DEFAULT_TEXT == ROOT / trained_on, (DEFAULT_TEXT, trained_on)
    ablate = re.search(r"default held-out text.*?\.(?:\s|$)", text.replace("\n", " "))
    assert ablate and f"`{trained_on}`" in ablate.group(0), (
        "README must say kimi ablate's default text is the fine-tune's"
    )
