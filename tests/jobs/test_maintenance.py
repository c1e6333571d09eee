"""Table maintenance over every table of a real warehouse (deltalake engine, no Spark)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from clickstream.cli import main
from clickstream.config import ENV_NAMES, Config
from clickstream.errors import EXIT_NOT_RETRYABLE, ClickstreamError
from clickstream.jobs.maintenance import checkpoint_tables, compact_tables, vacuum_tables
from tests.io.test_delta_tables import age_the_log


def small_files(config: Config, table: str, count: int) -> Path:
    """A table of ``count`` one-row files, as micro-batches leave them."""
    path = config.table_path(table)
    for index in range(count):
        write_deltalake(str(path), pa.table({"reason": [f"r{index}"]}), mode="append")
    return path


def corrupt_one_file(path: Path) -> str:
    """Overwrite one active data file with bytes that are not Parquet: compacting it fails."""
    victim = Path(DeltaTable(str(path)).file_uris()[0].removeprefix("file://"))
    victim.write_bytes(b"not parquet")
    return victim.name


def test_a_failed_compaction_still_compacts_every_other_table_then_fails(config: Config):
    # pageviews comes first in ALL_TABLES: its failure used to end the loop, so no table after
    # it was compacted that week (M2).
    broken = small_files(config, "pageviews", 2)
    corrupt_one_file(broken)
    quarantine = small_files(config, "quarantine", 3)
    lines: list[str] = []

    with pytest.raises(ClickstreamError) as failure:
        compact_tables(config, progress=lines.append)

    message = str(failure.value)
    assert message.startswith("compact failed on 1 of 2 tables: pageviews (DeltaError: "), message
    assert "done: quarantine" in message and "run it again" in message
    assert isinstance(failure.value.__cause__, Exception)  # the first failure, chained
    assert len(DeltaTable(str(quarantine)).file_uris()) == 1
    assert DeltaTable(str(quarantine)).to_pyarrow_table().num_rows == 3
    assert lines[0].startswith("compact pageviews: failed: ")
    assert lines[1] == "compact quarantine: 3 files into 1"


def test_maintain_runs_the_dags_steps_from_the_command_line(
    config: Config, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Maintenance had no command: a deployment without Airflow could not run it. Each step
    tries every table and runs whatever the step before did, as the DAG's, then it fails."""
    for name in ("warehouse", "home"):
        monkeypatch.setenv(ENV_NAMES[name], str(getattr(config, name)))
    assert main(["maintain"]) == 0
    assert capsys.readouterr().out.endswith("maintain: no table yet: nothing done\n")
    quarantine = small_files(config, "quarantine", 3)
    assert main(["maintain", "--retention-hours", "10"]) == EXIT_NOT_RETRYABLE
    assert "vacuum retention 10 h is below the safe minimum" in capsys.readouterr().err
    assert len(DeltaTable(str(quarantine)).file_uris()) == 3  # refused before any step

    assert main(["maintain"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("maintain: 1 tables: 3 files compacted into 1, 0 deleted by vacuum, "
                        "each log checkpointed\n")
    assert "checkpoint quarantine: version 4" in out
    assert list((quarantine / "_delta_log").glob("*.checkpoint.parquet"))

    corrupt_one_file(small_files(config, "pageviews", 2))
    assert main(["maintain"]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("clickstream maintain: error: compact failed on 1 of 2 tables: "
                          "pageviews (DeltaError: ")
    for line in ("vacuum pageviews: 0 files", "checkpoint pageviews: version 2",
                 "checkpoint quarantine: version 4"):
        assert line in out


def test_a_client_whose_folders_are_named_with_a_raw_tilde_is_compacted(config: Config):
    """A client's files in folders named with a raw '~' (deltalake's own writer): their
    compaction failed the whole table every week, then they were left out for good."""
    path = config.table_path("pageviews")
    for client_id in ("c1", "c1", "x~y", "x~y"):
        write_deltalake(str(path), pa.table({"client_id": [client_id], "n": [1]}),
                        partition_by=["client_id"], mode="append")
    lines: list[str] = []

    assert compact_tables(config, progress=lines.append) == {"pageviews": {
        "files_added": 2, "files_removed": 4}}
    assert lines == ["compact pageviews: 4 files into 2"]
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 4


def test_maintenance_of_a_warehouse_without_tables_says_so(config: Config):
    """A misspelled CLICKSTREAM_WAREHOUSE in a worker gave green weekly runs without a word."""
    lines: list[str] = []

    assert compact_tables(config, progress=lines.append) == {}
    assert checkpoint_tables(config, progress=lines.append) == {}
    assert lines == [f"{step}: no table under {config.warehouse} (CLICKSTREAM_WAREHOUSE) yet: "
                     "nothing to do" for step in ("compact", "checkpoint")]


def test_vacuum_keeps_the_commits_as_long_as_the_files(config: Config):
    """M3: the log is kept as long as vacuum keeps files. A retention above Delta's 30 days of
    log kept the files of versions whose commits were gone, so time travel failed anyway."""
    path = small_files(config, "quarantine", 2)
    lines: list[str] = []

    vacuum_tables(config, retention_hours=2000, progress=lines.append)
    assert ("vacuum quarantine: commits now kept 2000 h (delta.logRetentionDuration), removed "
            "files 2000 h (delta.deletedFileRetentionDuration)") in lines
    version = DeltaTable(str(path)).version()
    vacuum_tables(config, retention_hours=2000, progress=lines.append)
    assert DeltaTable(str(path)).version() == version  # set once, not once per run

    def forty_days_on() -> int:
        """The earliest version still readable after 40 days, a checkpoint and a commit."""
        age_the_log(path, 40)
        checkpoint_tables(config, progress=lines.append)
        write_deltalake(str(path), pa.table({"reason": ["later"]}), mode="append")
        return min(int(p.stem) for p in (path / "_delta_log").glob("*[0-9].json"))

    assert forty_days_on() == 0
    assert DeltaTable(str(path), version=0).to_pyarrow_table().num_rows == 1

    vacuum_tables(config, progress=lines.append)  # the minimum retention: Delta's 30 days
    assert ("vacuum quarantine: commits now kept 720 h (delta.logRetentionDuration), removed "
            "files 168 h (delta.deletedFileRetentionDuration)") in lines
    assert forty_days_on() > 0


def removed_hours_ago(config: Config, path: Path, hours: int) -> int:
    """Compact the table's files, written 35 days ago, by a commit made ``hours`` ago; the
    version before it (whose files the compaction removed)."""
    before = DeltaTable(str(path)).version()
    written = time.time() - 35 * 86_400
    for uri in DeltaTable(str(path)).file_uris():
        os.utime(uri.removeprefix("file://"), (written, written))
    compact_tables(config, progress=lambda line: None)
    commit = path / "_delta_log" / f"{DeltaTable(str(path)).version():020d}.json"
    actions = [json.loads(line) for line in commit.read_text().splitlines() if line.strip()]
    for action in actions:
        if "remove" in action:
            action["remove"]["deletionTimestamp"] = int((time.time() - hours * 3600) * 1000)
    commit.write_text("".join(json.dumps(action) + "\n" for action in actions))
    return before


def test_vacuum_keeps_a_file_removed_within_its_retention_past_a_checkpoint(config: Config):
    """M4: a checkpoint kept the record of a removed file 7 days only (Delta's default
    ``delta.deletedFileRetentionDuration``), and vacuum deleted the file no record named by
    its age alone. With a 720 h retention, a file written 35 days ago and removed 200 h ago
    went at the vacuum after a checkpoint, and time travel to the version before failed."""
    path = small_files(config, "quarantine", 2)
    before = removed_hours_ago(config, path, 200)
    for _ in range(2):  # two weekly runs: vacuum, then checkpoint
        vacuum_tables(config, retention_hours=720, progress=lambda line: None)
        checkpoint_tables(config, progress=lambda line: None)
    assert DeltaTable(str(path), version=before).to_pyarrow_table().num_rows == 2

    deleted = vacuum_tables(config, retention_hours=168, progress=lambda line: None)
    assert deleted == {"quarantine": 2}  # removed 200 h ago: past a 168 h retention
