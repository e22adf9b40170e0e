"""``--layout auto``'s profile of this machine (pdserve/planner/calibration.py): measured once,
cached under a key of everything it depends on, measured again when any of it changes, and the
stored profile where measuring is impossible, with the log saying which. The measurement is a
fake that writes a profile and counts its calls (a real one takes some 15 s here); the child
process is run for real where it fails fast."""

import dataclasses
import os

import pytest

from pdserve.planner import calibration
from pdserve.planner.calibration import CacheKey, CalibrationError, cache_key, measure_in_child, profile_dir, resolve
from pdserve.planner.hardware import HardwareProfile
from tests.helpers.planner_profiles import CORE

STORED = dataclasses.replace(CORE, name="stored", source="fitted on another machine")
MEASURED = dataclasses.replace(CORE, name="measured", source="measured here")
MEASURING = {"PDSERVE_LAYOUT_MEASURE": "1"}
REAL_BUSY = calibration._busy  # the tests' default is 0 (tests/conftest.py)


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """The machine as if idle: what the log says of a busy one is tested on its own."""
    monkeypatch.setattr(calibration, "_busy", lambda: "")


@pytest.fixture
def stored(tmp_path):
    """A stored profile, and the ``profile_for`` stand-in that names it for any kernel path."""
    file = tmp_path / "stored" / "cpu.json"
    file.parent.mkdir()
    STORED.save(file)
    return lambda path: file


class Counting:
    """A measurement that writes ``MEASURED`` (or fails with ``error``) and counts its calls."""

    def __init__(self, error: str | None = None):
        self.keys, self.error = [], error

    def __call__(self, key: CacheKey, out):
        self.keys.append(key)
        if self.error:
            raise CalibrationError(self.error)
        MEASURED.save(out)


def test_the_cache_key_names_another_file_when_anything_measured_changes():
    key = CacheKey("AMD EPYC", "avx512_bf16", "bfloat16", "0.1.0", "abcd")
    assert key.file_name() == CacheKey("AMD EPYC", "avx512_bf16", "bfloat16", "0.1.0", "abcd").file_name()
    assert key.file_name().startswith("cpu-avx512_bf16-bfloat16-") and key.file_name().endswith(".json")
    changed = [dataclasses.replace(key, **{f.name: "other" if f.name != "calibration" else 99})
               for f in dataclasses.fields(key)]
    assert len({key.file_name(), *(k.file_name() for k in changed)}) == 1 + len(changed)


def test_this_machines_key_holds_its_processor_path_dtype_and_kernel_sources(monkeypatch):
    key = cache_key("avx2", None)
    assert key.dtype == "bfloat16" and key.kernel_path == "avx2" and key.processor
    monkeypatch.setattr(calibration, "kernel_source_hash", lambda: "edited kernels")
    assert cache_key("avx2", None).file_name() != key.file_name()
    assert cache_key("avx2", "float32").file_name() != key.file_name()


def test_the_profile_directory_is_the_variable_else_the_cache_directorys_else_xdgs(tmp_path):
    home = os.path.expanduser("~")
    assert profile_dir({}) == type(tmp_path)(home) / ".cache" / "pdserve" / "profiles"
    assert profile_dir({"XDG_CACHE_HOME": "/x"}) == type(tmp_path)("/x/pdserve/profiles")
    assert profile_dir({"XDG_CACHE_HOME": "/x", "PDSERVE_CACHE_DIR": "/c"}) == type(tmp_path)("/c/profiles")
    assert profile_dir({"PDSERVE_CACHE_DIR": "/c", "PDSERVE_PROFILE_DIR": "/p"}) == type(tmp_path)("/p")


def test_the_first_start_measures_and_later_ones_read_the_cache(tmp_path, stored):
    measure, announced = Counting(), []
    first = resolve("avx2", None, stored, tmp_path / "cache", measure, announced.append, MEASURING)
    assert (first.how, first.profile) == ("measured now", MEASURED) and len(measure.keys) == 1
    assert first.file == tmp_path / "cache" / measure.keys[0].file_name() and first.file.exists()
    assert len(announced) == 1 and "measuring this machine" in announced[0]
    again = resolve("avx2", None, stored, tmp_path / "cache", measure, announced.append, MEASURING)
    assert (again.how, again.profile, again.file) == ("cached", MEASURED, first.file)
    assert len(measure.keys) == 1 and len(announced) == 1
    assert again.line() == f"profile {first.file} (cached)"


def test_a_measurement_on_a_busy_machine_is_kept_and_says_so(tmp_path, stored, monkeypatch):
    monkeypatch.setattr(calibration, "_busy", lambda: "measured while busy (load average 15.0 on 2 cores)")
    r = resolve("avx2", None, stored, tmp_path, Counting(), environ=MEASURING)
    assert r.how == "measured now" and r.file.exists()
    assert r.note == "measured while busy (load average 15.0 on 2 cores): delete the file to measure again"


