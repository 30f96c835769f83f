"""Export: the index of an output folder (index.json, index.html) and its entries.

Each text of a run has one entry (its number, origin, folder, status and files); the
entries are streamed to a scratch file as texts finish, then written as index.json and
index.html together with the entries of earlier runs into the same folder, so memory stays
flat however many texts there are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from attnviz._version import __version__
from attnviz.export.plan import FOLDER_NAME
from attnviz.export.write import MANIFEST, is_dir, read_json

if TYPE_CHECKING:
    from attnviz.export.plan import ExportItem, ExportOptions, ExportSummary

INDEX_JSON = "index.json"
INDEX_HTML = "index.html"
INDEX_FORMAT = "attnviz-export-index"
REPORT_HTML = "report.html"
_INDEX_READ_LIMIT = 64 << 20  # an index.json not in our line layout is read whole up to this


# --------------------------------------------------------------------------- entries
def folder_entry(number: int, item: ExportItem, name: str, manifest: dict[str, Any],
                 status: str) -> dict[str, Any]:
    """The entry of a text whose folder is complete (``exported`` or ``skipped``)."""
    return {"number": number, "origin": item.origin, "id": item.id,
            "text": manifest.get("text"), "pair": manifest.get("pair"), "folder": name,
            "status": status, "num_tokens": manifest.get("num_tokens"),
            "files": [f"{name}/{f}" for f in [*manifest.get("files", []), MANIFEST]]}


def failed_entry(number: int, item: ExportItem, message: str,
                 folder: str | None = None) -> dict[str, Any]:
    """The entry of a text that failed (``folder``: the folder it was written to, if any)."""
    return {"number": number, "origin": item.origin, "id": _printable(item.id),
            "text": _printable(item.text), "pair": _printable(item.pair), "folder": folder,
            "status": "failed", "error": message, "files": []}


def duplicate_entry(number: int, item: ExportItem, text: str, pair: str | None,
                    name: str) -> dict[str, Any]:
    """The entry of a repeat of an earlier text of the input (exported once, in ``name``)."""
    return {"number": number, "origin": item.origin, "id": item.id, "text": text,
            "pair": pair, "folder": name, "status": "duplicate", "files": []}


def _printable(text: str | None) -> str | None:
    """``text`` with what UTF-8 cannot hold (bytes of a non-UTF-8 argument) as ``?``."""
    if text is None:
        return None
    return text.encode("utf-8", "replace").decode("utf-8")


def index_header(summary: ExportSummary, settings: dict[str, Any],
                 model: dict[str, Any]) -> dict[str, Any]:
    """What index.json says before its entries: the run's settings and counts."""
    header = {
        "format": INDEX_FORMAT, "format_version": 1, "attnviz": __version__,
        "settings": {**settings, "model": model},
        "summary": {"texts": summary.texts, "exported": summary.exported,
                    "skipped": summary.skipped, "duplicates": summary.duplicates,
                    "failed": summary.failed,
                    "blank": summary.blank, "files_written": summary.files_written,
                    "files_skipped": summary.files_skipped,
                    "seconds": round(summary.seconds, 3)},
    }
    if summary.report is not None:
        header["report"] = summary.report.name
    return header


def _complete(folder: Path) -> bool:
    """Whether ``folder``'s export.json says it is complete (read, not its files checked:
    one small read per text keeps a big index cheap to rewrite)."""
    manifest = read_json(folder / MANIFEST)
    return manifest is not None and manifest.get("complete") is True


# --------------------------------------------------------------------------- the index
class Index:
    """The run's entries, streamed to an unnamed scratch file, then written as index.json and
    index.html together with the entries of earlier runs into the same folder."""

    def __init__(self, out_dir: Path) -> None:
        from attnviz.fileio import scratch_file

        self.out_dir = out_dir
        self._scratch = scratch_file(out_dir, f"{INDEX_JSON}.entries")
        self.handle = self._scratch.__enter__()
        self.count = 0
        self.folders: set[str] = set()  # folders of this run's entries

    def add(self, entry: dict[str, Any]) -> None:
        """Add a text's entry (in input order)."""
        self.handle.seek(0, os.SEEK_END)
        self.handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.handle.flush()
        self.count += 1
        if isinstance(entry.get("folder"), str):
            self.folders.add(entry["folder"])

    def entries(self) -> Iterator[dict[str, Any]]:
        """This run's entries so far."""
        self.handle.flush()
        self.handle.seek(0)
        for line in self.handle:
            yield json.loads(line)
        self.handle.seek(0, os.SEEK_END)

    def earlier(self) -> Iterator[dict[str, Any]]:
        """Entries of index.json from earlier runs whose folder is still here and was not
        exported again by this run (failures without a folder are not kept); an exported or
        skipped text only while its folder's export.json still says complete, so the index
        never lists a folder that is not whole."""
        for entry in read_index_entries(self.out_dir / INDEX_JSON):
            folder = entry.get("folder")
            if (isinstance(folder, str) and FOLDER_NAME.fullmatch(folder)
                    and folder not in self.folders and is_dir(self.out_dir / folder)
                    and (entry.get("status") not in ("exported", "skipped")
                         or _complete(self.out_dir / folder))):
                yield entry

    def finish(self, header: dict[str, Any]) -> None:
        """Write index.json and index.html atomically (streamed: memory stays flat)."""
        import itertools

        from attnviz.fileio import atomic_open

        try:
            with atomic_open(self.out_dir / INDEX_JSON, "w", encoding="utf-8") as out:
                head = json.dumps(header, ensure_ascii=False, indent=1)
                out.write(head[:-2] + ',\n "texts": [')
                for number, entry in enumerate(itertools.chain(self.earlier(), self.entries())):
                    out.write(("\n  " if number == 0 else ",\n  ")
                              + json.dumps(entry, ensure_ascii=False))
                out.write("\n ]\n}\n")
            with atomic_open(self.out_dir / INDEX_HTML, "w", encoding="utf-8") as out:
                _write_html(out, header, read_index_entries(self.out_dir / INDEX_JSON))
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the scratch file (nothing more is added)."""
        self._scratch.__exit__(None, None, None)


class PartEntries(Index):
    """Index entries kept in memory: one worker's share of a distributed export."""

    def __init__(self) -> None:  # no file: the driver writes the index
        self.items: list[dict[str, Any]] = []
        self.count = 0

    def add(self, entry: dict[str, Any]) -> None:
        self.items.append(entry)
        self.count += 1


