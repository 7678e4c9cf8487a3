"""The distribution installs whole: pyproject's package list is every package folder of the tree,
and a wheel built from the checkout holds every module and imports without the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.unit.test_structure import PACKAGES, ROOT, modules


def package_folders() -> set[str]:
    """Installed names of every folder with an __init__.py under tracer/, hooks/, reports/."""
    found = set()
    for folder, package in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([package, *parts]))
    return found


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_pyproject_lists_every_package_folder():
    assert set(pyproject()["tool"]["setuptools"]["packages"]) == package_folders()


def test_the_distribution_name_is_not_the_unrelated_tracer_on_the_index():
    project = pyproject()["project"]
    assert project["name"] == "llm-divergence-tracer"
    assert project["scripts"]["tracer"] == "tracer.cli:console_main"
    for extra in project["optional-dependencies"]["runtimes"]:
        assert extra.startswith(project["name"] + "[")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the source alone: setuptools' in-tree build/ folder of an earlier build
    would otherwise lend the wheel files the package list leaves out (and bench/'s written models, gigabytes,
    have no place in it)."""
    source, out = tmp_path_factory.mktemp("source") / "tree", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                               ".pytest_cache", ".hypothesis", "tracer-*",
                                                               ".bench-*"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    (path,) = out.glob("llm_divergence_tracer-*.whl")
    return path


def test_the_wheel_holds_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
                for name, path in modules().items()}
    assert expected - names == set()


def test_every_module_imports_from_the_installed_wheel(wheel, tmp_path):
    """Installed into a folder of its own that comes first on sys.path: each module must come from
    there, so a package the wheel left out fails to import instead of falling back to the checkout."""
    importable = sorted(name for name in modules() if not name.endswith("__main__"))  # __main__ runs the CLI
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                                str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]
    check = (
        "import importlib, sys\n"
        f"names = {importable!r}\n"
        "for name in names:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(target)!r}), (name, module.__file__)\n"
        "print(len(names))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    ran = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert int(ran.stdout) == len(importable)
