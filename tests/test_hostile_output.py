"""Hostile output folders: links planted inside, temporaries, two runs, colliding names.

Nothing may be written, replaced or deleted outside the real output folder; every temporary
file is new and exclusive; a second export into a folder adds to its index; folder names from
JSONL ids and from texts never collide. Every case checks the files on disk (bytes, JSON), the
exit code and that no traceback was printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TOY = ["--model", "toy"]
ONE = ["--jobs", "1", "--figures", "overview"]  # the least drawing that still draws


def _export(invoke, out: Path, *args: str):
    return invoke("export", *args, *TOY, *ONE, "-o", out)


def _clean(result, code: int) -> str:
    output = result.stdout + result.stderr
    assert result.exit_code == code, output
    assert "Traceback" not in output
    return output


def _folder(text: str, ident: str | None = None) -> str:
    from attnviz.export import folder_name

    return folder_name(text, None, ident)


def _outside(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A folder outside every OUT_DIR holding files a careless export would touch."""
    outside = tmp_path / "outside"
    (outside / "heads").mkdir(parents=True)
    files = {
        "victim.txt": b"mine, do not touch\n",
        "overview.png": b"not a png",
        "L00.png": b"a layer grid of mine",
        ".notes.abcdefgh.tmp": b"an old temporary-looking file of mine",
        f".x.png.{_dead_pid()}.0123abcd.tmp": b"looks like ours, is not inside OUT_DIR",
        "heads/L00_H00.png": b"mine",
    }
    for name, data in files.items():
        (outside / name).write_bytes(data)
    old = time.time() - 7200
    os.utime(outside / ".notes.abcdefgh.tmp", (old, old))
    return outside, files


def _unchanged(outside: Path, files: dict[str, bytes]) -> None:
    found = {str(p.relative_to(outside)): p.read_bytes() for p in outside.rglob("*")
             if p.is_file()}
    assert found == files, "a file outside OUT_DIR was written, replaced or deleted"


_DEAD: list[int] = []


def _dead_pid() -> int:
    """The pid of a process that has finished (so nobody can be writing its temporaries)."""
    if not _DEAD:
        process = subprocess.Popen([sys.executable, "-c", "pass"])
        process.wait()
        _DEAD.append(process.pid)
    return _DEAD[0]


# --------------------------------------------------------------------------- 1. links
def test_text_folder_link_is_refused_and_other_texts_export(invoke, tmp_path):
    outside, files = _outside(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / _folder("a b c")).symlink_to(outside, target_is_directory=True)
    result = _export(invoke, out, "a b c", "d e f")
    output = _clean(result, 1)
    assert "symbolic link" in output and _folder("a b c") in output
    _unchanged(outside, files)
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert [e["status"] for e in index["texts"]] == ["failed", "exported"]
    manifest = json.loads((out / _folder("d e f") / "export.json").read_text("utf-8"))
    assert manifest["complete"] is True and manifest["text"] == "d e f"


@pytest.mark.parametrize("sub", ["heads", "layers"])
def test_figure_folder_link_is_refused(invoke, tmp_path, sub):
    outside, files = _outside(tmp_path)
    out = tmp_path / "out"
    folder = out / _folder("a b c")
    folder.mkdir(parents=True)
    (folder / sub).symlink_to(outside / "heads" if sub == "heads" else outside,
                              target_is_directory=True)
    # --force on a folder made with other settings removes old figures: never through a link
    result = invoke("export", "a b c", *TOY, "--jobs", "1", "--force", "-o", out)
    output = _clean(result, 1)
    assert "symbolic link" in output and sub in output
    _unchanged(outside, files)
    assert (folder / sub).is_symlink()


