"""The class archive setup builds: drivers map it, and a stale one starts them quietly without."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clickstream import jvm_class_archive
from clickstream.config import Config
from clickstream.spark_session import driver_launch_conf
from tests.child_jvm import submit_driver


def mapped(classes: list[str]) -> list[str]:
    return [line for line in classes if "source: shared objects file (top)" in line]


def test_setup_built_the_archive_for_this_environment_and_drivers_map_it(
        tmp_path: Path, config: Config) -> None:
    assert jvm_class_archive.ARCHIVE.is_file(), "run scripts/setup.sh: it builds the archive"
    assert jvm_class_archive.ARCHIVE.with_suffix(".stamp").read_text().strip() == \
        jvm_class_archive.environment_stamp()
    assert jvm_class_archive.usable()
    # A space in a path: Spark splits the driver's options at spaces unless quoted.
    _, classes = submit_driver(tmp_path, config.replace(home=tmp_path / "home with a space"))
    read_from_jars = [line for line in classes if "source: file:" in line
                      or "source: jar:" in line]
    # Without the archive, every one of these ~12,000 classes is read from a jar; what still
    # is (~400, Janino's compiler) was not loaded by the warm-up's driver (lambdas and
    # generated classes, defined at run time, are neither).
    assert len(mapped(classes)) > 5_000
    assert len(read_from_jars) < 0.1 * len(mapped(classes)), read_from_jars[:20]


def test_off_or_no_archive_leaves_the_option_out(config: Config, tmp_path: Path,
                                                 monkeypatch) -> None:
    options = driver_launch_conf(config.replace(jvm_class_archive="off"))
    assert "SharedArchiveFile" not in options["spark.driver.extraJavaOptions"]
    assert jvm_class_archive.launch_options(config.replace(jvm_class_archive="off")) == []
    # Named but missing, the JVM would drop its default archive of the JDK's classes too.
    assert jvm_class_archive.launch_options(config) != []
    monkeypatch.setattr(jvm_class_archive, "ARCHIVE", tmp_path / "missing.jsa")
    assert jvm_class_archive.launch_options(config) == []


def test_a_driver_on_other_jars_than_the_archives_starts_without_it_and_without_a_word(
        tmp_path: Path, config: Config) -> None:
    # One more jar on the driver's class path: what the JVM sees when the jars changed since
    # the archive was made (its warning would break a CLI command's one-line error).
    assert jvm_class_archive.launch_options(config) != []
    jar = min((jvm_class_archive.spark_home() / "jars").glob("*.jar"),
              key=lambda path: path.stat().st_size)
    other = shutil.copy(jar, tmp_path / "other.jar")
    output, classes = submit_driver(tmp_path, config, f"spark.driver.extraClassPath={other}")
    assert mapped(classes) == []
    assert "shared archive" not in output and "[cds" not in output


def test_the_setup_probe_tells_a_damaged_archive_from_a_good_one(
        tmp_path: Path, monkeypatch) -> None:
    assert jvm_class_archive.usable()
    damaged = tmp_path / "damaged.jsa"  # a copy cut short, as a full disk or a crash leaves it
    with jvm_class_archive.ARCHIVE.open("rb") as good, damaged.open("wb") as cut:
        cut.write(good.read(jvm_class_archive.ARCHIVE.stat().st_size // 2))
    monkeypatch.setattr(jvm_class_archive, "ARCHIVE", damaged)
    assert not jvm_class_archive.usable()  # setup builds it again; a driver would crash on it


def test_a_probe_that_hangs_finds_the_archive_unusable(tmp_path: Path, monkeypatch) -> None:
    """Its time limit's error escaped setup as a traceback, no archive built."""
    hanging = tmp_path / "spark-submit"
    hanging.write_text("#!/bin/sh\nexec sleep 60\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(jvm_class_archive, "_spark_submit", lambda: str(hanging))
    monkeypatch.setattr(jvm_class_archive, "PROBE_TIMEOUT_S", 0.5)
    assert not jvm_class_archive.usable()


class Interrupted(Exception):
    """What a Ctrl-C or a time limit raises in the process that builds the archive."""


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie no one has reaped yet is stopped


def test_an_interrupted_build_stops_its_warm_up_job_and_leaves_no_partial_archive(
        tmp_path: Path, monkeypatch) -> None:
    """The warm-up job runs in a session of its own, which a terminal's Ctrl-C does not reach:
    setup exited while the job (a Spark driver and a broker, ~1.5 min of CPU) ran on, and
    its partial archive stayed beside the real one for good. spark-submit is stood in for by
    a script that writes the partial archive at once, then waits (its child too)."""
    archive = tmp_path / "share" / "classes.jsa"
    partial = archive.with_name(f".{archive.name}.{os.getpid()}")
    fake = tmp_path / "spark-submit"
    fake.write_text(f"#!/bin/sh\necho part > '{partial}'\nsleep 60 &\necho $$ $! > "
                    f"'{tmp_path / 'pids'}'\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setattr(jvm_class_archive, "ARCHIVE", archive)
    monkeypatch.setattr(jvm_class_archive, "_spark_submit", lambda: str(fake))

    def interrupt(*_: object) -> None:
        raise Interrupted

    # Not SIGALRM: the real-time timer is pytest-timeout's, which this test would cancel.
    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        sender.start()
        with pytest.raises(Interrupted):
            jvm_class_archive.build("stamp", progress=lambda _: None)
    finally:
        sender.cancel()
        signal.signal(signal.SIGUSR1, previous)
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if running(pid)]
    assert not partial.exists() and not archive.exists()


BUILD_IN_A_CHILD = """
import sys
from pathlib import Path
from clickstream import jvm_class_archive
jvm_class_archive.ARCHIVE = Path(sys.argv[1])
jvm_class_archive._spark_submit = lambda: sys.argv[2]
sys.exit(jvm_class_archive.main(["--if-stale"]))
"""


def test_setup_stopped_by_a_signal_stops_its_warm_up_job_and_leaves_no_partial_archive(
        tmp_path: Path) -> None:
    """SIGTERM (a CI time limit, ``timeout``) killed setup's Python without an exception: the
    warm-up job ran on in its own session, and its partial archive and folder stayed."""
    archive = tmp_path / "share" / "classes.jsa"
    fake = tmp_path / "spark-submit"
    fake.write_text(f"#!/bin/sh\necho part > \"$(dirname '{archive}')/.$(basename "
                    f"'{archive}').$PPID\"\nsleep 60 &\necho $$ $! > '{tmp_path / 'pids'}'"
                    "\nwait\n")
    fake.chmod(0o755)
    setup = subprocess.Popen([sys.executable, "-c", BUILD_IN_A_CHILD, str(archive), str(fake)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pids").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    setup.send_signal(signal.SIGTERM)
    assert setup.wait(timeout=60) == 128 + signal.SIGTERM
    pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if running(pid)]
    assert list(archive.parent.iterdir()) == []  # no partial archive


def test_an_archive_drivers_cannot_map_is_removed_even_when_its_rebuild_fails(
        tmp_path: Path, monkeypatch) -> None:
    """A damaged archive (its stamp current) failed the probe, and a failed rebuild left it
    in place: every driver then mapped it and crashed. A spark-submit that fails every run
    stands in for both the probe's driver and the warm-up's."""
    archive = tmp_path / "classes.jsa"
    archive.write_bytes(b"not an archive")
    archive.with_suffix(".stamp").write_text(jvm_class_archive.environment_stamp() + "\n")
    failing = tmp_path / "spark-submit"
    failing.write_text("#!/bin/sh\necho 'the JVM crashed'\nexit 134\n")
    failing.chmod(0o755)
    monkeypatch.setattr(jvm_class_archive, "ARCHIVE", archive)
    monkeypatch.setattr(jvm_class_archive, "_spark_submit", lambda: str(failing))
    with pytest.raises(RuntimeError, match="the warm-up job failed"):
        jvm_class_archive.build_if_stale(progress=lambda _: None)
    assert not archive.exists() and not archive.with_suffix(".stamp").exists()
    assert jvm_class_archive.launch_options(Config()) == []  # drivers start without one


def test_the_stamp_does_not_change_with_java_tool_options(monkeypatch) -> None:
    """The JVM prints "Picked up JAVA_TOOL_OPTIONS" with its version: the stamp changed, and
    setup rebuilt the archive (~1.5 min) for nothing."""
    stamp = jvm_class_archive.environment_stamp()
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Dsome.setting=1")
    assert jvm_class_archive.environment_stamp() == stamp
