"""Every code snippet in docs/ is run, and every output shown under one is checked.

Markers (an HTML comment on the line before a fenced ``python`` block; invisible in the site):

``<!-- test -->``
    Runs in one process, in the page's default session: the tested blocks of a page share one
    namespace and run in order, like a notebook.
``<!-- test: session=NAME -->``
    Like ``test``, in the session ``NAME`` of that page (its own process and namespace), for
    snippets that need another world (a fake 4-rank process group, say).
``<!-- test: session=NAME after=ranks -->``
    Runs once the multi-rank scripts have finished, in the same working directory (to read a
    checkpoint one of them wrote, say).
``<!-- test: ranks=4 -->``
    A complete script, run on 4 ranks as ``python -m fshard.run -n 4 script.py`` would run it (as
    ``__main__``, with torchrun's environment; its ``fs.init()`` joins the ranks' world). A block
    whose body is only a ``--8<-- "examples/x.py"`` include runs that file.
``<!-- no-test: REASON -->``
    Not run. A python block with no marker fails ``test_every_python_block_is_marked``.

``<!-- output -->`` on the line before a fenced ``text`` block that directly follows a tested block
gives that block's expected stdout (rank 0's for ``ranks=4``), compared as doctest does with
ELLIPSIS: ``...`` matches anything.

Cost control: the single-process sessions run in one interpreter that imports torch once and
forks a child per session; all multi-rank scripts run one after the other on the test-suite's
persistent 4-rank pool (conftest.py ``run_ranks``), in the snippets' working directory, with the
ranks' global random state restored afterwards. The two run at the same time. This file is also
the single-process runner: ``python tests/test_docs.py single PAYLOAD RESULTS``.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RANKS = 4
TIMEOUT = 240  # seconds for each runner; a hang in a snippet fails the test instead of CI

_MARK = re.compile(r"^<!--\s*(test|no-test|output)\s*(?::\s*(.*?))?\s*-->\s*$")
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
_INCLUDE = re.compile(r"""^\s*--8<--\s+["']([^"']+)["']\s*$""")


@dataclass
class Snippet:
    page: str  # path relative to the repo root
    line: int  # 1-based line of the first code line
    mode: str  # "single" | "ranks" | "after" (single, once the "ranks" scripts are done)
    session: str
    code: str
    source_name: str  # file name used in tracebacks
    expected: str | None = None  # expected stdout, or None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _parse_page(path: Path) -> tuple[list[Snippet], list[str]]:
    """The snippets of one page, and the problems found (unmarked python blocks, bad markers)."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    snippets: list[Snippet] = []
    problems: list[str] = []
    i = 0
    pending: tuple[str, str] | None = None  # the marker seen on the previous non-blank line
    last: Snippet | None = None  # the last tested snippet, for an output block that follows it
    while i < len(lines):
        line = lines[i]
        mark = _MARK.match(line.strip())
        if mark:
            pending = (mark.group(1), mark.group(2) or "")
            i += 1
            continue
        fence = _FENCE.match(line.strip())
        if not fence:
            if line.strip():  # prose between a block and its marker or its output: they do not belong
                pending, last = None, None
            i += 1
            continue
        ticks, lang = fence.groups()
        start = i + 1
        j = start
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            j += 1
        indent = len(line) - len(line.lstrip())
        body = "\n".join(text[indent:] for text in lines[start:j]) + "\n"
        kind, arg = pending if pending else (None, "")
        if kind == "output":
            if last is None or lang != "text":
                problems.append(
                    f"{rel}:{i + 1}: <!-- output --> must precede a text block right after a tested block"
                )
            else:
                last.expected = body
            last = None
        elif lang == "python":
            last = None
            if kind is None:
                problems.append(
                    f"{rel}:{start}: python block without <!-- test --> or <!-- no-test: reason -->"
                )
            elif kind == "no-test":
                if not arg:
                    problems.append(f"{rel}:{i}: <!-- no-test --> needs a reason")
            else:
                opts = dict(item.split("=", 1) for item in arg.split() if "=" in item)
                mode = "ranks" if opts.get("ranks") else "after" if opts.get("after") == "ranks" else "single"
                if mode == "ranks" and opts["ranks"] != str(RANKS):
                    problems.append(f"{rel}:{i}: only ranks={RANKS} is supported")
                code, name = body, rel
                include = _INCLUDE.match(body.strip())
                if include:
                    target = ROOT / include.group(1)
                    code, name = target.read_text(encoding="utf-8"), include.group(1)
                snip = Snippet(rel, start + 1, mode, opts.get("session", "default"), code, name)
                snippets.append(snip)
                last = snip
        else:
            last = None
        pending = None
        i = j + 1
    return snippets, problems