def test_link_in_place_of_a_file_is_replaced_not_followed(invoke, tmp_path):
    outside, files = _outside(tmp_path)
    out = tmp_path / "out"
    folder = out / _folder("a b c")
    folder.mkdir(parents=True)
    for name in ("overview.png", "capture.json", "attention.npy", "topk.csv", "export.json"):
        (folder / name).symlink_to(outside / "victim.txt")
    for name in ("index.json", "index.html", ".index.json.entries.tmp"):
        (out / name).symlink_to(outside / "victim.txt")
    _clean(_export(invoke, out, "a b c"), 0)
    _unchanged(outside, files)
    for name in ("overview.png", "capture.json", "attention.npy", "topk.csv", "export.json"):
        assert not (folder / name).is_symlink() and (folder / name).is_file(), name
    assert (folder / "overview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "index.json").is_symlink()
    assert json.loads((out / "index.json").read_text("utf-8"))["texts"][0]["status"] == (
        "exported")


def test_export_lock_file_link_is_refused(invoke, tmp_path):
    outside, files = _outside(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    from attnviz.export import LOCK_NAME

    (out / LOCK_NAME).symlink_to(outside / "victim.txt")
    output = _clean(_export(invoke, out, "a b c"), 1)
    assert "symbolic link" in output and LOCK_NAME in output
    _unchanged(outside, files)


@pytest.mark.parametrize("command", [
    ["heatmap", "a b", *TOY, "-o", "{o}/x.png"],
    ["html", "a b", *TOY, "-o", "{o}/x.html"],
    ["heads", "a b", *TOY, "--format", "csv", "-o", "{o}/x.csv"],
    ["rollout", "a b", *TOY, "-o", "{o}/x.png"],
])
def test_output_file_link_is_replaced(invoke, tmp_path, command):
    outside, files = _outside(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    target = out / Path(command[-1]).name
    target.symlink_to(outside / "victim.txt")
    _clean(invoke(*[a.replace("{o}", str(out)) for a in command]), 0)
    _unchanged(outside, files)
    assert target.is_file() and not target.is_symlink()
    assert target.stat().st_size > 0


def test_dump_into_folder_with_links(invoke, tmp_path):
    outside, files = _outside(tmp_path)
    dump = tmp_path / "d"
    dump.mkdir()
    (dump / "attention.npy").symlink_to(outside / "victim.txt")
    (dump / "capture.json").symlink_to(outside / "overview.png")
    _clean(invoke("dump", "a b c", *TOY, "-o", dump), 0)
    _unchanged(outside, files)
    from attnviz.capture import load_capture

    assert load_capture(dump).text == "a b c"
    assert not (dump / "attention.npy").is_symlink()


# --------------------------------------------------------------------------- 2. temporaries
def test_planted_temporary_name_is_never_opened(invoke, tmp_path, monkeypatch):
    import secrets

    import attnviz.fileio as fileio

    outside, files = _outside(tmp_path)
    dump = tmp_path / "d"
    dump.mkdir()
    guesses = iter(["deadbeef", "deadbeef"])
    real = secrets.token_hex
    monkeypatch.setattr(fileio.secrets, "token_hex", lambda n: next(guesses, None) or real(n))
    for name in ("attention.npy", "capture.json"):
        (dump / f".{name}.{os.getpid()}.deadbeef.tmp").symlink_to(outside / "victim.txt")
    _clean(invoke("dump", "a b c", *TOY, "-o", dump), 0)
    _unchanged(outside, files)
    from attnviz.capture import load_capture

    assert load_capture(dump).tokens  # a whole capture, written beside the planted links


def _plant_temporaries(folder: Path, outside: Path) -> tuple[list[str], list[str]]:
    """Stale temporaries of ours (to remove) and look-alikes (to keep) in ``folder``."""
    dead, old = _dead_pid(), time.time() - 7200
    stale = [f".attention.npy.{dead}.0123abcd.tmp", f".report.html.{dead}.99999999.tmp",
             ".attention.npy.k3j_x9q2.tmp"]  # the last: an earlier version's, two hours old
    keep = [f".attention.npy.{os.getpid()}.0123abcd.tmp",  # a live process's
            ".attention.npy.abcdefgh.tmp",  # an earlier version's, but recent
            ".notes.tmp", "notes.txt", f"attention.npy.{dead}.0123abcd.tmp"]
    for name in stale + keep:
        (folder / name).write_bytes(b"x" * 1000)
    os.utime(folder / stale[2], (old, old))
    link = f".capture.json.{dead}.00000000.tmp"
    (folder / link).symlink_to(outside / "victim.txt")
    keep.append(link)
    return stale, keep


@pytest.mark.parametrize("command", [
    ["dump", "a b c", *TOY, "-o", "{f}"],
    ["html", "a b c", *TOY, "-o", "{f}/report.html"],
    ["heatmap", "a b c", *TOY, "-o", "{f}/x.png"],
])
def test_stale_temporaries_are_removed_by_the_next_run(invoke, tmp_path, command):
    outside, files = _outside(tmp_path)
    folder = tmp_path / "f"
    folder.mkdir()
    stale, keep = _plant_temporaries(folder, outside)
    _clean(invoke(*[a.replace("{f}", str(folder)) for a in command]), 0)
    names = {p.name for p in folder.iterdir()}
    assert not names & set(stale), names
    assert set(keep) <= names
    _unchanged(outside, files)


def test_export_removes_stale_temporaries_only_inside(invoke, tmp_path):
    outside, files = _outside(tmp_path)
    out = tmp_path / "out"
    folder = out / _folder("a b c")
    (folder / "heads").mkdir(parents=True)
    stale, keep = _plant_temporaries(folder / "heads", outside)
    _clean(invoke("export", "a b c", *TOY, "--jobs", "1", "-o", out), 0)
    names = {p.name for p in (folder / "heads").iterdir()}
    assert not names & set(stale) and set(keep) <= names
    _unchanged(outside, files)


# --------------------------------------------------------------------------- 6. two exports
def test_second_export_into_a_locked_folder_fails_clearly(invoke, tmp_path):
    from attnviz.export import LOCK_NAME
    from attnviz.fileio import FolderLock

    out = tmp_path / "out"
    out.mkdir()
    with FolderLock(out, LOCK_NAME):
        output = _clean(_export(invoke, out, "a b c"), 1)
        assert f"another export is writing to {out} (pid {os.getpid()})" in output
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    assert not (out / LOCK_NAME).exists()
    _clean(_export(invoke, out, "a b c"), 0)  # free again once the first one is done
    assert not (out / LOCK_NAME).exists()


def test_later_export_adds_to_the_index(invoke, tmp_path):
    out = tmp_path / "figs"
    _clean(_export(invoke, out, "first text"), 0)
    _clean(_export(invoke, out, "second text", "third text"), 0)
    index = json.loads((out / "index.json").read_text("utf-8"))
    folders = [e["folder"] for e in index["texts"]]
    assert folders == [_folder("first text"), _folder("second text"), _folder("third text")]
    html = (out / "index.html").read_text("utf-8")
    assert all(f"{name}/" in html for name in folders)
    # Again with one of them: replaced in place, not listed twice.
    _clean(invoke("export", "second text", *TOY, *ONE, "--force", "-o", out), 0)
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert sorted(e["folder"] for e in index["texts"]) == sorted(folders)
    # A folder the user removed is dropped from the index.
    import shutil

    shutil.rmtree(out / _folder("first text"))
    _clean(_export(invoke, out, "fourth text"), 0)
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert sorted(e["folder"] for e in index["texts"]) == sorted(
        [_folder("second text"), _folder("third text"), _folder("fourth text")])


def test_index_of_another_tool_is_replaced_not_merged(invoke, tmp_path):
    out = tmp_path / "figs"
    out.mkdir()
    (out / "index.json").write_text('{"texts": [{"folder": "../../etc", "status": "x"}]}')
    _clean(_export(invoke, out, "first text"), 0)
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert [e["folder"] for e in index["texts"]] == [_folder("first text")]


# --------------------------------------------------------------------------- 7. names
IDS = ["x", "X", "x-1", "x_1", "x--1", "con", "con-", "CON", "a/b", "a_b", "a-b", "", " ",
       "..", "doc-17", "Doc-17", "hello-world", "z" * 200]
TEXTS = ["x", "hello world", "X", "con", "a b", "doc 17", ""]


def test_folder_names_from_ids_and_texts_never_collide():
    from attnviz.export import folder_name

    inputs = {("id", ident) for ident in IDS} | {("text", text) for text in TEXTS}
    # ids chosen to equal the automatic name of a text, or another input's folder name
    taken = {folder_name(text) for text in TEXTS} | {folder_name("t", None, i) for i in IDS}
    inputs |= {("id", name) for name in taken}
    inputs |= {("id", name.upper()) for name in taken}
    names = {kind_value: (folder_name("t", None, kind_value[1]) if kind_value[0] == "id"
                          else folder_name(kind_value[1]))
             for kind_value in inputs}
    keys = [name.lower() for name in names.values()]
    assert len(set(keys)) == len(inputs), sorted(keys)
    for name in names.values():
        assert 0 < len(name) <= 80 and all(c.isalnum() or c == "-" for c in name), name
    assert folder_name("t", None, "doc-17") == "doc-17"  # a clean id is the folder name
    assert folder_name("t", None, "Doc-17") != "doc-17"


def test_id_equal_to_a_text_folder_does_not_replace_it(invoke, tmp_path):
    out = tmp_path / "out"
    _clean(_export(invoke, out, "hello world"), 0)
    taken = _folder("hello world")
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(json.dumps({"text": "something else", "id": taken}) + "\n"
                     + json.dumps({"text": "and more", "id": taken.upper()}) + "\n")
    _clean(invoke("export", "--input", jsonl, *TOY, *ONE, "-o", out), 0)
    manifest = json.loads((out / taken / "export.json").read_text("utf-8"))
    assert manifest["text"] == "hello world" and manifest["complete"] is True
    index = json.loads((out / "index.json").read_text("utf-8"))
    by_folder = {e["folder"]: e["text"] for e in index["texts"]}
    assert by_folder[taken] == "hello world"
    assert sorted(by_folder.values()) == ["and more", "hello world", "something else"]


# --------------------------------------------------------------------------- 8. --jobs
def test_jobs_has_a_bound(invoke):
    from attnviz.errors import UsageError
    from attnviz.export import ExportOptions, max_jobs

    output = _clean(invoke("export", "a", *TOY, "--jobs", "10000", "-o", "out"), 2)
    assert f"at most {max_jobs()}" in output and "--jobs" in output
    with pytest.raises(UsageError):
        ExportOptions(jobs=max_jobs() + 1).check()
    ExportOptions(jobs=max_jobs()).check()
    assert 4 <= max_jobs() <= 4 * (os.cpu_count() or 1) + 4


# --------------------------------------------------------------------------- 10. tracebacks
LONG = "n" * 300


@pytest.mark.parametrize("command", [
    ["export", "a b", *TOY, "-o", LONG],
    ["export", "a b", *TOY, "-o", f"{LONG}/sub"],
    ["dump", "a b", *TOY, "-o", LONG],
    ["heatmap", "a b", *TOY, "-o", f"{LONG}.png"],
    ["html", "a b", *TOY, "-o", f"{LONG}.html"],
    ["rollout", "a b", *TOY, "-o", f"{LONG}.png"],
])
def test_output_name_too_long(invoke, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    output = _clean(invoke(*command), 1)
    assert "too long" in output
    assert list(tmp_path.iterdir()) == []


def test_model_name_too_long(invoke):
    output = _clean(invoke("heatmap", "a b", "--model", "m" * 300), 1)
    assert "--model" in output


def test_text_that_is_not_utf8_fails_alone(invoke, tmp_path):
    out = tmp_path / "out"
    output = _clean(_export(invoke, out, "good text", "bad \udcff text", "also good"), 1)
    assert "TEXT 2" in output and "not valid UTF-8" in output
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert [e["status"] for e in index["texts"]] == ["exported", "failed", "exported"]
    assert json.loads((out / _folder("also good") / "export.json").read_text())["complete"]


# --------------------------------------------------------------------------- 11. smaller ones
def test_ctrl_c_says_interrupted(invoke, monkeypatch, tmp_path):
    import attnviz.export as export_module

    def stop(self, items):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module.Exporter, "run", stop)
    result = invoke("export", "a b", *TOY, "-o", tmp_path / "out")
    assert result.exit_code == 130
    assert "Interrupted" in result.stdout + result.stderr


def test_ctrl_c_in_another_command(invoke, monkeypatch):
    import attnviz.session as session_module

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_module.Session, "capture", stop)
    result = invoke("heatmap", "a b", *TOY, "-o", "never.png")
    assert result.exit_code == 130
    assert "Interrupted" in result.stdout + result.stderr
    assert not Path("never.png").exists()


@pytest.mark.parametrize("args", [
    ["a b", *TOY, "--layers", "5"],  # fits no text: stops before anything is written
    ["a b", "--model", "/nonexistent/model/folder"],
])
def test_failed_export_leaves_no_folder(invoke, tmp_path, args):
    out = tmp_path / "new" / "out"
    result = invoke("export", *args, "-o", out)
    assert result.exit_code in (1, 2)
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    invoke("export", *args, "-o", existing)
    assert existing.is_dir() and list(existing.iterdir()) == []  # the user's folder stays


@pytest.mark.parametrize("command", [
    ["heads", "--input", "{i}", *TOY],
    ["export", "--input", "{i}", *TOY, "-o", "{t}/out"],
    ["html", "--input", "{i}", *TOY, "-o", "{t}/r.html"],
])
@pytest.mark.parametrize("source", ["/dev/zero", "folder"])
def test_input_that_is_not_a_text_file(invoke, tmp_path, command, source):
    if source == "/dev/zero" and not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    path = source if source.startswith("/") else str(tmp_path)
    started = time.perf_counter()
    result = invoke(*[a.replace("{i}", path).replace("{t}", str(tmp_path)) for a in command])
    output = result.stdout + result.stderr
    assert result.exit_code in (1, 2), output
    assert "Traceback" not in output
    assert "does not exist" not in output
    assert ("is a folder" in output) if source == "folder" else ("longer than" in output
                                                                 or "larger than" in output)
    assert time.perf_counter() - started < 60


def test_input_from_a_pipe_still_works(invoke, tmp_path):
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w") as handle:
            handle.write("one text\nanother text\n")

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    out = tmp_path / "out"
    _clean(invoke("export", "--input", fifo, *TOY, *ONE, "-o", out), 0)
    thread.join(10)
    index = json.loads((out / "index.json").read_text("utf-8"))
    assert [e["text"] for e in index["texts"]] == ["one text", "another text"]


# --------------------------------------------------------------------------- streams as -o
def _stream_target(kind: str, folder: Path, name: str) -> tuple[Path, str]:
    """A target that is not a regular file; returns it and how to recognise it afterwards."""
    target = folder / name
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "link to /dev/null":
        target.symlink_to("/dev/null")
    elif kind == "link to a fifo":
        os.mkfifo(folder / "pipe")
        target.symlink_to(folder / "pipe")
    else:  # what /dev/stdout is on Linux
        target.symlink_to("/proc/self/fd/1")
    return target, os.readlink(target) if target.is_symlink() else "fifo"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX named pipes")
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/null", "link to a fifo",
                                  "link to /proc/self/fd/1"])