def read_index_entries(path: Path) -> Iterator[dict[str, Any]]:
    """The ``texts`` of an export's index.json, streamed (one entry per line, as written);
    nothing for a file that is missing, a link, or not an attnviz export index."""
    import stat

    # Not waiting: a FIFO planted as index.json is refused, never waited on.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        header: list[bytes] = []
        for raw in handle:
            if raw.strip() == b'"texts": [':
                break
            header.append(raw)
            if len(header) > 1000:
                header = []
                break
        else:
            header = []
        if not header:
            yield from _index_entries_whole(handle)
            return
        if b'"format": "attnviz-export-index"' not in b"".join(header):
            return
        for raw in handle:
            line = raw.strip().rstrip(b",")
            if line in (b"]", b"}", b""):
                if line == b"]":
                    return
                continue
            try:
                entry = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                return
            if isinstance(entry, dict):
                yield entry


def _index_entries_whole(handle: IO[bytes]) -> Iterator[dict[str, Any]]:
    handle.seek(0)
    data = handle.read(_INDEX_READ_LIMIT + 1)
    if len(data) > _INDEX_READ_LIMIT:
        return
    try:
        index = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        return
    for entry in index.get("texts") or []:
        if isinstance(entry, dict):
            yield entry



def _write_html(out: IO[str], header: dict[str, Any], entries: Iterable[dict[str, Any]]) -> None:
    from html import escape
    from urllib.parse import quote

    summary = header.get("summary", {})
    out.write("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
              "<title>attnviz export</title>\n<style>body{font-family:sans-serif;margin:2em;"
              "max-width:80em}figure{margin:1.5em 0;border-top:1px solid #ccc;"
              "padding-top:1em}img{max-width:100%;height:auto}.failed{color:#b00}"
              "code{background:#f4f4f4}</style></head><body>\n<h1>attnviz export</h1>\n")
    texts = summary.get("texts", 0)
    out.write(f"<p>Last run: {escape(str(texts))} text{'' if texts == 1 else 's'}: "
              f"{escape(str(summary.get('exported', 0)))} exported, "
              f"{escape(str(summary.get('skipped', 0)))} skipped, "
              f"{escape(str(summary.get('duplicates', 0)))} duplicates, "
              f"{escape(str(summary.get('failed', 0)))} failed. Settings: "
              f"<code>{escape(json.dumps(header.get('settings', {}), ensure_ascii=False))}</code>"
              "</p>\n")
    if header.get("report"):
        report = str(header["report"])
        out.write(f"<p>Interactive report of every text: <a href=\"{quote(report)}\">"
                  f"{escape(report)}</a></p>\n")
    for entry in entries:
        text = str(entry.get("text") or "")
        shown = text if len(text) <= 300 else text[:300] + "..."
        folder = entry.get("folder")
        out.write("<figure>\n")
        out.write(f"<figcaption><b>{escape(str(entry.get('number')))}.</b> "
                  f"{escape(shown)}")
        if entry.get("pair"):
            out.write(f" | {escape(str(entry['pair'])[:300])}")
        if folder:
            out.write(f" &mdash; <a href=\"{quote(folder)}/\">{escape(folder)}/</a>")
        out.write(f" ({escape(str(entry.get('status')))}")
        if entry.get("files"):
            out.write(f", {len(entry['files'])} files")
        out.write(")</figcaption>\n")
        if entry.get("error"):
            out.write(f"<p class=\"failed\">{escape(str(entry['error']))}</p>\n")
        overview = next((f for f in entry.get("files") or []
                         if f.rsplit("/", 1)[-1].startswith("overview.")), None)
        if overview:
            source = quote(overview)
            if overview.endswith(".pdf"):
                out.write(f"<p><a href=\"{source}\">overview (PDF)</a></p>\n")
            else:
                out.write(f"<img loading=\"lazy\" src=\"{source}\" alt=\"overview\">\n")
        out.write("</figure>\n")
    out.write("</body></html>\n")


def write_text_report(index: Index, out_dir: Path, options: ExportOptions,
                      note: Callable[[str], None]) -> Path | None:
    """Write report.html from the saved captures of every exported (or skipped) text.

    Returns:
        The report; ``None`` when no text was exported (then ``note`` says so).
    """
    from attnviz.capture import load_capture
    from attnviz.render.html import write_report

    folders = list(dict.fromkeys(
        entry["folder"] for entry in index.entries()
        if entry.get("status") in ("exported", "skipped") and entry.get("folder")))
    if not folders:
        note("no text was exported, so no report.html was written")
        return None
    # Copies, not memory maps: a file cut short while the report is built must be an
    # error, not a SIGBUS (the report holds every capture's weights anyway).
    captures = [load_capture(out_dir / name, mmap=False) for name in folders]
    return write_report(captures, out_dir / REPORT_HTML, top_k=options.top_k,
                        words=options.words, exclude_special=options.exclude_special)