def collect() -> tuple[list[Snippet], list[str]]:
    snippets, problems = [], []
    for path in sorted(DOCS.rglob("*.md")):
        s, p = _parse_page(path)
        snippets += s
        problems += p
    return snippets, problems


# == runners (run as scripts) ==============================================================


def _compile(snip: dict):
    # Tracebacks name the page and the page's line numbers.
    offset = 0 if snip["source_name"] != snip["page"] else snip["line"] - 1
    return compile("\n" * offset + snip["code"], snip["source_name"], "exec")


def _run_one(snip: dict, namespace: dict) -> dict:
    out = io.StringIO()
    started = time.monotonic()
    error = None
    try:
        with contextlib.redirect_stdout(out):
            exec(_compile(snip), namespace)  # noqa: S102  (running the docs is the point)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            error = f"SystemExit: {exc.code}"
    except BaseException:  # noqa: BLE001  (any failure of a snippet is reported, not raised)
        error = traceback.format_exc()
    return {"id": snip["id"], "stdout": out.getvalue(), "error": error, "seconds": time.monotonic() - started}


def _single_runner(payload: list[dict], results_path: str) -> None:
    """Run each session in a forked child of this process (torch and fshard imported once).

    Sessions marked ``after=ranks`` run last, once the file ``RESULTS.go`` exists (the test
    creates it when the multi-rank scripts are done).
    """
    import torch  # noqa: F401  (imported before forking, once for all sessions)

    import fshard  # noqa: F401

    sessions: dict[tuple[str, str, bool], list[dict]] = {}
    for snip in payload:
        sessions.setdefault((snip["page"], snip["session"], snip["mode"] == "after"), []).append(snip)
    results = []
    for (page, session, after), snips in sorted(sessions.items(), key=lambda item: item[0][2]):
        if after:
            deadline = time.monotonic() + TIMEOUT
            while not Path(results_path + ".go").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        out_file = f"{results_path}.{len(results)}"
        pid = os.fork()
        if pid == 0:  # the child runs the session and reports through a file
            code = 0
            try:
                namespace: dict = {"__name__": "__main__"}
                got = []
                for snip in snips:
                    got.append(_run_one(snip, namespace))
                    if got[-1]["error"]:
                        break
                Path(out_file).write_text(json.dumps(got), encoding="utf-8")
            except BaseException:  # noqa: BLE001  (the parent reports a session that wrote nothing)
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        try:
            got = json.loads(Path(out_file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            got = [
                {
                    "id": snips[0]["id"],
                    "stdout": "",
                    "error": f"session {page}[{session}] died ({status})",
                    "seconds": 0.0,
                }
            ]
        results.extend(got)
    Path(results_path).write_text(json.dumps(results), encoding="utf-8")


def _ranks_runner(payload: list[dict], results_dir: str, workdir: str) -> None:
    """Rank function: run every multi-rank script in turn; each rank writes its own results file.

    Runs in ``workdir``; the working directory, ``sys.argv`` and the global random state are
    restored afterwards (the pool's ranks serve other tests). A failed script raises, so that the
    pool stops the other ranks, which may wait for this one in a collective.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    path = Path(results_dir) / f"rank{rank}.json"
    results = []
    cwd, argv = os.getcwd(), sys.argv
    os.chdir(workdir)
    try:
        with torch.random.fork_rng(devices=[]):
            for snip in payload:
                sys.argv = [snip["source_name"]]
                got = _run_one(snip, {"__name__": "__main__", "__file__": str(ROOT / snip["source_name"])})
                results.append(got)
                path.write_text(json.dumps(results), encoding="utf-8")
                if got["error"]:
                    raise RuntimeError(f"{snip['id']} failed on rank {rank}:\n{got['error']}")
    finally:
        os.chdir(cwd)
        sys.argv = argv


# == the tests ==============================================================================

try:
    import pytest
except ImportError:  # the runners do not need pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        """Run every tested snippet once: {snippet id: result}."""
        snippets, _ = collect()
        tmp = tmp_path_factory.mktemp("docs")
        work = tmp / "work"  # snippets' working directory (checkpoints and such land here)
        work.mkdir()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        got: dict[str, dict] = {}

        def chosen(modes):
            return [asdict(s) | {"id": s.id} for s in snippets if s.mode in modes]

        def not_run(snips, why):
            for s in snips:
                got.setdefault(
                    s["id"],
                    {"id": s["id"], "stdout": "", "seconds": 0.0, "error": f"not run ({why})"},
                )

        # The single-process runner starts first, in the background; its "after=ranks" sessions
        # wait for the go file, created once the multi-rank scripts are done.
        single = chosen({"single", "after"})
        proc = None
        if single:
            payload, out = tmp / "single.json", tmp / "single-results"
            payload.write_text(json.dumps(single), encoding="utf-8")
            log = open(tmp / "single.log", "w", encoding="utf-8")  # noqa: SIM115
            cmd = [sys.executable, str(Path(__file__).resolve()), "single", str(payload), str(out)]
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)

        ranks = chosen({"ranks"})
        if ranks:
            from fshard._errors import RankError
            from tests.conftest import run_ranks

            ranks_out = tmp / "ranks-results"
            ranks_out.mkdir()
            failure = None
            try:
                run_ranks(RANKS, _ranks_runner, ranks, str(ranks_out), str(work), timeout=TIMEOUT)
            except RankError as exc:
                failure = str(exc)[-3000:]
            for rank_file in sorted(ranks_out.glob("rank*.json")):
                rank = rank_file.stem
                for r in json.loads(rank_file.read_text(encoding="utf-8")):
                    if rank == "rank0" or r["error"]:
                        if r["error"]:
                            r["error"] = f"[{rank}] {r['error']}"
                        got.setdefault(r["id"], r)
            not_run(ranks, f"an earlier snippet failed, or the ranks failed:\n{failure}")
        (tmp / "single-results.go").touch()

        if proc is not None:
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            tail = (tmp / "single.log").read_text(encoding="utf-8")[-3000:]
            if out.exists():
                got.update({r["id"]: r for r in json.loads(out.read_text(encoding="utf-8"))})
            not_run(
                single,
                f"an earlier snippet failed, or the single runner died: exit {proc.returncode}; "
                f"runner output:\n{tail}",
            )
        return got

    _SNIPPETS, _PROBLEMS = collect()

    def test_every_python_block_is_marked():
        assert not _PROBLEMS, "\n".join(_PROBLEMS)

    @pytest.mark.timeout(2 * TIMEOUT + 60)  # a backstop: the runners finish in well under a minute
    @pytest.mark.parametrize("snip", _SNIPPETS, ids=lambda s: s.id)
    def test_snippet(snip, results):
        r = results[snip.id]
        assert r["error"] is None, f"{snip.id} failed:\n{r['error']}\nstdout:\n{r['stdout']}"
        if snip.expected is not None:
            want = "\n".join(line.rstrip() for line in snip.expected.splitlines()) + "\n"
            have = "\n".join(line.rstrip() for line in r["stdout"].splitlines()) + "\n"
            checker = doctest.OutputChecker()
            if not checker.check_output(want, have, doctest.ELLIPSIS):
                diff = checker.output_difference(doctest.Example("", want), have, doctest.ELLIPSIS)
                pytest.fail(
                    f"{snip.id}: the output shown in the docs is not what the snippet prints.\n{diff}"
                )

    def test_api_page_lists_every_public_name():
        import fshard

        api = (DOCS / "api.md").read_text(encoding="utf-8")  # generated by docs/gen_api.py
        documented = set(re.findall(r"^### fs\.([\w.]+)$", api, flags=re.MULTILINE))
        documented |= {name.split(".")[0] for name in documented}  # fs.optim.sgd documents optim
        missing = [name for name in fshard.__all__ if name not in documented]
        assert not missing, (
            f"docs/api.md has no '### fs.NAME' entry for {missing}: run python docs/gen_api.py"
        )
        for module in ("optim", "random", "checkpoint"):
            assert module in documented, f"docs/api.md has no '### fs.{module}.NAME' entry"

    def test_mentioned_examples_exist():
        text = "".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
        missing = sorted({m for m in re.findall(r"examples/[a-z0-9_]+\.py", text) if not (ROOT / m).exists()})
        assert not missing, f"docs mention example scripts that do not exist: {missing}"

    def test_nav_lists_every_page():
        text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
        pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
        missing = [p for p in pages if p not in text]
        assert not missing, f"mkdocs.yml nav does not list {missing}"


if __name__ == "__main__":
    _mode, _payload, _out = sys.argv[1:4]
    assert _mode == "single", _mode
    sys.path.insert(0, str(ROOT))
    _single_runner(json.loads(Path(_payload).read_text(encoding="utf-8")), _out)