@pytest.mark.parametrize(("command", "name"), [
    (["top-k", "a b", *TOY, "-l", "0", "--head", "0"], "out.md"),
    (["heads", "a b", *TOY, "-f", "csv"], "out.csv"),
    (["heatmap", "a b", *TOY, "--layer", "0", "--head", "0"], "out.png"),
    (["html", "a b", *TOY], "out.html"),
    (["rollout", "a b", *TOY], "out.png"),
    (["dump", "a b", *TOY], "out"),
    (["compare", "a b", "a c", *TOY, "-l", "0", "--head", "0"], "out.png"),
    (["generate", "a b", *TOY], "out.csv"),
])
def test_a_device_pipe_or_stream_link_is_never_replaced(invoke, tmp_path: Path, kind: str,
                                                        command: list[str], name: str) -> None:
    """-o /dev/null, -o /dev/stdout: a usage error, and the device, pipe or link stays."""
    target, before = _stream_target(kind, tmp_path, name)
    output = _clean(invoke(*command, "-o", target), 2)
    assert "not a regular file" in output and str(target) in " ".join(output.split())
    if target.is_symlink():
        assert os.readlink(target) == before
    else:
        import stat

        assert stat.S_ISFIFO(target.lstat().st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("command", [
    ["top-k", "a b", *TOY, "-l", "0", "--head", "0"], ["heads", "a b", *TOY, "-f", "csv"],
    ["heatmap", "a b", *TOY, "--layer", "0", "--head", "0"], ["html", "a b", *TOY],
    ["rollout", "a b", *TOY], ["compare", "a b", "a c", *TOY, "-l", "0", "--head", "0"],
    ["generate", "a b", *TOY]])
def test_an_existing_folder_as_an_output_file_is_a_usage_error(invoke, tmp_path: Path,
                                                               command: list[str]) -> None:
    """Said as such, before any work (it read "cannot tell the image format" or exit 1)."""
    folder = tmp_path / "figs"
    folder.mkdir()
    (folder / "kept.txt").write_text("mine")
    output = " ".join(_clean(invoke(*command, "-o", folder), 2).split())
    assert f"{folder}: it is a folder" in output and "names a file" in output
    assert [p.name for p in folder.iterdir()] == ["kept.txt"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="Linux /proc")
@pytest.mark.parametrize("target", ["/proc/self/fd/1", "/dev/fd/1"])
def test_a_process_descriptor_as_output_is_a_usage_error(invoke, target: str) -> None:
    output = _clean(invoke("top-k", "a b", *TOY, "-l", "0", "--head", "0", "-o", target), 2)
    assert "file descriptor, not a regular file" in output


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_link_to_a_regular_file_under_dev_shm_is_replaced(invoke, tmp_path: Path) -> None:
    """Only streams are refused: a link to an ordinary file is replaced, wherever it points."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        elsewhere = Path(shm) / "f.csv"
        elsewhere.write_text("mine")
        link = tmp_path / "out.csv"
        link.symlink_to(elsewhere)
        _clean(invoke("heads", "a b", *TOY, "-f", "csv", "-o", link), 0)
        assert not link.is_symlink() and link.read_text().startswith("layer,head")
        assert elsewhere.read_text() == "mine"


@pytest.mark.parametrize("fmt", ["table", "csv", "markdown"])
def test_escapes_in_a_saved_captures_tokens_never_reach_the_terminal(invoke, tmp_path: Path,
                                                                     fmt: str) -> None:
    """A capture.json whose display tokens carry terminal escapes (a title change, colours,
    a bell): printed as their escapes, as a local capture's tokens are."""
    saved = tmp_path / "cap"
    _clean(invoke("dump", "a b c", *TOY, "-o", saved), 0)
    sidecar = json.loads((saved / "capture.json").read_text("utf-8"))
    sidecar["display_tokens"] = ["\x1b]0;pwn\x07A", "\x1b[31mB", "\x9bC"]
    (saved / "capture.json").write_text(json.dumps(sidecar), "utf-8")
    output = _clean(invoke("top-k", "--from", saved, "-l", "0", "--head", "0", "-f", fmt), 0)
    assert "\x1b" not in output and "\x07" not in output and "\x9b" not in output
    assert "\\x1b[31mB" in output


@pytest.mark.parametrize("name", ["victim.txt", "victim", "notes.md"])
def test_dump_over_an_existing_file_that_is_not_a_capture_is_a_usage_error(
        invoke, tmp_path: Path, name: str) -> None:
    """As generate --dump says it (dump's read "cannot write ...", exit 1, after the work)."""
    victim = tmp_path / name
    victim.write_bytes(b"mine, do not touch\n")
    output = " ".join(_clean(invoke("dump", "a b", *TOY, "-o", victim), 2).split())
    assert f"-o {victim}: a file with that name exists and is not a capture" in output
    assert victim.read_bytes() == b"mine, do not touch\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_dump_over_an_existing_npy_file_replaces_it(invoke, tmp_path: Path) -> None:
    import numpy as np

    target = tmp_path / "old.npy"
    np.save(target, np.zeros(3))
    result = invoke("dump", "a b", *TOY, "-o", target)
    assert result.exit_code == 0, result.output
    assert np.load(target).ndim == 4 and (tmp_path / "old.json").is_file()


@pytest.mark.parametrize("before", [None, "long.json", "capture.json"])
def test_an_interrupted_full_dump_leaves_the_folder_as_it_was(invoke, tmp_path: Path,
                                                              monkeypatch, before) -> None:
    """Stopped as the weights are written: no attention.npy, no temporary, no folder it made; an
    earlier capture's files (and nothing else) stay."""
    from attnviz.stream import CaptureWriter

    folder = tmp_path / "d"
    if before is not None:
        folder.mkdir()
        names = (["long.json", "q_000.npy", "k_000.npy", "lse_000.npy"]
                 if before == "long.json" else ["attention.npy", "capture.json"])
        for name in names:
            (folder / name).write_bytes(f"old {name}".encode())
        (folder / "notes.txt").write_text("mine")
    files = {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else None
    real = CaptureWriter.allocate

    def stop_once_allocated(self, shape):
        real(self, shape)
        assert [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # the weights' file
        raise KeyboardInterrupt

    monkeypatch.setattr(CaptureWriter, "allocate", stop_once_allocated)
    result = invoke("dump", "a b c", *TOY, "--no-cache", "-o", folder)
    assert result.exit_code == 130, result.output
    if files is None:
        assert not folder.exists()
    else:
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == files


def test_rollout_npy_is_checked_before_any_work(invoke, tmp_path: Path) -> None:
    """--npy naming a folder or a stream is refused before the figures are written."""
    (tmp_path / "dir.npy").mkdir()
    (tmp_path / "so.npy").symlink_to("/proc/self/fd/1")
    for npy, fragment in (("dir.npy", "it is a folder"), ("so.npy", "not a regular file")):
        out = tmp_path / f"r-{npy}.png"
        output = " ".join(_clean(invoke("rollout", "a b", *TOY, "--npy", tmp_path / npy,
                                        "-o", out), 2).split())
        assert f"--npy {tmp_path / npy}" in output and fragment in output
        assert not out.exists()
