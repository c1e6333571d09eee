"""Read and validate a historical batch from the landing folder (the backfill's first step).

A batch is refused as a whole (``BatchRefusedError``, nothing written) when its path is outside
the landing folder, it holds no readable files, mixes formats, or lacks required columns.
Otherwise every row comes out valid or with a reason, which becomes its quarantine row.
Time always comes from ``ts``, never from load time.

Known edge cases, cited inline as (B1)..(B27):
  B1. ``..`` segments and symlinks are resolved before the landing check, so neither can
      escape the landing folder.
  B2. ``ts`` may arrive as text (ISO-8601 with zone, or epoch ms), an integer (epoch ms) or a
      Parquet timestamp (an instant, already UTC); all three are accepted, and kept to the
      millisecond as the stream keeps them (``contract.TS_PRECISION``).
  B3. The same id twice in one batch with identical content counts once; with different
      content the batch contradicts itself, so every copy is quarantined. Copies are a
      client's: another client's row with the id is no copy (it is quarantined by B4).
  B4. A row of another client than ``--client`` is quarantined, never merged into the
      declared client's partitions.
  B5. Spark reads a path with ``* ? [ ] { } \\`` as a glob pattern, which could match files
      the landing check never saw (a link beside ``[x].csv`` named ``x.csv``); such names are
      refused. Files under hidden or ``_`` folders (``.ipynb_checkpoints``, ``_temporary``) are
      not part of a batch, and a linked folder inside it is refused, not silently skipped.
  B6. Spark maps a CSV file's columns by position and takes the names from one file, so the
      files of a CSV batch must share one header (else ``order_id`` of one file would be
      ``user_id`` of another); a row with more or fewer fields than its header is quarantined,
      not cut or padded.
  B7. An integer ``ts`` goes through the same epoch-millis rule as a text one, so a value out
      of range is a row's reason, not an overflow that fails the batch.
  B8. A row stamped more than CLICKSTREAM_MAX_TS_AHEAD after its file was last modified
      comes from a wrong clock: quarantined. Stored, a row in the stream's future makes its
      user's window reach the stream's open tail, so the whole user's correction would wait
      (queued) until the watermark reaches that row: for a ts years ahead, for good. The
      modification time is part of the run's id (``fingerprint``), so a rerun judges alike.
  B9. An ``amount`` column of numbers (Parquet decimals, floats; JSON numbers) is judged by its
      value, written plainly without trailing zeros: Spark's text of it carries the column's
      scale (``12.500000``) or an exponent (``1.23456785E7``), and such valid amounts were
      quarantined as having more than 4 decimals. A value with more still is, past 18
      decimals too (a cast to ``decimal(38,18)`` rounded -1e-20 to 0, accepted). A 32-bit
      float is judged by its own shortest text (19.99 stays 19.99, not the double it
      widens to), and a JSON Lines number by its own digits, not the double Spark infers
      (999999999999.0003 became ...0002). In JSON Lines each line's amount is judged by its
      own JSON type, as the stream judges it (``parse.amount_text``): a column Spark inferred
      as text judged a number with an exponent by its double's text (``1.5E7``, refused), and
      one inferred as numbers or booleans took ``"1e3"`` and ``true`` as amounts.
  B10. A JSON Lines batch is read line by line (``_json_lines``): Spark's JSON reader takes
      the first value of a line and ignores the rest, so two records on one line (files
      joined without a final newline: ``{...}{...}``) stored the first and lost the second
      unseen, and a line holding ``[]`` gave no row at all. Such a line, or one that is not
      strict JSON (Spark's reader took single quotes and ``NaN``, and split a line holding
      an array of records into rows), is quarantined as it is, and one that is not UTF-8 as
      its bytes, as the stream keeps such a value (``parse.bytes_unless_utf8``). Blank lines
      are no records, and a byte-order mark is not part of a line, as for Spark's reader.
  B11. A text column's bytes that are not UTF-8 (Parquet keeps a string's bytes as the
      writer gave them, and reads a byte array without the UTF-8 mark as bytes) are the
      row's reason, and its columns carry them replaced by U+FFFD: as they were, the write
      of the row (Arrow's statistics decode them) failed the whole backfill with a
      ``UnicodeDecodeError``, at every rerun. A CSV file's too (B13); a JSON Lines line is
      judged whole (B10).
  B12. A row's typed ``amount`` is null unless its text is one the contract reads
      (``parse.amount_value``): the plain cast rounded 1.23456 to 1.2346 and read 13-digit
      amounts, exponents and signs, so ``historical_batch``'s ``bad_amount_fraction`` counted
      only unparsable text and let a batch of such amounts through (its rows quarantined).
  B13. Spark's CSV reader decodes a file as UTF-8 and turns bytes that are not into U+FFFD,
      so a Latin-1 url was stored altered, as a valid row. A CSV batch is read as ISO-8859-1
      (one character per byte; the delimiters, quotes and line ends are the same bytes in
      both) and each field turned back into its bytes: UTF-8 fields are their text, and a
      field that is not UTF-8 is its row's reason (B11); a malformed row's line is kept as its
      bytes (``parse.bytes_unless_utf8``).
  B14. A CSV batch is read as standard CSV (RFC 4180, what Python's and Arrow's writers
      produce): a doubled quote inside a quoted field is one quote, a backslash is text, and
      a quoted field may hold line breaks. Spark's defaults (a backslash escapes, a line is
      a record) stored ``""shoes""`` doubled, dropped a backslash before a character, and
      cut a record at a quoted line break: a field stored short and its rest a quarantine
      row. Spark reads a file that may hold such records in one task, so a CSV batch
      spreads over as many tasks as it has files.
  B15. A JSON Lines batch's ids, ``client_id``, ``user_id``, ``ts``, ``url`` and ``referrer``
      are each line's own JSON text, whatever type Spark infers for the column across the
      batch, read as the stream reads them; an id sent as a JSON object, array, boolean or
      number with a fraction is refused as the stream refuses it (``_json_lines``,
      ``parse.not_text_error``).
  B16. A JSON Lines batch may leave out a column whose every value is null (Spark's JSON
      writer drops null fields: a batch of pageviews without a referrer has no ``referrer``
      key), so such a nullable column (``NULLABLE``) is null, not missing.
  B17. A JSON Lines batch without one JSON object (empty files, blank lines, or lines that
      are all malformed) has the kind's columns: Spark infers no column from it, and such a
      batch was refused as lacking every column, where an empty CSV or Parquet batch reads
      as 0 rows and malformed lines are quarantined one by one.
  B18. A CSV file whose quoting is malformed is refused, naming the file and the line: a
      quoted field never closed, or text after a closing quote (``"/b"c``). Spark (B14)
      reads the rest of the file into a quoted field left open (after such text, a quote
      further on the line opens one), and when it is the row's last, the row still has the
      header's number of fields, so every row after it was neither merged nor quarantined
      (their text was stored in one row's ``referrer``). Found by Python's strict reader in
      one pass over each file (~180 MB/s), before Spark reads; a quote inside an unquoted
      field (``5" screen``) is text to both.
  B19. A CSV or JSON Lines file that is compressed, an archive or a Parquet file under a text
      name (``orders.csv`` gzipped) is refused, saying what it is (``packed_file_reason``):
      Spark reads it as text, so a CSV batch was refused for a garbled header that lacked
      every column, and a JSON Lines one had each line of bytes quarantined as bad JSON.
  B20. A Delta table's Parquet files hold every version's rows, removed ones too: a table
      is refused as a batch, and so is a file or partition folder of one (its ``_delta_log``
      is above the batch path, up to the landing folder) and a folder holding one (below,
      where the batch's files are listed). Only the table's own folder was checked, and a
      partition of it, or the folder above it, was read with its removed rows.
  B21. Every listed file is checked before any is opened: a link out of the batch is refused
      (B1), and so is anything but a regular file (a FIFO, socket or device). The B19 peek
      opened each file first, so it read from a file a link pointed to outside the landing
      folder (its refusal told what kind of file that was), and a FIFO's open blocked the run
      (and every queued backfill behind it) for good.
  B22. A JSON Lines line whose object repeats a key is quarantined ("line is JSON the parser
      refuses"), as the stream quarantines such a value. Spark's schema inference failed on
      it (``COLUMN_ALREADY_EXISTS``) and the whole batch was refused as unreadable; the
      batch's columns are then every key its lines hold, read as text.
  B23. A Parquet batch's id column (its key, ``client_id``, ``user_id``) is text or whole
      numbers: each row of any other type is quarantined, naming the column's type
      (``_not_text_error``). Read as its text, a float id 123 was stored as '123.0', two
      large ids became one ('1.23456789012345677E18', one row dropped as the other's copy).
  B24. A JSON Lines batch whose lines spell a key in two cases (``user_id``, ``User_Id``)
      reads the contract's spelling; a line with only the other lacks that field and is
      quarantined naming the key it has (``_one_field_per_name``, ``misspelled_key_error``).
      The batch failed with an unexpected error; later, one whose lines all wrote
      ``Referrer`` stored every referrer null.
  B25. A CSV or JSON Lines file in UTF-16 (a byte-order mark, or NULs between ASCII
      characters) is refused, naming it (``utf16_reason``): a CSV was refused for lacking
      every column, a JSON Lines file quarantined line by line, with a row for no record.
  B26. A CSV file whose records end in two kinds of line break (LF and CRLF: files joined
      from two systems) is refused, naming the file and the first line of the other kind
      (``_malformed_records``): Spark takes one file's line break from its first line, so
      the others' records kept a stray CR in their last field or were joined in pairs.
  B27. A ``ts`` sent as a number with a fraction or an exponent (a JSON Lines line's, a
      Parquet float or decimal column's) is quarantined saying so, as in the stream: its
      reason quoted '1.7356896E12' (the double's text) for ``1735689600000.0``.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pyarrow as pa
from pyspark.errors import PySparkException
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    DataType,
    DateType,
    DecimalType,
    FloatType,
    FractionalType,
    IntegralType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from clickstream.config import Config, unreadable_path_reason
from clickstream.errors import BatchRefusedError
from clickstream.events.parse import (
    TEXT_FIELDS,
    amount_error,
    amount_text,
    amount_value,
    bytes_unless_utf8,
    currency_error,
    exact_decimal_text,
    id_error,
    is_one_json_object,
    json_number_not_whole,
    misspelled_key_error,
    not_text_error,
    not_utf8_reason,
    to_milliseconds,
    ts_ahead_error,
    ts_error,
    ts_from_text,
    unparsed_json_reason,
    url_error,
    user_id_error,
)
from clickstream.spark_session import BROADCAST_KEYS_MAX

BatchKind = Literal["orders", "pageviews"]
FORMATS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json",
           ".ndjson": "json"}
REQUIRED = {
    "orders": ("order_id", "client_id", "user_id", "ts", "amount", "currency"),
    "pageviews": ("event_id", "client_id", "user_id", "ts", "url", "referrer"),
}
KEY = {"orders": "order_id", "pageviews": "event_id"}
NULLABLE = {"orders": (), "pageviews": ("referrer",)}  # required columns whose rows may be null


# Leading bytes of files a text reader would take apart as garbage: Spark reads a compressed
# file as text only when its name ends in the codec's suffix, which no accepted format has.
# Each is long enough that no header line of text starts with it.
PACKED_FILE_MAGIC = {
    re.compile(rb"\x1f\x8b\x08"): "gzip-compressed",
    re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)"): "bzip2-compressed",
    re.compile(rb"\x28\xb5\x2f\xfd"): "zstd-compressed",
    re.compile(rb"\xfd7zXZ\x00"): "xz-compressed",
    re.compile(rb"PK\x03\x04"): "a zip archive",
}


def packed_file_reason(path: Path) -> str | None:
    """Why a CSV or JSON Lines file cannot be read as text, or None: a gzip file named
    ``.csv`` would otherwise be read as one garbled header (or as rows of bad JSON)."""
    with path.open("rb") as file:
        start = file.read(16)
        size = file.seek(0, os.SEEK_END)
        if start.startswith(b"PAR1") and size >= 8:  # Parquet: the magic at both ends
            file.seek(-4, os.SEEK_END)
            if file.read(4) == b"PAR1":
                return "a Parquet file"
    for magic, what in PACKED_FILE_MAGIC.items():
        if magic.match(start):
            return what
    return None


def utf16_reason(path: Path) -> str | None:
    """(B25) Which UTF-16 (or UTF-32) a CSV or JSON Lines file is written in, or None.
    PowerShell and Excel's 'Unicode text' write UTF-16: read as UTF-8, a CSV header lacked
    every column, and JSON Lines' lines were quarantined as bad JSON, one a lone NUL that was
    no record."""
    with path.open("rb") as file:
        start = file.read(16)
    even = start[: len(start) // 2 * 2]
    if start.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return "UTF-32"
    if start.startswith(b"\xff\xfe") or (len(even) >= 4 and not any(even[1::2])
                                         and all(even[0::2])):
        return "UTF-16LE"
    if start.startswith(b"\xfe\xff") or (len(even) >= 4 and not any(even[0::2])
                                         and all(even[1::2])):
        return "UTF-16BE"
    return None


MALFORMED_CSV_ROW = "_malformed_csv_row"  # Spark's corrupt-record column of a CSV batch (B6)
ROW_TEXT = "_row_text"  # the record as its file holds it, when the reader keeps it (B6, B10)
ROW_ERROR = "_row_error"  # why the reader could not take the record apart (B6, B10)
CSV_READ_AS = "ISO-8859-1"  # one character per byte: a CSV file's bytes come through (B13)
CSV_STANDARD = {"escape": '"', "multiLine": "true"}  # RFC 4180: "" is a quote (B14)
CSV_MAX_COLUMNS = 20_480  # Spark's default: a wider batch's readers are given its width
TS_NOT_WHOLE = "_ts_not_whole"  # a JSON Lines line's ts is a number with a fraction (B27)
READER_COLUMNS = ("_file", "_file_modified", MALFORMED_CSV_ROW, ROW_TEXT, ROW_ERROR,
                  TS_NOT_WHOLE)
# Names a batch's own columns cannot have: the reader's, and Spark's file metadata column.
RESERVED_COLUMNS = frozenset((*READER_COLUMNS, "_metadata"))


@dataclass(frozen=True)
class BatchFiles:
    """The files of one batch, all of one format."""

    root: Path
    files: tuple[Path, ...]
    file_format: str
    hidden: tuple[Path, ...] = ()
    """Files of an accepted format the batch leaves out, as Spark does, for names starting
    with '.' or '_' (theirs or a folder's): said, so a file named so by mistake is not lost
    without a word (a macOS copy's ``._orders.csv`` is one to leave out)."""

    def hidden_line(self) -> str | None:
        """What the progress says of :attr:`hidden`, if any."""
        if not self.hidden:
            return None
        names = ", ".join(str(p.relative_to(self.root)) for p in self.hidden[:5])
        more = f" and {len(self.hidden) - 5} more" if len(self.hidden) > 5 else ""
        return (f"not read: {len(self.hidden)} file(s) of an accepted format whose names (or "
                f"folders' names) start with '.' or '_', which Spark skips as hidden: {names}"
                f"{more}; rename any that belongs to the batch and rerun")

    @property
    def fingerprint(self) -> str:
        """Identity of the batch's content (names, sizes, modification times)."""
        import hashlib

        digest = hashlib.sha256()
        for path in self.files:
            stat = path.stat()
            digest.update(f"{path}\x1f{stat.st_size}\x1f{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()[:16]


def resolve_in_landing(config: Config, path: str) -> Path:
    """The batch path, refused unless it is inside the landing folder (B1)."""
    landing = config.landing
    try:
        resolved, inside = config.in_landing(path)
        exists = resolved.exists()
    # A NUL byte, a name too long for the system; a link loop (RuntimeError before 3.13).
    except (OSError, ValueError, RuntimeError) as error:
        raise BatchRefusedError(
            f"batch path {path[:200]!r} cannot name a file here: {error}; pass the path of a "
            f"file or folder under the landing folder {landing}") from error
    if not inside:  # where it resolves is not said: a form's user would learn where any
        # link on the worker points (/proc/self/fd/3: a file the task holds open)
        raise BatchRefusedError(
            f"batch path {path!r} is outside the landing folder {landing} (or links out of "
            "it); copy the batch into the landing folder (CLICKSTREAM_LANDING) and pass a path "
            "relative to it"
        )
    if not exists:
        raise BatchRefusedError(
            f"batch path {path!r} does not exist under the landing folder {landing}")
    if resolved == landing.resolve():  # every client's batches, as one
        raise BatchRefusedError(
            f"batch path {path!r} is the landing folder itself, which holds every batch; pass "
            "the path of one batch's file or folder inside it")
    return resolved


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _refuse_a_delta_table(folder: Path) -> None:
    """A Delta table's Parquet files hold every version's rows, removed ones too, which a
    batch would read as they are (B20)."""
    raise BatchRefusedError(
        f"batch folder {folder} is a Delta table: its Parquet files hold every version's rows, "
        "removed ones too, which a batch would read as they are; export the table's current "
        "rows as Parquet (or CSV, JSON Lines) and load that folder")


def _unlisted(error: OSError) -> None:
    """``os.walk`` skips a folder it cannot list: the batch would be loaded without its files."""
    raise BatchRefusedError(
        f"batch folder {error.filename} cannot be listed ({error.strerror}), so its files "
        "would be left out of the batch; give this process read access to it") from error


def _files_under(root: Path) -> tuple[list[Path], list[Path]]:
    """The batch files of a folder: none under hidden folders; linked folders refused (B5);
    a folder that is (or holds) a Delta table refused (B20). And the hidden files of an
    accepted format, left out (``BatchFiles.hidden``)."""
    found: list[Path] = []
    for folder, subfolders, names in os.walk(root, onerror=_unlisted):
        if "_delta_log" in subfolders:
            _refuse_a_delta_table(Path(folder))
        subfolders[:] = sorted(name for name in subfolders if not _hidden(name))
        for name in subfolders:
            if (Path(folder) / name).is_symlink():
                raise BatchRefusedError(
                    f"batch folder {root} holds a linked folder {Path(folder) / name}, whose "
                    "files would not be read; copy them into the batch folder or pass the "
                    "linked folder's path instead")
        found += [Path(folder) / name for name in names if not _hidden(name)]
    return sorted(found), _hidden_batch_files(root)


def _hidden_batch_files(root: Path) -> list[Path]:
    """The files of an accepted format under ``root`` that the batch leaves out as hidden: by
    their name, or a folder's between them and ``root``."""
    hidden: list[Path] = []
    # Folders it cannot list are passed over: a hidden one's files are not the batch's, and
    # a batch folder that cannot be listed was refused by the walk that found the batch.
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name != "_delta_log"]
        in_hidden = any(_hidden(part) for part in Path(folder).relative_to(root).parts)
        hidden += [Path(folder) / name for name in names
                   if Path(name).suffix.lower() in FORMATS and (in_hidden or _hidden(name))]
    return sorted(hidden)


def list_batch_files(config: Config, path: str) -> BatchFiles:
    root = resolve_in_landing(config, path)
    if root.is_file() and _hidden(root.name):
        raise BatchRefusedError(
            f"batch file {root} has a name starting with '.' or '_', which Spark skips as "
            "hidden (it would read no rows); rename it")
    landing = config.landing.resolve()
    for folder in root.parents:  # a file or partition folder of a table (B20)
        if folder == landing or landing not in folder.parents:
            break
        if (folder / "_delta_log").is_dir():
            _refuse_a_delta_table(folder)
    candidates, hidden = _files_under(root) if root.is_dir() else ([root], [])  # B21 below
    for candidate in candidates:
        reason = unreadable_path_reason(str(candidate))
        if reason:
            raise BatchRefusedError(f"batch file {candidate} {reason}; rename it")
        if not candidate.exists():  # its fingerprint failed as an unexpected error, retried
            raise BatchRefusedError(
                f"batch file {candidate} is a link to a missing file ({os.readlink(candidate)})"
                "; copy the file it should link to into the batch, or remove the link")
        # Before any file is opened: a link out of the batch would be peeked at (B19), and a
        # FIFO or device would block its open for good (B21).
        target = candidate.resolve()
        if target != root and root not in target.parents:  # (B1) symlinked files
            # Where a link out of the landing folder points is not said (as above).
            where = (f"the batch folder (to {target})" if config.in_landing(target)[1]
                     else "the landing folder")
            raise BatchRefusedError(
                f"batch file {candidate} links outside {where}; copy the file into the batch "
                "folder")
        if not target.is_file():  # (B21)
            raise BatchRefusedError(
                f"batch file {candidate} is not a regular file (a FIFO, socket or device), "
                "whose reading could block for good; write the batch as regular files")
    unknown = [p.name for p in candidates if p.suffix.lower() not in FORMATS]
    if unknown:
        raise BatchRefusedError(
            f"batch {root} has files of no accepted format: {', '.join(unknown[:5])}; accepted: "
            f"{', '.join(sorted(FORMATS))}")
    if not candidates:
        raise BatchRefusedError(f"batch {root} holds no files")
    formats = {FORMATS[p.suffix.lower()] for p in candidates}
    if len(formats) > 1:
        raise BatchRefusedError(
            f"batch {root} mixes formats ({', '.join(sorted(formats))}); send one format per "
            "batch")
    file_format = formats.pop()
    for p in candidates:
        packed = packed_file_reason(p) if file_format != "parquet" else None  # (B19)
        if packed:
            raise BatchRefusedError(
                f"batch file {p} is {packed}, not {file_format.upper()} text; unpack it "
                f"into the batch folder (e.g. gunzip, unzip) and load the {p.suffix} file")
        utf16 = utf16_reason(p) if file_format != "parquet" else None  # (B25)
        if utf16:
            raise BatchRefusedError(
                f"batch file {p} is {utf16} text, not UTF-8; re-encode it as UTF-8 (e.g. "
                f"iconv -f {utf16} -t UTF-8, dropping a byte-order mark) and load it again")
    return BatchFiles(root, tuple(candidates), file_format, tuple(hidden))


def csv_header(batch: BatchFiles) -> list[str]:
    """The one header of a CSV batch's files; refuses files whose headers differ (B6)."""
    headers: dict[tuple[str, ...], Path] = {}
    for path in batch.files:
        if path.stat().st_size == 0 and len(batch.files) > 1:  # no header, no rows: as an
            continue  # empty Parquet or JSON Lines file, it is no other header
        with path.open(newline="", encoding="utf-8-sig", errors="replace") as lines:
            header = tuple(name.strip() or f"_c{i}"  # Spark's name for a nameless column
                           for i, name in enumerate(next(csv.reader(lines), [])))
        headers.setdefault(header, path)
    if len(headers) > 1:
        (first, first_file), (other, other_file) = list(headers.items())[:2]
        raise BatchRefusedError(
            f"batch {batch.root}: the files' CSV headers differ "
            f"({first_file.relative_to(batch.root)}: {','.join(first) or 'none'}; "
            f"{other_file.relative_to(batch.root)}: {','.join(other) or 'none'}), so their "
            "columns would be mixed up; send files with one header (one kind per batch: a "
            "`generate history` folder holds a pageviews and an orders batch)")
    header = list(headers.popitem()[0]) if headers else []
    repeated = sorted({name for name in header if header.count(name) > 1})
    if repeated:
        raise BatchRefusedError(
            f"batch {batch.root}: its CSV header repeats {', '.join(repeated)}; send each "
            "column once")
    return header


def check_csv_quoting(batch: BatchFiles) -> int:
    """Refuses a CSV batch with a file whose quoting is malformed (B18) or whose records end
    in two kinds of line break (B26). Returns the most fields a record of the batch has:
    Spark's reader failed the whole batch on a record wider than its ``maxColumns`` (20,480
    by default) where a record of too many fields is quarantined as malformed."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a field left open holds the rest of the file
    widest = 0
    try:
        for path in batch.files:
            malformed, fields = _malformed_records(path)
            if malformed is not None:
                line, what = malformed
                raise BatchRefusedError(f"batch {batch.root}: {path.name} line {line}: {what}")
            widest = max(widest, fields)
    finally:
        csv.field_size_limit(limit)
    return widest


def _holds_two_kinds_of_line_break(path: Path) -> bool:
    """Whether the file's bytes hold two of CRLF, a lone LF and a lone CR (B26)."""
    crlf = lf = cr = 0
    ended_in_cr = False
    with path.open("rb") as file:
        while chunk := file.read(1 << 22):
            crs = chunk.count(b"\r")  # most files have none: one count
            if crs or ended_in_cr:
                cr += crs
                crlf += chunk.count(b"\r\n") + (ended_in_cr and chunk.startswith(b"\n"))
            lf += chunk.count(b"\n")
            ended_in_cr = chunk.endswith(b"\r")
    return sum(1 for count in (crlf, lf - crlf, cr - crlf) if count) > 1


_QUOTING_FIX = ("so the lines after it could be read as part of one field (neither merged nor "
                "quarantined); fix the quoting: a field with a comma, quote or line break is "
                'quoted whole, and a quote inside it is written twice ("")')
_LINE_BREAKS = {"\r\n": "CRLF", "\n": "LF", "\r": "CR"}


def _malformed_records(path: Path) -> tuple[tuple[int, str] | None, int]:
    """(the line of the first malformed record, what is wrong and what to do) or None, and
    the most fields a record of the file has.

    (B26) Spark takes a file's line break from its first line: after an LF, a record ending
    in CRLF kept the CR in its last field (stored as valid, or an order's currency 'EUR\r'
    quarantined); after a CRLF, a record ending in LF was joined to the next one (two records
    one quarantine row). Only the breaks that end records count: a quoted field may hold
    others (Excel writes LF inside a cell, CRLF after each record). Looked for record by
    record only in a file holding two kinds (a byte count first): that reading took 3x as
    long."""
    mixed = _holds_two_kinds_of_line_break(path)
    with path.open(newline="", encoding=CSV_READ_AS) as text:  # bytes as they are (B13)
        last_line = [""]

        def lines() -> Iterator[str]:
            for line in text:
                last_line[0] = line
                yield line

        rows = csv.reader(lines() if mixed else text, strict=True)
        starts_at, first_break, widest = 1, None, 0
        try:
            for row in rows:
                widest = max(widest, len(row))
                if mixed and row:  # the record's last line (a blank line is no record)
                    ending = next((e for e in _LINE_BREAKS if last_line[0].endswith(e)), None)
                    first_break = first_break or ending
                    if ending is not None and ending != first_break:
                        return (starts_at, (
                            f"its record ends in {_LINE_BREAKS[ending]} where the file's first "
                            f"ends in {_LINE_BREAKS[first_break]} (files of two systems "
                            "joined?), so its records would be read with a stray CR or joined; "
                            "convert the file to one kind of line break (e.g. dos2unix) and "
                            "load it again")), widest
                starts_at = rows.line_num + 1
        except csv.Error as error:
            if "unexpected end of data" in str(error):
                return (starts_at, "a row there opens a quoted field that is never closed, "
                        + _QUOTING_FIX), widest
            return (starts_at, f"a row there has text after a closing quote ({error}), "
                    + _QUOTING_FIX), widest
    return None, widest


def read_batch(spark: SparkSession, batch: BatchFiles, kind: BatchKind) -> DataFrame:
    """Raw rows of the batch with their file of origin; refuses missing columns and files
    Spark cannot read."""
    frame = (_json_lines(spark, batch, kind) if batch.file_format == "json"
             else _read(spark, batch, required=[c for c in REQUIRED[kind]
                                                 if c not in NULLABLE[kind]]))
    if batch.file_format == "json":  # (B16) a key left out is a null in JSON
        frame = frame.withColumns({name: F.lit(None).cast(StringType())
                                   for name in NULLABLE[kind] if name not in frame.columns})
    found = [c for c in frame.columns if c not in (*READER_COLUMNS, "_metadata")]
    missing = [c for c in REQUIRED[kind] if c not in found]
    if missing:
        raise BatchRefusedError(
            f"batch {batch.root} lacks required {kind} columns: {', '.join(missing)} (found: "
            f"{', '.join(found) or 'none'}); required: {', '.join(REQUIRED[kind])}")
    frame = frame.withColumn("_file", F.input_file_name()).withColumn(
        "_file_modified", F.col("_metadata.file_modification_time")  # (B8)
    ).drop("_metadata")  # a column of ``_json_lines``' rows, else Spark's hidden one: kept
    return _spread_over_cores(spark, batch, frame, KEY[kind])  # after ``input_file_name``


SPREAD_MIN_BYTES = 4 << 20
"""A batch of at least this many bytes that Spark's reader would read in fewer tasks than the
session has cores is spread over them (``_spread_over_cores``); a smaller one is not worth
the shuffle (a test's batch of a few rows would pay one more stage)."""


def _read_tasks(batch: BatchFiles) -> int | None:
    """How many tasks at most Spark's reader reads the batch in, where its files' sizes do not
    decide it: a Parquet file is split by row groups only (pyarrow and pandas write up to ~1M
    rows as one), a CSV file read with ``multiLine`` (B14) not at all. None for JSON Lines,
    whose lines Spark splits by bytes."""
    if batch.file_format == "csv":
        return len(batch.files)
    if batch.file_format == "parquet":
        import pyarrow.parquet as pq

        return sum(pq.read_metadata(path).num_row_groups for path in batch.files)
    return None


def _spread_over_cores(spark: SparkSession, batch: BatchFiles, frame: DataFrame, key: str
                       ) -> DataFrame:
    """``frame`` hashed by its key over the session's cores when the reader would leave some
    idle: a year of orders in one Parquet row group (525k rows) was validated, cached and
    merged in one task, every other core of an executor idle. On 2 cores it does not
    shorten a backfill: validating that batch took ~27% less in a warm JVM (6.2 s, not
    8.5 s), but no less in a new process, its compilers busy on the other core
    (BENCHMARKS.md, session 69)."""
    cores = spark.sparkContext.defaultParallelism
    if len(batch.files) >= cores or sum(p.stat().st_size for p in batch.files) < SPREAD_MIN_BYTES:
        return frame
    tasks = _read_tasks(batch)
    if tasks is None or tasks >= cores:
        return frame
    return frame.repartition(cores, _column(key))


def _read(spark: SparkSession, batch: BatchFiles, file_format: str | None = None,
          required: Sequence[str] = ()) -> DataFrame:
    """The batch through Spark's reader of its format (or ``file_format``); a Parquet file
    without one of the ``required`` columns is refused."""
    reader = spark.read
    header: list[str] | None = None
    if (file_format or batch.file_format) == "parquet":
        _check_parquet_types(batch, required)
    if batch.file_format == "csv":  # (B6) one header, every field as text, bad rows marked
        header = csv_header(batch)
        widest = check_csv_quoting(batch)  # (B18)
        reader = reader.schema(StructType(
            [StructField(name, StringType()) for name in header]
            + [StructField(MALFORMED_CSV_ROW, StringType())])).options(
            header="true", mode="PERMISSIVE", columnNameOfCorruptRecord=MALFORMED_CSV_ROW,
            encoding=CSV_READ_AS, maxColumns=max(CSV_MAX_COLUMNS, widest + 1),
            **CSV_STANDARD)  # (B13, B14)
    try:
        frame = reader.format(file_format or batch.file_format).load(
            [str(p) for p in batch.files])
    except PySparkException as error:
        raise BatchRefusedError(
            f"batch {batch.root} could not be read as {batch.file_format}: "
            f"{str(error).strip().splitlines()[0]}") from error
    clashing = [c for c in (frame.columns if header is None else header)
                if c in RESERVED_COLUMNS]
    if clashing:
        raise BatchRefusedError(
            f"batch {batch.root} has a column named {clashing[0]}, a name the backfill's reader "
            f"gives its own columns ({', '.join(sorted(RESERVED_COLUMNS))}); rename or drop it")
    if MALFORMED_CSV_ROW in frame.columns:  # (B6) the line as it was is the raw record
        frame = frame.select(*(_file_bytes(c).alias(c) for c in frame.columns))  # (B13)
        malformed = F.col(MALFORMED_CSV_ROW)
        frame = frame.withColumn(ROW_TEXT, F.coalesce(bytes_unless_utf8(malformed), malformed)
                                 ).withColumn(ROW_ERROR, F.when(
            malformed.isNotNull(),
            F.lit("malformed CSV row: its number of fields differs from the header's")))
    return frame


def _type_kind(kind: pa.DataType, int96: bool = False) -> str:
    """A Parquet column's type as Spark reads it: text of any Arrow string type, dictionary
    encoded or not (pandas' categoricals), and timestamps of any unit, are one type to Spark's
    reader; an INT96 timestamp (Spark's, Hive's and Impala's default) is an instant."""
    if pa.types.is_dictionary(kind):
        return _type_kind(kind.value_type)
    if int96:
        return "timestamp"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_timestamp(kind):
        return "timestamp" if kind.tz is not None else "timestamp without zone"
    return str(kind)


def _check_parquet_types(batch: BatchFiles, required: Sequence[str] = ()) -> None:
    """Refuses a Parquet batch whose files give one column different types: Spark takes
    the types from one file and fails reading the others (``PARQUET_COLUMN_DATA_TYPE_
    MISMATCH``) only once the batch is counted, as an unexpected error retried in vain.
    Columns are one whatever their case, as Spark's reader matches them (``USER_ID`` and
    ``user_id``). A ``ts`` without a zone (pandas' default) is refused too: read as text,
    every row was quarantined as "neither ISO-8601 with a time zone nor epoch milliseconds".
    So is a file without one of the ``required`` columns: Spark reads the batch with one
    file's columns, so the pageviews and orders of a ``generate history`` folder were
    refused for columns the batch has, or read as rows of the other kind and quarantined."""
    import pyarrow.parquet as pq

    seen: dict[str, tuple[str, str, str]] = {}  # lower-case name: (kind, file, name there)
    for path in batch.files:
        try:  # INT96 reads as nanoseconds by default, which Spark's reader does not take
            with pq.ParquetFile(path, coerce_int96_timestamp_unit="us") as parquet:
                schema = parquet.schema_arrow
                columns = parquet.schema
                int96 = {columns.column(i).path for i in range(len(columns))
                         if columns.column(i).physical_type == "INT96"}
        except (OSError, pa.ArrowException) as error:
            raise BatchRefusedError(
                f"batch file {path} is not a readable Parquet file: {error}") from error
        name = path.relative_to(batch.root).as_posix() if path != batch.root else path.name
        names = {n.lower() for n in schema.names}
        lacking = [c for c in required if c not in names]
        if lacking and len(batch.files) > 1:  # one file: read_batch names what it lacks
            raise BatchRefusedError(
                f"batch file {path} lacks the column{'s' if len(lacking) > 1 else ''} "
                f"{', '.join(lacking)} (found: {', '.join(schema.names) or 'none'}); every "
                "file of a batch holds its kind's columns (one kind per batch: a `generate "
                "history` folder holds a pageviews and an orders batch)")
        for field in schema:
            if pa.types.is_timestamp(field.type) and field.type.unit == "ns":
                raise BatchRefusedError(
                    f"batch file {path}: column {field.name} holds timestamps in nanoseconds, "
                    "which Spark cannot read; write them in microseconds (pandas: "
                    "to_parquet(..., coerce_timestamps='us'); pyarrow: "
                    "write_table(..., coerce_timestamps='us'))")
            kind = _type_kind(field.type, field.name in int96)
            if field.name.lower() == "ts" and kind == "timestamp without zone":
                raise BatchRefusedError(
                    f"batch file {path}: column ts holds timestamps without a time zone (local "
                    "times in a zone the file does not name), and ts must be an instant; write "
                    "it with its zone (pandas: df['ts'].dt.tz_localize('UTC') or the zone it "
                    "was recorded in; pyarrow: pa.timestamp('us', tz='UTC'))")
            first = seen.setdefault(field.name.lower(), (kind, name, field.name))
            if first[0] != kind:
                named = (field.name if first[2] == field.name
                         else f"{first[2]} / {field.name} (one column to Spark)")
                raise BatchRefusedError(
                    f"batch {batch.root}: column {named} is {first[0]} in {first[1]} and "
                    f"{kind} in {name}; write every file of a batch with the same column "
                    "types")


def _file_bytes(column: str) -> Column:
    """(B13) A CSV field read as ISO-8859-1, as its file's bytes again: a text Spark keeps
    byte for byte, so UTF-8 is its text and anything else is seen (``is_valid_utf8``)."""
    return F.encode(_column(column), CSV_READ_AS).cast(StringType())


def _column(name: str) -> Column:
    """A batch's own column by its name as written: ``F.col`` reads a dot as a struct's field,
    and an extra column such as ``utm.source`` (flattened analytics exports) failed the batch
    with an unexpected error."""
    return F.col("`" + name.replace("`", "``") + "`")


def _json_lines(spark: SparkSession, batch: BatchFiles, kind: BatchKind) -> DataFrame:
    """Each non-blank line of a JSON Lines batch as a row of the columns Spark infers from the
    batch, with the line itself and, when it is not one JSON object, why (B10)."""
    fields = _one_field_per_name(_inferred_fields(spark, batch), REQUIRED[kind])
    if not fields:  # (B17) no object to infer from
        fields = StructType([StructField(name, StringType()) for name in REQUIRED[kind]])
    # A required field is read as text, as the stream reads it (``parse``): whatever type
    # Spark infers for its column across the batch (B15), one line's float made a column of
    # ids or ``ts`` a double for every line (the ids 1234567890123456789 and ...788 both
    # 1.23456789012345677E18, one dropped as the other's copy; every integer ``ts``
    # quarantined). Read from a variant instead, numbers were normalised (7.0 as 7, more than
    # 38 digits as a double) where the stream kept them as sent. An object, array, boolean or
    # non-integer number in a text field is refused, in both (``parse.not_text_error``).
    # ``amount`` is judged by its line's own JSON type (B9): a string as sent; a number by
    # its exact decimal, not the double Spark infers (999999999999.0003 was stored as
    # ...0002), and by its text where a decimal(38,18) cannot hold it exactly (1e25, -1e-20).
    as_text = {name for names in REQUIRED.values() for name in names} - {"amount"}
    record = StructType([StructField(f.name, StringType()) if f.name in as_text else f
                         for f in fields])
    text = F.col("value")
    lines = _read(spark, batch, "text").where(~text.rlike(r"^[ \t\r\n]*$"))
    line = _without_bom(text)
    as_bytes = bytes_unless_utf8(text)
    error = F.coalesce(
        F.when(as_bytes.isNotNull(), F.lit(not_utf8_reason("line"))),
        F.when(F.col("_value").isNull(), unparsed_json_reason(line, "line")),
        F.when(~is_one_json_object(line), F.lit(
            "line is not one JSON object: JSON Lines holds one record per line (two records "
            "joined on one line, or an array, are quarantined as they are); split the line "
            "and load it again")),
        not_text_error(F.col("_value"), line, {
            name: F.col("_record")[name] for name in record.fieldNames() if name in TEXT_FIELDS}),
        *(misspelled_key_error(line, name, F.col("_record")[name] if name in record.fieldNames()
                               else F.lit(None)) for name in REQUIRED[kind]))
    parsed = lines.select(F.from_json(line, record).alias("_record"),
                          F.try_parse_json(line).alias("_value"), text, "_metadata")

    def column(field: StructField) -> Column:
        if field.name == "amount":  # each line's by its own JSON type, as the stream's
            return amount_text(F.col("_value"))
        return F.col("_record")[field.name]

    ts_not_whole = F.lit(False)
    if "ts" in record.fieldNames():  # (B27)
        ts_not_whole = json_number_not_whole(F.col("_value"), "ts", F.col("_record")["ts"])
    return parsed.select(
        *(column(f).alias(f.name) for f in fields),
        F.coalesce(as_bytes, text).alias(ROW_TEXT), error.alias(ROW_ERROR),
        ts_not_whole.alias(TS_NOT_WHOLE), "_metadata")


def _one_field_per_name(fields: StructType, contract_names: tuple[str, ...]) -> StructType:
    """(B24) One field of the names Spark takes as one column (``user_id`` and ``User_Id`` in
    two lines, or one), named as the contract spells it where it is one of
    ``contract_names``: with both, naming the column failed the batch
    (``AMBIGUOUS_REFERENCE_TO_FIELDS``), an unexpected error retried in vain. A line parses
    its keys exactly, as the stream does: one that spells a contract field otherwise lacks
    it, and is quarantined saying so (``misspelled_key_error``). Read by the inferred
    spelling, a batch whose lines all wrote ``Referrer`` stored every referrer null."""
    kept: dict[str, StructField] = {}
    for field in fields:
        name = field.name.lower()
        if name not in kept or field.name == name:
            kept[name] = field
    return StructType([StructField(name, field.dataType, field.nullable)
                       if name in contract_names else field for name, field in kept.items()])


def _without_bom(line: Column) -> Column:
    """A line without a file's byte-order mark: the text reader joins a batch's files, so any
    line may be a file's first."""
    return F.regexp_replace(line, "^\ufeff", "")


def _inferred_fields(spark: SparkSession, batch: BatchFiles) -> StructType:
    """The columns Spark's JSON reader infers from a JSON Lines batch (B22)."""
    try:
        schema = _read(spark, batch).schema
    except BatchRefusedError as refused:
        cause = refused.__cause__
        if not (isinstance(cause, PySparkException)
                and cause.getCondition() == "COLUMN_ALREADY_EXISTS"):
            raise
        # A key repeated in one line's object: Spark's inference fails for the whole batch.
        # The line is quarantined (``unparsed_json_reason``); every key is read as text.
        keys = _read(spark, batch, "text").select(F.explode(F.json_object_keys(
            _without_bom(F.col("value")))).alias("key")).distinct().collect()
        schema = StructType([StructField(k, StringType()) for k in sorted(r.key for r in keys)])
    return StructType([f for f in schema if f.name != "_corrupt_record"])


def _text(frame: DataFrame, name: str) -> Column:
    return F.col(name).cast(StringType())


def _amount_text(frame: DataFrame) -> Column:
    """The ``amount`` as the text the contract's amount rule judges (B9)."""
    text = F.col("amount").cast(StringType())
    if not isinstance(frame.schema["amount"].dataType, FractionalType):  # decimals too
        return text
    # Floats become decimals by their shortest text (0.1 stays 0.1). Beyond 20 digits before
    # the point, past 18 decimals (-1e-20 was judged as 0), or NaN and infinities, the
    # column's own text is judged.
    kind = frame.schema["amount"].dataType
    number = F.col("amount")
    if isinstance(kind, FloatType):  # (B9) by its own shortest text: a cast widens it to a
        number = text  # double first (19.99 -> 19.9899997711...)
    return F.coalesce(exact_decimal_text(number, F.col("amount"), kind), text)


def _ts(frame: DataFrame) -> tuple[Column, Column]:
    """(timestamp, text for messages) of the ``ts`` column, whatever its type (B2)."""
    kind = frame.schema["ts"].dataType
    if isinstance(kind, TimestampType):
        return to_milliseconds(F.col("ts")), F.col("ts").cast("string")
    if isinstance(kind, DateType):
        return F.lit(None).cast("timestamp"), F.col("ts").cast("string")
    text = F.col("ts").cast("string")  # integers too: epoch ms by the text rule (B7)
    return ts_from_text(text), text


def _ts_not_whole(frame: DataFrame) -> Column:
    """(B27) Whether a row's ``ts`` was sent as a number with a fraction or an exponent: a
    JSON Lines line's by its own JSON type, a Parquet column's by its type."""
    if TS_NOT_WHOLE in frame.columns:
        return F.col(TS_NOT_WHOLE)
    kind = frame.schema["ts"].dataType
    return F.lit(isinstance(kind, FractionalType)
                 and not (isinstance(kind, DecimalType) and kind.scale == 0))


def validate_batch(frame: DataFrame, kind: BatchKind, client_id: str, max_ts_ahead_ms: int
                   ) -> DataFrame:
    """Every row with typed columns, ``error`` (null when valid) and ``copies`` (rows with its
    key, when more than one); conflicting duplicates marked (B3); other clients' rows marked
    (B4); rows stamped after their file (B8). :func:`valid_rows` picks what to merge.
    ``max_ts_ahead_ms`` is ``Config.max_ts_ahead_ms``."""
    ts, ts_text = _ts(frame)
    key = KEY[kind]
    columns = {name: _text(frame, name) for name in REQUIRED[kind] if name != "ts"}
    if kind == "orders":
        columns["amount"] = _amount_text(frame)  # (B9)
    strings = [n for n in REQUIRED[kind]
               if isinstance(frame.schema[n].dataType, (StringType, BinaryType))]
    not_utf8 = F.coalesce(*(F.when(~F.is_valid_utf8(_text(frame, n)), F.lit(n)) for n in strings),
                          F.lit(None).cast(StringType()))  # (B11)
    columns = {n: F.make_valid_utf8(c) if n in strings else c for n, c in columns.items()}
    if "ts" in strings:
        ts_text = F.make_valid_utf8(ts_text)
    fields = [c for c in frame.columns if c not in READER_COLUMNS]
    raw = F.to_json(F.struct(*[_column(c) for c in fields]))
    unreadable = F.lit(None).cast(StringType())
    if ROW_TEXT in frame.columns:  # (B6, B10) the record as its file holds it
        raw = F.coalesce(F.col(ROW_TEXT), raw)
        unreadable = F.col(ROW_ERROR)
    typed = frame.select(
        raw.alias("raw"), F.col("_file").alias("source"),
        *(c.alias(n) for n, c in columns.items()),
        ts.alias("ts"), ts_text.alias("ts_text"), _ts_not_whole(frame).alias("ts_not_whole"),
        unreadable.alias("unreadable"),
        not_utf8.alias("not_utf8"), F.col("_file_modified").alias("file_modified"))
    blank = {n: F.col(n).isNull() | (F.trim(F.col(n)) == "") for n in columns}
    # raw is the row as JSON text: a binary column's value shows there in base64.
    binary = [n for n in strings if isinstance(frame.schema[n].dataType, BinaryType)]
    shown = F.lit("its invalid bytes as U+FFFD (the file keeps them)")
    if binary:
        shown = F.when(F.col("not_utf8").isin(*binary), F.lit(
            "its value in base64 (a binary column)")).otherwise(shown)
    checks = [F.col("unreadable"), F.when(F.col("not_utf8").isNotNull(), F.format_string(
        "%s is not UTF-8 text: raw shows %s; re-encode the batch as UTF-8 and load it again",
        F.col("not_utf8"), shown))]  # (B11)
    checks += [error for error in (_not_text_error(n, frame.schema[n].dataType)
                                   for n in (key, "client_id", "user_id")) if error is not None]
    checks += [F.when(blank[n], F.lit(f"missing {n}")) for n in (key, "client_id", "user_id")]
    checks.append(user_id_error(F.col("user_id")))  # the client's is --client's (B4)
    checks.append(id_error(F.col(key), key))
    checks.append(ts_error(F.col("ts_text"), F.col("ts"), not_whole=F.col("ts_not_whole")))
    checks.append(ts_ahead_error(  # (B8)
        F.col("ts_text"), F.col("ts"), F.col("file_modified"), max_ts_ahead_ms,
        reference_is="the time its file was last modified",
        harm="its user's sessions would wait for the stream's watermark to reach it"))
    checks.append(F.when(F.col("client_id") != F.lit(client_id), F.format_string(
        "client_id '%s' is not the batch's client '%s'", F.col("client_id"),
        F.lit(client_id))))  # (B4)
    if kind == "orders":
        checks += [amount_error(F.col("amount")), currency_error(F.col("currency"))]
    else:
        checks.append(url_error(F.col("url")))
    typed = typed.withColumn("error", F.coalesce(*checks))
    if kind == "orders":
        typed = typed.withColumn("amount", amount_value(F.col("amount")))  # (B12)
    return _with_copies(frame, typed.drop("ts_text", "ts_not_whole", "unreadable", "not_utf8",
                                          "file_modified"), key)


def _not_text_error(name: str, kind: DataType) -> Column | None:
    """(B23) An id column of a Parquet batch that is neither text nor whole numbers: read as
    its text, a float id 123 was stored as '123.0' (the stream's user '123' twice), two large
    ids became one text (1.23456789012345677E18: one row dropped as the other's copy), a
    boolean 'true'. The stream and JSON Lines refuse such ids by value (B15)."""
    if isinstance(kind, (StringType, BinaryType, IntegralType)) or (
            isinstance(kind, DecimalType) and kind.scale == 0):
        return None
    return F.when(F.col(name).isNotNull(), F.lit(
        f"{name} is a Parquet {kind.simpleString()} column, not text: write ids as strings (or "
        "whole numbers) and load the batch again"))


def _with_copies(frame: DataFrame, typed: DataFrame, key: str) -> DataFrame:
    """``typed`` with ``copies``, how many rows share the row's client and key (null when one
    does), and B3's error on each copy of a key whose copies differ. Ids are a client's: a
    row of another client (quarantined, B4) with the same id made a valid row of the batch's
    client a copy that differs, and it was quarantined too.

    Runs one job: counting the repeated keys reads the key column alone. A batch usually
    repeats none, and its rows then meet no other row; a few are compared through a
    broadcast of those keys. Only beyond ``BROADCAST_KEYS_MAX`` repeated keys is the whole
    batch shuffled and sorted by key, as every batch was before: validating a year of
    pageviews (10.5M rows) and taking its valid rows took 120 s that way, 75 s this way
    (BENCHMARKS.md, session 39)."""
    client_key = ["client_id", key]
    repeated = (frame.groupBy(_text(frame, "client_id").alias("client_id"),
                              _text(frame, key).alias(key))
                .agg(F.count(F.lit(1)).alias("n"))
                .where((F.col("n") > 1) & F.col(key).isNotNull()).select(*client_key))
    how_many = repeated.count()
    content = F.to_json(F.struct(*[c for c in typed.columns
                                   if c not in ("raw", "source", "error")]))
    if how_many == 0:
        marked = typed.withColumn("copies", F.lit(None).cast(LongType())).withColumn(
            "variants", F.lit(1))
    elif how_many <= BROADCAST_KEYS_MAX:
        variants = typed.join(F.broadcast(repeated), client_key, "left_semi").groupBy(
            *client_key).agg(F.count(F.lit(1)).alias("copies"),
                             F.size(F.collect_set(content)).alias("variants"))
        marked = typed.join(F.broadcast(variants), client_key, "left")
    else:
        by_key = Window.partitionBy(*client_key)
        copies = F.count(F.lit(1)).over(by_key)
        marked = typed.withColumn("copies", F.when(copies > 1, copies)).withColumn(
            "variants", F.size(F.collect_set(content).over(by_key)))
    return marked.select(*typed.columns, "copies", "variants").withColumn(
        "error", F.coalesce(F.col("error"), F.when(F.col("variants") > 1, F.format_string(
            "%s '%s' appears %d times in the batch with different content", F.lit(key),
            F.col(key), F.col("copies"))))).drop("variants")


def valid_rows(batch: DataFrame, kind: BatchKind) -> DataFrame:
    """The rows of a validated batch a backfill merges: the valid ones, one per key (B3).
    Only the copies of repeated keys meet to be deduplicated."""
    valid = batch.where(F.col("error").isNull())
    once = valid.where(F.col("copies").isNull())
    one_of_each = valid.where(F.col("copies").isNotNull()).dropDuplicates([KEY[kind]])
    return once.unionByName(one_of_each).drop("error", "copies")