def test_busy_is_a_load_average_at_or_above_the_core_count(monkeypatch):
    busy = REAL_BUSY  # the autouse ``quiet`` replaced the module's
    monkeypatch.setattr(calibration.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(calibration.os, "getloadavg", lambda: (1.9, 9.0, 9.0))
    assert busy() == ""
    monkeypatch.setattr(calibration.os, "getloadavg", lambda: (2.0, 0.0, 0.0))
    assert busy().startswith("measured while busy (load average 2.0 on 2 cores")


def test_another_dtype_or_a_corrupt_cache_file_is_measured_again(tmp_path, stored):
    measure = Counting()
    first = resolve("avx2", None, stored, tmp_path, measure, environ=MEASURING)
    resolve("avx2", "float32", stored, tmp_path, measure, environ=MEASURING)
    assert len(measure.keys) == 2 and len(list(tmp_path.glob("cpu-avx2-*.json"))) == 2
    first.file.write_text("{not json")
    again = resolve("avx2", None, stored, tmp_path, measure, environ=MEASURING)
    assert again.how == "measured now" and "unreadable" in again.note and len(measure.keys) == 3
    assert HardwareProfile.load(first.file) == MEASURED


def test_where_measuring_is_impossible_the_stored_profile_stays_and_the_log_says_why(tmp_path, stored):
    failing = Counting("measuring failed (exit 1: the model did not load)")
    r = resolve("avx2", None, stored, tmp_path, failing, environ=MEASURING)
    assert (r.how, r.profile, r.file) == ("stored", STORED, stored(None))
    assert "the model did not load" in r.line() and not list(tmp_path.glob("cpu-*.json"))
    never = Counting()
    no_path = resolve(None, None, stored, tmp_path, never, environ=MEASURING)
    assert no_path.how == "stored" and "lacks AVX2 + FMA" in no_path.note
    off = resolve("avx2", None, stored, tmp_path, never, environ={"PDSERVE_LAYOUT_MEASURE": "0"})
    assert off.how == "stored" and "PDSERVE_LAYOUT_MEASURE=0" in off.note and never.keys == []


def test_a_directory_that_cannot_be_made_measures_for_this_start_only(tmp_path, stored):
    (tmp_path / "a file").write_text("")
    nowhere = tmp_path / "a file" / "profiles"  # under a file: not even root makes it
    measure = Counting()
    r = resolve("avx2", None, stored, nowhere, measure, environ=MEASURING)
    assert (r.how, r.profile) == ("measured now", MEASURED) and "not cached" in r.note
    assert resolve("avx2", None, stored, nowhere, measure, environ=MEASURING).how == "measured now"
    assert len(measure.keys) == 2


def test_the_child_process_reports_its_failure_and_its_timeout(tmp_path):
    key = dataclasses.replace(cache_key("avx2", None), dtype="float16")  # the child's --dtype refuses it
    with pytest.raises(CalibrationError, match=r"exit 2: .*invalid choice: 'float16'"):
        measure_in_child(key, tmp_path / "p.json")
    with pytest.raises(CalibrationError, match="over 0.01 s"):
        measure_in_child(key, tmp_path / "p.json", timeout_s=0.01)
    assert not (tmp_path / "p.json").exists()


def test_serve_logs_the_profile_measured_now_then_cached(monkeypatch, tmp_path):
    """``choose_for_settings`` (what ``pdserve serve --layout auto`` calls) simulates on this
    machine's measured profile and names it, measured now at the first start, cached after."""
    from pdserve.planner import auto_layout
    from pdserve.planner.auto_layout import candidates, choose_for_settings, decide

    measure, seen = Counting(), []
    monkeypatch.setattr(calibration, "measure_in_child", measure)
    monkeypatch.setattr(auto_layout, "kernel_path", lambda: "avx2")
    monkeypatch.setenv("PDSERVE_LAYOUT_MEASURE", "1")
    monkeypatch.setenv("PDSERVE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setattr(auto_layout, "choose", lambda model, hw, cores, objective: seen.append(hw) or decide(
        [(c, 1.0) for c in candidates(cores)], factors={}))
    v = {"model": "default", "layout_ttft_slo_s": 2.0, "layout_tpot_slo_s": 0.1, "layout_prompt_tokens": 256,
         "layout_output_tokens": 64, "dtype": "float32"}
    announced = []
    _, first = choose_for_settings(v, announced.append)
    _, again = choose_for_settings(v, announced.append)
    assert [hw.name for hw in seen] == ["measured", "measured"] and len(measure.keys) == 1
    assert measure.keys[0].dtype == "float32" and len(announced) == 1
    assert "(measured now)" in first[1] and "(cached)" in again[1] and "measured here" in again[1]
