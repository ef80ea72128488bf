"""``tests/support/cxx/g++``: the suite's compiler cache gives what g++ builds, and builds again
whatever differs in a source, a flag or the compiler."""

import os
import subprocess

import pytest
from support import paths

CXX = paths.SUPPORT / "cxx" / "g++"
SOURCE = 'extern "C" int answer() { return %d; }\n'

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/g++"), reason="needs g++")


def build(tmp_path, source, out, *flags, cache=True):
    src = tmp_path / f"{abs(hash(source))}.cpp"
    src.write_text(source)
    env = {**os.environ, "MTP_TEST_CXX_CACHE": str(tmp_path / "cache") if cache else ""}
    subprocess.run([str(CXX), str(src), "-shared", "-fPIC", *flags, "-o", str(out)], env=env,
                   check=True, capture_output=True)
    return out.read_bytes()


def entries(tmp_path):
    return sorted(p.name for p in (tmp_path / "cache").iterdir())


def test_same_build_is_copied_and_any_difference_builds_again(tmp_path):
    first = build(tmp_path, SOURCE % 42, tmp_path / "a.so")
    assert first == (tmp_path / "a.so").read_bytes() and len(entries(tmp_path)) == 1
    # Same source and flags, another output path (another compile key's directory): a copy.
    cached = entries(tmp_path)[0]
    (tmp_path / "cache" / cached).write_bytes(first + b"marker")
    assert build(tmp_path, SOURCE % 42, tmp_path / "b.so") == first + b"marker"
    # Another source, another flag: built by g++ (not the marked entry), each its own entry.
    for built in (build(tmp_path, SOURCE % 43, tmp_path / "c.so"),
                  build(tmp_path, SOURCE % 42, tmp_path / "d.so", "-O2")):
        assert built[:4] == b"\x7fELF" and not built.endswith(b"marker")
    assert len(entries(tmp_path)) == 3


def test_without_a_cache_directory_it_is_g_plus_plus(tmp_path):
    built = build(tmp_path, SOURCE % 7, tmp_path / "e.so", cache=False)
    assert built[:4] == b"\x7fELF" and not (tmp_path / "cache").exists()
    version = subprocess.run([str(CXX), "--version"], capture_output=True, text=True, check=True)
    assert version.stdout == subprocess.run(["/usr/bin/g++", "--version"], capture_output=True,
                                            text=True, check=True).stdout
